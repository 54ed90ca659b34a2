"""Who can reach an NBD export: only the attaching host. Real qemu-storage-daemon, qemu-io, nbdinfo.

* Unix socket (``vbs up``'s mode): the daemon's user reads and writes; ``nobody`` on the same machine
  can neither list nor read nor write, and a real TCG guest gets its disk through the socket.
* TCP with X.509 (the default over TCP): from a second network namespace, a client without a
  certificate, with a certificate of another CA, or with one of the right CA for a host that has no
  export here, can neither list nor read nor write; the attached host's certificate can, until its
  export is removed.

Every daemon is stopped by PID; every namespace and veth a test makes is deleted at teardown.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import export_fixtures
from tests.conftest import VbsUp, wait_until
from tests.export_fixtures import MiB, drivers_of, guest_disk, read_at, write_at
from vbs.config import StorageAgentConfig
from vbs.connectors import connector_for
from vbs.errors import InvalidParameter
from vbs.ids import virtio_serial
from vbs.pools.exports import FileSource
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.rigs.testguest import TestGuest, build_guest
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.system.argv import run
from vbs.trust.pki import CertificateAuthority
from vbs.wire.connection import HostIdentity, NbdConnection

pytestmark = pytest.mark.integration

VOL = "vol-0123456789abcdef0"
QSD = "qemu-storage-daemon"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
volume = export_fixtures.volume


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    yield from drivers_of(NbdExportDriver, tmp_path, QSD)


def attempt(argv: list[str], *, netns: str | None = None, user: list[str] | None = None) -> tuple[bool, str]:
    """Run one client; whether it succeeded (qemu-io exits 0 even when its command failed: its
    output tells) and what it said."""
    prefix = (["ip", "netns", "exec", netns] if netns else []) + (user or [])
    proc = run([*prefix, *argv], timeout=60, check=False)
    out = proc.stdout + proc.stderr
    return proc.returncode == 0 and "fail" not in out.lower() and "error" not in out.lower(), out


def qemu_io(opts: str, cmd: str, *, tls_dir: Path | None = None) -> list[str]:
    obj = ["--object", f"tls-creds-x509,id=t0,endpoint=client,dir={tls_dir}"] if tls_dir else []
    creds = ",tls-creds=t0" if tls_dir else ""
    return ["qemu-io", *obj, "--image-opts", f"driver=nbd,{opts}{creds}", "-c", cmd]


# -- unix socket -------------------------------------------------------------------------------------


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A directory every user may enter (unlike pytest's 0700 tmp root), so that only the socket
    directory's own mode stands between ``nobody`` and the socket."""
    parent = Path(tempfile.mkdtemp(prefix="vbs-nbd-"))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_unix_socket_export_serves_its_own_user_and_refuses_nobody(
        make_driver: Callable[..., NbdExportDriver], volume: Path, open_parent: Path) -> None:
    drv = make_driver(socket_dir=open_parent / "nbd")
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address="127.0.0.1"))
    assert isinstance(c, NbdConnection)
    assert (c.socket, c.host, c.port, c.tls) == (str(open_parent / "nbd" / "nbd.sock"), None, None, None)
    assert stat.S_IMODE((open_parent / "nbd").stat().st_mode) == 0o700
    server = f"server.type=unix,server.path={c.socket}"

    ok, out = attempt(qemu_io(f"{server},export={c.export}", "write -P 0x5a 0 64k"))
    assert ok, out
    assert read_at(volume, 0, 64 * 1024) == b"\x5a" * 64 * 1024

    write_at(volume, 1 * MiB, b"secret" * 100)
    listed, out = attempt(["nbdinfo", "--list", f"nbd+unix:///?socket={c.socket}"], user=NOBODY)
    assert not listed and "Permission denied" in out, out
    read, out = attempt(qemu_io(f"{server},export={c.export}", "read -P 0x73 1M 6"), user=NOBODY)
    assert not read and "Permission denied" in out, out
    wrote, out = attempt(qemu_io(f"{server},export={c.export}", "write -P 0x66 0 4k"), user=NOBODY)
    assert not wrote and "Permission denied" in out, out
    assert read_at(volume, 0, 64 * 1024) == b"\x5a" * 64 * 1024

    # The same client as nobody does get in once the directory and socket are opened up: what
    # refused it above was their modes, not a broken invocation.
    (open_parent / "nbd").chmod(0o755)
    Path(c.socket).chmod(0o777)
    listed, out = attempt(["nbdinfo", "--list", f"nbd+unix:///?socket={c.socket}"], user=NOBODY)
    assert listed and c.export in out, out


