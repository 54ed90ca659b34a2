"""CreateSnapshot as the API offers it: the snapshot's row (``pending``) recorded with its operation in one
transaction, then handed to the create-snapshot workflow (a local volume's own workflow for those).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import update
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Node, Snapshot, Volume
from vbs.controller.db.states import SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import storage_info
from vbs.controller.placement import quotas
from vbs.controller.placement.room import refuse_if_full
from vbs.controller.placement.scheduler import choose_pool
from vbs.controller.requests.describe_snapshots import describe_many
from vbs.controller.requests.describe_volumes import live_volume
from vbs.controller.requests.tags import set_tags
from vbs.controller.rest.schemas.snapshots import CreateSnapshotRequest, SnapshotOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.create_snapshot import CREATE_SNAPSHOT, CreateSnapshotParams
from vbs.controller.workflows.local_volumes import SNAPSHOT_LOCAL_VOLUME, SnapshotLocalParams
from vbs.controller.workflows.stored import copy_share
from vbs.errors import IncorrectState


def create_snapshot(svc: Controller, req: CreateSnapshotRequest, tenant: str) -> SnapshotOut:
    with svc.db.session() as s:
        op_id, snap = begin_snapshot(svc, s, req, tenant)
        out = describe_many(s, [snap])[0]
    svc.engine.submit(op_id)
    return out


def begin_snapshot(svc: Controller, s: Session, req: CreateSnapshotRequest, tenant: str) -> tuple[str, Snapshot]:
    """The pending snapshot's row and its operation, in the caller's transaction (which submits the
    operation once it committed): the lifecycle policies' runs record it in the same transaction."""
    vol = live_volume(s, req.volume_id, tenant)
    # The volume must stay put while we snapshot it: touch it conditionally in this transaction
    # (its row lock comes before the tenant's: db.locks' order).
    hit = s.execute(update(Volume).where(Volume.id == vol.id,
                                         Volume.status.in_([VolumeState.AVAILABLE, VolumeState.IN_USE]))
                    .values(updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
    if hit != 1:
        raise IncorrectState(f"The volume '{vol.id}' is '{vol.status}'; it must be available or in-use.")
    if vol.placement == "local":
        op_id, snap = _snapshot_local_volume(svc, s, vol, req, tenant)
    else:
        snap = new_snapshot_row(s, svc, vol, req.comment, req.tags, tenant, utcnow())
        op_id = svc.engine.begin(s, CREATE_SNAPSHOT, snap.id, CreateSnapshotParams(
            node=vol.storage_node, pool=vol.pool, volume_id=vol.id,
            store_share=copy_share(s, vol.storage_node, vol.pool)))
    return op_id, snap


def _snapshot_local_volume(svc: Controller, s: Session, vol: Volume, req: CreateSnapshotRequest,
                           tenant: str) -> tuple[str, Snapshot]:
    """A snapshot of a local volume lands on shared storage (a pool the scheduler picks): the host copies
    the volume back there (``workflows.local``)."""
    cfg = svc.cfg
    node, pool = choose_pool(s, vol.size_gib, timeout_s=cfg.heartbeat_timeout_s, overcommit=cfg.overcommit_ratio,
                             default_zone=cfg.availability_zone)
    snap = new_snapshot_row(s, svc, vol, req.comment, req.tags, tenant, utcnow(), where=(node, pool))
    op_id = svc.engine.begin(s, SNAPSHOT_LOCAL_VOLUME, snap.id, SnapshotLocalParams(
        node=node, pool=pool, volume_id=vol.id, host=vol.host or vol.storage_node, local_pool=vol.pool,
        size_gib=vol.size_gib, scratch_volume_id=ids.new_id("volume"), store_share=copy_share(s, node, pool)))
    return op_id, snap


def _refuse_full_pool(s: Session, node: str, pool: str, volume_id: str) -> None:
    """A snapshot needs room in its pool (a reflink's new extents, a point-in-time view's scratch, the
    copy): refused on a full one before anything is made (``placement.room``)."""
    row = s.get(Node, (node, "storage"))
    info = next((p for p in storage_info(row).pools if p.name == pool), None) if row is not None else None
    refuse_if_full(node, info, f"a snapshot of {volume_id}")


def new_snapshot_row(s: Session, svc: Controller, vol: Volume, comment: str, tags: dict[str, str], tenant: str,
                     now: datetime, where: tuple[str, str] | None = None) -> Snapshot:
    """A pending snapshot of ``vol`` with its tags, within the tenant's and the pool's limits; on the
    volume's storage node and pool, or ``where`` (node, pool)."""
    quotas.check_volume_snapshots(s, vol)
    quotas.check_snapshots(s, svc.cfg, tenant)
    node, pool = where or (vol.storage_node, vol.pool)
    _refuse_full_pool(s, node, pool, vol.id)
    snap = Snapshot(id=ids.new_id("snapshot"), volume_id=vol.id, volume_size_gib=vol.size_gib, comment=comment,
                    storage_node=node, pool=pool, status=SnapshotState.PENDING, progress=0,
                    started_at=now, updated_at=now, tenant=tenant, key_id=vol.key_id)
    s.add(snap)
    s.flush()
    set_tags(s, snap.id, tags)
    return snap
