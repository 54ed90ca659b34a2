"""The Recycle Bin's snapshots and volumes (docs/recycle-bin.md): a delete that a retention rule matches
puts the resource in the bin instead of deleting it (``keep_deleted``); EC2's ListSnapshotsInRecycleBin,
ListVolumesInRecycleBin, RestoreSnapshotFromRecycleBin and RestoreVolumeFromRecycleBin; and, when the
retention ends, the real delete workflow (``expire``, the controllers' housekeeping).

A resource in the bin is ``recoverable`` (db/states.py): hidden from every describe and refused by every
use as a deleted one is, its data and tags kept. Its entry (``recycle_bin_entries``) says until when and
the state a restore gives back; the entry and the state change in one transaction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import RecycleBinEntry, Snapshot, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.db.transitions import transition, try_transition
from vbs.controller.requests import filters as flt
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.requests.describe_snapshots import snapshot_not_found
from vbs.controller.requests.describe_volumes import describe_many, volume_not_found
from vbs.controller.requests.recycle_bin_rules import retention_for
from vbs.controller.rest.schemas.recycle_bin import BinSnapshotOut, BinVolumeOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.delete_snapshot import DELETE_SNAPSHOT
from vbs.controller.workflows.delete_volume import DELETE_VOLUME
from vbs.controller.workflows.steps import StorageParams
from vbs.errors import InvalidParameter, NotFound

__all__ = ["SNAPSHOT", "VOLUME", "keep_deleted", "list_snapshots", "list_volumes", "restore", "expire"]

log = logging.getLogger(__name__)

SNAPSHOT, VOLUME = "EBS_SNAPSHOT", "EBS_VOLUME"
EXPIRED_PER_PASS = 100
CRASH_KIND = "recycle-bin"  # VBS_CRASH_AT=recycle-bin:expire:done (vbs.controller.workflows.faults)


@dataclass(frozen=True)
class _Kind:
    table: type[Volume] | type[Snapshot]
    id_kind: str
    live: str  # the state it enters the bin from, and a restore gives back
    recoverable: str  # in the bin

    def not_found(self, resource_id: str) -> NotFound:
        return snapshot_not_found(resource_id) if self.table is Snapshot else volume_not_found(resource_id)


_KINDS = {SNAPSHOT: _Kind(Snapshot, "snapshot", SnapshotState.COMPLETED, SnapshotState.RECOVERABLE),
          VOLUME: _Kind(Volume, "volume", VolumeState.AVAILABLE, VolumeState.RECOVERABLE)}


def keep_deleted(svc: Controller, s: Session, resource_type: str, resource_id: str, tenant: str,
                 *conditions: ColumnElement[bool]) -> bool:
    """In the caller's delete transaction: if a retention rule of ``tenant`` matches the resource (a completed
    snapshot, an available volume), move it to the bin for the longest matching retention instead of deleting
    it, and answer True. ``conditions``: the delete's own guards, held in the same statement."""
    kind = _KINDS[resource_type]
    days = retention_for(s, tenant, resource_type, flt.tags_of(s, [resource_id])[resource_id])
    if days is None:
        return False
    now = utcnow()
    transition(s, kind.table, resource_id, kind.recoverable, *conditions, from_states=[kind.live])
    s.add(RecycleBinEntry(resource_id=resource_id, resource_type=resource_type, tenant=tenant,
                          former_status=kind.live, entered_at=now,
                          exits_at=now + timedelta(seconds=days * svc.cfg.recycle_bin_day_s)))
    return True


def _entries(s: Session, resource_type: str, tenant: str, wanted: list[str], max_results: int | None,
             next_token: str | None, now: datetime) -> tuple[list[RecycleBinEntry], str | None]:
    kind = _KINDS[resource_type]
    for rid in wanted:
        ids.check(kind.id_kind, rid)
    if next_token is not None and not ids.is_valid(kind.id_kind, next_token):
        raise InvalidParameter("The NextToken is not one this service gave.")
    # An entry past its end is gone for its user at once, before the housekeeping deletes it.
    q = select(RecycleBinEntry).where(RecycleBinEntry.tenant == tenant, RecycleBinEntry.resource_type == resource_type,
                                      RecycleBinEntry.exits_at > now)
    if wanted:
        q = q.where(RecycleBinEntry.resource_id.in_(wanted))
    if next_token is not None:
        q = q.where(RecycleBinEntry.resource_id > next_token)
    q = q.order_by(RecycleBinEntry.resource_id)
    if max_results is not None:
        q = q.limit(max_results + 1)
    found = list(s.scalars(q))
    if max_results is not None and len(found) > max_results:
        found = found[:max_results]
        return found, found[-1].resource_id
    return found, None


