"""Snapshot operations as the API offers them: create, delete, describe."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session, aliased

from vbs import ids
from vbs.controller.auth import encryption
from vbs.controller.db import Node, Snapshot, Volume
from vbs.controller.db.states import SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.db.transitions import transition
from vbs.controller.fleet.nodes import choose_pool, pool_of
from vbs.controller.placement import quotas
from vbs.controller.requests import filters as flt
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.requests.tags import set_tags
from vbs.controller.requests.volumes import live_volume
from vbs.controller.rest.schemas import CopySnapshotRequest, CreateSnapshotRequest, SnapshotList, SnapshotOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.local_volumes import SnapshotLocalParams
from vbs.controller.workflows.snapshots import CopySnapshotParams, CreateSnapshotParams
from vbs.controller.workflows.steps import StorageParams
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
        if vol.placement == "local":
            op_id, snap = _snapshot_local_volume(svc, s, vol, req, tenant)
        else:
            snap = new_snapshot_row(s, svc, vol, req.comment, req.tags, tenant, utcnow())
            op_id = svc.engine.begin(s, "create-snapshot", snap.id, CreateSnapshotParams(
                node=vol.storage_node, pool=vol.pool, volume_id=vol.id))
        out = describe_many(s, [snap])[0]
    svc.engine.submit(op_id)
    return out


def _snapshot_local_volume(svc: Controller, s: Session, vol: Volume, req: CreateSnapshotRequest,
                           tenant: str) -> tuple[str, Snapshot]:
    """A snapshot of a local volume lands on shared storage (a pool the scheduler picks): the host copies
    the volume back there (``workflows.local``)."""
    cfg = svc.cfg
    node, pool = choose_pool(s, vol.size_gib, timeout_s=cfg.heartbeat_timeout_s, overcommit=cfg.overcommit_ratio,
                             default_zone=cfg.availability_zone)
    snap = new_snapshot_row(s, svc, vol, req.comment, req.tags, tenant, utcnow(), where=(node, pool))
    op_id = svc.engine.begin(s, "snapshot-local-volume", snap.id, SnapshotLocalParams(
        node=node, pool=pool, volume_id=vol.id, host=vol.host or vol.storage_node, local_pool=vol.pool,
        size_gib=vol.size_gib, scratch_volume_id=ids.new_id("volume")))
    return op_id, snap


def new_snapshot_row(s: Session, svc: Controller, vol: Volume, comment: str, tags: dict[str, str], tenant: str,
                     now: datetime, where: tuple[str, str] | None = None) -> Snapshot:
    """A pending snapshot of ``vol`` with its tags, within the tenant's and the pool's limits; on the
    volume's storage node and pool, or ``where`` (node, pool)."""
    quotas.check_volume_snapshots(s, vol)
    quotas.check_snapshots(s, svc.cfg, tenant)
    node, pool = where or (vol.storage_node, vol.pool)
    snap = Snapshot(id=ids.new_id("snapshot"), volume_id=vol.id, volume_size_gib=vol.size_gib, comment=comment,
                    storage_node=node, pool=pool, status=SnapshotState.PENDING, progress=0,
                    started_at=now, updated_at=now, tenant=tenant, key_id=vol.key_id)
    s.add(snap)
    s.flush()
    set_tags(s, snap.id, tags)
    return snap