def test_socket_paths_from_the_wire_are_strict() -> None:
    for bad in ("relative/nbd.sock", "/run/../etc/nbd.sock", "/run/./nbd.sock", "/run//nbd.sock", "/run/vbs/qmp",
                "/run/a b.sock", "/run/x.sock\n", "/" + "a" * 120 + ".sock"):
        with pytest.raises(ValueError):
            NbdConnection(socket=bad, export="v")
    with pytest.raises(ValueError):
        NbdConnection(socket="/run/vbs/nbd.sock", host="127.0.0.1", port=10809, export="v")
    with pytest.raises(ValueError):
        NbdConnection(export="v")


def test_vbs_up_attaches_a_guest_through_the_unix_socket(tmp_path: Path) -> None:
    up = VbsUp(tmp_path / "var", tmp_path / "up.log")
    vbs = up.start()
    guest = TestGuest("vm1", tmp_path / "guests", build_guest(), tmp_path / "var" / "vms")
    try:
        guest.start()
        guest.wait_ready(120)
        wait_until(lambda: vbs.http.get("/v1/instances").json()["instances"], 30, what="the guest as an instance")
        vol = vbs.cli("create-volume", "--size", "1", "--wait")["volume_id"]
        vbs.cli("attach-volume", vol, "--host", "host-1", "--vm", "vm1", "--wait")
        dev = guest.wait_for_disk(virtio_serial(vol), 20)
        digest = guest.write_pattern(dev, "unix-socket", 4)
        assert guest.checksum(dev, 4) == digest

        sock = tmp_path / "var" / "nbd" / "nbd.sock"
        assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        qsd = int((tmp_path / "var" / "storage-state" / "nbd" / "qsd.pid").read_text())
        argv = Path(f"/proc/{qsd}/cmdline").read_bytes().split(b"\0")
        assert f"addr.type=unix,addr.path={sock}".encode() in argv, argv  # no TCP listener
        listed, out = attempt(["nbdinfo", "--list", f"nbd+unix:///?socket={sock}"], user=NOBODY)
        assert not listed and "Permission denied" in out, out
        vbs.cli("detach-volume", vol, "--wait")
        guest.wait_disk_gone(virtio_serial(vol), 20)
    finally:
        guest.stop()
        up.stop()


# -- TCP with X.509, from another network namespace --------------------------------------------------


