"""The NBD export driver against a real qemu-storage-daemon: data path, idempotency, TLS-PSK, recovery.

Each test runs its own daemon in tmp_path on a free loopback port and stops it by PID at teardown.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests import export_fixtures
from tests.export_fixtures import MiB, drivers_of, free_port, read_at, runs, taken_port, wait_dead, write_at
from vbs.config import StorageAgentConfig
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, NotFound
from vbs.pools.exports import ExportDriver, FileSource, PointInTimeCopier
from vbs.qemu.qmp import connect_until
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.system.argv import run
from vbs.wire.connection import HostIdentity, NbdConnection
from vbs.wire.storage import ExportInfo

pytestmark = pytest.mark.integration

VOL = "vol-0123456789abcdef0"
VOL2 = "vol-0fedcba9876543210"
HOST_A = HostIdentity(name="hv-a", address="127.0.0.1")
HOST_B = HostIdentity(name="hv-b.example", address="127.0.0.2")
QSD = "qemu-storage-daemon"
volume = export_fixtures.volume


def connected(port: int) -> bool:
    """Whether a TCP connection to ``port`` on this machine is established (read from /proc)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def wait_connected(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not connected(port):
        assert time.monotonic() < deadline, f"no client connected to port {port}"
        time.sleep(0.02)


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    """Build drivers on a fresh port; every daemon they ran is stopped, by PID, at teardown."""
    yield from drivers_of(NbdExportDriver, tmp_path, QSD)


def info(key: str, host: str, target: str) -> ExportInfo:
    return ExportInfo(key=key, host=host, protocol="nbd", target=target)


def url(c: NbdConnection) -> str:
    return f"nbd://{c.host}:{c.port}/{c.export}"


def qemu_io(c: NbdConnection, cmd: str, *, tls_dir: Path | None = None, user: str | None = None,
            read_only: bool = False) -> tuple[int, str]:
    """Run one qemu-io command against the export (TLS-PSK client when ``tls_dir`` is given)."""
    ro = ["-r"] if read_only else []
    if tls_dir is None:
        argv = ["qemu-io", *ro, "-f", "raw", url(c), "-c", cmd]
    else:
        argv = ["qemu-io", *ro, "--object",
                f"tls-creds-psk,id=t0,endpoint=client,dir={tls_dir},username={user}", "--image-opts",
                f"driver=nbd,server.type=inet,server.host={c.host},server.port={c.port},"
                f"export={c.export},tls-creds=t0", "-c", cmd]
    proc = run(argv, timeout=60, check=False)
    out = proc.stdout + proc.stderr
    # qemu-io exits 0 even when a command inside fails: look at its output too.
    failed = proc.returncode != 0 or "failed" in out.lower() or "error" in out.lower()
    return (1 if failed else 0), out


def client_keys(tmp_path: Path, c: NbdConnection, key: str | None = None) -> Path:
    """What a host agent does with the connection info: its own keys.psk for its identity."""
    assert c.tls_psk_identity is not None and c.tls_psk_key is not None
    d = tmp_path / f"client-{c.tls_psk_identity}-{os.urandom(3).hex()}"
    d.mkdir()
    (d / "keys.psk").write_text(f"{c.tls_psk_identity}:{key or c.tls_psk_key.get_secret_value()}\n")
    return d


def test_driver_satisfies_the_contract(make_driver: Callable[..., NbdExportDriver]) -> None:
    drv = make_driver()
    assert isinstance(drv, ExportDriver) and isinstance(drv, PointInTimeCopier)


def test_from_config(tmp_path: Path) -> None:
    cfg = StorageAgentConfig(export_host="127.0.0.1", nbd_port=10999, nbd_tls=True,
                             options={"nbd": {"aio": "threads", "copy_speed": 1 << 20}})
    drv = NbdExportDriver.from_config(cfg, tmp_path / "nbd")
    assert (drv.listen_host, drv.port, drv.tls) == ("127.0.0.1", 10999, "psk")
    assert (drv.aio, drv.copy_speed) == ("threads", 1 << 20)
    assert drv.pid is None  # nothing started
    with pytest.raises(ValidationError):
        NbdExportDriver.from_config(StorageAgentConfig(options={"nbd": {"copy_speed": -1}}), tmp_path / "nbd")


def test_export_read_write(make_driver: Callable[..., NbdExportDriver], volume: Path, tmp_path: Path) -> None:
    drv = make_driver()
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c, NbdConnection)
    assert (c.host, c.port) == ("127.0.0.1", drv.port)
    assert c.export.startswith(VOL + "-") and len(c.export) > len(VOL) + 30
    assert c.tls_psk_identity is None and c.tls_psk_key is None

    # client write -> lands in the file
    rc, out = qemu_io(c, "write -P 0xab 1M 64k")
    assert rc == 0, out
    assert read_at(volume, MiB, 65536) == b"\xab" * 65536

    # file content -> client read (nbdcopy of the whole export)
    write_at(volume, 4 * MiB, b"\xcd" * 4096)
    copy = tmp_path / "copy.img"
    run(["nbdcopy", url(c), str(copy)], timeout=60)
    assert copy.read_bytes() == volume.read_bytes()
    assert run(["nbdinfo", "--size", url(c)], timeout=30).stdout.strip() == str(16 * MiB)


