"""The nbdkit export driver with the real nbdkit (Debian 1.32): one process per (volume, host), read
and written with qemu-io and nbdinfo; who gets in (X.509 with the install's CA, TLS-PSK, unix socket,
plain TCP only --insecure); a restarted agent adopting its processes; online resize.

Every process is stopped by PID at teardown (its pidfile names the test's state directory)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import export_fixtures
from tests.conftest import free_ports, reap_daemons
from tests.export_fixtures import MiB, guest_disk, read_at, wait_dead, write_at
from tests.test_nbd_access import attempt, qemu_io
from vbs.config import StorageAgentConfig
from vbs.connectors import connector_for
from vbs.errors import IdempotentParameterMismatch, InvalidParameter
from vbs.pools.exports import FileSource, RbdSource
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.storage.exports.nbdkit import NbdkitExportDriver
from vbs.system.socket_paths import socket_path
from vbs.trust.pki import CertificateAuthority
from vbs.wire.connection import HostIdentity, NbdConnection

pytestmark = pytest.mark.integration

volume = export_fixtures.volume
VOL = "vol-0123456789abcdef0"
VOL2 = "vol-0123456789abcdef1"
HV_A = HostIdentity(name="hv-a", address="127.0.0.1")


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdkitExportDriver]]:
    """``make(state="state", **kw)``: a driver in ``tmp_path/state`` on 8 free ports; every process
    stopped at teardown (cleanly, then by the PID in its pidfile)."""
    drivers: list[NbdkitExportDriver] = []

    def make(state: str = "state", **kw: Any) -> NbdkitExportDriver:
        kw.setdefault("port", free_ports(8))
        kw.setdefault("ports", 8)
        drv = NbdkitExportDriver(tmp_path / state, **kw)
        drivers.append(drv)
        return drv

    yield make
    for drv in reversed(drivers):
        drv.stop()
        reap_daemons(drv.state_dir)


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")


def node_x509(ca: CertificateAuthority, tmp: Path) -> X509Files:
    node = ca.issue_in(tmp / "node", "storage-1", ["127.0.0.1"])
    return X509Files(node.cert, node.key, node.ca)


def client_dir(ca: CertificateAuthority, tmp: Path, name: str, names: list[str]) -> Path:
    """A QEMU client credentials directory with host ``name``'s certificate, valid for ``names``."""
    files = ca.issue_in(tmp / "issued", name, names)
    return qemu_x509_dir(X509Files(files.cert, files.key, files.ca), tmp / f"client-{name}", "client")


def server(c: NbdConnection) -> str:
    if c.socket is not None:
        return f"server.type=unix,server.path={c.socket},export={c.export}"
    return f"server.type=inet,server.host={c.host},server.port={c.port},export={c.export}"


def nbd_uri(c: NbdConnection, export: str | None = None) -> str:
    return f"nbd://{c.host}:{c.port}/{c.export if export is None else export}"


# -- serving ------------------------------------------------------------------------------------------


def test_an_export_reads_and_writes_the_volume_and_its_removal_stops_the_process(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path) -> None:
    drv = make_driver()
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HV_A)
    assert (c.host, c.port, c.tls, c.export.startswith(f"{VOL}-")) == ("127.0.0.1", drv.port, None, True)
    assert drv.ensure_export(VOL, FileSource(volume), HV_A) == c  # idempotent: same port and name
    pid = drv.pid(VOL, "hv-a")
    assert pid is not None

    ok, out = attempt(qemu_io(server(c), "write -P 0x5a 0 64k"))
    assert ok, out
    assert read_at(volume, 0, 64 * 1024) == b"\x5a" * 64 * 1024
    write_at(volume, 1 * MiB, b"\x73" * 4096)
    ok, out = attempt(qemu_io(server(c), "read -P 0x73 1M 4k"))
    assert ok, out
    assert [(e.key, e.host, e.protocol, e.target) for e in drv.list_exports()] == [(VOL, "hv-a", "nbd", c.export)]

    # It answers to its own name only, and lists nothing.
    ok, out = attempt(["nbdinfo", "--size", nbd_uri(c, f"{VOL}-{'0' * 32}")])
    assert not ok and "export" in out, out
    ok, out = attempt(["nbdinfo", "--list", nbd_uri(c, "")])
    assert c.export not in out, out

    drv.remove_export(VOL, "hv-a")
    wait_dead(pid)
    assert drv.list_exports() == [] and not drv.is_exported(VOL)
    ok, out = attempt(qemu_io(server(c), "read 0 4k"))
    assert not ok, out
    drv.remove_export(VOL, "hv-a")  # idempotent


