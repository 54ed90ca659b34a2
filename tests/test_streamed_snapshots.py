"""Snapshots of a copy pool stream into the snapshot store with no full copy in the pool, through a real
qemu-storage-daemon (its point-in-time view: copy-before-write into a sparse scratch file, read through
its FUSE export), a real ``file`` pool and a ``dir`` store (docs/snapshots.md).

- A sparse volume larger than its pool's free space (a small ext4 file system on a loop device) is
  snapshotted and stored: the pool never holds a copy of it.
- A host overwrites the volume while the upload runs (held at its first chunk by the store): the stored
  snapshot is the volume at the snapshot's instant, the volume has the new data, and the scratch file
  took only what was overwritten; nothing of the view is left once stored.
- An upload stopped by deleting the snapshot, and one whose agent restarted midway (the daemon adopted,
  the view in it), leave nothing behind; the second resumes and stores the instant.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests import test_nbd_export as nbd
from tests.export_fixtures import free_port, write_at
from tests.loopfs import loop_filesystem
from tests.snapshot_stores import until
from vbs import ids
from vbs.snapshot_store import CHUNK_SIZE
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.manifests import find_manifest
from vbs.storage.backends.file import FileBackend
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.wire.connection import HostIdentity, NbdConnection
from vbs.wire.storage import RestoreVolume, StoredStatus, StoreSnapshot

pytestmark = pytest.mark.integration

MiB = 1 << 20
KEY = SecretStr(secrets.token_hex(32))
HOST = HostIdentity(name="hv-a", address="127.0.0.1")
make_driver = nbd.make_driver
Make = Callable[..., NbdExportDriver]


class HeldStore(DirStore):
    """A ``dir`` store whose first chunk put waits until the test lets it go: the upload is under way
    (the view is being read) for as long as the test needs, with no timing involved."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.arrived = threading.Event()
        self.release = threading.Event()

    def _write(self, key: str, data: bytes, *, durable: bool) -> Path:
        # Every put goes through here: the store's own and its batch's (an upload puts chunks in a batch).
        if key.startswith("chunks/") and not self.release.is_set():
            self.arrived.set()
            assert self.release.wait(300), "the test never let the upload go on"
        return super()._write(key, data, durable=durable)


