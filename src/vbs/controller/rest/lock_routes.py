"""The ``/v1`` routes of snapshot locks (tag ``snapshots``): lock, unlock, list
(vbs.controller.requests.snapshot_locks)."""

from __future__ import annotations

from fastapi import APIRouter, Query

from vbs.controller.requests import snapshot_locks as locks
from vbs.controller.rest import queries
from vbs.controller.rest.queries import Caller, Services
from vbs.controller.rest.schemas.locks import LockList, LockOut, LockRequest, Unlocked


def lock_routes(r: APIRouter) -> None:
    @r.put("/snapshots/{snapshot_id}/lock", response_model=LockOut, tags=["snapshots"])
    def lock_snapshot(snapshot_id: str, body: LockRequest, svc: Services, who: Caller) -> LockOut:
        """Lock the snapshot against deletion, or change its lock as its state allows."""
        return locks.lock_snapshot(svc, snapshot_id, who.tenant, mode=body.mode,
                                   cool_off_hours=body.cool_off_hours, duration_days=body.duration_days,
                                  expiration=body.expires_at)

    @r.delete("/snapshots/{snapshot_id}/lock", response_model=Unlocked, tags=["snapshots"])
    def unlock_snapshot(snapshot_id: str, svc: Services, who: Caller) -> Unlocked:
        return Unlocked(snapshot_id=locks.unlock_snapshot(svc, snapshot_id, who.tenant))

    @r.get("/snapshot-locks", response_model=LockList, tags=["snapshots"])
    def describe_locked_snapshots(svc: Services, who: Caller, snapshot_id: list[str] = queries.ids_query(),
                                  state: list[str] = Query(default_factory=list, max_length=4)) -> LockList:
        found = locks.describe_locks(svc, who.tenant, snapshot_id, state or None)
        return LockList(locks=found)