def test_ensure_is_idempotent(make_driver: Callable[..., NbdExportDriver], volume: Path) -> None:
    drv = make_driver()
    c1 = drv.ensure_export(VOL, FileSource(volume), HOST_A)  # starts the daemon itself
    c2 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert c1 == c2
    assert drv.list_exports() == [info(VOL, HOST_A.name, c1.export)]
    with pytest.raises(IdempotentParameterMismatch):
        drv.ensure_export(VOL, FileSource(volume), HOST_A, read_only=True)
    # a new attachment after removal gets a new name: the old one is dead for good
    drv.remove_export(VOL, HOST_A.name)
    c3 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c3, NbdConnection) and c3.export != c1.export


def test_remove_export(make_driver: Callable[..., NbdExportDriver], volume: Path) -> None:
    drv = make_driver()
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c, NbdConnection)
    pid = drv.pid
    assert pid is not None

    def open_files() -> set[str]:
        fds = Path(f"/proc/{pid}/fd")
        return {os.readlink(fds / fd) for fd in os.listdir(fds) if (fds / fd).is_symlink()}

    assert str(volume) in open_files()
    drv.remove_export(VOL, HOST_A.name)
    assert drv.list_exports() == []
    assert str(volume) not in open_files()  # both nodes deleted: the file is closed
    rc, out = qemu_io(c, "read 0 4k")
    assert rc != 0 and "export" in out.lower(), out
    # idempotent: absent is success, also for a pair that never existed
    drv.remove_export(VOL, HOST_A.name)
    drv.remove_export(VOL2, "never-seen")


