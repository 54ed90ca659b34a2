"""Changed-block tracking of the NBD export driver (QEMU dirty bitmaps in a real qemu-storage-daemon):
the blocks hosts write between two point-in-time views, read back out of the daemon through a qcow2
file QEMU writes; a copy pool's incremental upload then reads only those blocks and the stored snapshot
restores bit for bit. A bitmap that cannot have seen every write (a new chain of the volume, a
restarted daemon, a view that never had one) answers None: every chunk is read and hashed.

Each test runs its own daemon in tmp_path on a free loopback port, stopped by PID at teardown.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests import test_nbd_export as nbd
from tests.export_fixtures import wait_dead
from tests.snapshot_stores import until
from vbs import ids
from vbs.pools.exports import FileSource, ViewChanges
from vbs.qemu.qcow2_bitmaps import read_bitmap
from vbs.snapshot_store import CHUNK_SIZE
from vbs.snapshot_store.dir import DirStore
from vbs.storage.backends.file import FileBackend
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.system.argv import run
from vbs.wire.connection import HostIdentity, NbdConnection
from vbs.wire.storage import RestoreVolume, StoredStatus, StoreSnapshot

pytestmark = pytest.mark.integration

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 512 * KiB
SIZE = 32 * MiB
KEY = SecretStr(secrets.token_hex(32))
HOST = HostIdentity(name="hv-a", address="127.0.0.1")
make_driver = nbd.make_driver
Make = Callable[..., NbdExportDriver]


def write(c: NbdConnection, pattern: int, offset: int, length: int) -> None:
    rc, out = nbd.qemu_io(c, f"write -P {pattern:#x} {offset} {length}")
    assert rc == 0, out


def test_a_bitmap_qemu_stored_in_a_qcow2_file_reads_back_as_the_blocks_written(tmp_path: Path) -> None:
    image = tmp_path / "b.qcow2"
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), str(SIZE)])
    run(["qemu-img", "bitmap", "--add", "-g", str(BLOCK), str(image), "seen"])
    # Three writes: inside one block, across two blocks, and zeroes (a write all the same).
    run(["qemu-io", "-f", "qcow2", str(image), "-c", f"write -P 1 {MiB + 4 * KiB} 4k",
         "-c", f"write -P 2 {10 * MiB - 4 * KiB} 8k", "-c", f"write -z {20 * MiB} {BLOCK}"])
    granularity, extents = read_bitmap(image, "seen")
    assert granularity == BLOCK
    assert extents == [(MiB, BLOCK), (10 * MiB - BLOCK, 2 * BLOCK), (20 * MiB, BLOCK)]
    with pytest.raises(KeyError):
        read_bitmap(image, "other")
    raw = tmp_path / "r.raw"
    raw.write_bytes(bytes(4096))
    with pytest.raises(ValueError):
        read_bitmap(raw, "seen")


def test_the_daemon_tells_what_hosts_wrote_between_two_views_and_forgets_what_it_cannot_vouch_for(
        make_driver: Make, tmp_path: Path) -> None:
    volume = tmp_path / "vol.img"
    with open(volume, "wb") as f:
        f.write(b"\xaa" * (8 * MiB))
        f.truncate(SIZE)
    drv = make_driver()
    assert isinstance(drv, ViewChanges)
    vol = nbd.VOL
    conn = drv.ensure_export(vol, FileSource(volume), HOST)
    assert isinstance(conn, NbdConnection)
    first, second, third = (ids.new_id("snapshot") for _ in range(3))
    assert drv.ensure_view(first, vol, FileSource(volume), tmp_path / "s1").state == "ready"
    write(conn, 0xBB, MiB + 4 * KiB, 4 * KiB)  # one block
    write(conn, 0xBB, 10 * MiB - 4 * KiB, 8 * KiB)  # two blocks
    drv.remove_view(first)  # stored: its view ends, the host's chain (and its bitmap) serve on
    assert drv.ensure_view(second, vol, FileSource(volume), tmp_path / "s2").state == "ready"
    write(conn, 0xCC, 30 * MiB, 4 * KiB)  # after the second instant: may be listed, never needed
    changed = drv.view_changes(second, first)
    assert changed is not None
    assert [(MiB, BLOCK), (10 * MiB - BLOCK, 2 * BLOCK)] == [e for e in changed if e[0] < 30 * MiB]
    assert drv.view_changes(second, ids.new_id("snapshot")) is None, "no bitmap of a view it never had"
    assert not list((drv.state_dir / "bitmaps").iterdir()), "the qcow2 file the bits came through is gone"

    # A new writable chain of the volume (a resize) would not pass the bitmaps' node: they are dropped.
    drv.remove_view(second)
    tracked = [n["node-name"] for n in nbd.qmp(drv, "query-named-block-nodes", {"flat": True})
               if n.get("dirty-bitmaps")]
    assert len(tracked) == 1, "the bitmaps are on the raw node of the host's chain"
    os.truncate(volume, 2 * SIZE)
    conn = drv.refresh_export(vol, FileSource(volume), HOST.name)
    assert not [n for n in nbd.qmp(drv, "query-named-block-nodes", {"flat": True}) if n.get("dirty-bitmaps")]
    drv.retire_exports(vol, HOST.name)
    assert drv.ensure_view(third, vol, FileSource(volume), tmp_path / "s3").state == "ready"
    assert drv.view_changes(third, second) is None and drv.view_changes(third, first) is None

    # A restarted daemon lost every bitmap: a view made since cannot answer for the time before it.
    drv.remove_view(third)
    fourth = ids.new_id("snapshot")
    assert drv.ensure_view(fourth, vol, FileSource(volume), tmp_path / "s4").state == "ready"
    drv.remove_view(fourth)
    pid = int((drv.state_dir / "qsd.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    drv.ensure_export(vol, FileSource(volume), HOST)  # the daemon starts again, its chains opened anew
    fifth = ids.new_id("snapshot")
    assert drv.ensure_view(fifth, vol, FileSource(volume), tmp_path / "s5").state == "ready"
    assert drv.view_changes(fifth, fourth) is None
    drv.remove_view(fifth)
    drv.remove_export(vol, HOST.name)


def test_a_copy_pools_incremental_upload_reads_only_the_blocks_the_host_wrote(
        make_driver: Make, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vbs.storage.stored_snapshots")
    (tmp_path / "pool").mkdir()
    pool = FileBackend("p", tmp_path / "pool", exports=make_driver(), clone_method="copy", stream_snapshots=True)
    store = DirStore(tmp_path / "store")
    agent = StoredSnapshots(store)
    try:
        vol = ids.new_id("volume")
        assert pool.ensure_volume(vol, SIZE).state == "ready"
        with open(pool.volume_path(vol), "r+b") as f:
            f.write(os.urandom(16 * MiB))
        conn = pool.connection_for(vol, HOST)  # attached: the daemon serves it between the snapshots
        assert isinstance(conn, NbdConnection)

        def snapshot(parent: str | None) -> tuple[str, StoredStatus]:
            snap = ids.new_id("snapshot")
            assert pool.ensure_snapshot(snap, vol).state == "ready"
            req = StoreSnapshot(volume_id=vol, tenant="acme", parent_snapshot_id=parent, store_key=KEY)
            done = until(lambda: agent.upload(pool, "p", snap, req))
            assert isinstance(done, StoredStatus) and done.state == "ready", done
            return snap, done

        first, stored = snapshot(None)
        assert stored.chunks_uploaded == 16 * MiB // CHUNK_SIZE
        write(conn, 0xBB, 5 * MiB, 4 * KiB)
        write(conn, 0xCC, 20 * MiB, 4 * KiB)  # into the hole: a new chunk of the manifest
        with open(pool.volume_path(vol), "rb") as f:
            expected = hashlib.sha256(f.read()).hexdigest()  # the volume at the second instant

        caplog.clear()
        second, stored = snapshot(first)
        assert stored.chunks_uploaded == 2, stored
        chunks = stored.chunks
        assert f"snapshot {second} stored in dir:{store.root}: {chunks} chunks, 2 read, 2 new" in caplog.text

        target = ids.new_id("volume")
        restore = RestoreVolume(snapshot_id=second, size_bytes=SIZE, tenant="acme", store_key=KEY)
        assert until(lambda: agent.restore(pool, "p", target, restore)).state == "ready"
        with open(pool.volume_path(target), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == expected
        pool.remove_connection(vol, HOST.name)
    finally:
        agent.close()
        pool.close()