def list_snapshots(svc: Controller, tenant: str, snapshot_ids: list[str], max_results: int | None = None,
                   next_token: str | None = None) -> tuple[list[BinSnapshotOut], str | None]:
    now = utcnow()
    with svc.db.read() as s:
        found, token = _entries(s, SNAPSHOT, tenant, snapshot_ids, max_results, next_token, now)
        snaps = {x.id: x for x in s.scalars(select(Snapshot).where(Snapshot.id.in_([e.resource_id for e in found])))}
        return [BinSnapshotOut(snapshot_id=e.resource_id, volume_id=snaps[e.resource_id].volume_id,
                               description=snaps[e.resource_id].comment, entered_at=e.entered_at,
                               exits_at=e.exits_at) for e in found if e.resource_id in snaps], token


def list_volumes(svc: Controller, tenant: str, volume_ids: list[str], max_results: int | None = None,
                 next_token: str | None = None) -> tuple[list[BinVolumeOut], str | None]:
    now = utcnow()
    with svc.db.read() as s:
        found, token = _entries(s, VOLUME, tenant, volume_ids, max_results, next_token, now)
        rows = [row._mapping for row in s.execute(select(*Volume.__table__.columns).where(
            Volume.id.in_([e.resource_id for e in found])))]
        # A page's volumes described together: their zones and IOPS as DescribeVolumes shows them.
        described = {v["volume_id"]: v for v in describe_many(svc, s, rows)}
        return [BinVolumeOut(volume_id=v["volume_id"], volume_type=v["volume_type"], size_gib=v["size_gib"],
                             iops=v["iops"], throughput=v["throughput"], availability_zone=v["availability_zone"],
                             snapshot_id=v["snapshot_id"], created_at=v["created_at"], entered_at=e.entered_at,
                             exits_at=e.exits_at)
                for e in found if (v := described.get(e.resource_id)) is not None], token


def restore(svc: Controller, tenant: str, resource_type: str, resource_id: str) -> str:
    """Back out of the bin into the state it was deleted from (tags and all); the state. Not in the tenant's
    bin (or past its end): the resource's NotFound."""
    kind = _KINDS[resource_type]
    ids.check(kind.id_kind, resource_id)
    with svc.db.session() as s:
        lock_rows(s, kind.table, resource_id)  # takes turns with the housekeeping's delete of it
        entry = s.get(RecycleBinEntry, resource_id)
        if entry is None or entry.tenant != tenant or entry.resource_type != resource_type \
                or entry.exits_at <= utcnow():
            raise kind.not_found(resource_id)
        if not try_transition(s, kind.table, resource_id, entry.former_status,
                              from_states=[kind.recoverable]):
            raise kind.not_found(resource_id)
        s.delete(entry)
        return entry.former_status


def expire(svc: Controller) -> int:
    """Start the delete workflow of every resource whose retention has ended: once, whichever controller
    runs this (the state moves out of ``recoverable`` and the entry goes in the transaction that begins the
    operation; a second pass, or another controller, finds nothing to do). The workflow frees the data
    (pool copy, store manifest) as any delete does. The number started."""
    now = utcnow()
    with svc.db.read() as s:
        due = list(s.execute(select(RecycleBinEntry.resource_id, RecycleBinEntry.resource_type)
                             .where(RecycleBinEntry.exits_at <= now).order_by(RecycleBinEntry.exits_at)
                             .limit(EXPIRED_PER_PASS)))
    started = []
    for resource_id, resource_type in due:
        kind = _KINDS[resource_type]
        with svc.db.session() as s:
            lock_rows(s, kind.table, resource_id)
            entry = s.get(RecycleBinEntry, resource_id)
            row = s.get(Snapshot, resource_id) if kind.table is Snapshot else s.get(Volume, resource_id)
            if entry is None or entry.exits_at > now:
                continue  # restored, or expired already
            s.delete(entry)
            if row is None or not try_transition(s, kind.table, resource_id, VolumeState.DELETING,
                                                 from_states=[kind.recoverable]):
                continue  # a stray entry: its resource left the bin some other way
            if kind.table is Snapshot:
                sharing.forget(s, [resource_id])
            workflow = DELETE_SNAPSHOT if kind.table is Snapshot else DELETE_VOLUME
            started.append(svc.engine.begin(s, workflow, resource_id,
                                            StorageParams(node=row.storage_node, pool=row.pool)))
            log.info("%s %s: its Recycle Bin retention ended; deleting it", kind.id_kind, resource_id)
        # Committed, not submitted yet: a controller killed here leaves the operation the engine resumes
        # at its restart, or another controller adopts (docs/reliability.md).
        svc.engine.faults.maybe_crash(CRASH_KIND, "expire", "done")
    for op_id in started:
        svc.engine.submit(op_id)
    return len(started)
