"""Snapshot operations as the API offers them: create, delete, describe."""

from __future__ import annotations

from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller import filters as flt
from vbs.controller import quotas
from vbs.controller.db import Snapshot, Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.runtime import Controller
from vbs.controller.schemas import CreateSnapshotRequest, SnapshotList, SnapshotOut
from vbs.controller.states import SnapshotState, VolumeState
from vbs.controller.tags import set_tags
from vbs.controller.transitions import transition
from vbs.controller.volumes import live_volume
from vbs.controller.workflows.snapshots import CreateSnapshotParams
from vbs.controller.workflows.storage import StorageParams
from vbs.errors import IncorrectState, NotFound, SnapshotInUse


def snapshot_not_found(snapshot_id: str) -> NotFound:
    return NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")


def create_snapshot(svc: Controller, req: CreateSnapshotRequest, tenant: str) -> SnapshotOut:
    with svc.db.session() as s:
        vol = live_volume(s, req.volume_id, tenant)
        # The volume must stay put while we snapshot it: touch it conditionally in this transaction
        # (its row lock comes before the tenant's: db.locks' order).
        hit = s.execute(update(Volume).where(Volume.id == vol.id,
                                             Volume.status.in_([VolumeState.AVAILABLE, VolumeState.IN_USE]))
                        .values(updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
        if hit != 1:
            raise IncorrectState(f"The volume '{vol.id}' is '{vol.status}'; it must be available or in-use.")
        quotas.check_volume_snapshots(s, vol)
        quotas.check_snapshots(s, svc.cfg, tenant)
        now = utcnow()
        snap = Snapshot(id=ids.new_id("snapshot"), volume_id=vol.id, volume_size_gib=vol.size_gib,
                        comment=req.comment, storage_node=vol.storage_node, pool=vol.pool,
                        status=SnapshotState.PENDING, progress=0, started_at=now, updated_at=now, tenant=tenant)
        s.add(snap)
        s.flush()
        set_tags(s, snap.id, req.tags)
        op_id = svc.engine.begin(s, "create-snapshot", snap.id, CreateSnapshotParams(
            node=vol.storage_node, pool=vol.pool, volume_id=vol.id))
        out = _describe_many(s, [snap])[0]
    svc.engine.submit(op_id)
    return out


def delete_snapshot(svc: Controller, snapshot_id: str, tenant: str) -> SnapshotOut:
    ids.check("snapshot", snapshot_id)
    with svc.db.session() as s:
        snap = s.get(Snapshot, snapshot_id)
        if snap is None or snap.status in (SnapshotState.DELETED, SnapshotState.DELETING) or snap.tenant != tenant:
            raise snapshot_not_found(snapshot_id)
        copying = exists().where(Volume.snapshot_id == snapshot_id, Volume.status == VolumeState.CREATING)
        if s.scalar(select(copying)):
            raise SnapshotInUse(f"The snapshot '{snapshot_id}' is being copied into a new volume; "
                                "delete it when that volume is available.")
        transition(s, Snapshot, snapshot_id, SnapshotState.DELETING, ~copying)
        op_id = svc.engine.begin(s, "delete-snapshot", snapshot_id, StorageParams(node=snap.storage_node,
                                                                                   pool=snap.pool))
        s.refresh(snap)
        out = _describe_many(s, [snap])[0]
    svc.engine.submit(op_id)
    return out


SNAPSHOT_FILTERS = {
    "status": flt.in_values(Snapshot.status),
    "snapshot-id": flt.in_values(Snapshot.id),
    "volume-id": flt.in_values(Snapshot.volume_id),
    "volume-size": flt.in_values(Snapshot.volume_size_gib, flt.bounded_int()),
    "description": flt.in_values(Snapshot.comment),
    "progress": flt.in_values(Snapshot.progress, lambda v: flt.bounded_int(0, 100)(v.rstrip("%"))),
    "encrypted": flt.constant(False),
}


def describe_snapshots(svc: Controller, tenant: str, snapshot_ids: list[str], filters: dict[str, list[str]],
                       max_results: int | None, next_token: str | None, *, hide_deleting: bool = False) -> SnapshotList:
    for sid in snapshot_ids:
        ids.check("snapshot", sid)
    limit = flt.page_limit(max_results, snapshot_ids)
    hidden = [SnapshotState.DELETED, SnapshotState.DELETING] if hide_deleting else [SnapshotState.DELETED]
    stmt = select(Snapshot).where(Snapshot.tenant == tenant, Snapshot.status.not_in(hidden),
                                  *flt.where_clauses(filters, Snapshot.id, SNAPSHOT_FILTERS))
    if snapshot_ids:
        stmt = stmt.where(Snapshot.id.in_(snapshot_ids))
    stmt = flt.paginate(stmt, Snapshot.id, limit, next_token)
    with svc.db.read() as s:
        rows = list(s.scalars(stmt))
        if snapshot_ids:
            missing = sorted(set(snapshot_ids) - {x.id for x in rows})
            if missing and not filters:
                raise NotFound(f"The snapshot(s) '{', '.join(missing)}' do not exist.",
                               code="InvalidSnapshot.NotFound")
        rows, token = flt.page(rows, limit, lambda x: x.id)
        return SnapshotList(snapshots=_describe_many(s, rows), next_token=token)


def get_snapshot(svc: Controller, snapshot_id: str, tenant: str) -> SnapshotOut:
    return describe_snapshots(svc, tenant, [snapshot_id], {}, None, None).snapshots[0]


def _describe_many(s: Session, snaps: list[Snapshot]) -> list[SnapshotOut]:
    tags = flt.tags_of(s, [x.id for x in snaps])
    return [
        SnapshotOut(snapshot_id=x.id, volume_id=x.volume_id, volume_size_gib=x.volume_size_gib, comment=x.comment,
                    status=x.status, status_reason=x.status_reason, progress=x.progress,
                    storage_node=x.storage_node, pool=x.pool, started_at=x.started_at, tags=tags[x.id])
        for x in snaps
    ]