def test_remove_cuts_a_connected_client(make_driver: Callable[..., NbdExportDriver], volume: Path) -> None:
    """A forced detach: the export goes even while a client still holds it open."""
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c, NbdConnection)
    holder = subprocess.Popen(  # an idle client keeping the export open
        ["qemu-io", "-f", "raw", url(c)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_connected(drv.port)
        drv.remove_export(VOL, HOST_A.name)
        assert drv.list_exports() == []
        assert not connected(drv.port)  # the daemon hung up on it
    finally:
        holder.kill()
        holder.wait(10)


def test_list_exports_and_multi_attach(make_driver: Callable[..., NbdExportDriver], volume: Path,
                                       tmp_path: Path) -> None:
    drv = make_driver()
    drv.start()
    assert drv.list_exports() == []
    vol2 = tmp_path / "vol2.img"
    vol2.write_bytes(b"\0" * MiB)
    ca = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    cb = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    c2 = drv.ensure_export(VOL2, FileSource(vol2), HOST_A)
    assert isinstance(ca, NbdConnection) and isinstance(cb, NbdConnection) and isinstance(c2, NbdConnection)
    assert len({ca.export, cb.export, c2.export}) == 3
    assert sorted(drv.list_exports(), key=lambda e: (e.key, e.host)) == sorted([
        info(VOL, HOST_A.name, ca.export),
        info(VOL, HOST_B.name, cb.export),
        info(VOL2, HOST_A.name, c2.export),
    ], key=lambda e: (e.key, e.host))

    # both attachments see one volume: a write by A is read by B (O_DIRECT on both nodes)
    rc, out = qemu_io(ca, "write -P 0x5a 0 64k")
    assert rc == 0, out
    rc, out = qemu_io(cb, "read -P 0x5a 0 64k")
    assert rc == 0, out

    drv.remove_export(VOL, HOST_A.name)
    assert {(e.key, e.host) for e in drv.list_exports()} == {(VOL, HOST_B.name), (VOL2, HOST_A.name)}
    rc, out = qemu_io(cb, "read -P 0x5a 0 64k")
    assert rc == 0, out


def test_read_only_export_refuses_writes(make_driver: Callable[..., NbdExportDriver], volume: Path) -> None:
    drv = make_driver()
    write_at(volume, 0, b"\x11" * 4096)
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A, read_only=True)
    assert isinstance(c, NbdConnection)
    rc, out = qemu_io(c, "read -P 0x11 0 4k", read_only=True)
    assert rc == 0, out
    rc, out = qemu_io(c, "write -P 0x22 0 4k")  # a read-write open is refused
    assert rc != 0 and "denied" in out, out
    rc, out = qemu_io(c, "write -P 0x22 0 4k", read_only=True)  # so is a write on a read-only open
    assert rc != 0, out
    info = run(["nbdinfo", url(c)], timeout=30).stdout
    assert "is_read_only: true" in info
    assert volume.read_bytes()[:4096] == b"\x11" * 4096


def test_tls_psk(make_driver: Callable[..., NbdExportDriver], volume: Path, tmp_path: Path) -> None:
    drv = make_driver(tls=True)
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c, NbdConnection)
    assert c.tls_psk_identity == HOST_A.name and c.tls_psk_key is not None
    key = c.tls_psk_key.get_secret_value()
    assert len(key) == 64 and key not in repr(c)
    assert (drv.keys_path.stat().st_mode & 0o777) == 0o600

    # plaintext client: refused before any option, listing included
    rc, out = qemu_io(c, "read 0 4k")
    assert rc != 0 and "tls" in out.lower(), out
    listing = run(["nbdinfo", "--list", f"nbd://{c.host}:{c.port}"], timeout=30, check=False)
    assert listing.returncode != 0

    # the right identity and key: works, data lands in the file
    good = client_keys(tmp_path, c)
    rc, out = qemu_io(c, "write -P 0x77 0 64k", tls_dir=good, user=c.tls_psk_identity)
    assert rc == 0, out
    assert volume.read_bytes()[:65536] == b"\x77" * 65536
    info = run(["nbdinfo", "--size",
                f"nbds://{c.tls_psk_identity}@{c.host}:{c.port}/{c.export}?tls-psk-file={good}/keys.psk"],
               timeout=30)
    assert info.stdout.strip() == str(16 * MiB)

    # a wrong key: refused
    bad = client_keys(tmp_path, c, key="00" * 32)
    rc, out = qemu_io(c, "read 0 4k", tls_dir=bad, user=c.tls_psk_identity)
    assert rc != 0, out

    # same host, second volume: same identity and key
    vol2 = tmp_path / "vol2.img"
    vol2.write_bytes(b"\0" * MiB)
    c2 = drv.ensure_export(VOL2, FileSource(vol2), HOST_A)
    assert isinstance(c2, NbdConnection) and c2.tls_psk_key is not None
    assert c2.tls_psk_key.get_secret_value() == key

    # the host's last export removed: its key is revoked at once, no restart
    drv.remove_export(VOL, HOST_A.name)
    rc, out = qemu_io(c2, "read 0 4k", tls_dir=good, user=c.tls_psk_identity)
    assert rc == 0, out
    drv.remove_export(VOL2, HOST_A.name)
    assert HOST_A.name not in drv.keys_path.read_text()
    c3 = drv.ensure_export(VOL2, FileSource(vol2), HOST_B)  # keep an export so that only the key decides
    assert isinstance(c3, NbdConnection)
    stale = NbdConnection(host=c3.host, port=c3.port, export=c3.export,
                          tls_psk_identity=HOST_A.name, tls_psk_key=c.tls_psk_key)
    rc, out = qemu_io(stale, "read 0 4k", tls_dir=good, user=HOST_A.name)
    assert rc != 0, out


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_check_restarts_a_killed_daemon(make_driver: Callable[..., NbdExportDriver], volume: Path,
                                        tmp_path: Path, tls: bool) -> None:
    drv = make_driver(tls=tls)
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    ro = drv.ensure_export(VOL2, FileSource(volume), HOST_B, read_only=True)
    assert isinstance(c, NbdConnection) and isinstance(ro, NbdConnection)
    keys = client_keys(tmp_path, c) if tls else None
    user = c.tls_psk_identity
    rc, out = qemu_io(c, "write -P 0x3c 0 64k", tls_dir=keys, user=user)
    assert rc == 0, out

    old = drv.pid
    assert old is not None
    drv.check()  # healthy: nothing changes
    assert drv.pid == old
    os.kill(old, signal.SIGKILL)
    wait_dead(old)
    rc, out = qemu_io(c, "read 0 4k", tls_dir=keys, user=user)
    assert rc != 0  # really down

    drv.check()
    assert drv.pid is not None and drv.pid != old
    # the same names and secrets work again: a client just reconnects
    assert drv.ensure_export(VOL, FileSource(volume), HOST_A) == c
    assert {e.target for e in drv.list_exports()} == {c.export, ro.export}
    rc, out = qemu_io(c, "read -P 0x3c 0 64k", tls_dir=keys, user=user)
    assert rc == 0, out
    # read-only survives the restart too
    if tls:
        keys_b = client_keys(tmp_path, ro)
        rc, out = qemu_io(ro, "write 0 4k", tls_dir=keys_b, user=ro.tls_psk_identity)
    else:
        rc, out = qemu_io(ro, "write 0 4k")
    assert rc != 0, out


