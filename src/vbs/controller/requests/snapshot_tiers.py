"""ModifySnapshotTier, RestoreSnapshotTier, DescribeSnapshotTierStatus as the API offers them: the archive
tier of snapshots (docs/snapshot-tiers.md).

- **Archive** (``modify_tier``): a completed snapshot that is in the snapshot store moves to the archive
  tier; the archive-snapshot workflow drops its pool's fast copy (and moves it into the archive store, if
  there is one). An archived snapshot makes no volume and
  is not read through the EBS direct APIs until it is restored (``refuse_if_archived``).
- **Restore** (``restore_tier``): permanently (back to standard), or for ``days`` (standard until then, then
  archive again: ``expire_restores``, run by the controllers' housekeeping). Without a separate archive
  store the data never left the snapshot store, so a restore is done at once; with one, the
  restore-snapshot-tier workflow copies it back first. A volume made from it is hydrated from the store.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from vbs.controller.db import Snapshot, SnapshotTier
from vbs.controller.db.states import GONE_SNAPSHOT, SnapshotState
from vbs.controller.db.tables import utcnow
from vbs.controller.requests.describe_snapshots import effective_tier, tiers_of
from vbs.controller.requests.snapshot_permissions import owned_snapshot
from vbs.controller.rest.schemas.tiers import MAX_RESTORE_DAYS, TierOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows import stored
from vbs.controller.workflows.archive_snapshot import ARCHIVE_SNAPSHOT
from vbs.controller.workflows.restore_snapshot_tier import RESTORE_SNAPSHOT_TIER, TierRestoreParams
from vbs.controller.workflows.steps import StorageParams
from vbs.errors import IncorrectState, InvalidParameter

__all__ = ["TierOut", "modify_tier", "restore_tier", "describe_tiers", "refuse_if_archived", "refuse_if_moved_out",
           "expire_restores", "MAX_RESTORE_DAYS", "SnapshotArchived"]

STANDARD, ARCHIVE = "standard", "archive"


class SnapshotArchived(IncorrectState):
    code = "IncorrectState"


def modify_tier(svc: Controller, snapshot_id: str, tenant: str, tier: str) -> datetime:
    """Start moving the snapshot to ``tier`` (``archive``); when it started."""
    if tier != ARCHIVE:
        raise InvalidParameter(f"Value ({tier[:32]}) for parameter StorageTier is invalid. Expected: archive.")
    now = utcnow()
    with svc.db.session() as s:
        snap = owned_snapshot(s, snapshot_id, tenant, lock=True)
        if snap.status != SnapshotState.COMPLETED:
            raise IncorrectState(f"The snapshot '{snapshot_id}' is {snap.status}: only a completed snapshot is "
                                 "archived.")
        if snap.store_state != stored.STORED:
            raise IncorrectState(f"The snapshot '{snapshot_id}' is not in the snapshot store: it cannot be archived "
                                 "(this install keeps snapshots in their pools only, or its upload is unfinished).")
        row = s.get(SnapshotTier, snapshot_id)
        if row is not None and (row.tier == ARCHIVE or row.last_status.endswith("-in-progress")):
            raise IncorrectState(f"The snapshot '{snapshot_id}' is archived already (or being moved between "
                                 "tiers).")
        if row is None:
            row = SnapshotTier(snapshot_id=snapshot_id, tier=STANDARD)
            s.add(row)
        row.last_status, row.last_started_at, row.last_progress, row.last_detail = "archival-in-progress", now, 0, None
        row.restore_expires_at = None
        op_id = svc.engine.begin(s, ARCHIVE_SNAPSHOT, snapshot_id, StorageParams(node=snap.storage_node,
                                                                                    pool=snap.pool))
    svc.engine.submit(op_id)
    return now


def restore_tier(svc: Controller, snapshot_id: str, tenant: str, *, days: int | None, permanent: bool
                 ) -> tuple[datetime, int | None]:
    """Bring an archived snapshot back to the standard tier, for ``days`` or for good; (when, days). One kept
    in a separate archive store is copied back first (the restore-snapshot-tier workflow)."""
    if permanent == (days is not None):
        raise InvalidParameter("Specify one of TemporaryRestoreDays and PermanentRestore.")
    if days is not None and not 1 <= days <= MAX_RESTORE_DAYS:
        raise InvalidParameter(f"TemporaryRestoreDays must be 1-{MAX_RESTORE_DAYS}, not {days}.")
    now = utcnow()
    op_id = None
    with svc.db.session() as s:
        owned_snapshot(s, snapshot_id, tenant, lock=True)
        row = s.get(SnapshotTier, snapshot_id)
        restored_for_now = row is not None and row.tier == STANDARD and row.restore_expires_at is not None
        if row is None or (row.tier != ARCHIVE and not restored_for_now):
            raise IncorrectState(f"The snapshot '{snapshot_id}' is not archived.")
        if row.last_status.endswith("-in-progress"):
            raise IncorrectState(f"The snapshot '{snapshot_id}' is being moved between tiers "
                                 f"({row.last_status}); try again once that is done.")
        kind = "permanent" if permanent else "temporary"
        copy_back = row.archive_store is not None and (row.tier == ARCHIVE or permanent)
        if copy_back:
            # Not usable until the archive store's copy is back in the snapshot store.
            row.last_status = f"{kind}-restore-in-progress"
            row.last_started_at, row.last_progress, row.last_detail = now, 0, None
            if permanent:
                row.restore_expires_at = None  # no expiry meanwhile: it stays restored
            op_id = svc.engine.begin(s, RESTORE_SNAPSHOT_TIER, snapshot_id,
                                     TierRestoreParams(permanent=permanent, days=days))
        elif permanent:
            row.tier, row.last_status, row.archived_at, row.restore_expires_at = (
                STANDARD, "permanent-restore-completed", None, None)
        else:
            row.tier, row.last_status = STANDARD, "temporary-restore-completed"
            row.restore_expires_at = now + timedelta(days=days or 0)
        if not copy_back:
            row.last_started_at, row.last_progress, row.last_detail = now, 100, None
    if op_id is not None:
        svc.engine.submit(op_id)
    return now, days


def describe_tiers(svc: Controller, tenant: str, snapshot_ids: list[str] | None) -> list[TierOut]:
    """The tier and last tiering operation of the tenant's snapshots, by snapshot id."""
    now = utcnow()
    with svc.db.read() as s:
        q = select(Snapshot).where(Snapshot.tenant == tenant,
                                   Snapshot.status.notin_(GONE_SNAPSHOT))
        if snapshot_ids:
            q = q.where(Snapshot.id.in_(snapshot_ids))
        snaps = list(s.scalars(q.order_by(Snapshot.id)))
        rows = tiers_of(s, [x.id for x in snaps])
    out = []
    for snap in snaps:
        row = rows.get(snap.id)
        out.append(TierOut(snapshot_id=snap.id, volume_id=snap.volume_id, status=snap.status, owner=tenant,
                           storage_tier=effective_tier(row, now), last_status=row.last_status if row else None,
                           last_started_at=row.last_started_at if row else None,
                           last_progress=row.last_progress if row else None,
                           last_detail=row.last_detail if row else None, archived_at=row.archived_at if row else None,
                           restore_expires_at=row.restore_expires_at if row else None))
    return out


