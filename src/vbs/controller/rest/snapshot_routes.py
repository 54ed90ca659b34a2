"""The ``/v1`` routes of snapshots (tag ``snapshots``): create, describe, delete, copy, the sets of an
instance's volumes, and who else may create volumes from a snapshot."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from vbs.controller.auth.keys import Principal
from vbs.controller.requests import copy_snapshot as copy_snapshot_req
from vbs.controller.requests import create_snapshot as create_snapshot_req
from vbs.controller.requests import create_snapshots as create_snapshots_req
from vbs.controller.requests import delete_snapshot as delete_snapshot_req
from vbs.controller.requests import describe_snapshots as describe_snapshots_req
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.requests.filters import parse_filters
from vbs.controller.rest.completion import SNAPSHOT_BUSY
from vbs.controller.rest.queries import (
    caller,
    filters_query,
    ids_query,
    max_results_query,
    next_token_query,
    services,
    settled_read,
    wait_query,
)
from vbs.controller.rest.schemas.snapshots import (
    CopySnapshotRequest,
    CreateSnapshotRequest,
    CreateSnapshotSetRequest,
    SnapshotList,
    SnapshotOut,
    SnapshotPermissionsOut,
    SnapshotPermissionsRequest,
    SnapshotSetOut,
)
from vbs.controller.runtime import Controller


def snapshot_routes(r: APIRouter) -> None:
    @r.post("/snapshots", response_model=SnapshotOut, tags=["snapshots"])
    def create_snapshot(body: CreateSnapshotRequest, svc: Controller = Depends(services),
                        who: Principal = Depends(caller)) -> SnapshotOut:
        return create_snapshot_req.create_snapshot(svc, body, who.tenant)

    @r.get("/snapshots", response_model=SnapshotList, tags=["snapshots"])
    def describe_snapshots(snapshot_id: list[str] = ids_query(), filter: list[str] = filters_query(),
                           max_results: int | None = max_results_query(), next_token: str | None = next_token_query(),
                           svc: Controller = Depends(services), who: Principal = Depends(caller)) -> SnapshotList:
        return describe_snapshots_req.describe_snapshots(svc, who.tenant, snapshot_id, parse_filters(filter),
                                                         max_results, next_token)

    @r.get("/snapshots/{snapshot_id}", response_model=SnapshotOut, tags=["snapshots"])
    async def get_snapshot(snapshot_id: str, wait: int = wait_query(), svc: Controller = Depends(services),
                           who: Principal = Depends(caller)) -> SnapshotOut:
        """With ``wait``: answers once the snapshot is no longer pending or deleting (the CLI's --wait)."""
        return await settled_read(svc, snapshot_id,
                                  lambda: describe_snapshots_req.get_snapshot(svc, snapshot_id, who.tenant),
                                  SNAPSHOT_BUSY, wait)

    @r.delete("/snapshots/{snapshot_id}", response_model=SnapshotOut, tags=["snapshots"])
    def delete_snapshot(snapshot_id: str, svc: Controller = Depends(services),
                        who: Principal = Depends(caller)) -> SnapshotOut:
        return delete_snapshot_req.delete_snapshot(svc, snapshot_id, who.tenant)

    @r.post("/snapshot-sets", response_model=SnapshotSetOut, tags=["snapshots"])
    def create_snapshot_set(body: CreateSnapshotSetRequest, svc: Controller = Depends(services),
                            who: Principal = Depends(caller)) -> SnapshotSetOut:
        """Snapshots of every volume attached to an instance, taken at one instant (the VM pauses briefly)."""
        return SnapshotSetOut(snapshots=create_snapshots_req.create_snapshot_set(svc, body, who.tenant))

    @r.post("/snapshot-copies", response_model=SnapshotOut, tags=["snapshots"])
    def copy_snapshot(body: CopySnapshotRequest, svc: Controller = Depends(services),
                      who: Principal = Depends(caller)) -> SnapshotOut:
        return copy_snapshot_req.copy_snapshot(svc, body, who.tenant)

    @r.get("/snapshots/{snapshot_id}/permissions", response_model=SnapshotPermissionsOut, tags=["snapshots"])
    def snapshot_permissions(snapshot_id: str, svc: Controller = Depends(services),
                             who: Principal = Depends(caller)) -> SnapshotPermissionsOut:
        with svc.db.read() as s:
            sharing.owned_snapshot(s, snapshot_id, who.tenant)
            return SnapshotPermissionsOut(snapshot_id=snapshot_id,
                                          create_volume_permission=sharing.grantees(s, snapshot_id))

    @r.post("/snapshots/{snapshot_id}/permissions", response_model=SnapshotPermissionsOut, tags=["snapshots"])
    def modify_snapshot_permissions(snapshot_id: str, body: SnapshotPermissionsRequest,
                                    svc: Controller = Depends(services),
                                    who: Principal = Depends(caller)) -> SnapshotPermissionsOut:
        with svc.db.session() as s:
            granted = sharing.modify(s, snapshot_id, who.tenant, add=body.add, remove=body.remove)
        return SnapshotPermissionsOut(snapshot_id=snapshot_id, create_volume_permission=granted)
