"""The ``file`` backend on real filesystems: the copy path on the ext4 root, reflink on loop xfs/btrfs.

Nothing is mocked: files are written, copied and cloned, and compared by content. Loop devices and
mounts come from ``loopfs`` and are undone even when a test fails.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.loopfs import loop_filesystem
from vbs import ids
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound
from vbs.storage.backends.file import FileBackend
from vbs.wire.storage import ItemStatus

pytestmark = pytest.mark.unit

MiB = 1 << 20
GiB = 1 << 30
# Small chunks give a copy many progress steps and cancel points within a test-sized file.
CHUNK = 1 * MiB
_RANDOM = os.urandom(16 * MiB)
_ZERO = bytes(MiB)


# -- helpers --------------------------------------------------------------------------------------


def new_vol() -> str:
    return ids.new_id("volume")


def new_snap() -> str:
    return ids.new_id("snapshot")


def fill(path: Path, offset: int, length: int, seed: int = 0) -> None:
    """Write random data; every MiB starts with its offset and seed so a shifted copy differs."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for pos in range(offset, offset + length, MiB):
            start = (pos // MiB * 7 + seed * 13) % 16 * MiB
            block = f"{pos}:{seed}:".encode().ljust(32, b".") + _RANDOM[start + 32 : start + MiB]
            os.pwrite(fd, block[: offset + length - pos], pos)
        os.fsync(fd)
    finally:
        os.close(fd)


def extents(path: Path) -> list[tuple[int, int]]:
    """The file's data ranges, found independently of the code under test."""
    found: list[tuple[int, int]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break
                raise
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            found.append((start, pos))
    finally:
        os.close(fd)
    return found


def digest(path: Path) -> str:
    """A hash of the content (size and non-zero MiB blocks) that reads only the allocated parts."""
    h = hashlib.sha256()
    blocks = sorted({b for start, end in extents(path) for b in range(start // MiB, (end + MiB - 1) // MiB)})
    with open(path, "rb") as f:
        h.update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
        for b in blocks:
            data = os.pread(f.fileno(), MiB, b * MiB)
            if data != _ZERO[: len(data)]:
                h.update(b.to_bytes(8, "little") + data)
    return h.hexdigest()


def full_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def st(state: str, size_bytes: int = 0, progress: int = 0) -> ItemStatus:
    return ItemStatus(state=state, size_bytes=size_bytes, progress=progress)  # type: ignore[arg-type]


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def wait_done(get: Callable[[], ItemStatus], timeout: float = 20.0) -> tuple[ItemStatus, list[ItemStatus]]:
    """Poll until the item stops copying; returns the last status and every one seen."""
    seen: list[ItemStatus] = []
    deadline = time.monotonic() + timeout
    while True:
        status = get()
        seen.append(status)
        if status.state != "copying":
            return status, seen
        assert time.monotonic() < deadline, f"still copying after {timeout}s: {status}"
        time.sleep(0.001)


def copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("vbs-copy-") and t.is_alive()]


def leftovers(pool: Path) -> list[str]:
    return sorted(p.name for p in pool.rglob("*") if p.is_file())


def close_and_check_threads(backend: FileBackend) -> None:
    backend.close()
    for t in copy_threads():
        t.join(10)
    assert copy_threads() == []


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    path = tmp_path / "pool"
    path.mkdir()
    return path


@pytest.fixture
def pool(pool_dir: Path) -> Iterator[FileBackend]:
    """A pool on the ext4 root: no reflink, every snapshot and clone is a background copy."""
    backend = FileBackend("root", pool_dir, copy_chunk_bytes=CHUNK)
    yield backend
    close_and_check_threads(backend)


@pytest.fixture(scope="module")
def xfs_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with loop_filesystem(tmp_path_factory.mktemp("xfs"), "xfs", 1024) as mountpoint:
        yield mountpoint


@pytest.fixture(scope="module")
def btrfs_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with loop_filesystem(tmp_path_factory.mktemp("btrfs"), "btrfs", 1024) as mountpoint:
        yield mountpoint


def _pool_on(mountpoint: Path, **kwargs: object) -> Iterator[FileBackend]:
    path = Path(tempfile.mkdtemp(dir=mountpoint))
    backend = FileBackend(mountpoint.name, path, copy_chunk_bytes=CHUNK, **kwargs)  # type: ignore[arg-type]
    try:
        yield backend
        close_and_check_threads(backend)
    finally:
        shutil.rmtree(path)  # the filesystem is shared by the module's tests


@pytest.fixture
def xfs_pool(xfs_mount: Path) -> Iterator[FileBackend]:
    yield from _pool_on(xfs_mount)


@pytest.fixture
def btrfs_pool(btrfs_mount: Path) -> Iterator[FileBackend]:
    yield from _pool_on(btrfs_mount)


# -- plain volumes --------------------------------------------------------------------------------


def test_new_volume_is_a_sparse_raw_file_of_the_requested_size(pool: FileBackend, pool_dir: Path) -> None:
    vol = new_vol()

    status = pool.ensure_volume(vol, 8 * GiB)

    assert status == st("ready", 8 * GiB, 100)
    path = pool.volume_path(vol)
    assert path == pool_dir / "volumes" / f"{vol}.raw"
    assert path.stat().st_size == 8 * GiB
    assert allocated(path) == 0
    assert leftovers(pool_dir) == [f"{vol}.raw"]
    assert pool.volume_status(vol) == status


def test_ensure_volume_again_is_ready_and_keeps_the_existing_size(pool: FileBackend) -> None:
    vol = new_vol()
    pool.ensure_volume(vol, GiB)
    fill(pool.volume_path(vol), 0, MiB)
    before = digest(pool.volume_path(vol))

    assert pool.ensure_volume(vol, GiB) == st("ready", GiB, 100)
    assert pool.ensure_volume(vol, 2 * GiB) == st("ready", GiB, 100)
    assert digest(pool.volume_path(vol)) == before


def test_a_plain_volume_whose_guest_wrote_a_luks_header_grows_by_its_size_alone(pool: FileBackend) -> None:
    """Only the controller says a volume is a container: a guest's own LUKS header (cryptsetup in the guest,
    or a hostile one claiming a 2 TiB payload offset) changes nothing the storage node does."""
    vol = new_vol()
    pool.ensure_volume(vol, GiB)
    path = pool.volume_path(vol)
    with open(path, "r+b") as f:
        f.write(b"LUKS\xba\xbe" + (1).to_bytes(2, "big") + bytes(96) + (1 << 32 - 1).to_bytes(4, "big"))
    assert pool.resize_volume(vol, 2 * GiB) == st("ready", 2 * GiB, 100)
    assert path.stat().st_size == 2 * GiB


def test_unknown_items_are_absent(pool: FileBackend) -> None:
    assert pool.volume_status(new_vol()) == st("absent")
    assert pool.snapshot_status(new_snap()) == st("absent")
    with pytest.raises(NotFound) as exc:
        pool.volume_path(new_vol())
    assert exc.value.code == "InvalidVolume.NotFound"


def test_remove_is_idempotent(pool: FileBackend, pool_dir: Path) -> None:
    vol, snap = new_vol(), new_snap()
    pool.ensure_volume(vol, GiB)
    fill(pool.volume_path(vol), 0, MiB)
    wait_done(lambda: pool.ensure_snapshot(snap, vol))

    for _ in range(2):
        pool.remove_snapshot(snap)
        pool.remove_volume(vol)

    assert pool.volume_status(vol).state == "absent"
    assert pool.snapshot_status(snap).state == "absent"
    assert leftovers(pool_dir) == []
    pool.remove_volume(new_vol())  # never existed
    pool.remove_snapshot(new_snap())


def test_resize_grows_keeps_data_and_refuses_to_shrink(pool: FileBackend) -> None:
    vol = new_vol()
    pool.ensure_volume(vol, GiB)
    path = pool.volume_path(vol)
    fill(path, 0, 2 * MiB)
    data = _read(path, 0, 2 * MiB)

    assert pool.resize_volume(vol, 3 * GiB) == st("ready", 3 * GiB, 100)
    assert pool.resize_volume(vol, 3 * GiB) == st("ready", 3 * GiB, 100)
    assert path.stat().st_size == 3 * GiB
    assert allocated(path) < 4 * MiB
    assert _read(path, 0, 2 * MiB) == data
    with pytest.raises(InvalidParameter):
        pool.resize_volume(vol, GiB)
    assert path.stat().st_size == 3 * GiB
    with pytest.raises(NotFound):
        pool.resize_volume(new_vol(), GiB)


@pytest.mark.integration  # a loop device: root
def test_a_size_the_file_system_cannot_hold_is_refused_as_bad_input_and_changes_nothing(tmp_path: Path) -> None:
    """ext4 with 4 KiB blocks holds files up to 16 TiB - 4 KiB: a 16 TiB volume is the caller's to change (a
    400 that ends a modification as failed), not a driver fault retried for minutes."""
    with loop_filesystem(tmp_path, "ext4", 64) as mountpoint:
        backend = FileBackend("ext4", mountpoint, copy_chunk_bytes=CHUNK)
        try:
            vol = new_vol()
            backend.ensure_volume(vol, GiB)
            with pytest.raises(InvalidParameter, match="more than this pool's file system holds"):
                backend.resize_volume(vol, 16 << 40)
            assert backend.volume_path(vol).stat().st_size == GiB
            big = new_vol()
            with pytest.raises(InvalidParameter, match="more than this pool's file system holds"):
                backend.ensure_volume(big, 16 << 40)
            assert backend.volume_status(big).state == "absent"
            assert leftovers(mountpoint) == [f"{vol}.raw"]  # no partial of the refused one
        finally:
            close_and_check_threads(backend)


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


BAD_IDS = ["", "vol-123", "vol-0123456789ABCDEF0", "../../etc/passwd", "vol-0123456789abcdef0/x", None, 7]
# name -> (the kind of id the call expects, the call)
CALLS: dict[str, tuple[str, Callable[[FileBackend, object], object]]] = {
    "ensure_volume": ("volume", lambda b, v: b.ensure_volume(v, GiB)),  # type: ignore[arg-type]
    "ensure_volume_source": ("snapshot", lambda b, v: b.ensure_volume(new_vol(), GiB, v)),  # type: ignore[arg-type]
    "volume_status": ("volume", lambda b, v: b.volume_status(v)),  # type: ignore[arg-type]
    "remove_volume": ("volume", lambda b, v: b.remove_volume(v)),  # type: ignore[arg-type]
    "resize_volume": ("volume", lambda b, v: b.resize_volume(v, GiB)),  # type: ignore[arg-type]
    "volume_path": ("volume", lambda b, v: b.volume_path(v)),  # type: ignore[arg-type]
    "ensure_snapshot": ("snapshot", lambda b, v: b.ensure_snapshot(v, new_vol())),  # type: ignore[arg-type]
    "ensure_snapshot_source": ("volume", lambda b, v: b.ensure_snapshot(new_snap(), v)),  # type: ignore[arg-type]
    "snapshot_status": ("snapshot", lambda b, v: b.snapshot_status(v)),  # type: ignore[arg-type]
    "remove_snapshot": ("snapshot", lambda b, v: b.remove_snapshot(v)),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_malformed_ids_are_rejected_before_touching_files(pool: FileBackend, pool_dir: Path, call: str) -> None:
    kind, invoke = CALLS[call]
    wrong_kind = new_snap() if kind == "volume" else new_vol()  # well-formed, but of the other kind
    for bad in [*BAD_IDS, wrong_kind]:
        if bad is None and call == "ensure_volume_source":
            continue  # None there means "no source", not a bad id
        with pytest.raises(InvalidParameter):
            invoke(pool, bad)
    assert leftovers(pool_dir) == []


@pytest.mark.parametrize("size", [0, -512, 1000, True, 1.5 * GiB])
def test_invalid_sizes_are_rejected(pool: FileBackend, size: object) -> None:
    with pytest.raises(InvalidParameter):
        pool.ensure_volume(new_vol(), size)  # type: ignore[arg-type]


# -- the copy path (ext4, no reflink) -------------------------------------------------------------


def test_pool_info_reports_copy_on_ext4(pool: FileBackend, pool_dir: Path) -> None:
    info = pool.pool_info()
    assert info.clone_method == "copy"
    assert info.name == "root" and info.backend == "file" and not info.point_in_time
    assert 0 < info.free_bytes <= info.capacity_bytes
    with pytest.raises(DriverError):
        FileBackend("forced", pool_dir, clone_method="reflink")
    assert not [p for p in pool_dir.iterdir() if p.name.startswith(".vbs")]  # probe files cleaned up


def test_pool_directory_must_exist(tmp_path: Path) -> None:
    with pytest.raises(DriverError):
        FileBackend("gone", tmp_path / "missing")


def test_a_pool_whose_directory_is_removed_reports_itself_lost_with_no_room(tmp_path: Path) -> None:
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    pool = FileBackend("doomed", pool_dir)
    vol = new_vol()
    pool.ensure_volume(vol, 4 * MiB)
    assert pool.lost() is None and pool.inventory().volumes == [vol] and pool.inventory().lost is None

    shutil.rmtree(pool_dir)

    info = pool.pool_info()  # a heartbeat's report is still made
    assert info.lost == f"{pool_dir} is gone" and info.capacity_bytes == info.free_bytes == 0
    assert pool.inventory().model_dump(include={"volumes", "snapshots", "lost"}) == {
        "volumes": [], "snapshots": [], "lost": f"{pool_dir} is gone"}
    assert pool.volume_usage() == {}
    pool_dir.mkdir()  # a mount point without its file system: still lost
    assert pool.inventory().lost == f"{pool_dir / 'volumes'} is gone"


def test_snapshot_copies_in_background_with_rising_progress(pool: FileBackend, pool_dir: Path) -> None:
    vol, snap = new_vol(), new_snap()
    pool.ensure_volume(vol, 256 * MiB)
    fill(pool.volume_path(vol), 0, 128 * MiB)

    first = pool.ensure_snapshot(snap, vol)
    again = pool.ensure_snapshot(snap, vol)
    running = [t.name for t in copy_threads()]
    final, seen = wait_done(lambda: pool.snapshot_status(snap))

    assert first.state == "copying" and first.size_bytes == 256 * MiB
    assert again.state == "copying"
    assert running == [f"vbs-copy-{snap}"]  # the second ensure started no second job
    progress = [s.progress for s in seen if s.state == "copying"]
    assert progress == sorted(progress)
    assert len({p for p in progress if 0 < p < 100}) >= 2, progress
    assert final == st("ready", 256 * MiB, 100)
    snap_path = pool_dir / "snapshots" / f"{snap}.raw"
    assert full_sha256(snap_path) == full_sha256(pool.volume_path(vol))
    assert pool.ensure_snapshot(snap, vol) == final
    assert not list(pool_dir.rglob("*.partial"))


def test_copy_keeps_holes(pool: FileBackend, pool_dir: Path) -> None:
    vol, snap = new_vol(), new_snap()
    pool.ensure_volume(vol, 4 * GiB)
    path = pool.volume_path(vol)
    for offset in (0, GiB, 3 * GiB + 5 * MiB, 4 * GiB - MiB):
        fill(path, offset, MiB, seed=offset // MiB)

    pool.ensure_snapshot(snap, vol)
    status, _ = wait_done(lambda: pool.snapshot_status(snap))

    assert status == st("ready", 4 * GiB, 100)
    snap_path = pool_dir / "snapshots" / f"{snap}.raw"
    assert allocated(snap_path) <= 8 * MiB
    assert extents(snap_path) == extents(path)
    assert digest(snap_path) == digest(path)


def test_snapshot_is_independent_of_later_volume_writes(pool: FileBackend, pool_dir: Path) -> None:
    vol, snap = new_vol(), new_snap()
    pool.ensure_volume(vol, 64 * MiB)
    path = pool.volume_path(vol)
    fill(path, 0, 16 * MiB)
    pool.ensure_snapshot(snap, vol)
    wait_done(lambda: pool.snapshot_status(snap))
    snap_path = pool_dir / "snapshots" / f"{snap}.raw"
    taken = full_sha256(snap_path)
    assert taken == full_sha256(path)

    fill(path, 4 * MiB, 2 * MiB, seed=9)  # over data
    fill(path, 40 * MiB, MiB, seed=9)  # into a hole

    assert full_sha256(snap_path) == taken
    assert full_sha256(path) != taken


def test_clone_bigger_than_snapshot_survives_deleting_its_sources(pool: FileBackend) -> None:
    vol, snap, clone = new_vol(), new_snap(), new_vol()
    pool.ensure_volume(vol, 64 * MiB)
    fill(pool.volume_path(vol), 0, 64 * MiB)
    wait_done(lambda: pool.ensure_snapshot(snap, vol))
    snap_content = _read(pool.volume_path(vol), 0, 64 * MiB)

    first = pool.ensure_volume(clone, 128 * MiB, snap)
    status, _ = wait_done(lambda: pool.volume_status(clone))
    pool.remove_volume(vol)
    pool.remove_snapshot(snap)

    assert first.state == "copying"
    assert status == st("ready", 128 * MiB, 100)
    path = pool.volume_path(clone)
    assert _read(path, 0, 64 * MiB) == snap_content
    assert _read(path, 64 * MiB, 64 * MiB) == bytes(64 * MiB)
    assert allocated(path) <= 66 * MiB  # the grown tail is a hole
    assert pool.ensure_volume(clone, 128 * MiB, snap) == status  # idempotent, even with the source gone


def test_clone_smaller_than_its_snapshot_is_refused(pool: FileBackend, pool_dir: Path) -> None:
    vol, snap, clone = new_vol(), new_snap(), new_vol()
    pool.ensure_volume(vol, 64 * MiB)
    wait_done(lambda: pool.ensure_snapshot(snap, vol))

    with pytest.raises(InvalidParameter):
        pool.ensure_volume(clone, 32 * MiB, snap)
    assert pool.volume_status(clone).state == "absent"
    assert not list(pool_dir.rglob("*.partial"))


def test_sources_must_exist_and_be_ready(pool: FileBackend, pool_dir: Path) -> None:
    with pytest.raises(NotFound) as exc:
        pool.ensure_snapshot(new_snap(), new_vol())
    assert exc.value.code == "InvalidVolume.NotFound"
    with pytest.raises(NotFound) as exc:
        pool.ensure_volume(new_vol(), GiB, new_snap())
    assert exc.value.code == "InvalidSnapshot.NotFound"

    creating = new_vol()
    (pool_dir / "volumes" / f"{creating}.raw.partial").write_bytes(b"half")
    with pytest.raises(IncorrectState):
        pool.ensure_snapshot(new_snap(), creating)
    with pytest.raises(IncorrectState):
        pool.volume_path(creating)


def test_remove_during_copy_cancels_it_and_leaves_nothing(pool: FileBackend, pool_dir: Path) -> None:
    vol, snap = new_vol(), new_snap()
    pool.ensure_volume(vol, 256 * MiB)
    fill(pool.volume_path(vol), 0, 256 * MiB)

    assert pool.ensure_snapshot(snap, vol).state == "copying"
    job = pool._jobs[("snapshot", snap)]
    pool.remove_snapshot(snap)
    # The remove stopped the copy, not waited for it: the job ended cancelled, short of the whole volume.
    assert (job.state, job.error) == ("cancelled", None)
    assert job.done_bytes < 256 * MiB

    assert copy_threads() == []
    assert pool.snapshot_status(snap) == st("absent")
    assert leftovers(pool_dir) == [f"{vol}.raw"]
    assert pool.inventory().model_dump(include={"volumes", "snapshots"}) == {"volumes": [vol], "snapshots": []}
    # The same copy run to the end completes.
    final, _ = wait_done(lambda: pool.ensure_snapshot(snap, vol))
    assert final.state == "ready", final


def test_after_a_crash_a_stalled_clone_restarts_and_a_stalled_snapshot_is_an_error(pool_dir: Path) -> None:
    first = FileBackend("root", pool_dir, copy_chunk_bytes=CHUNK)
    vol, snap, plain = new_vol(), new_snap(), new_vol()
    first.ensure_volume(vol, 128 * MiB)
    fill(first.volume_path(vol), 0, 96 * MiB)
    first.close()
    # What a crash mid-copy leaves: partial files with garbage, no job behind them.
    (pool_dir / "snapshots" / f"{snap}.raw.partial").write_bytes(b"garbage" * 1000)
    (pool_dir / "volumes" / f"{plain}.raw.partial").write_bytes(b"")

    second = FileBackend("root", pool_dir, copy_chunk_bytes=CHUNK)
    try:
        assert second.snapshot_status(snap) == st("stalled", 7000)
        time.sleep(0.05)
        assert second.snapshot_status(snap).state == "stalled"  # a status never starts anything
        assert copy_threads() == []
        listed = second.inventory()
        assert (listed.volumes, listed.snapshots) == (sorted([vol, plain]), [snap])
        assert second.volume_status(plain).state == "stalled"

        # A snapshot's copy is not restarted: the instant it stood for is lost.
        interrupted = second.ensure_snapshot(snap, vol)
        assert interrupted.state == "error" and "point in time is lost" in (interrupted.error or "")
        second.remove_snapshot(snap)
        assert second.ensure_snapshot(snap, vol).state == "copying"
        status, _ = wait_done(lambda: second.snapshot_status(snap))
        assert second.ensure_volume(plain, GiB) == st("ready", GiB, 100)

        assert status == st("ready", 128 * MiB, 100)
        assert full_sha256(pool_dir / "snapshots" / f"{snap}.raw") == full_sha256(second.volume_path(vol))
        assert not list(pool_dir.rglob("*.partial"))
    finally:
        close_and_check_threads(second)


def test_close_stops_copies_and_leaves_them_stalled(pool_dir: Path) -> None:
    first = FileBackend("root", pool_dir, copy_chunk_bytes=CHUNK)
    vol, snap = new_vol(), new_snap()
    first.ensure_volume(vol, 128 * MiB)
    fill(first.volume_path(vol), 0, 128 * MiB)
    assert first.ensure_snapshot(snap, vol).state == "copying"

    close_and_check_threads(first)

    with pytest.raises(DriverError):
        first.ensure_volume(new_vol(), GiB)
    second = FileBackend("root", pool_dir, copy_chunk_bytes=CHUNK)
    try:
        assert second.snapshot_status(snap).state == "stalled"
        assert second.ensure_snapshot(snap, vol).state == "error"
        second.remove_snapshot(snap)
        wait_done(lambda: second.ensure_snapshot(snap, vol))
        assert full_sha256(pool_dir / "snapshots" / f"{snap}.raw") == full_sha256(second.volume_path(vol))
    finally:
        close_and_check_threads(second)


def test_stalled_clone_whose_source_is_gone_is_dropped(pool: FileBackend, pool_dir: Path) -> None:
    vol = new_vol()
    partial = pool_dir / "volumes" / f"{vol}.raw.partial"
    partial.write_bytes(b"half")

    with pytest.raises(NotFound):
        pool.ensure_volume(vol, GiB, new_snap())

    assert not partial.exists()
    assert pool.volume_status(vol).state == "absent"


@pytest.mark.integration  # a loop device: root
def test_failed_copy_reports_error_until_removed_then_a_new_one_completes(tmp_path: Path) -> None:
    with loop_filesystem(tmp_path, "ext4", 64) as mountpoint:
        backend = FileBackend("small", mountpoint, copy_chunk_bytes=CHUNK)
        try:
            vol, snap = new_vol(), new_snap()
            backend.ensure_volume(vol, 24 * MiB)
            fill(backend.volume_path(vol), 0, 24 * MiB)
            filler = mountpoint / "filler"
            filler.write_bytes(bytes(24 * MiB))  # leaves less than 24 MiB free

            assert backend.ensure_snapshot(snap, vol).state == "copying"
            status, _ = wait_done(lambda: backend.snapshot_status(snap))

            assert status.state == "error"
            assert status.error is not None and "No space left on device" in status.error
            assert not list(mountpoint.rglob("*.partial"))
            assert backend.inventory().snapshots == []

            filler.unlink()
            assert backend.ensure_snapshot(snap, vol).state == "error"  # never retried under the same id
            backend.remove_snapshot(snap)
            assert backend.ensure_snapshot(snap, vol).state == "copying"
            status, _ = wait_done(lambda: backend.snapshot_status(snap))
            assert status == st("ready", 24 * MiB, 100)
            assert full_sha256(mountpoint / "snapshots" / f"{snap}.raw") == full_sha256(backend.volume_path(vol))
        finally:
            close_and_check_threads(backend)


def test_inventory_lists_ready_and_in_progress_items_only(pool: FileBackend, pool_dir: Path) -> None:
    vol, snap = new_vol(), new_snap()
    pool.ensure_volume(vol, 128 * MiB)
    fill(pool.volume_path(vol), 0, 128 * MiB)
    (pool_dir / "volumes" / "notes.txt").write_text("not a volume")
    (pool_dir / "volumes" / "vol-xyz.raw").write_text("not an id")

    pool.ensure_snapshot(snap, vol)
    during = pool.inventory()
    wait_done(lambda: pool.snapshot_status(snap))

    assert during.model_dump(include={"volumes", "snapshots"}) == {"volumes": [vol], "snapshots": [snap]}
    assert pool.inventory() == during


# -- the reflink path (loop xfs and btrfs) --------------------------------------------------------


@pytest.mark.integration  # a loop device: root
def test_reflink_is_detected_on_xfs_unless_copy_is_forced(xfs_pool: FileBackend) -> None:
    assert xfs_pool.pool_info().clone_method == "reflink"
    forced = FileBackend("forced", xfs_pool.path, clone_method="copy")
    assert forced.pool_info().clone_method == "copy"
    assert FileBackend("asked", xfs_pool.path, clone_method="reflink").clone_method == "reflink"


def _check_reflink_snapshot_and_clone(backend: FileBackend) -> None:
    vol, snap, clone = new_vol(), new_snap(), new_vol()
    backend.ensure_volume(vol, 16 * GiB)
    path = backend.volume_path(vol)
    for offset in (0, 5 * GiB, 16 * GiB - 8 * MiB):
        fill(path, offset, 8 * MiB, seed=offset // MiB)
    before_content = digest(path)
    free_before = backend.pool_info().free_bytes

    status = backend.ensure_snapshot(snap, vol)
    free_after = backend.pool_info().free_bytes

    assert status == st("ready", 16 * GiB, 100)  # ready at once: nothing was copied in the background
    assert abs(free_before - free_after) < 2 * MiB  # 24 MiB of data, shared not copied
    snap_path = backend.path / "snapshots" / f"{snap}.raw"
    assert digest(snap_path) == before_content

    fill(path, 0, 2 * MiB, seed=99)
    fill(path, 9 * GiB, MiB, seed=99)
    assert digest(snap_path) == before_content
    assert digest(path) != before_content

    assert backend.ensure_volume(clone, 20 * GiB, snap) == st("ready", 20 * GiB, 100)
    backend.remove_volume(vol)
    clone_path = backend.volume_path(clone)
    assert digest(snap_path) == before_content
    assert _read(clone_path, 5 * GiB, 8 * MiB) == _read(snap_path, 5 * GiB, 8 * MiB)
    assert _read(clone_path, 16 * GiB, MiB) == _ZERO
    assert backend.ensure_snapshot(snap, vol) == status  # idempotent, even with the volume gone
    assert not list(backend.path.rglob("*.partial"))


@pytest.mark.integration  # a loop device: root
def test_reflink_snapshot_of_a_16g_volume_is_instant_and_independent_on_xfs(xfs_pool: FileBackend) -> None:
    _check_reflink_snapshot_and_clone(xfs_pool)


@pytest.mark.integration  # a loop device: root
def test_reflink_snapshot_and_clone_on_btrfs(btrfs_pool: FileBackend) -> None:
    assert btrfs_pool.pool_info().clone_method == "reflink"
    _check_reflink_snapshot_and_clone(btrfs_pool)


def test_volume_usage_counts_the_bytes_written_not_the_size(pool: FileBackend) -> None:
    empty, written = new_vol(), new_vol()
    pool.ensure_volume(empty, 4 * GiB)
    pool.ensure_volume(written, 4 * GiB)
    fill(pool.volume_path(written), 64 * MiB, 3 * MiB)

    usage = pool.volume_usage()

    assert usage[empty] == 0
    assert 3 * MiB <= usage[written] < 4 * MiB
    pool.remove_volume(empty)
    assert set(pool.volume_usage()) == {written}