def test_a_new_agent_adopts_the_running_daemon(make_driver: Callable[..., NbdExportDriver],
                                               volume: Path) -> None:
    port = free_port()
    first = make_driver(port=port)
    c = first.ensure_export(VOL, FileSource(volume), HOST_A)
    pid = first.pid

    # the agent restarts: it lets go of the daemon, a fresh driver takes over the same state directory
    first.close()
    second = make_driver(port=port)
    second.start()
    assert second.pid == pid
    assert second.list_exports() == [info(VOL, HOST_A.name, c.export)]  # type: ignore[union-attr]
    assert second.ensure_export(VOL, FileSource(volume), HOST_A) == c
    rc, out = qemu_io(c, "read 0 4k")  # type: ignore[arg-type]
    assert rc == 0, out
    second.stop()
    wait_dead(pid)  # type: ignore[arg-type]
    assert second.pid is None and second.list_exports() == []

    # stopped daemon, agent starts again: the exports come back under the same names
    third = make_driver(port=port)
    third.start()
    assert third.pid not in (None, pid)
    rc, out = qemu_io(c, "read 0 4k")  # type: ignore[arg-type]
    assert rc == 0, out


def test_start_fails_clearly_when_the_port_is_taken(make_driver: Callable[..., NbdExportDriver]) -> None:
    with taken_port() as port:
        drv = make_driver(port=port)
        with pytest.raises(DriverError, match="did not start"):
            drv.start()
    assert drv.pid is None


def test_bad_input_never_reaches_the_daemon(make_driver: Callable[..., NbdExportDriver], volume: Path,
                                            tmp_path: Path) -> None:
    drv = make_driver()
    with pytest.raises(InvalidParameter):
        drv.ensure_export("vol-nothex", FileSource(volume), HOST_A)
    with pytest.raises(NotFound):
        drv.ensure_export(VOL, FileSource(tmp_path / "missing.img"), HOST_A)
    with pytest.raises(InvalidParameter):
        drv.remove_export(VOL, "Bad Host;rm")
    with pytest.raises(InvalidParameter):
        NbdExportDriver(tmp_path / "x", listen_host="0.0.0.0")
    assert NbdExportDriver(tmp_path / "x", listen_host="0.0.0.0", advertise_host="192.0.2.1").advertise_host \
        == "192.0.2.1"
    for bad in ({"aio": "bogus"}, {"aio": "native", "cache_direct": False}, {"listen_host": "bad host;"},
                {"port": 0}, {"copy_speed": -1}, {"advertise_host": "no spaces"}):
        with pytest.raises(InvalidParameter):
            NbdExportDriver(tmp_path / "x", **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="comma"):
        NbdExportDriver(tmp_path / "a,b")  # QEMU's option syntax would split it
    assert drv.pid is None  # nothing above started a daemon


