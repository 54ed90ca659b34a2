"""EC2 actions on snapshot locks: LockSnapshot, UnlockSnapshot, DescribeLockedSnapshots
(vbs.controller.requests.snapshot_locks keeps AWS's rules)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from vbs.controller.auth.keys import Principal
from vbs.controller.ec2.params import dry_run, snapshot_id_of
from vbs.controller.ec2.query import QueryParams
from vbs.controller.requests import snapshot_locks as locks
from vbs.controller.requests.snapshot_permissions import owner_id
from vbs.controller.rest.schemas.locks import MAX_COOL_OFF_HOURS, MAX_DURATION_DAYS, LockOut
from vbs.controller.runtime import Controller
from vbs.errors import InvalidParameter

# DescribeLockedSnapshots' largest page (EC2: 5-1000).
LOCKS_PAGE = 1000
_STATES = {"compliance", "governance", "compliance-cooloff", "expired"}


def _timestamp(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidParameter(f"Value ({value[:40]}) for parameter ExpirationDate is not a timestamp.") from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _lock(info: LockOut) -> dict[str, Any]:
    return {
        "ownerId": owner_id(info.owner), "snapshotId": info.snapshot_id, "lockState": info.lock_state,
        "lockDuration": info.duration_days, "coolOffPeriod": info.cool_off_hours,
        "coolOffPeriodExpiresOn": info.cool_off_expires_at, "lockCreatedOn": info.created_at,
        "lockDurationStartTime": info.duration_start, "lockExpiresOn": info.expires_at,
    }


def lock_snapshot(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
    mode = p.str("LockMode", required=True, max_len=32) or ""
    cool_off = p.int("CoolOffPeriod", min=1, max=MAX_COOL_OFF_HOURS)
    duration = p.int("LockDuration", min=1, max=MAX_DURATION_DAYS)
    expiration = _timestamp(p.str("ExpirationDate", max_len=40))
    dry_run(p)
    info = locks.lock_snapshot(svc, snap_id, who.tenant, mode=mode, cool_off_hours=cool_off, duration_days=duration,
                               expiration=expiration)
    return {k: v for k, v in _lock(info).items() if k != "ownerId"}


def unlock_snapshot(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
    dry_run(p)
    return {"snapshotId": locks.unlock_snapshot(svc, snap_id, who.tenant)}


def describe_locked_snapshots(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_ids = [snapshot_id_of(v) for v in p.list("SnapshotId")]
    filters = p.filters()
    unknown = set(filters) - {"lock-state"}
    if unknown:
        raise InvalidParameter(f"The filter '{sorted(unknown)[0][:64]}' is invalid.", code="InvalidParameterValue")
    states = filters.get("lock-state")
    if states is not None and not set(states) <= _STATES:
        raise InvalidParameter(f"lock-state must be one of {', '.join(sorted(_STATES))}.")
    max_results = p.int("MaxResults", min=5, max=LOCKS_PAGE) or LOCKS_PAGE
    token = p.str("NextToken", max_len=64)
    dry_run(p)
    found = locks.describe_locks(svc, who.tenant, snap_ids, states)
    if token is not None:
        found = [f for f in found if f.snapshot_id > token]
    page, more = found[:max_results], len(found) > max_results
    return {"snapshotSet": [_lock(f) for f in page], "nextToken": page[-1].snapshot_id if more and page else None}
