"""The rbd backend on a real single-node Ceph cluster: the backend contract, step by step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ceph_cluster import CephForTests
from vbs import drivers, ids
from vbs.config import StorageAgentConfig
from vbs.errors import InvalidParameter, NotFound, VolumeSnapshotLimitExceeded
from vbs.pools.backend import Backend
from vbs.storage.backends.rbd import RbdBackend

MiB = 1 << 20

pytestmark = pytest.mark.integration

GIB = 1 << 30


@pytest.fixture
def backend(ceph: CephForTests) -> Iterator[RbdBackend]:
    b = RbdBackend("default", ceph.conf_path, rbd_pool=ceph.new_pool())
    yield b
    b.close()


def test_the_rbd_driver_is_registered_and_built_from_the_agent_config(ceph: CephForTests) -> None:
    cls = drivers.load("backend", "rbd")
    cfg = StorageAgentConfig(backend="rbd", ceph_conf=ceph.conf_path, ceph_user="admin", rbd_pool=ceph.new_pool())
    backend = cls.from_config(cfg, None)
    try:
        assert isinstance(backend, Backend)
        assert backend.inventory().volumes == []
    finally:
        backend.close()  # its maintenance thread, which would outlive the session's cluster


def test_ensure_volume_creates_an_image_once(backend: RbdBackend) -> None:
    vol = ids.new_id("volume")
    first = backend.ensure_volume(vol, GIB)
    again = backend.ensure_volume(vol, GIB)
    assert first.state == again.state == "ready"
    assert again.size_bytes == GIB
    assert backend.inventory().volumes == [vol]
    assert backend.volume_status(vol).state == "ready"


def test_snapshot_is_taken_once_and_listed(backend: RbdBackend) -> None:
    vol, snap = ids.new_id("volume"), ids.new_id("snapshot")
    backend.ensure_volume(vol, GIB)
    assert backend.ensure_snapshot(snap, vol).state == "ready"
    assert backend.ensure_snapshot(snap, vol).size_bytes == GIB
    assert backend.snapshot_status(snap).state == "ready"
    assert backend.inventory().snapshots == [snap]


def test_snapshot_of_a_missing_volume_is_not_found(backend: RbdBackend) -> None:
    with pytest.raises(NotFound):
        backend.ensure_snapshot(ids.new_id("snapshot"), ids.new_id("volume"))


def test_a_volume_cloned_from_a_snapshot_may_be_larger(backend: RbdBackend) -> None:
    vol, snap, clone = ids.new_id("volume"), ids.new_id("snapshot"), ids.new_id("volume")
    backend.ensure_volume(vol, GIB)
    backend.ensure_snapshot(snap, vol)
    assert backend.ensure_volume(clone, 2 * GIB, snap).size_bytes == 2 * GIB
    assert backend.ensure_volume(clone, 2 * GIB, snap).state == "ready"
    with pytest.raises(InvalidParameter):
        backend.ensure_volume(ids.new_id("volume"), GIB // 2, snap)
    with pytest.raises(NotFound):
        backend.ensure_volume(ids.new_id("volume"), GIB, ids.new_id("snapshot"))


def test_resize_grows_and_refuses_to_shrink(backend: RbdBackend) -> None:
    vol = ids.new_id("volume")
    backend.ensure_volume(vol, GIB)
    assert backend.resize_volume(vol, 3 * GIB).size_bytes == 3 * GIB
    assert backend.volume_status(vol).size_bytes == 3 * GIB
    with pytest.raises(InvalidParameter):
        backend.resize_volume(vol, GIB)
    with pytest.raises(NotFound):
        backend.resize_volume(ids.new_id("volume"), GIB)


def test_delete_removes_the_image_and_a_missing_one_is_fine(backend: RbdBackend) -> None:
    vol = ids.new_id("volume")
    backend.ensure_volume(vol, GIB)
    backend.remove_volume(vol)
    backend.remove_volume(vol)
    backend.remove_volume(ids.new_id("volume"))
    backend.remove_snapshot(ids.new_id("snapshot"))
    assert backend.volume_status(vol).state == "absent"
    assert backend.inventory().volumes == []


def test_snapshots_and_clones_outlive_the_deleted_volume(backend: RbdBackend) -> None:
    vol, snap, clone = ids.new_id("volume"), ids.new_id("snapshot"), ids.new_id("volume")
    backend.ensure_volume(vol, GIB)
    backend.ensure_snapshot(snap, vol)
    backend.ensure_volume(clone, GIB, snap)
    backend.remove_volume(vol)
    assert backend.inventory().volumes == [clone]
    assert backend.snapshot_status(snap).state == "ready"
    again = ids.new_id("volume")
    assert backend.ensure_volume(again, GIB, snap).state == "ready"
    backend.remove_snapshot(snap)
    backend.remove_snapshot(snap)
    assert backend.snapshot_status(snap).state == "absent"
    backend.remove_volume(clone)
    backend.remove_volume(again)
    assert backend.inventory().volumes == []
    listing = backend._listing()
    assert not listing.retired and not listing.trash, "the deleted volume's image goes with its last clone"


def test_capacity_comes_from_the_pool_stats(backend: RbdBackend) -> None:
    info = backend.pool_info()
    assert info.backend == "rbd"
    assert info.point_in_time
    assert 0 < info.free_bytes <= info.capacity_bytes <= 10 * GIB


def test_ids_are_checked_before_any_tool_runs(backend: RbdBackend) -> None:
    for bad in ("vol-1; rm -rf /", "../vol-0123456789abcdef0", "vol-0123456789ABCDEF0\n"):
        with pytest.raises(InvalidParameter):
            backend.ensure_volume(bad, GIB)
    with pytest.raises(InvalidParameter):
        backend.ensure_snapshot("snap-x@y", ids.new_id("volume"))
    with pytest.raises(InvalidParameter):
        RbdBackend("default", backend.ceph_conf, rbd_pool="rbd/../x")


def test_the_backend_takes_back_a_snapshot_past_its_limit_and_a_repeat_answers_the_one_made(
        ceph: CephForTests) -> None:
    b = RbdBackend("default", ceph.conf_path, rbd_pool=ceph.new_pool(), max_snapshots_per_volume=2)
    try:
        vol = ids.new_id("volume")
        b.ensure_volume(vol, 16 * MiB)
        first, second, third = (ids.new_id("snapshot") for _ in range(3))
        assert b.ensure_snapshot(first, vol).state == "ready"
        assert b.ensure_snapshot(first, vol).size_bytes == 16 * MiB  # a repeat: the same snapshot
        assert b.ensure_snapshot(second, vol).state == "ready"
        with pytest.raises(VolumeSnapshotLimitExceeded):
            b.ensure_snapshot(third, vol)
        assert sorted(b.inventory().snapshots) == sorted([first, second])  # the third was taken back
    finally:
        b.close()
