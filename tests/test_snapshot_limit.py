"""The per-volume snapshot limit a pool reports (RBD: 450 an image), checked by the controller before
anything is made, on a real SQLite DB; and the bounds of the rbd backend's new settings.

The refusal through the REST and EC2 APIs against a real Ceph is in tests/test_rbd_chains.py (with a
low configured limit: 450 real snapshots would take minutes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from tests.fakes import RecordingEngine
from vbs import ids
from vbs.config import ControllerConfig, StorageAgentConfig
from vbs.controller.db import Database, Node, Snapshot, Volume
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.controller.fleet.nodes import StorageNodeInfo
from vbs.controller.requests.create_snapshot import create_snapshot
from vbs.controller.rest.schemas.snapshots import CreateSnapshotRequest
from vbs.errors import VolumeSnapshotLimitExceeded
from vbs.wire.storage import CloneChain, PoolInfo, TrashedImage

pytestmark = pytest.mark.unit

GIB = 1 << 30
RBD_DEFAULT = StorageAgentConfig().rbd_max_snapshots_per_volume



@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    d = Database(f"sqlite:///{tmp_path / 'vbs.db'}")
    d.migrate()
    yield d
    d.dispose()


def add_world(db: Database, limit: int | None, snapshots: int) -> str:
    """A storage node whose pool reports ``limit``, one volume on it and ``snapshots`` of it."""
    info = StorageNodeInfo(pools=[PoolInfo(name="default", backend="rbd", capacity_bytes=100 * GIB,
                                           free_bytes=100 * GIB, clone_method="rbd-clone", point_in_time=True,
                                           max_snapshots_per_volume=limit)])
    now, vol = utcnow(), ids.new_id("volume")
    with db.session() as s:
        s.add(Node(name="storage-1", kind="storage", url="http://127.0.0.1:1", address="127.0.0.1",
                   info=info.model_dump(mode="json"), started_at=now, last_heartbeat=now))
        s.add(Volume(id=vol, size_gib=1, comment="", volume_type="gp3", multi_attach=False, placement="shared",
                     storage_node="storage-1", pool="default", status="available", progress=100,
                     tenant=DEFAULT_TENANT, created_at=now, updated_at=now))
        for i in range(snapshots):
            s.add(Snapshot(id=ids.new_id("snapshot"), volume_id=vol, volume_size_gib=1, comment="",
                           storage_node="storage-1", pool="default", status="deleted" if i == 0 else "completed",
                           progress=100, tenant=DEFAULT_TENANT, started_at=now, updated_at=now))
    return vol


def snapshot(db: Database, vol: str) -> Any:
    ctl = SimpleNamespace(cfg=ControllerConfig(quota_snapshots=100_000), db=db, engine=RecordingEngine())
    return create_snapshot(ctl, CreateSnapshotRequest(volume_id=vol), DEFAULT_TENANT)  # type: ignore[arg-type]


def count(db: Database, vol: str) -> int:
    with db.read() as s:
        return int(s.scalar(select(func.count()).select_from(Snapshot).where(Snapshot.volume_id == vol,
                                                                             Snapshot.status != "deleted")) or 0)


def test_the_rbd_default_is_450_snapshots_and_the_451st_is_refused_before_anything_is_made(db: Database) -> None:
    assert RBD_DEFAULT == 450
    vol = add_world(db, RBD_DEFAULT, 1 + 449)  # one deleted snapshot does not count
    assert snapshot(db, vol).status == "pending"  # the 450th
    assert count(db, vol) == 450
    with pytest.raises(VolumeSnapshotLimitExceeded) as refused:
        snapshot(db, vol)
    assert refused.value.status == 400
    assert refused.value.code == "VolumeSnapshotLimitExceeded"
    assert "450" in refused.value.message and vol in refused.value.message
    assert count(db, vol) == 450  # nothing was made


def test_a_pool_without_a_limit_takes_more(db: Database) -> None:
    vol = add_world(db, None, 5)
    assert snapshot(db, vol).status == "pending"


def test_the_rbd_settings_are_bounded() -> None:
    for key, bad in (("rbd_max_clone_depth", 0), ("rbd_max_clone_depth", 17), ("rbd_max_flattens", 0),
                     ("rbd_max_snapshots_per_volume", 451), ("rbd_max_snapshots_per_volume", 0)):
        with pytest.raises(ValidationError):
            StorageAgentConfig(**{key: bad})
    cfg = StorageAgentConfig(rbd_max_clone_depth=1, rbd_max_flattens=1, rbd_max_snapshots_per_volume=3)
    assert (cfg.rbd_max_clone_depth, cfg.rbd_max_flattens, cfg.rbd_max_snapshots_per_volume) == (1, 1, 3)


def test_the_pool_report_models_refuse_what_no_pool_has() -> None:
    vol = "vol-0123456789abcdef0"
    with pytest.raises(ValidationError):
        CloneChain(volume_id=vol, depth=1, parents=["vol-1@snap; rm -rf /"])
    with pytest.raises(ValidationError):
        CloneChain(volume_id=vol, depth=1, parents=["x@y"] * 65)
    with pytest.raises(ValidationError):
        TrashedImage(id="../x", name=vol, snapshots=0, children=0, kept_for="nothing")
    with pytest.raises(ValidationError):
        PoolInfo(name="p", backend="rbd", capacity_bytes=1, free_bytes=1, clone_method="c", point_in_time=True,
                 max_snapshots_per_volume=0)
    links = [f"{vol}@snap-0123456789abcdef0", "vol-x@8237c508-5d1a"]
    assert CloneChain(volume_id=vol, depth=2, parents=links).parents == links