def test_each_host_gets_a_process_and_a_port_of_its_own(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path) -> None:
    drv = make_driver()
    a = drv.ensure_export(VOL, FileSource(volume), HV_A)
    b = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-b", address="127.0.0.2"))
    assert a.port != b.port and a.export != b.export
    assert drv.pid(VOL, "hv-a") != drv.pid(VOL, "hv-b")
    ok, out = attempt(qemu_io(server(a), "write -P 0x11 0 4k"))
    assert ok, out
    ok, out = attempt(qemu_io(server(b), "read -P 0x11 0 4k"))
    assert ok, out
    # hv-a's name is not served on hv-b's port.
    ok, out = attempt(["nbdinfo", "--size", f"nbd://127.0.0.1:{b.port}/{a.export}"])
    assert not ok, out
    drv.remove_export(VOL, "hv-b")
    ok, out = attempt(qemu_io(server(a), "read -P 0x11 0 4k"))
    assert ok, out


def test_a_read_only_export_refuses_writes(make_driver: Callable[..., NbdkitExportDriver], volume: Path) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HV_A, read_only=True)
    ok, out = attempt(qemu_io(server(c), "write -P 0x5a 0 4k"))
    assert not ok, out
    assert read_at(volume, 0, 4096) == bytes(4096)
    with pytest.raises(IdempotentParameterMismatch):
        drv.ensure_export(VOL, FileSource(volume), HV_A)


def test_rbd_and_qcow2_sources_are_refused_with_the_reason(
        make_driver: Callable[..., NbdkitExportDriver], tmp_path: Path) -> None:
    drv = make_driver()
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\n")
    with pytest.raises(InvalidParameter, match="no rbd plugin"):
        drv.ensure_export(VOL, RbdSource(pool="rbd", image=VOL, conf=conf, size_bytes=MiB), HV_A)
    image = tmp_path / "v.qcow2"
    image.write_bytes(b"QFI\xfb")
    with pytest.raises(InvalidParameter, match="raw"):
        drv.ensure_export(VOL, FileSource(image, "qcow2", MiB), HV_A)
    assert drv.list_exports() == []


def test_a_grown_volume_shows_its_new_size_on_the_same_connection(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HV_A)
    size = subprocess.run(["nbdinfo", "--size", nbd_uri(c)], capture_output=True, text=True, timeout=30)
    assert size.stdout.strip() == str(16 * MiB), size.stderr
    os.truncate(volume, 32 * MiB)
    assert drv.refresh_export(VOL, FileSource(volume), "hv-a") == c
    size = subprocess.run(["nbdinfo", "--size", nbd_uri(c)], capture_output=True, text=True, timeout=30)
    assert size.stdout.strip() == str(32 * MiB), size.stderr
    drv.retire_exports(VOL, "hv-a")
    ok, out = attempt(qemu_io(server(c), "write -P 0x42 31M 4k"))
    assert ok, out


# -- who gets in -------------------------------------------------------------------------------------


