"""LockSnapshot, UnlockSnapshot, DescribeLockedSnapshots as the API offers them: a snapshot locked against
deletion for a while, in governance or compliance mode (AWS's rules, docs/snapshot-locks.md).

- **governance**: nobody deletes the snapshot until the lock expires or is removed; its owner may unlock
  it, shorten or lengthen it, or turn it into compliance.
- **compliance**: the same, and once its cooling-off period (0-72 hours) has passed nobody may unlock it,
  shorten it or change its mode: only lengthen it. An admin key included: the controller has no way
  around a lock but the lock's own end.

The lock is a row of the metadata DB (``snapshot_locks``), so it outlives restarts and holds for every
controller of the install. Times are the controllers' clocks (UTC). A delete and a lock of one snapshot
take turns on its row: whichever commits first, the other sees it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs.controller.db import Snapshot, SnapshotLock
from vbs.controller.db.states import GONE_SNAPSHOT
from vbs.controller.db.tables import utcnow
from vbs.controller.requests.snapshot_permissions import owned_snapshot
from vbs.controller.rest.schemas.locks import MAX_COOL_OFF_HOURS, MAX_DURATION_DAYS, LockOut
from vbs.controller.runtime import Controller
from vbs.errors import IncorrectState, InvalidParameter, MissingParameter

__all__ = ["LockOut", "lock_snapshot", "unlock_snapshot", "describe_locks", "refuse_if_locked", "lock_state",
           "SnapshotLocked", "MAX_DURATION_DAYS", "MAX_COOL_OFF_HOURS"]

GOVERNANCE, COMPLIANCE = "governance", "compliance"


class SnapshotLocked(IncorrectState):
    code = "SnapshotLocked"


def lock_state(lock: SnapshotLock, now: datetime) -> str:
    """``compliance-cooloff``, ``governance``, ``compliance`` or ``expired``."""
    if lock.expires_at <= now:
        return "expired"
    if lock.mode == COMPLIANCE:
        cooling = lock.cool_off_expires_at is not None and now < lock.cool_off_expires_at
        return "compliance-cooloff" if cooling else COMPLIANCE
    return GOVERNANCE


def _info(lock: SnapshotLock, tenant: str, now: datetime) -> LockOut:
    return LockOut(snapshot_id=lock.snapshot_id, owner=tenant, lock_state=lock_state(lock, now), mode=lock.mode,
                   created_at=lock.created_at, duration_start=lock.duration_start, expires_at=lock.expires_at,
                   duration_days=lock.duration_days, cool_off_hours=lock.cool_off_hours,
                   cool_off_expires_at=lock.cool_off_expires_at)


def lock_snapshot(svc: Controller, snapshot_id: str, tenant: str, *, mode: str, cool_off_hours: int | None,
                  duration_days: int | None, expiration: datetime | None) -> LockOut:
    """Lock the snapshot, or change its lock as the lock's state allows."""
    if mode not in (GOVERNANCE, COMPLIANCE):
        raise InvalidParameter(f"Value ({mode[:32]}) for parameter LockMode is invalid. Expected: governance, "
                               "compliance.")
    if (duration_days is None) == (expiration is None):
        raise MissingParameter("Specify one of LockDuration and ExpirationDate.")
    if duration_days is not None and not 1 <= duration_days <= MAX_DURATION_DAYS:
        raise InvalidParameter(f"LockDuration must be 1-{MAX_DURATION_DAYS} days, not {duration_days}.")
    if cool_off_hours is not None and (mode != COMPLIANCE or not 1 <= cool_off_hours <= MAX_COOL_OFF_HOURS):
        raise InvalidParameter(f"CoolOffPeriod is 1-{MAX_COOL_OFF_HOURS} hours, and only in compliance mode.")
    now = utcnow()
    if expiration is not None and expiration.tzinfo is None:
        expiration = expiration.replace(tzinfo=UTC)  # a time without a zone is UTC, as EC2 takes it
    expires = now + timedelta(days=duration_days) if duration_days is not None else expiration
    assert expires is not None
    if expires <= now:
        raise InvalidParameter("The ExpirationDate must be in the future.")
    if duration_days is None and expires - now > timedelta(days=MAX_DURATION_DAYS):
        raise InvalidParameter(f"The ExpirationDate must be within {MAX_DURATION_DAYS} days.")
    with svc.db.session() as s:
        owned_snapshot(s, snapshot_id, tenant, lock=True)
        lock = s.get(SnapshotLock, snapshot_id)
        if lock is not None and lock_state(lock, now) == COMPLIANCE:
            if mode != COMPLIANCE or cool_off_hours is not None:
                raise SnapshotLocked(f"The snapshot '{snapshot_id}' is locked in compliance mode past its "
                                     "cooling-off period: its lock can only be extended.")
            if expires < lock.expires_at:
                raise SnapshotLocked(f"The snapshot '{snapshot_id}' is locked in compliance mode until "
                                     f"{lock.expires_at:%Y-%m-%dT%H:%M:%SZ}: its lock cannot be shortened.")
            lock.expires_at, lock.duration_days = expires, duration_days
        else:
            if lock is not None:
                s.delete(lock)
                s.flush()
            lock = SnapshotLock(snapshot_id=snapshot_id, mode=mode, created_at=now, duration_start=now,
                                expires_at=expires, duration_days=duration_days, cool_off_hours=cool_off_hours,
                                cool_off_expires_at=now + timedelta(hours=cool_off_hours) if cool_off_hours else None)
            s.add(lock)
        s.flush()
        return _info(lock, tenant, now)