def test_a_daemon_with_another_configuration_is_replaced(make_driver: Callable[..., NbdExportDriver],
                                                         volume: Path, tmp_path: Path) -> None:
    port = free_port()
    first = make_driver(port=port)
    c = first.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c, NbdConnection)
    old = first.pid
    assert old is not None
    first.close()
    second = make_driver(port=port, tls=True)  # the operator turned TLS on
    second.start()
    wait_dead(old)
    assert second.pid not in (None, old)
    c2 = second.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c2, NbdConnection) and c2.export == c.export and c2.tls_psk_key is not None
    rc, out = qemu_io(c, "read 0 4k")  # plaintext is refused now
    assert rc != 0, out
    rc, out = qemu_io(c2, "read 0 4k", tls_dir=client_keys(tmp_path, c2), user=c2.tls_psk_identity)
    assert rc == 0, out


def test_a_second_agent_does_not_kill_a_busy_daemon(make_driver: Callable[..., NbdExportDriver],
                                                    volume: Path) -> None:
    port = free_port()
    first = make_driver(port=port)
    c = first.ensure_export(VOL, FileSource(volume), HOST_A)
    second = make_driver(port=port)  # first still holds the one-client monitor
    with pytest.raises(DriverError, match="another storage agent"):
        second.start()
    assert first.pid is not None and runs(first.pid, QSD)
    rc, out = qemu_io(c, "read 0 4k")  # type: ignore[arg-type]
    assert rc == 0, out
    first.stop()  # the monitor's holder quits it (teardown would wait for the busy monitor)


# -- online resize: refresh_export / retire_exports ---------------------------------------------------


def nbd_sizes(port: int) -> dict[str, int]:
    """Every export a client can list on the daemon, with the size it reports."""
    out = run(["nbdinfo", "--list", "--json", f"nbd://127.0.0.1:{port}"], timeout=30, check=False)
    if out.returncode != 0:
        return {}
    return {e["export-name"]: int(e["export-size"]) for e in json.loads(out.stdout)["exports"]}


def test_refresh_exports_the_grown_file_under_a_new_name(make_driver: Callable[..., NbdExportDriver],
                                                         volume: Path) -> None:
    drv = make_driver()
    c1 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c1, NbdConnection)
    assert drv.refresh_export(VOL, FileSource(volume), HOST_A.name) == c1  # the file did not grow: nothing to do
    os.truncate(volume, 32 * MiB)
    assert nbd_sizes(drv.port) == {c1.export: 16 * MiB}  # fixed when the export was made

    c2 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    assert isinstance(c2, NbdConnection) and c2.export != c1.export and c2.export.startswith(VOL + "-")
    assert nbd_sizes(drv.port) == {c1.export: 16 * MiB, c2.export: 32 * MiB}
    assert drv.refresh_export(VOL, FileSource(volume), HOST_A.name) == c2
    assert drv.ensure_export(VOL, FileSource(volume), HOST_A) == c2
    assert drv.list_exports() == [info(VOL, HOST_A.name, c2.export)]  # one per (volume, host)
    rc, out = qemu_io(c1, "write -P 0x42 0 64k")  # the old one serves on, on the same file
    assert rc == 0, out
    rc, out = qemu_io(c2, "read -P 0x42 0 64k")
    assert rc == 0, out

    drv.retire_exports(VOL, HOST_A.name)
    drv.retire_exports(VOL, HOST_A.name)  # idempotent
    assert nbd_sizes(drv.port) == {c2.export: 32 * MiB}
    rc, out = qemu_io(c1, "read 0 4k")
    assert rc != 0, out
    state = drv.state_path.read_text()
    assert c1.export not in state and c2.export in state

    # remove_export takes every generation with it.
    os.truncate(volume, 48 * MiB)
    c3 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    assert isinstance(c3, NbdConnection) and len(nbd_sizes(drv.port)) == 2
    drv.remove_export(VOL, HOST_A.name)
    assert nbd_sizes(drv.port) == {} and drv.list_exports() == []
    assert VOL not in drv.state_path.read_text()
    with pytest.raises(NotFound):
        drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    drv.retire_exports(VOL, HOST_A.name)  # nothing to retire: fine
    with pytest.raises(InvalidParameter):
        drv.refresh_export(VOL, FileSource(volume), "Bad Host")