def test_x509_admits_the_host_the_export_was_made_for_and_refuses_every_other(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path, ca: CertificateAuthority,
        tmp_path: Path) -> None:
    drv = make_driver(tls="x509", x509=node_x509(ca, tmp_path))
    a = drv.ensure_export(VOL, FileSource(volume), HV_A)
    assert a.tls == "x509"
    # hv-b holds an export of another volume here: under one server-wide daemon it could open hv-a's.
    (tmp_path / "vol2.img").write_bytes(bytes(MiB))
    b = drv.ensure_export(VOL2, FileSource(tmp_path / "vol2.img"), HostIdentity(name="hv-b", address="127.0.0.2"))
    attached = client_dir(ca, tmp_path, "hv-a", ["127.0.0.1", "hv-a.example"])
    other_host = client_dir(ca, tmp_path, "hv-b", ["127.0.0.2"])
    foreign = client_dir(CertificateAuthority(tmp_path / "other" / "ca.pem", tmp_path / "other" / "ca-key.pem"),
                         tmp_path / "other", "hv-a", ["127.0.0.1"])  # the right names from another CA
    write_at(volume, 1 * MiB, b"s" * 4096)

    refused = {
        "no certificate": [qemu_io(server(a), "read -P 0x73 1M 4k"), ["nbdinfo", "--list", nbd_uri(a, "")]],
        "another host's certificate": [qemu_io(server(a), "read -P 0x73 1M 4k", tls_dir=other_host),
                                       qemu_io(server(a), "write -P 0x66 0 4k", tls_dir=other_host)],
        "another CA": [qemu_io(server(a), "read -P 0x73 1M 4k", tls_dir=foreign)],
    }
    for what, argvs in refused.items():
        for argv in argvs:
            ok, out = attempt(argv)
            assert not ok, f"{what}: {argv[0]} got in: {out}"
    assert read_at(volume, 0, 4096) == bytes(4096)

    ok, out = attempt(qemu_io(server(a), "write -P 0x5a 0 64k", tls_dir=attached))
    assert ok, out
    assert read_at(volume, 0, 64 * 1024) == b"\x5a" * 64 * 1024
    ok, out = attempt(qemu_io(server(b), "read 0 4k", tls_dir=other_host))
    assert ok, out  # hv-b reaches its own export
    ok, out = attempt(qemu_io(server(b), "read 0 4k", tls_dir=attached))
    assert not ok, out  # and hv-a does not reach it

    # The process's private files: the node's key in a 0700 directory, 0600.
    key = drv.tls_dir / next(p.name for p in drv.tls_dir.iterdir()) / "server-key.pem"
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700 and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(drv.tls_dir.stat().st_mode) == 0o700


def test_a_guest_disk_over_x509_through_the_host_agents_own_certificate(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path, ca: CertificateAuthority,
        tmp_path: Path) -> None:
    """The QEMU driver of the host agent and a real TCG guest: QEMU's TLS client through the anchor."""
    host = ca.issue_in(tmp_path / "host", "hv-a", ["127.0.0.1", "hv-a"])
    drv = make_driver(tls="x509", x509=node_x509(ca, tmp_path))
    c = drv.ensure_export(VOL, FileSource(volume), HV_A)
    with guest_disk(tmp_path, VOL, c, volume, X509Files(host.cert, host.key, host.ca), "nbdkit-x509") as disk:
        nodes = disk.guest.qmp("query-named-block-nodes", {"flat": True})
        assert any(connector_for(c).qemu_node_opens(n, c) for n in nodes)


def test_tls_psk_admits_only_the_hosts_own_key(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path, tmp_path: Path) -> None:
    drv = make_driver(tls="psk")
    a = drv.ensure_export(VOL, FileSource(volume), HV_A)
    b = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-b", address="127.0.0.2"))
    assert a.tls == "psk" and a.tls_psk_key is not None and b.tls_psk_key is not None

    def psk_io(c: NbdConnection, identity: str, key: str, cmd: str) -> list[str]:
        d = tmp_path / f"psk-{identity}-{key[:6]}"
        d.mkdir(mode=0o700, exist_ok=True)
        (d / "keys.psk").write_text(f"{identity}:{key}\n")
        return ["qemu-io", "--object", f"tls-creds-psk,id=t0,endpoint=client,dir={d},username={identity}",
                "--image-opts", f"driver=nbd,{server(c)},tls-creds=t0", "-c", cmd]

    ok, out = attempt(psk_io(a, "hv-a", a.tls_psk_key.get_secret_value(), "write -P 0x21 0 4k"))
    assert ok, out
    ok, out = attempt(psk_io(a, "hv-b", b.tls_psk_key.get_secret_value(), "write -P 0x22 0 4k"))
    assert not ok, out
    ok, out = attempt(qemu_io(server(a), "read 0 4k"))
    assert not ok, out
    assert read_at(volume, 0, 4096) == b"\x21" * 4096
    psk_file = next(drv.tls_dir.glob("*.psk"))
    assert stat.S_IMODE(psk_file.stat().st_mode) == 0o600 and psk_file.read_text().count("\n") == 1


