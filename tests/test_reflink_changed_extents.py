"""Changed extents from a reflink pool's shared extents (docs/snapshots.md "Incremental uploads"), on a
real XFS (reflink=1) and btrfs made on loop devices by the test.

The FIEMAP comparison of two reflinked files reports every byte that differs (more is allowed, less never)
and nothing for two untouched reflinks, also for a map longer than one FIEMAP call and when read in
windows; a reflink pool's second snapshot after a small write is uploaded reading only the chunk that
changed and restores bit for bit; without the previous snapshot's pool copy the upload reads and hashes
everything.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests.loopfs import loop_filesystem
from tests.snapshot_stores import sha, until
from vbs import ids
from vbs.snapshot_store import CHUNK_SIZE
from vbs.snapshot_store.dir import DirStore
from vbs.storage.backends.file import FileBackend
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.system import argv
from vbs.system.shared_extents import WINDOW, changed_extents, file_extents
from vbs.wire.storage import RestoreVolume, StoredStatus, StoreSnapshot

pytestmark = pytest.mark.integration

KiB, MiB = 1 << 10, 1 << 20
KEY = SecretStr(secrets.token_hex(32))


def write(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def reflink(src: Path, dst: Path) -> None:
    argv.run(["cp", "--reflink=always", "--", str(src), str(dst)], timeout=60)


def changes(older: Path, newer: Path, window: int = WINDOW) -> list[tuple[int, int]] | None:
    with older.open("rb") as a, newer.open("rb") as b:
        return changed_extents(a.fileno(), b.fileno(), window)


def differing_blocks(older: Path, newer: Path, block: int = 4 * KiB) -> set[int]:
    """The offsets of the ``block``-sized blocks of ``newer`` whose bytes ``older`` does not hold there."""
    old, new = older.read_bytes(), newer.read_bytes()
    return {off for off in range(0, len(new), block) if old[off:off + block] != new[off:off + block]
            or off + block > len(old)}


def covered(extents: list[tuple[int, int]], offset: int, length: int) -> bool:
    return any(start <= offset and offset + length <= start + size for start, size in extents)


@pytest.fixture(params=["xfs", "btrfs"])
def reflink_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A directory on a real file system that reflinks, made on a loop device for this test."""
    with loop_filesystem(tmp_path, request.param, size_mib=1024) as mnt:
        yield mnt


def test_untouched_reflinks_share_everything_and_every_change_is_reported(reflink_dir: Path) -> None:
    older, twin, newer = reflink_dir / "older.raw", reflink_dir / "twin.raw", reflink_dir / "newer.raw"
    with older.open("wb") as f:
        f.truncate(32 * MiB)
    write(older, 0, os.urandom(12 * MiB))  # data, a hole at 12-20 MiB, data, a hole to the end
    write(older, 20 * MiB, os.urandom(4 * MiB))
    reflink(older, twin)
    reflink(older, newer)
    assert changes(older, twin) == [] and changes(twin, newer) == [] and changes(older, older) == []
    assert changes(older, twin, window=MiB + 4 * KiB) == []

    write(newer, MiB + 100, os.urandom(4 * KiB))  # unaligned: straddles two blocks
    write(newer, 8 * MiB, os.urandom(MiB))
    write(newer, 14 * MiB, os.urandom(64 * KiB))  # into what was a hole in both
    write(newer, 5 * MiB, older.read_bytes()[5 * MiB:5 * MiB + 4 * KiB])  # the same bytes, written anew
    argv.run(["fallocate", "--punch-hole", "--offset", str(21 * MiB), "--length", str(MiB), str(newer)],
             timeout=60)
    write(newer, 36 * MiB, os.urandom(8 * KiB))  # grown past the older file's end
    assert newer.stat().st_size > older.stat().st_size

    reported = changes(older, newer)
    assert reported is not None
    differ = differing_blocks(older, newer)
    assert differ, "the writes changed something"
    missed = [off for off in sorted(differ) if not covered(reported, off, 4 * KiB)]
    assert not missed, f"changed blocks not reported: {missed[:8]} (reported {reported})"
    # Everything from the older file's end on is reported changed, the rest only near the writes.
    assert covered(reported, 32 * MiB, newer.stat().st_size - 32 * MiB)
    for start, size in reported:
        if start + size <= 32 * MiB:
            assert any(lo - 2 * MiB <= start and start + size <= hi + 2 * MiB for lo, hi in (
                (MiB, MiB + 8 * KiB), (5 * MiB, 5 * MiB + 4 * KiB), (8 * MiB, 9 * MiB), (14 * MiB, 14 * MiB + 64 * KiB),
                (21 * MiB, 22 * MiB))), (start, size, reported)
    # The rewritten same bytes count as changed (other blocks), never as missing.
    assert covered(reported, 5 * MiB, 4 * KiB)
    assert sum(size for start, size in reported if start < 32 * MiB) < 8 * MiB, reported
    # Read a window at a time (extents cut at odd offsets, a punched hole across a window's end): the same.
    assert changes(older, newer, window=3 * MiB + 4 * KiB) == reported
    assert changes(older, newer, window=64 * KiB) == reported


