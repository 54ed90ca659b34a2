"""Local paths for hypervisors that open only a file: a volume's export (NBD over TLS-PSK, iSCSI with
CHAP) opened on the host by a qemu-storage-daemon and shown as a file through FUSE.

What is written through the path lands in the volume; a read-only path refuses writes; open and close
are idempotent; a restarted agent adopts the running daemon; a daemon that died leaves a dead mount
that the next open clears; no secret is in the state directory or on an argv; an open path grows in place
onto the grown volume's refreshed export.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import export_fixtures
from tests.export_fixtures import MiB, drivers_of, read_at, wait_dead, write_at
from tests.test_iscsi_export import tgtd_driver
from vbs.connectors.local_path import LocalPaths
from vbs.errors import IncorrectState, InvalidParameter
from vbs.pools.exports import FileSource
from vbs.storage.exports.iscsi import IscsiExportDriver
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.system.argv import run
from vbs.system.fuse_connections import FUSECTL
from vbs.system.mounts import is_mounted as _mounted
from vbs.system.processes import cmdline
from vbs.wire.connection import HostIdentity, IscsiConnection, NbdConnection

pytestmark = pytest.mark.integration

VOL = "vol-0123456789abcdef0"
HOST = HostIdentity(name="hv-a", address="127.0.0.1", initiator_name="iqn.2026-11.org.vbs:hv-a")
volume = export_fixtures.volume


@pytest.fixture
def nbd(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    yield from drivers_of(NbdExportDriver, tmp_path, "qemu-storage-daemon")


@pytest.fixture
def iscsi(tmp_path: Path) -> Iterator[Callable[..., IscsiExportDriver]]:
    yield from drivers_of(tgtd_driver, tmp_path, "tgtd")


@pytest.fixture
def paths(tmp_path: Path) -> Iterator[Callable[[], LocalPaths]]:
    """LocalPaths on one state dir (a second one is an agent restarted); every key is closed after."""
    made: list[LocalPaths] = []

    def make() -> LocalPaths:
        lp = LocalPaths(tmp_path / "paths", secrets_dir=tmp_path / "secrets", timeout=30)
        made.append(lp)
        return lp

    yield make
    last = LocalPaths(tmp_path / "paths", secrets_dir=tmp_path / "secrets", timeout=30)
    for key in last.opened():
        last.close(key)
    for lp in made:
        lp.release()


def _secrets_in(directory: Path, secret: str) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def _roundtrip(lp: LocalPaths, key: str, connection: Any, volume: Path) -> Path:
    path = lp.open(key, connection)
    assert path.stat().st_size == 16 * MiB
    data = os.urandom(64 * 1024)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, 1 * MiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert read_at(volume, 1 * MiB, len(data)) == data
    write_at(volume, 2 * MiB, b"from-the-storage-node")
    with open(path, "rb") as f:
        f.seek(2 * MiB)
        assert f.read(21) == b"from-the-storage-node"
    return path


def test_nbd_over_tls_psk_through_a_local_path(nbd: Callable[..., NbdExportDriver], paths: Callable[[], LocalPaths],
                                               volume: Path, tmp_path: Path) -> None:
    drv = nbd(tls=True)
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST)
    assert isinstance(c, NbdConnection) and c.tls_psk_key is not None
    lp = paths()
    path = _roundtrip(lp, "vol0123456789abcdef0", c, volume)
    assert lp.open("vol0123456789abcdef0", c) == path  # idempotent: the same daemon serves it
    assert lp.opened() == {"vol0123456789abcdef0": path}
    key = c.tls_psk_key.get_secret_value()
    assert _secrets_in(tmp_path / "paths", key) == []
    pid = int((path.parent / "pid").read_text())
    assert key not in " ".join(cmdline(pid))
    assert lp.size_of("vol0123456789abcdef0") == 16 * MiB

    lp.close("vol0123456789abcdef0")
    assert not _mounted(path) and lp.opened() == {}
    wait_dead(pid)
    lp.close("vol0123456789abcdef0")  # absent is success


def test_iscsi_with_chap_through_a_local_path_read_only(iscsi: Callable[..., IscsiExportDriver],
                                                        paths: Callable[[], LocalPaths], volume: Path,
                                                        tmp_path: Path) -> None:
    drv = iscsi()
    drv.start()
    write_at(volume, 0, b"boot-sector")
    c = drv.ensure_export(VOL, FileSource(volume), HOST)
    assert isinstance(c, IscsiConnection) and c.chap_secret is not None
    lp = paths()
    path = lp.open("ro-disk", c, read_only=True)
    with open(path, "rb") as f:
        assert f.read(11) == b"boot-sector"
    with pytest.raises(OSError):  # refused at open, or at the write
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"x", 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    assert read_at(volume, 0, 11) == b"boot-sector"
    assert _secrets_in(tmp_path / "paths", c.chap_secret.get_secret_value()) == []
    # The same key asked read-write: opened again on the new terms.
    _roundtrip(lp, "ro-disk", c, volume)
    lp.close("ro-disk")
    assert lp.opened() == {}


def test_a_restarted_agent_adopts_the_daemon_and_a_dead_one_is_recovered(
        nbd: Callable[..., NbdExportDriver], paths: Callable[[], LocalPaths], volume: Path) -> None:
    drv = nbd()
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST)
    first = paths()
    path = first.open("disk-1", c)
    pid = int((path.parent / "pid").read_text())
    first.release()  # the agent stops; its daemon goes on serving the path

    again = paths()
    assert again.opened() == {"disk-1": path}
    assert again.open("disk-1", c) == path
    assert int((path.parent / "pid").read_text()) == pid

    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    assert _mounted(path)  # a mount nobody serves any more
    assert again.opened() == {}
    path2 = _roundtrip(again, "disk-1", c, volume)
    assert int((path2.parent / "pid").read_text()) != pid
    again.close("disk-1")
    assert not _mounted(path2)


def test_an_open_path_grows_in_place_onto_the_refreshed_export(
        nbd: Callable[..., NbdExportDriver], paths: Callable[[], LocalPaths], volume: Path, tmp_path: Path) -> None:
    drv = nbd(tls=True)
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST)
    lp = paths()
    key = "vol0123456789abcdef0"
    path = _roundtrip(lp, key, c, volume)
    fd = os.open(path, os.O_RDWR)  # held open across the growth, as a loop device holds it
    try:
        with open(volume, "r+b") as f:
            f.truncate(32 * MiB)
        grown = drv.refresh_export(VOL, FileSource(volume), HOST.name)
        assert lp.grow(key, grown, 32 * MiB) == path
        assert path.stat().st_size == 32 * MiB and lp.size_of(key) == 32 * MiB
        os.pwrite(fd, b"beyond-the-old-end", 24 * MiB)
        os.fsync(fd)
        assert read_at(volume, 24 * MiB, 18) == b"beyond-the-old-end"
        assert os.pread(fd, 21, 2 * MiB) == b"from-the-storage-node"  # written before the growth
    finally:
        os.close(fd)
    drv.retire_exports(VOL, HOST.name)  # the old export goes: the path no longer reads it
    assert read_at(path, 24 * MiB, 18) == b"beyond-the-old-end"
    assert lp.grow(key, grown, 32 * MiB) == path  # again: nothing to do
    # An agent that died between moving the node and recording it: the record still names the old connection.
    meta = path.parent / "opened.json"
    recorded = json.loads(meta.read_text())
    meta.write_text(json.dumps({**recorded, "fingerprint": "before-the-growth", "generation": 0}))
    assert lp.grow(key, grown, 32 * MiB) == path and path.stat().st_size == 32 * MiB
    assert json.loads(meta.read_text())["generation"] == recorded["generation"]
    assert lp.open(key, grown) == path, "the path is known to be on the refreshed connection"
    assert grown.tls_psk_key is not None
    assert _secrets_in(tmp_path / "paths", grown.tls_psk_key.get_secret_value()) == []
    lp.close(key)
    with pytest.raises(IncorrectState):
        lp.grow(key, grown, 32 * MiB)  # not open


def test_keys_are_checked(paths: Callable[[], LocalPaths]) -> None:
    lp = paths()
    for bad in ("../x", "a b", "", "-rf", "a/b", "x" * 65):
        with pytest.raises(InvalidParameter):
            lp.close(bad)


def _qemu_io(*args: str) -> str:
    return run(["qemu-io", *args], timeout=300).stdout


@pytest.mark.parametrize("aio", ["io_uring", "native", "threads"])
def test_concurrent_direct_writes_through_a_path_land_as_written(
        aio: str, nbd: Callable[..., NbdExportDriver], paths: Callable[[], LocalPaths], tmp_path: Path) -> None:
    """qemu-storage-daemon 7.2's FUSE export can store another concurrent write's bytes for a write
    (vbs.system.fuse_connections). Without the limit, these 320 concurrent O_DIRECT writes (each of its
    own pattern; those of 2 MiB the kernel splits into several requests) through a path on an NBD export
    over loopback TCP left 12 to 76 wrong over io_uring or Linux AIO (through a unix socket most of them).
    The volume's file must hold every one."""
    volume = tmp_path / "big.raw"
    with open(volume, "wb") as f:
        f.truncate(384 * MiB)
    drv = nbd()
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST)
    path = paths().open("disk-1", c)
    assert (FUSECTL / str(os.minor(path.stat().st_dev)) / "max_background").read_text().strip() == "1"
    writes = [(i * MiB, MiB, i % 250 + 1) for i in range(256)] + \
             [(256 * MiB + i * 2 * MiB, 2 * MiB, (i + 6) % 250 + 1) for i in range(64)]
    _qemu_io("-f", "raw", "-t", "none", "-i", aio,
             *[arg for off, size, p in writes for arg in ("-c", f"aio_write -P {p} {off} {size}")],
             "-c", "aio_flush", str(path))
    wrong = [(off, p) for off, size, p in writes if read_at(volume, off, size) != bytes([p]) * size]
    assert wrong == [], f"{len(wrong)} of {len(writes)} writes hold other bytes"


def test_a_path_opened_without_the_limit_gets_it_when_asked_again(
        nbd: Callable[..., NbdExportDriver], paths: Callable[[], LocalPaths], volume: Path) -> None:
    """A path an earlier version opened (the connection at the kernel's default of 12 background
    requests) is limited when the agent is next asked for it; a read-only path needs no limit."""
    drv = nbd()
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST)
    lp = paths()
    path = lp.open("disk-1", c)
    setting = FUSECTL / str(os.minor(path.stat().st_dev)) / "max_background"
    setting.write_text("12\n")
    assert lp.open("disk-1", c) == path
    assert setting.read_text().strip() == "1"
    lp.close("disk-1")