def refuse_if_archived(s: Session, snapshot_id: str) -> None:
    """``IncorrectState`` if the snapshot is archived (or on its way there): restore it first."""
    row = s.get(SnapshotTier, snapshot_id)
    if row is not None and (effective_tier(row, utcnow()) == ARCHIVE or row.last_status == "archival-in-progress"):
        raise SnapshotArchived(f"The snapshot '{snapshot_id}' is in the archive tier: restore it first "
                               "(RestoreSnapshotTier).")


def refuse_if_moved_out(s: Session, snapshot_id: str) -> None:
    """``IncorrectState`` if the snapshot was moved into a separate archive store (or is on its way there):
    the snapshot store no longer holds it, so nothing is copied or built on it until it is restored."""
    row = s.get(SnapshotTier, snapshot_id)
    if row is not None and row.archive_store is not None and (
            row.tier == ARCHIVE or row.last_status == "archival-in-progress"):
        raise SnapshotArchived(f"The snapshot '{snapshot_id}' is in the archive store: restore it first "
                               "(RestoreSnapshotTier).")


def expire_restores(svc: Controller, now: datetime | None = None) -> int:
    """Temporary restores past their end go back to the archive tier; how many. One kept in a separate
    archive store as well is archived again by the archive-snapshot workflow, which drops its standard copy
    (it counts as archived meanwhile: its restore has ended)."""
    now = now or utcnow()
    started: list[str] = []
    with svc.db.session() as s:
        expired = SnapshotTier.tier == STANDARD, SnapshotTier.restore_expires_at.is_not(None), \
            SnapshotTier.restore_expires_at < now
        count = int(s.execute(update(SnapshotTier).where(*expired, SnapshotTier.archive_store.is_(None)).values(
            tier=ARCHIVE, restore_expires_at=None, last_status="archival-completed",
            last_started_at=now)).rowcount)  # type: ignore[attr-defined]
        rows = s.execute(select(SnapshotTier, Snapshot).join(Snapshot, Snapshot.id == SnapshotTier.snapshot_id).where(
            *expired, SnapshotTier.archive_store.is_not(None), SnapshotTier.last_status != "archival-in-progress",
            Snapshot.status == SnapshotState.COMPLETED)).all()
        for row, snap in rows:
            try:
                op_id = svc.engine.begin(s, ARCHIVE_SNAPSHOT, snap.id, StorageParams(node=snap.storage_node,
                                                                                      pool=snap.pool))
            except IncorrectState:
                continue  # another operation holds it (a delete): the next round sees
            row.last_status, row.last_started_at, row.last_progress, row.last_detail = (
                "archival-in-progress", now, 0, None)
            started.append(op_id)
    for op_id in started:
        svc.engine.submit(op_id)
    return count + len(started)
