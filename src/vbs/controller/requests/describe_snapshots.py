"""DescribeSnapshots as the API offers it: the caller's snapshots and those shared with it, filtered and
paged.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.auth import encryption
from vbs.controller.db import Snapshot, SnapshotTier
from vbs.controller.db.states import GONE_SNAPSHOT, SnapshotState
from vbs.controller.db.tables import utcnow
from vbs.controller.requests import filters as flt
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.rest.schemas.snapshots import SnapshotList, SnapshotOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.stored import data_location
from vbs.errors import NotFound


def snapshot_not_found(snapshot_id: str) -> NotFound:
    return NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")


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
    hidden = sorted(GONE_SNAPSHOT) if hide_deleting else [SnapshotState.DELETED, SnapshotState.RECOVERABLE]
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


def tiers_of(s: Session, snapshot_ids: list[str]) -> dict[str, SnapshotTier]:
    """The tier rows of these snapshots (a snapshot without one is in the standard tier)."""
    if not snapshot_ids:
        return {}
    return {t.snapshot_id: t for t in s.scalars(select(SnapshotTier).where(SnapshotTier.snapshot_id.in_(snapshot_ids)))}


def effective_tier(row: SnapshotTier | None, now: datetime) -> str:
    """A snapshot's tier now: a temporary restore past its end is the archive tier again (before the
    housekeeping that records it has run)."""
    if row is None:
        return "standard"
    if row.tier == "standard" and row.restore_expires_at is not None and row.restore_expires_at <= now:
        return "archive"
    return row.tier


def describe_many(s: Session, snaps: list[Snapshot], *, viewer: str | None = None) -> list[SnapshotOut]:
    """Snapshots as ``viewer`` (None: their owner) sees them. As on AWS, tags stay their owner's (a
    tenant a snapshot is shared with sees none), and the volume is shown only to the owner of a
    snapshot taken of it: a copy, and another tenant's snapshot, show ``HIDDEN_VOLUME_ID``."""
    tags = flt.tags_of(s, [x.id for x in snaps])
    kms = encryption.kms_key_ids(s, {x.key_id for x in snaps if x.key_id is not None})
    tiers = tiers_of(s, [x.id for x in snaps])
    now = utcnow()

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
                    kms_key_id=kms.get(x.key_id) if x.key_id is not None else None,
                    data_location=data_location(x), store_state=x.store_state, stored_bytes=x.stored_bytes,
                    storage_tier=effective_tier(tiers.get(x.id), now),
                    restore_expires_at=tiers[x.id].restore_expires_at if x.id in tiers else None)
        for x in snaps
    ]