def test_refresh_is_per_host(make_driver: Callable[..., NbdExportDriver], volume: Path) -> None:
    drv = make_driver()
    a1 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    b1 = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    os.truncate(volume, 32 * MiB)
    a2 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    drv.retire_exports(VOL, HOST_A.name)
    assert isinstance(a2, NbdConnection) and isinstance(b1, NbdConnection) and isinstance(a1, NbdConnection)
    assert nbd_sizes(drv.port) == {a2.export: 32 * MiB, b1.export: 16 * MiB}  # B untouched
    drv.retire_exports(VOL, HOST_B.name)  # B has nothing to retire
    assert set(nbd_sizes(drv.port)) == {a2.export, b1.export}


def test_refresh_survives_agent_and_daemon_restarts(make_driver: Callable[..., NbdExportDriver],
                                                    volume: Path) -> None:
    port = free_port()
    first = make_driver(port=port)
    c1 = first.ensure_export(VOL, FileSource(volume), HOST_A)
    os.truncate(volume, 32 * MiB)
    c2 = first.refresh_export(VOL, FileSource(volume), HOST_A.name)
    assert isinstance(c1, NbdConnection) and isinstance(c2, NbdConnection)

    # The agent restarts between refresh and retire: the new one adopts the daemon and knows both.
    first.close()
    second = make_driver(port=port)
    second.start()
    assert nbd_sizes(port) == {c1.export: 16 * MiB, c2.export: 32 * MiB}
    assert second.refresh_export(VOL, FileSource(volume), HOST_A.name) == c2  # its size was persisted
    assert second.ensure_export(VOL, FileSource(volume), HOST_A) == c2

    # The daemon dies: check() re-creates both generations (the old one now opens the grown file).
    pid = second.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    second.check()
    assert nbd_sizes(port) == {c1.export: 32 * MiB, c2.export: 32 * MiB}
    assert second.refresh_export(VOL, FileSource(volume), HOST_A.name) == c2
    second.retire_exports(VOL, HOST_A.name)
    assert nbd_sizes(port) == {c2.export: 32 * MiB}

    # Stopped and started again: only the current generation comes back.
    second.stop()
    third = make_driver(port=port)
    third.start()
    assert nbd_sizes(port) == {c2.export: 32 * MiB}
    rc, out = qemu_io(c2, "read 0 4k")
    assert rc == 0, out


# -- one chain per key, shared by every host ----------------------------------------------------------


def qmp(drv: NbdExportDriver, command: str, args: dict[str, object] | None = None) -> Any:
    """Ask the driver's daemon directly (its monitor takes one client: the driver's)."""
    return drv._q(command, args)


def file_nodes(drv: NbdExportDriver, path: Path) -> list[str]:
    """The daemon's file nodes open on ``path``."""
    return [n["node-name"] for n in qmp(drv, "query-named-block-nodes", {"flat": True})
            if n["drv"] == "file" and n["image"]["filename"] == str(path)]


def test_hosts_share_one_chain(make_driver: Callable[..., NbdExportDriver], volume: Path) -> None:
    drv = make_driver()
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    b = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    assert isinstance(a, NbdConnection) and isinstance(b, NbdConnection) and a.export != b.export
    assert len(file_nodes(drv, volume)) == 1  # both exports on one file node and one raw node
    exports = {e["id"]: e["node-name"] for e in qmp(drv, "query-block-exports")}
    assert len(exports) == 2 and len(set(exports.values())) == 1
    rc, out = qemu_io(a, "write -P 0x61 0 64k")
    assert rc == 0, out
    rc, out = qemu_io(b, "read -P 0x61 0 64k")
    assert rc == 0, out

    drv.remove_export(VOL, HOST_A.name)  # the chain stays for B
    assert len(file_nodes(drv, volume)) == 1
    drv.remove_export(VOL, HOST_B.name)
    assert file_nodes(drv, volume) == [] and VOL not in drv.state_path.read_text()