class Netns:
    """A network namespace joined to this one by a veth pair: ``server`` here, ``client`` there."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.name = f"vbs-nbd-{tag}"
        self.veth = f"vbsn{tag}"
        self.peer = f"vbsp{tag}"
        octet = 16 + secrets.randbelow(200)
        self.server, self.client = f"10.213.{octet}.1", f"10.213.{octet}.2"

    def __enter__(self) -> Netns:
        steps = [
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.veth, "type", "veth", "peer", "name", self.peer],
            ["ip", "link", "set", self.peer, "netns", self.name],
            ["ip", "addr", "add", f"{self.server}/30", "dev", self.veth],
            ["ip", "link", "set", self.veth, "up"],
            ["ip", "-n", self.name, "addr", "add", f"{self.client}/30", "dev", self.peer],
            ["ip", "-n", self.name, "link", "set", self.peer, "up"],
            ["ip", "-n", self.name, "link", "set", "lo", "up"],
        ]
        try:
            for argv in steps:
                run(argv, timeout=30)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        run(["ip", "netns", "del", self.name], timeout=30, check=False)  # takes its end of the pair
        run(["ip", "link", "del", self.veth], timeout=30, check=False)  # gone with it, unless half-made


@pytest.fixture
def netns() -> Iterator[Netns]:
    with Netns() as ns:
        yield ns
    assert ns.name not in run(["ip", "netns", "list"], timeout=30).stdout


def client_dir(ca: CertificateAuthority, tmp: Path, name: str) -> Path:
    files = ca.issue_in(tmp / "issued", name, [name])
    return qemu_x509_dir(X509Files(files.cert, files.key, files.ca), tmp / f"client-{name}", "client")


def test_tls_x509_admits_only_the_attached_hosts_certificate(
        make_driver: Callable[..., NbdExportDriver], volume: Path, tmp_path: Path, netns: Netns) -> None:
    ca = CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")
    node = ca.issue_in(tmp_path / "node", "storage-1", [netns.server])
    drv = make_driver(listen_host=netns.server, tls="x509", x509=X509Files(node.cert, node.key, node.ca))
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address=netns.client))
    assert isinstance(c, NbdConnection)
    assert (c.host, c.port, c.tls, c.tls_psk_key) == (netns.server, drv.port, "x509", None)
    server = f"server.type=inet,server.host={c.host},server.port={c.port},export={c.export}"
    write_at(volume, 1 * MiB, b"s" * 4096)

    attached = client_dir(ca, tmp_path, "hv-a")
    unattached = client_dir(ca, tmp_path, "hv-b")
    other_ca = CertificateAuthority(tmp_path / "other" / "ca.pem", tmp_path / "other" / "ca-key.pem")
    foreign = client_dir(other_ca, tmp_path / "other", "hv-a")  # the right name from the wrong CA
    refused: dict[str, list[list[str]]] = {
        "no certificate": [
            ["nbdinfo", "--list", f"nbd://{c.host}:{c.port}"],
            qemu_io(server, "read -P 0x73 1M 4k"),
            qemu_io(server, "write -P 0x66 0 4k"),
        ],
        **{what: [
            ["nbdinfo", "--list", f"nbds://{c.host}:{c.port}/?tls-certificates={d}"],
            qemu_io(server, "read -P 0x73 1M 4k", tls_dir=d),
            qemu_io(server, "write -P 0x66 0 4k", tls_dir=d),
        ] for what, d in (("a host with no export here", unattached), ("another CA", foreign))},
    }
    for what, argvs in refused.items():
        for argv in argvs:
            ok, out = attempt(argv, netns=netns.name)
            assert not ok, f"{what}: {argv[0]} got in: {out}"
    assert read_at(volume, 0, 4096) == bytes(4096)

    ok, out = attempt(qemu_io(server, "write -P 0x5a 0 64k", tls_dir=attached), netns=netns.name)
    assert ok, out
    assert read_at(volume, 0, 64 * 1024) == b"\x5a" * 64 * 1024
    ok, out = attempt(qemu_io(server, "read -P 0x73 1M 4k", tls_dir=attached), netns=netns.name)
    assert ok, out

    drv.remove_export(VOL, "hv-a")
    listed, out = attempt(["nbdinfo", "--list", f"nbds://{c.host}:{c.port}/?tls-certificates={attached}"],
                          netns=netns.name)
    assert not listed, f"a host whose last export went may still open a session: {out}"
    assert "authz check for CN=hv-a is denied" in drv.log_path.read_text()


def test_a_guest_disk_over_x509_through_the_host_agents_own_certificate(
        make_driver: Callable[..., NbdExportDriver], volume: Path, tmp_path: Path) -> None:
    """The QEMU driver of the host agent, a real TCG guest: what a VM's disk runs on."""
    ca = CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")
    node = ca.issue_in(tmp_path / "node", "storage-1", ["127.0.0.1"])
    host = ca.issue_in(tmp_path / "host", "hv-a", ["hv-a"])
    drv = make_driver(tls="x509", x509=X509Files(node.cert, node.key, node.ca))
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address="127.0.0.1"))
    assert isinstance(c, NbdConnection) and c.tls == "x509"
    with guest_disk(tmp_path, VOL, c, volume, X509Files(host.cert, host.key, host.ca), "over-x509") as disk:
        nodes = disk.guest.qmp("query-named-block-nodes", {"flat": True})
        assert any(connector_for(c).qemu_node_opens(n, c) for n in nodes)
        assert stat.S_IMODE((tmp_path / "host-secrets" / "x509").stat().st_mode) == 0o700