def copy_snapshot(svc: Controller, req: CopySnapshotRequest, tenant: str) -> SnapshotOut:
    """A new snapshot of the tenant's with the data of ``req.source_snapshot_id`` (its own, or one shared with
    it), made where the source lives; the source may not be deleted until the copy is completed."""
    with svc.db.session() as s:
        source = s.get(Snapshot, req.source_snapshot_id)
        if source is None or source.status in (SnapshotState.DELETING, SnapshotState.DELETED) \
                or not sharing.usable(s, source, tenant):
            raise snapshot_not_found(req.source_snapshot_id)
        # Touching the source in this transaction makes a concurrent delete of it wait for us.
        hit = s.execute(update(Snapshot).where(Snapshot.id == source.id, Snapshot.status == SnapshotState.COMPLETED)
                        .values(updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
        if hit != 1:
            raise IncorrectState(f"The snapshot '{source.id}' is '{source.status}'; it must be completed.",
                                 code="IncorrectState")
        key_id, source_key_id = encryption.key_for_copy(s, svc.master_key, source.key_id, encrypted=req.encrypted,
                                                        kms_key_id=req.kms_key_id)
        reencrypt = key_id != source.key_id
        pool = pool_of(s.get(Node, (source.storage_node, "storage")), source.pool)
        if reencrypt and (pool is None or not pool.encryption):
            raise IncorrectState(f"The pool of the snapshot '{source.id}' cannot make encrypted copies.")
        quotas.check_snapshots(s, svc.cfg, tenant)
        now = utcnow()
        snap = Snapshot(id=ids.new_id("snapshot"), volume_id=source.volume_id, volume_size_gib=source.volume_size_gib,
                        comment=req.comment, storage_node=source.storage_node, pool=source.pool,
                        status=SnapshotState.PENDING, progress=0, started_at=now, updated_at=now, tenant=tenant,
                        source_snapshot_id=source.id, key_id=key_id)
        s.add(snap)
        s.flush()
        set_tags(s, snap.id, req.tags)
        op_id = svc.engine.begin(s, "copy-snapshot", snap.id, CopySnapshotParams(
            node=source.storage_node, pool=source.pool, source_snapshot_id=source.id,
            scratch_volume_id=ids.new_id("volume"), size_gib=source.volume_size_gib,
            encrypted=key_id is not None, key_id=key_id if reencrypt else None, source_key_id=source_key_id))
        out = describe_many(s, [snap])[0]
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
        copy = aliased(Snapshot)
        copied = exists().where(copy.source_snapshot_id == snapshot_id, copy.status == SnapshotState.PENDING)
        if s.scalar(select(copied)):
            raise SnapshotInUse(f"The snapshot '{snapshot_id}' is being copied (CopySnapshot); "
                                "delete it when the copy is completed.")
        transition(s, Snapshot, snapshot_id, SnapshotState.DELETING, ~copying, ~copied)
        sharing.forget(s, [snapshot_id])
        op_id = svc.engine.begin(s, "delete-snapshot", snapshot_id, StorageParams(node=snap.storage_node,
                                                                                   pool=snap.pool))
        s.refresh(snap)
        out = describe_many(s, [snap])[0]
    svc.engine.submit(op_id)
    return out


SNAPSHOT_FILTERS = {
    "status": flt.in_values(Snapshot.status),
    "snapshot-id": flt.in_values(Snapshot.id),
    "volume-id": flt.in_values(Snapshot.volume_id),
    "volume-size": flt.in_values(Snapshot.volume_size_gib, flt.bounded_int()),
    "description": flt.in_values(Snapshot.comment),
    "progress": flt.in_values(Snapshot.progress, lambda v: flt.bounded_int(0, 100)(v.rstrip("%"))),
    "encrypted": flt.flag(Snapshot.key_id.is_not(None)),
    "start-time": flt.in_time_spans(Snapshot.started_at),
}


def describe_snapshots(svc: Controller, tenant: str, snapshot_ids: list[str], filters: dict[str, list[str]],
                       max_results: int | None, next_token: str | None, *, hide_deleting: bool = False,
                       shared: bool = False, owners: set[str] | None = None) -> SnapshotList:
    """A page of the tenant's snapshots; with ``shared`` (or when named by id), also those other tenants share
    with it; with ``owners``, only those these tenants own."""
    for sid in snapshot_ids:
        ids.check("snapshot", sid)
    limit = flt.page_limit(max_results, snapshot_ids)
    hidden = [SnapshotState.DELETED, SnapshotState.DELETING] if hide_deleting else [SnapshotState.DELETED]
    scope = sharing.visible_to(tenant) if shared or snapshot_ids else Snapshot.tenant == tenant
    stmt = select(Snapshot).where(scope, Snapshot.status.not_in(hidden),
                                  *flt.where_clauses(filters, Snapshot.id, SNAPSHOT_FILTERS))
    if owners is not None:
        stmt = stmt.where(Snapshot.tenant.in_(sorted(owners)))
    if any(name.startswith("tag") for name in filters):  # another tenant's tags are not the caller's to match
        stmt = stmt.where(Snapshot.tenant == tenant)
    if "volume-id" in filters:  # nor its volumes; a copy comes from no volume (describe_many)
        stmt = stmt.where(Snapshot.tenant == tenant, Snapshot.source_snapshot_id.is_(None))
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
        return SnapshotList(snapshots=describe_many(s, rows, viewer=tenant), next_token=token)


def get_snapshot(svc: Controller, snapshot_id: str, tenant: str) -> SnapshotOut:
    return describe_snapshots(svc, tenant, [snapshot_id], {}, None, None).snapshots[0]


# What a snapshot shows as its volume where the caller may not know it (as AWS shows for copies).
HIDDEN_VOLUME_ID = "vol-ffffffff"


def describe_many(s: Session, snaps: list[Snapshot], *, viewer: str | None = None) -> list[SnapshotOut]:
    """Snapshots as ``viewer`` (None: their owner) sees them. As on AWS, tags stay their owner's (a
    tenant a snapshot is shared with sees none), and the volume is shown only to the owner of a
    snapshot taken of it: a copy, and another tenant's snapshot, show ``HIDDEN_VOLUME_ID``."""
    tags = flt.tags_of(s, [x.id for x in snaps])
    kms = encryption.kms_key_ids(s, {x.key_id for x in snaps if x.key_id is not None})

    def own(x: Snapshot) -> bool:
        return viewer is None or x.tenant == viewer

    return [
        SnapshotOut(snapshot_id=x.id,
                    volume_id=x.volume_id if own(x) and x.source_snapshot_id is None else HIDDEN_VOLUME_ID,
                    volume_size_gib=x.volume_size_gib, comment=x.comment,
                    status=x.status, status_reason=x.status_reason, progress=x.progress,
                    storage_node=x.storage_node, pool=x.pool, started_at=x.started_at,
                    tags=tags[x.id] if own(x) else {},
                    owner=x.tenant, source_snapshot_id=x.source_snapshot_id, encrypted=x.key_id is not None,
                    kms_key_id=kms.get(x.key_id) if x.key_id is not None else None)
        for x in snaps
    ]