def test_refresh_with_two_hosts_shares_the_new_chain(make_driver: Callable[..., NbdExportDriver],
                                                      volume: Path) -> None:
    drv = make_driver()
    a1 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    b1 = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    os.truncate(volume, 32 * MiB)
    a2 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)  # opens chain 1 on the grown file
    b2 = drv.refresh_export(VOL, FileSource(volume), HOST_B.name)  # chain 1 has the size: goes on it
    assert all(isinstance(c, NbdConnection) for c in (a1, b1, a2, b2))
    assert len(file_nodes(drv, volume)) == 2
    assert nbd_sizes(drv.port) == {a1.export: 16 * MiB, b1.export: 16 * MiB,  # type: ignore[union-attr]
                                   a2.export: 32 * MiB, b2.export: 32 * MiB}  # type: ignore[union-attr]
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-c", address="127.0.0.3"))
    assert isinstance(c, NbdConnection) and nbd_sizes(drv.port)[c.export] == 32 * MiB  # the newest chain
    assert len(file_nodes(drv, volume)) == 2

    drv.retire_exports(VOL, HOST_A.name)
    assert len(file_nodes(drv, volume)) == 2  # B may still be on chain 0
    drv.retire_exports(VOL, HOST_B.name)
    assert len(file_nodes(drv, volume)) == 1  # nothing uses chain 0 any more: closed
    assert set(nbd_sizes(drv.port)) == {a2.export, b2.export, c.export}  # type: ignore[union-attr]
    rc, out = qemu_io(b2, "write -P 0x62 0 64k")  # type: ignore[arg-type]
    assert rc == 0, out
    rc, out = qemu_io(a2, "read -P 0x62 0 64k")  # type: ignore[arg-type]
    assert rc == 0, out


def test_hosts_of_mixed_modes_share_the_writable_chain(make_driver: Callable[..., NbdExportDriver],
                                                       volume: Path) -> None:
    drv = make_driver()
    ro = drv.ensure_export(VOL, FileSource(volume), HOST_A, read_only=True)  # chain 0, read-only
    rw = drv.ensure_export(VOL, FileSource(volume), HOST_B)  # a writer cannot use it: chain 1
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-c", address="127.0.0.3"), read_only=True)
    assert isinstance(ro, NbdConnection) and isinstance(rw, NbdConnection) and isinstance(c, NbdConnection)
    assert len(file_nodes(drv, volume)) == 2
    rc, out = qemu_io(rw, "write -P 0x63 0 4k")
    assert rc == 0, out
    for reader in (ro, c):
        rc, out = qemu_io(reader, "read -P 0x63 0 4k", read_only=True)
        assert rc == 0, out
    rc, out = qemu_io(c, "write -P 0x64 0 4k", read_only=True)  # read-only on a writable chain
    assert rc != 0, out
    drv.remove_export(VOL, HOST_A.name)
    assert len(file_nodes(drv, volume)) == 1


# -- upgrade from the state file of version 1 ---------------------------------------------------------


def v1_state(volume: Path, *exports: tuple[str, int, str]) -> str:
    """What the driver before the driver kit wrote: one entry per (volume, host, generation)."""
    return json.dumps({"version": 1, "exports": [
        {"volume_id": VOL, "host": host, "path": str(volume), "read_only": False, "name": name, "gen": gen,
         "size": 16 * MiB} for host, gen, name in exports]})


def v1_ids(host: str, gen: int) -> tuple[str, str, str]:
    """Export id and node names as version 1 made them."""
    export_id = f"vbs_{VOL}_{host}" + (f"_{gen}" if gen else "")
    h = hashlib.sha256(export_id.encode()).hexdigest()[:24]
    return export_id, f"vbsf{h}", f"vbsr{h}"