def test_a_unix_socket_export_lives_in_a_private_directory(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path, tmp_path: Path) -> None:
    drv = make_driver(socket_dir=tmp_path / "nbd")
    c = drv.ensure_export(VOL, FileSource(volume), HV_A)
    assert c.socket is not None and (c.host, c.port, c.tls) == (None, None, None)
    # In the socket directory, or (a path too long for a unix socket, as a deep temp dir gives) in its
    # private fallback under /run/vbs: either way a 0700 directory.
    assert Path(c.socket) == socket_path(tmp_path / "nbd", Path(c.socket).name)
    assert stat.S_IMODE(Path(c.socket).parent.stat().st_mode) == 0o700
    ok, out = attempt(qemu_io(server(c), "write -P 0x5a 0 4k"))
    assert ok, out
    assert read_at(volume, 0, 4096) == b"\x5a" * 4096
    pid = drv.pid(VOL, "hv-a")
    assert pid is not None
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"-U" in argv and b"-p" not in argv  # no TCP listener
    drv.remove_export(VOL, "hv-a")
    assert not Path(c.socket).exists()


def test_plain_tcp_needs_insecure_and_x509_needs_certificates(tmp_path: Path, ca: CertificateAuthority) -> None:
    with pytest.raises(InvalidParameter, match="needs TLS"):
        NbdkitExportDriver.from_config(StorageAgentConfig(export="nbdkit"), tmp_path / "a")
    with pytest.raises(InvalidParameter, match="--insecure"):
        NbdkitExportDriver.from_config(StorageAgentConfig(export="nbdkit", nbd_tls="off"), tmp_path / "b")
    assert NbdkitExportDriver.from_config(StorageAgentConfig(insecure=True), tmp_path / "c").tls == "off"
    unix = NbdkitExportDriver.from_config(StorageAgentConfig(nbd_socket_dir=tmp_path / "s"), tmp_path / "d")
    assert (unix.tls, unix.socket_dir) == ("off", tmp_path / "s")
    x509 = node_x509(ca, tmp_path)
    drv = NbdkitExportDriver.from_config(StorageAgentConfig(tls_cert=x509.cert, tls_key=x509.key, tls_ca=x509.ca,
                                                            options={"nbdkit": {"threads": 4}}), tmp_path / "e")
    assert (drv.tls, drv.threads) == ("x509", 4)
    with pytest.raises(ValueError):
        NbdkitExportDriver.from_config(StorageAgentConfig(insecure=True, options={"nbdkit": {"cache": "bad"}}),
                                       tmp_path / "f")


# -- supervision -------------------------------------------------------------------------------------