def unlock_snapshot(svc: Controller, snapshot_id: str, tenant: str) -> str:
    now = utcnow()
    with svc.db.session() as s:
        owned_snapshot(s, snapshot_id, tenant, lock=True)
        lock = s.get(SnapshotLock, snapshot_id)
        if lock is None or lock_state(lock, now) == "expired":
            raise IncorrectState(f"The snapshot '{snapshot_id}' is not locked.", code="SnapshotNotLocked")
        if lock_state(lock, now) == COMPLIANCE:
            raise SnapshotLocked(f"The snapshot '{snapshot_id}' is locked in compliance mode past its cooling-off "
                                 f"period: it stays locked until {lock.expires_at:%Y-%m-%dT%H:%M:%SZ}.")
        s.delete(lock)
    return snapshot_id


def describe_locks(svc: Controller, tenant: str, snapshot_ids: list[str], states: list[str] | None
                   ) -> list[LockOut]:
    """The tenant's snapshot locks (those of ``snapshot_ids`` only, if given; of ``states`` only, if given),
    by snapshot id. Expired locks are shown until their snapshot is deleted."""
    now = utcnow()
    with svc.db.read() as s:
        q = select(SnapshotLock).join(Snapshot, Snapshot.id == SnapshotLock.snapshot_id).where(
            Snapshot.tenant == tenant, Snapshot.status.notin_(GONE_SNAPSHOT))
        if snapshot_ids:
            q = q.where(SnapshotLock.snapshot_id.in_(snapshot_ids))
        found = [_info(lock, tenant, now) for lock in s.scalars(q.order_by(SnapshotLock.snapshot_id))]
    return [f for f in found if states is None or f.lock_state in states]


def refuse_if_locked(s: Session, snapshot_id: str) -> None:
    """``SnapshotLocked`` if a lock that has not expired holds the snapshot: nobody deletes it then."""
    lock = s.get(SnapshotLock, snapshot_id)
    if lock is not None and lock_state(lock, utcnow()) != "expired":
        raise SnapshotLocked(f"The snapshot '{snapshot_id}' is locked ({lock.mode}) until "
                             f"{lock.expires_at:%Y-%m-%dT%H:%M:%SZ} and cannot be deleted.")
