"""The file backend's point-in-time rules, with an in-memory export driver (unit tier).

Which path a snapshot takes — the export daemon's copy, a plain copy no writer can spoil, or a
refusal that sends the controller to the hypervisor — and the snapshot target a hypervisor copies
into. The daemons themselves are proven in test_nbd_export.py and, end to end with guests, in
test_point_in_time.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fakes import CopyingExports, MemoryExports
from vbs import ids
from vbs.errors import PointInTimeUnavailable, RetryLater
from vbs.storage.backends.file import FileBackend
from vbs.wire.connection import HostIdentity
from vbs.wire.storage import ItemStatus

pytestmark = pytest.mark.unit

MiB = 1 << 20
HOST = HostIdentity(name="host-1", address="127.0.0.1")


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pool"
    d.mkdir()
    return d


def make(pool_dir: Path, exports: MemoryExports) -> FileBackend:
    return FileBackend("p", pool_dir, exports=exports, clone_method="copy", copy_chunk_bytes=MiB)  # type: ignore[arg-type]


@pytest.fixture
def plain(pool_dir: Path) -> Iterator[tuple[FileBackend, MemoryExports]]:
    exports = MemoryExports()
    backend = make(pool_dir, exports)
    yield backend, exports
    backend.close()


def volume_with_data(backend: FileBackend, mib: int) -> str:
    vol = ids.new_id("volume")
    backend.ensure_volume(vol, mib * MiB)
    with open(backend.volume_path(vol), "r+b") as f:
        f.write(os.urandom(mib * MiB // 2))
    return vol


def until(get: Callable[[], ItemStatus], timeout: float = 20.0) -> ItemStatus:
    deadline = time.monotonic() + timeout
    while (status := get()).state == "copying":
        assert time.monotonic() < deadline, status
        time.sleep(0.005)
    return status


def test_a_volume_a_host_writes_is_refused_where_the_node_cannot_copy_it_at_one_instant(
        plain: tuple[FileBackend, MemoryExports]) -> None:
    backend, _ = plain
    vol = volume_with_data(backend, 8)
    backend.connection_for(vol, HOST)

    with pytest.raises(PointInTimeUnavailable):
        backend.ensure_snapshot(ids.new_id("snapshot"), vol)
    assert not backend.pool_info().point_in_time


def test_no_host_gets_a_volume_while_a_plain_copy_of_it_runs(plain: tuple[FileBackend, MemoryExports]) -> None:
    backend, exports = plain
    vol, snap = volume_with_data(backend, 64), ids.new_id("snapshot")
    assert backend.ensure_snapshot(snap, vol).state == "copying"

    with pytest.raises(RetryLater, match=snap):
        backend.connection_for(vol, HOST)
    assert exports.exports == {}

    assert until(lambda: backend.snapshot_status(snap)).state == "ready"
    backend.connection_for(vol, HOST)
    assert exports.is_exported(vol)


def test_a_snapshot_target_is_exported_to_the_host_then_published_without_its_zeros(
        plain: tuple[FileBackend, MemoryExports], pool_dir: Path) -> None:
    backend, exports = plain
    vol, snap = volume_with_data(backend, 16), ids.new_id("snapshot")
    content = backend.volume_path(vol).read_bytes()

    backend.snapshot_target(snap, vol, HOST)
    partial = pool_dir / "snapshots" / f"{snap}.raw.partial"
    assert exports.exports == {(snap, "host-1"): partial}
    assert partial.stat().st_size == len(content)
    # What an iSCSI target does for the hypervisor's copy: every byte written, zeros as data.
    partial.write_bytes(content)
    assert os.stat(partial).st_blocks * 512 >= len(content)

    assert until(lambda: backend.finish_snapshot_target(snap, "host-1")).state == "ready"
    final = pool_dir / "snapshots" / f"{snap}.raw"
    assert final.read_bytes() == content
    assert os.stat(final).st_blocks * 512 <= len(content) // 2 + MiB, "the zero half was given back"
    assert exports.exports == {}
    assert backend.finish_snapshot_target(snap, "host-1").state == "ready"  # idempotent


def test_an_export_daemon_that_copies_takes_every_snapshot_and_its_unwritten_space_is_given_back(
        pool_dir: Path) -> None:
    exports = CopyingExports()
    backend = make(pool_dir, exports)
    try:
        vol, snap = volume_with_data(backend, 16), ids.new_id("snapshot")
        backend.connection_for(vol, HOST)  # exported or not, the daemon copies
        assert backend.pool_info().point_in_time

        assert backend.ensure_snapshot(snap, vol).state == "copying"
        assert until(lambda: backend.ensure_snapshot(snap, vol)).state == "ready"

        final = pool_dir / "snapshots" / f"{snap}.raw"
        assert final.read_bytes() == backend.volume_path(vol).read_bytes()
        assert os.stat(final).st_blocks * 512 <= 8 * MiB + MiB
        assert not list(pool_dir.rglob("*.partial"))
    finally:
        backend.close()


def test_a_daemon_copy_whose_instant_was_lost_is_an_error(pool_dir: Path) -> None:
    exports = CopyingExports()
    exports.fail_next = True
    backend = make(pool_dir, exports)
    try:
        vol, snap = volume_with_data(backend, 4), ids.new_id("snapshot")
        status = backend.ensure_snapshot(snap, vol)
        assert status.state == "error" and "interrupted" in (status.error or "")
        backend.remove_snapshot(snap)
        assert not list(pool_dir.rglob(f"{snap}*"))
    finally:
        backend.close()