def test_v1_state_is_upgraded_under_a_running_daemon(make_driver: Callable[..., NbdExportDriver],
                                                     volume: Path) -> None:
    """An agent upgraded while an old one's daemon serves: adopted, its exports kept untouched."""
    port = free_port()
    drv = make_driver(port=port)
    old = [(HOST_A.name, 0, f"{VOL}-{'a' * 32}"), (HOST_A.name, 1, f"{VOL}-{'b' * 32}"),
           (HOST_B.name, 0, f"{VOL}-{'c' * 32}")]
    # The old agent's daemon, with the command line and the exports it made.
    drv.state_dir.mkdir(parents=True)
    argv = ["qemu-storage-daemon", "--chardev", f"socket,path={drv.qmp_path},server=on,wait=off,id=m",
            "--monitor", "chardev=m", "--nbd-server", f"addr.type=inet,addr.host=127.0.0.1,addr.port={port}",
            "--pidfile", str(drv.pid_path)]
    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    with connect_until(drv.qmp_path, time.monotonic() + 15) as mon:
        for host, gen, name in old:
            export_id, fnode, rnode = v1_ids(host, gen)
            mon.execute("blockdev-add", {"driver": "file", "node-name": fnode, "filename": str(volume),
                                         "cache": {"direct": True}, "aio": "native"})
            mon.execute("blockdev-add", {"driver": "raw", "node-name": rnode, "file": fnode})
            mon.execute("block-export-add", {"type": "nbd", "id": export_id, "node-name": rnode, "name": name,
                                             "writable": True})
    drv.state_path.write_text(v1_state(volume, *old))
    pid = int(drv.pid_path.read_text())

    drv.start()
    assert drv.pid == pid  # adopted
    names = {name for _, _, name in old}
    assert set(nbd_sizes(port)) == names
    assert sorted(drv.list_exports(), key=lambda e: e.host) == [
        info(VOL, HOST_A.name, old[1][2]), info(VOL, HOST_B.name, old[2][2])]
    assert len(file_nodes(drv, volume)) == 3  # nothing re-opened
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(a, NbdConnection) and a.export == old[1][2]  # the newest generation of A

    # The old generation of A retires as it would have; a new host joins the newest chain.
    drv.retire_exports(VOL, HOST_A.name)
    assert json.loads(drv.state_path.read_text())["version"] == 2
    assert set(nbd_sizes(port)) == {old[1][2], old[2][2]} and len(file_nodes(drv, volume)) == 2
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-c", address="127.0.0.3"))
    assert isinstance(c, NbdConnection) and len(file_nodes(drv, volume)) == 2
    rc, out = qemu_io(c, "write -P 0x65 0 4k")
    assert rc == 0, out
    rc, out = qemu_io(a, "read -P 0x65 0 4k")
    assert rc == 0, out
    for host in (HOST_A.name, HOST_B.name, "hv-c"):
        drv.remove_export(VOL, host)
    assert file_nodes(drv, volume) == [] and nbd_sizes(port) == {}


def test_v1_state_is_upgraded_without_a_daemon(make_driver: Callable[..., NbdExportDriver], volume: Path) -> None:
    """The daemon was stopped with the old agent: the new one brings the same names back."""
    drv = make_driver()
    drv.state_dir.mkdir(parents=True)
    old = [(HOST_A.name, 0, f"{VOL}-{'d' * 32}"), (HOST_B.name, 3, f"{VOL}-{'e' * 32}")]
    drv.state_path.write_text(v1_state(volume, *old))
    drv.start()
    assert set(nbd_sizes(drv.port)) == {name for _, _, name in old}
    export_ids = {e["id"] for e in qmp(drv, "query-block-exports")}
    assert export_ids == {v1_ids(HOST_A.name, 0)[0], v1_ids(HOST_B.name, 3)[0]}
    b = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    assert isinstance(b, NbdConnection) and b.export == old[1][2]
    rc, out = qemu_io(b, "write -P 0x66 0 4k")
    assert rc == 0, out


def test_unreadable_v1_state_is_an_error(make_driver: Callable[..., NbdExportDriver]) -> None:
    drv = make_driver()
    drv.state_dir.mkdir(parents=True)
    drv.state_path.write_text(json.dumps({"version": 1, "exports": [{"host": "hv-a"}]}))
    with pytest.raises(DriverError, match="unreadable"):
        drv.start()
    assert drv.pid is None