def test_a_restarted_agent_adopts_the_running_processes_and_clients_keep_their_session(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path, ca: CertificateAuthority,
        tmp_path: Path) -> None:
    x509 = node_x509(ca, tmp_path)
    first = make_driver(tls="x509", x509=x509)
    c = first.ensure_export(VOL, FileSource(volume), HV_A)
    pid = first.pid(VOL, "hv-a")
    creds = client_dir(ca, tmp_path, "hv-a", ["127.0.0.1"])
    # A client that stays connected across the agent's restart (qemu-io reads its commands from stdin).
    client = subprocess.Popen(
        ["qemu-io", "--object", f"tls-creds-x509,id=t0,endpoint=client,dir={creds}", "--image-opts",
         f"driver=nbd,{server(c)},tls-creds=t0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert client.stdin is not None
        client.stdin.write("write -P 0x31 0 4k\n")
        client.stdin.flush()
        first.close()  # the agent goes away; its processes keep serving
        second = make_driver(tls="x509", x509=x509, port=first.port)
        second.start()
        assert second.pid(VOL, "hv-a") == pid  # adopted, not restarted
        assert second.ensure_export(VOL, FileSource(volume), HV_A) == c
        client.stdin.write("write -P 0x32 4k 4k\nread -P 0x31 0 4k\nquit\n")
        client.stdin.flush()
        out, _ = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode == 0 and "Pattern verification failed" not in out and "error" not in out.lower(), out
    assert read_at(volume, 0, 8192) == b"\x31" * 4096 + b"\x32" * 4096


def test_a_process_the_state_no_longer_names_is_stopped_when_the_agent_starts(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path) -> None:
    """An agent that died between forgetting an export (saved first) and stopping its process."""
    first = make_driver()
    c = first.ensure_export(VOL, FileSource(volume), HV_A)
    kept = first.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-b", address="127.0.0.2"))
    orphan, adopted = first.pid(VOL, "hv-a"), first.pid(VOL, "hv-b")
    assert orphan is not None
    first.close()
    state = json.loads(first.state_path.read_text())
    state["items"][0]["exports"] = [e for e in state["items"][0]["exports"] if e["host"] != "hv-a"]
    first.state_path.write_text(json.dumps(state))
    second = make_driver(port=first.port)
    second.start()
    wait_dead(orphan)
    assert second.pid(VOL, "hv-b") == adopted and second.pid(VOL, "hv-a") is None
    ok, out = attempt(qemu_io(server(c), "read 0 4k"))
    assert not ok, out
    ok, out = attempt(qemu_io(server(kept), "read 0 4k"))
    assert ok, out


def test_a_killed_process_comes_back_with_the_same_port_name_and_credentials(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path, ca: CertificateAuthority,
        tmp_path: Path) -> None:
    drv = make_driver(tls="x509", x509=node_x509(ca, tmp_path))
    c = drv.ensure_export(VOL, FileSource(volume), HV_A)
    other = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-b", address="127.0.0.2"))
    pid, other_pid = drv.pid(VOL, "hv-a"), drv.pid(VOL, "hv-b")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    drv.check()
    assert drv.pid(VOL, "hv-a") not in (None, pid) and drv.pid(VOL, "hv-b") == other_pid  # only the dead one
    assert drv.ensure_export(VOL, FileSource(volume), HV_A) == c
    ok, out = attempt(qemu_io(server(c), "write -P 0x44 0 4k", tls_dir=client_dir(ca, tmp_path, "hv-a",
                                                                                    ["127.0.0.1"])))
    assert ok, out
    assert other.port != c.port


def test_stop_ends_every_process_and_start_brings_them_back(
        make_driver: Callable[..., NbdkitExportDriver], volume: Path) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HV_A)
    pid = drv.pid(VOL, "hv-a")
    assert pid is not None
    drv.stop()
    wait_dead(pid)
    assert drv.pid(VOL, "hv-a") is None
    drv.start()
    assert drv.pid(VOL, "hv-a") not in (None, pid)
    ok, out = attempt(qemu_io(server(c), "write -P 0x5a 0 4k"))
    assert ok, out


def test_the_processes_get_a_minimal_environment(make_driver: Callable[..., NbdkitExportDriver], volume: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VBS_AGENT_TOKEN", "agent-token-that-must-not-leak")
    drv = make_driver()
    drv.ensure_export(VOL, FileSource(volume), HV_A)
    pid = drv.pid(VOL, "hv-a")
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert b"must-not-leak" not in environ
    assert {item.split(b"=", 1)[0] for item in environ.split(b"\0") if item} <= {b"PATH", b"LC_ALL"}