def pattern(seed: int, length: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(256)) * (length // 256)


def view_leftovers(drv: NbdExportDriver, pool: Path) -> list[str]:
    """What of any view is left: daemon nodes and exports, mount files, scratch and hold files."""
    names = [n["node-name"] for n in nbd.qmp(drv, "query-named-block-nodes", {"flat": True})]
    exports = [e["id"] for e in nbd.qmp(drv, "query-block-exports")]
    files = [p.name for p in (pool / "snapshots").iterdir()]
    mounts = [p.name for p in (drv.state_dir / "views").iterdir()] if (drv.state_dir / "views").exists() else []
    return ([n for n in names if n.startswith(("vbsv", "vbsw", "vbsl", "vbsx"))]
            + [e for e in exports if e.startswith("vbsview")] + files + mounts)


@pytest.fixture
def small_pool(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB ext4 file system (no reflink): a pool with far less room than its volume's size."""
    with loop_filesystem(tmp_path, "ext4", size_mib=64) as mnt:
        pool = mnt / "pool"
        pool.mkdir()
        yield pool


def test_a_volume_larger_than_its_pool_streams_its_instant_while_a_host_overwrites_it(
        make_driver: Make, small_pool: Path, tmp_path: Path) -> None:
    drv = make_driver()
    pool = FileBackend("p", small_pool, exports=drv, clone_method="copy", stream_snapshots=True)
    store = HeldStore(tmp_path / "store")
    agent = StoredSnapshots(store)
    try:
        vol = ids.new_id("volume")
        size = 512 * MiB  # sparse: 8 times what the pool's file system holds
        free = os.statvfs(small_pool).f_bavail * os.statvfs(small_pool).f_frsize
        assert free < size
        assert pool.ensure_volume(vol, size).state == "ready"
        path = pool.volume_path(vol)
        a = pattern(1, 4 * MiB)
        write_at(path, 0, a)
        write_at(path, 300 * MiB, a)
        conn = pool.connection_for(vol, HOST)  # a host has it attached and writes while the upload runs
        assert isinstance(conn, NbdConnection)

        snap = ids.new_id("snapshot")
        assert pool.ensure_snapshot(snap, vol).state == "ready", "the instant is taken at once, nothing copied"
        assert pool.snapshot_status(snap).state == "ready"
        assert not (small_pool / "snapshots" / f"{snap}.raw").exists()
        assert not (small_pool / "snapshots" / f"{snap}.raw.partial").exists()
        scratch = small_pool / "snapshots" / f"{snap}.scratch"
        assert scratch.stat().st_blocks == 0

        # Before the upload starts (the controller's next step): pattern B in small writes over every other
        # 64 KiB cluster of what the snapshot holds (a read of the view across clusters must not see them),
        # and the other copy of A zeroed with unmap (the volume file gets a hole where the snapshot has data).
        for k in range(0, 4 * MiB, 128 << 10):
            rc, out = nbd.qemu_io(conn, f"write -P 0xbb {k} 4k")
            assert rc == 0, out
        rc, out = nbd.qemu_io(conn, f"write -z -u {300 * MiB} {4 * MiB}")
        assert rc == 0, out
        req = StoreSnapshot(volume_id=vol, tenant="acme", store_key=KEY)
        assert agent.upload(pool, "p", snap, req).state == "copying"
        assert store.arrived.wait(120), "the upload reached its first chunk"
        rc, out = nbd.qemu_io(conn, f"write -P 0xcc {100 * MiB} {MiB}")  # and while it runs, C into a hole
        assert rc == 0, out
        # Only what was overwritten went to the scratch file (QEMU copies whole 64 KiB clusters).
        assert 6 * MiB <= scratch.stat().st_blocks * 512 <= 7 * MiB
        store.release.set()

        done = until(lambda: agent.upload(pool, "p", snap, req))
        assert isinstance(done, StoredStatus) and done.state == "ready", done
        # Pattern A at two places, 8 MiB: every chunk of it is listed (the same bytes are stored once).
        assert done.chunks == 8 * MiB // CHUNK_SIZE and done.stored_bytes == 8 * MiB and not done.pool_copy
        assert view_leftovers(drv, small_pool) == [], "stored: nothing of the view is left"
        assert not scratch.exists()

        # The volume has every write; the stored snapshot is the volume at its instant (pattern A).
        with open(path, "rb") as f:
            assert f.read(4096) == b"\xbb" * 4096
            f.seek(100 * MiB)
            assert f.read(MiB) == b"\xcc" * MiB
            f.seek(300 * MiB)
            assert f.read(4 * MiB) == bytes(4 * MiB)
        target = ids.new_id("volume")
        restore = RestoreVolume(snapshot_id=snap, size_bytes=size, tenant="acme", store_key=KEY)
        assert until(lambda: agent.restore(pool, "p", target, restore)).state == "ready"
        restored = pool.volume_path(target)
        with open(restored, "rb") as f:
            assert f.read(4 * MiB) == a
            f.seek(100 * MiB)
            assert f.read(MiB) == bytes(MiB)
            f.seek(300 * MiB)
            assert f.read(4 * MiB) == a
        assert restored.stat().st_blocks * 512 <= 9 * MiB, "restored thin, as it was"
        pool.remove_connection(vol, HOST.name)
    finally:
        agent.close()
        pool.close()


def test_a_cancelled_upload_and_a_restarted_agent_leave_nothing_behind(make_driver: Make, tmp_path: Path) -> None:
    (tmp_path / "pool").mkdir()
    pool_dir = tmp_path / "pool"
    port = free_port()
    drv = make_driver(state="nbd", port=port)
    pool = FileBackend("p", pool_dir, exports=drv, clone_method="copy", stream_snapshots=True)
    store = HeldStore(tmp_path / "store")
    agent = StoredSnapshots(store)
    vol = ids.new_id("volume")
    assert pool.ensure_volume(vol, 64 * MiB).state == "ready"
    a = pattern(7, 32 * MiB)  # 32 MiB of chunks: an upload held at its first put is far from done
    write_at(pool.volume_path(vol), 0, a)

    # -- deleted while its upload runs: the upload stops, the view goes ---------------------------------------
    cancelled = ids.new_id("snapshot")
    assert pool.ensure_snapshot(cancelled, vol).state == "ready"
    req = StoreSnapshot(volume_id=vol, tenant="acme", store_key=KEY)
    agent.upload(pool, "p", cancelled, StoreSnapshot(volume_id=vol, tenant="acme", store_key=KEY))
    assert store.arrived.wait(120)
    stopper = threading.Thread(target=agent.delete, args=(cancelled,))
    stopper.start()
    store.release.set()  # the held put returns; the cancelled upload stops at its next chunk
    stopper.join(120)
    assert not stopper.is_alive()
    pool.remove_snapshot(cancelled)  # what delete-snapshot does next on the pool
    assert find_manifest(store, cancelled) is None
    assert view_leftovers(drv, pool_dir) == []

    # -- the agent restarts midway: the daemon is adopted with the view in it, the upload resumes ------------
    store.arrived.clear()
    store.release.clear()
    a = pattern(9, 32 * MiB)  # chunks the store does not hold yet (those of the cancelled upload are there)
    write_at(pool.volume_path(vol), 0, a)
    snap = ids.new_id("snapshot")
    assert pool.ensure_snapshot(snap, vol).state == "ready"
    agent.upload(pool, "p", snap, req)
    assert store.arrived.wait(120)
    pid = drv.pid
    closing = threading.Thread(target=agent.close)  # the old agent's job stops at its next chunk...
    closing.start()
    drv.close()
    store.release.set()  # ...once its held put returns
    closing.join(120)
    assert not closing.is_alive() and find_manifest(store, snap) is None, "stopped midway"
    drv2 = make_driver(state="nbd", port=port)
    drv2.start()
    assert drv2.pid == pid, "the daemon was adopted"
    pool2 = FileBackend("p", pool_dir, exports=drv2, clone_method="copy", stream_snapshots=True)
    agent2 = StoredSnapshots(HeldStore(tmp_path / "store"))
    try:
        conn = pool2.connection_for(vol, HOST)
        rc, out = nbd.qemu_io(conn, f"write -P 0xcc {2 * MiB} {MiB}")  # after the instant: not in the snapshot
        assert rc == 0, out
        assert pool2.snapshot_status(snap).state == "ready"
        resumed = agent2.upload(pool2, "p", snap, req)
        assert resumed.state in ("copying", "ready")
        done = until(lambda: agent2.upload(pool2, "p", snap, req))
        assert done.state == "ready", done
        target = ids.new_id("volume")
        restore = RestoreVolume(snapshot_id=snap, size_bytes=64 * MiB, tenant="acme", store_key=KEY)
        assert until(lambda: agent2.restore(pool2, "p", target, restore)).state == "ready"
        got = pool2.volume_path(target).read_bytes()
        assert got == a + bytes(32 * MiB), "the snapshot is the volume at its instant"
        pool2.remove_connection(vol, HOST.name)
        assert view_leftovers(drv2, pool_dir) == []
    finally:
        agent2.close()
        pool2.close()
        pool.close()
