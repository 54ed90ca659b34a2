"""The ``/v1`` routes of snapshots' storage tiers (tag ``snapshots``): archive, restore, list
(vbs.controller.requests.snapshot_tiers)."""

from __future__ import annotations

from fastapi import APIRouter

from vbs.controller.requests import snapshot_tiers as tiers
from vbs.controller.rest import queries
from vbs.controller.rest.queries import Caller, Services
from vbs.controller.rest.schemas.tiers import TieringStarted, TierList, TierRequest, TierRestoreRequest


def tier_routes(r: APIRouter) -> None:
    @r.put("/snapshots/{snapshot_id}/tier", response_model=TieringStarted, tags=["snapshots"])
    def modify_snapshot_tier(snapshot_id: str, body: TierRequest, svc: Services, who: Caller) -> TieringStarted:
        """Move the snapshot to the archive tier (its pool's fast copy goes; restore it to make volumes)."""
        return TieringStarted(snapshot_id=snapshot_id,
                              started_at=tiers.modify_tier(svc, snapshot_id, who.tenant, body.tier))

    @r.post("/snapshots/{snapshot_id}/tier-restores", response_model=TieringStarted, tags=["snapshots"])
    def restore_snapshot_tier(snapshot_id: str, body: TierRestoreRequest, svc: Services,
                              who: Caller) -> TieringStarted:
        started, days = tiers.restore_tier(svc, snapshot_id, who.tenant, days=body.temporary_days,
                                           permanent=body.permanent)
        return TieringStarted(snapshot_id=snapshot_id, started_at=started, restore_days=days)

    @r.get("/snapshot-tiers", response_model=TierList, tags=["snapshots"])
    def describe_snapshot_tiers(svc: Services, who: Caller, snapshot_id: list[str] = queries.ids_query()) -> TierList:
        return TierList(tiers=tiers.describe_tiers(svc, who.tenant, snapshot_id or None))