def test_the_authz_list_comes_back_with_a_restarted_daemon(
        make_driver: Callable[..., NbdExportDriver], volume: Path, tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")
    node = ca.issue_in(tmp_path / "node", "storage-1", ["127.0.0.1"])
    drv = make_driver(tls="x509", x509=X509Files(node.cert, node.key, node.ca))
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-a", address="127.0.0.1"))
    assert isinstance(c, NbdConnection)
    pid = drv.pid
    assert pid is not None
    os.kill(pid, 9)
    export_fixtures.wait_dead(pid)
    drv.check()
    assert drv.pid != pid
    server = f"server.type=inet,server.host={c.host},server.port={c.port},export={c.export}"
    ok, out = attempt(qemu_io(server, "write -P 0x21 0 4k", tls_dir=client_dir(ca, tmp_path, "hv-a")))
    assert ok, out
    ok, out = attempt(qemu_io(server, "write -P 0x22 0 4k", tls_dir=client_dir(ca, tmp_path, "hv-b")))
    assert not ok, out
    assert read_at(volume, 0, 4096) == b"\x21" * 4096


def test_plain_tcp_needs_insecure_and_x509_needs_certificates(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameter, match="needs TLS"):
        NbdExportDriver.from_config(StorageAgentConfig(), tmp_path / "a")
    with pytest.raises(InvalidParameter, match="--insecure"):
        NbdExportDriver.from_config(StorageAgentConfig(nbd_tls="off"), tmp_path / "b")
    assert NbdExportDriver.from_config(StorageAgentConfig(insecure=True), tmp_path / "c").tls == "off"
    unix = NbdExportDriver.from_config(StorageAgentConfig(nbd_socket_dir=tmp_path / "s"), tmp_path / "d")
    assert (unix.tls, unix.socket) == ("off", tmp_path / "s" / "nbd.sock")
    ca = CertificateAuthority(tmp_path / "ca.pem", tmp_path / "ca-key.pem")
    node = ca.issue_in(tmp_path, "storage-1", ["127.0.0.1"])
    x509 = NbdExportDriver.from_config(StorageAgentConfig(tls_cert=node.cert, tls_key=node.key, tls_ca=node.ca),
                                       tmp_path / "e")
    assert x509.tls == "x509"
    with pytest.raises(InvalidParameter, match="go together"):
        NbdExportDriver.from_config(StorageAgentConfig(tls_cert=node.cert), tmp_path / "f")


def test_export_daemon_gets_a_minimal_environment(make_driver: Callable[..., NbdExportDriver],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VBS_AGENT_TOKEN", "agent-token-that-must-not-leak")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-that-must-not-leak")
    drv = make_driver()
    drv.start()
    assert drv.pid is not None
    environ = Path(f"/proc/{drv.pid}/environ").read_bytes()
    assert b"must-not-leak" not in environ
    assert {item.split(b"=", 1)[0] for item in environ.split(b"\0") if item} <= {b"PATH", b"LC_ALL"}


def test_nobody_cannot_read_the_daemons_private_files(make_driver: Callable[..., NbdExportDriver],
                                                      tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")
    node = ca.issue_in(tmp_path / "node", "storage-1", ["127.0.0.1"])
    drv = make_driver(tls="x509", x509=X509Files(node.cert, node.key, node.ca))
    drv.start()
    key = drv.x509_dir / "server-key.pem"
    assert stat.S_IMODE(drv.x509_dir.stat().st_mode) == 0o700 and stat.S_IMODE(key.stat().st_mode) == 0o600
    proc = subprocess.run([*NOBODY, "cat", str(key)], capture_output=True, timeout=30, check=False)
    assert proc.returncode != 0 and b"PRIVATE KEY" not in proc.stdout