def test_a_map_of_more_extents_than_one_call_lists_is_read_whole(reflink_dir: Path) -> None:
    older, newer = reflink_dir / "older.raw", reflink_dir / "newer.raw"
    with older.open("wb") as f:
        f.truncate(64 * MiB)
    fd = os.open(older, os.O_WRONLY)
    try:
        for k in range(1024):  # 1024 extents of 4 KiB, a hole after each: more than one FIEMAP call's 512
            os.pwrite(fd, os.urandom(4 * KiB), k * 64 * KiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    reflink(older, newer)
    with newer.open("rb") as f:
        assert len(file_extents(f.fileno(), 0, 64 * MiB) or []) == 1024
    assert changes(older, newer) == []
    for k in (3, 700, 1023):
        write(newer, k * 64 * KiB, os.urandom(4 * KiB))
    assert changes(older, newer) == [(k * 64 * KiB, 4 * KiB) for k in (3, 700, 1023)]


PER_MIB = MiB // CHUNK_SIZE  # chunks in a MiB


class Pool:
    def __init__(self, fs: Path, tmp: Path) -> None:
        (fs / "pool").mkdir()
        self.files = FileBackend("f", fs / "pool", clone_method="reflink")
        self.store = DirStore(tmp / "store")
        self.agent = StoredSnapshots(self.store)

    def snapshot(self, volume_id: str) -> str:
        snap = ids.new_id("snapshot")
        assert self.files.ensure_snapshot(snap, volume_id).state == "ready"
        return snap

    def upload(self, volume_id: str, snap: str, parent: str | None = None) -> StoredStatus:
        req = StoreSnapshot(volume_id=volume_id, tenant="acme", parent_snapshot_id=parent, store_key=KEY)
        return until(lambda: self.agent.upload(self.files, "f", snap, req))

    def restored(self, snap: str, size: int) -> Path:
        target = ids.new_id("volume")
        restore = RestoreVolume(snapshot_id=snap, size_bytes=size, tenant="acme", store_key=KEY)
        assert until(lambda: self.agent.restore(self.files, "f", target, restore)).state == "ready"
        return self.files.volume_path(target)

    def close(self) -> None:
        self.agent.close()
        self.files.close()


@pytest.fixture
def pool(reflink_dir: Path, tmp_path: Path) -> Iterator[Pool]:
    p = Pool(reflink_dir, tmp_path)
    yield p
    p.close()


def test_a_reflink_snapshot_is_stored_reading_only_the_chunks_it_does_not_share(
        pool: Pool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vbs.storage.stored_snapshots")
    where = f"dir:{pool.store.root}"
    vol = ids.new_id("volume")
    pool.files.ensure_volume(vol, 64 * MiB)
    path = pool.files.volume_path(vol)
    write(path, 0, os.urandom(8 * MiB))
    write(path, 40 * MiB, os.urandom(MiB))
    first = pool.snapshot(vol)
    done = pool.upload(vol, first)
    assert done.state == "ready" and done.chunks == 9 * PER_MIB and done.chunks_uploaded == 9 * PER_MIB \
        and done.pool_copy, done

    # 4 KiB written at 2 MiB + 4 KiB: its extent is the only one the next snapshot does not share with the first.
    write(path, 2 * MiB + 4 * KiB, os.urandom(4 * KiB))
    second = pool.snapshot(vol)
    caplog.clear()
    after = pool.upload(vol, second, parent=first)
    assert after.state == "ready" and after.chunks == 9 * PER_MIB and after.chunks_uploaded == 1, after
    assert f"snapshot {second} stored in {where}: {9 * PER_MIB} chunks, 1 read, 1 new" in caplog.text
    assert sha(pool.restored(second, 64 * MiB)) == sha(pool.files.snapshot_image(second))

    # Grown by 8 MiB, one chunk changed below the old end and one written past it: the grown tail is read
    # whole (8 MiB of chunks, one of them data), and the changed chunk below.
    assert pool.files.resize_volume(vol, 72 * MiB).state == "ready"
    write(path, 30 * MiB, os.urandom(4 * KiB))
    write(path, 70 * MiB, os.urandom(4 * KiB))
    third = pool.snapshot(vol)
    caplog.clear()
    grown = pool.upload(vol, third, parent=second)
    assert grown.state == "ready" and grown.chunks == 9 * PER_MIB + 2 and grown.chunks_uploaded == 2, grown
    assert f"snapshot {third} stored in {where}: {9 * PER_MIB + 2} chunks, {8 * PER_MIB + 1} read, 2 new" in caplog.text
    assert sha(pool.restored(third, 72 * MiB)) == sha(pool.files.snapshot_image(third))


def test_without_the_previous_pool_copy_every_chunk_is_read_and_hashed(
        pool: Pool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vbs.storage.stored_snapshots")
    vol = ids.new_id("volume")
    pool.files.ensure_volume(vol, 16 * MiB)
    path = pool.files.volume_path(vol)
    write(path, 0, os.urandom(4 * MiB))
    first = pool.snapshot(vol)
    assert pool.upload(vol, first).chunks_uploaded == 4 * PER_MIB
    write(path, MiB, os.urandom(4 * KiB))
    second = pool.snapshot(vol)
    assert pool.files.changed_since(second, first) is not None
    pool.files.remove_snapshot(first)  # the fast tier lost: its manifest is all the store knows
    assert pool.files.changed_since(second, first) is None

    caplog.clear()
    after = pool.upload(vol, second, parent=first)
    assert after.state == "ready" and after.chunks == 4 * PER_MIB and after.chunks_uploaded == 1, after
    # Every chunk is read (the holes as zeros, unread from the disk), hashed, and only one is new.
    assert f"snapshot {second} stored in dir:{pool.store.root}: {4 * PER_MIB} chunks, {16 * PER_MIB} read, 1 new" \
        in caplog.text
    assert sha(pool.restored(second, 16 * MiB)) == sha(pool.files.snapshot_image(second))
