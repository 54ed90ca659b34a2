"""The ``/v1`` routes of snapshots (tag ``snapshots``): create, describe, delete, copy, the sets of an
instance's volumes, and who else may create volumes from a snapshot."""

from __future__ import annotations

from fastapi import APIRouter

from vbs.controller.requests import copy_snapshot as copy_snapshot_req
from vbs.controller.requests import create_snapshot as create_snapshot_req
from vbs.controller.requests import create_snapshots as create_snapshots_req
from vbs.controller.requests import delete_snapshot as delete_snapshot_req
from vbs.controller.requests import describe_snapshots as describe_snapshots_req
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.requests.filters import parse_filters
from vbs.controller.rest import queries
from vbs.controller.rest.completion import SNAPSHOT_BUSY
from vbs.controller.rest.queries import Caller, Services
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


def snapshot_routes(r: APIRouter) -> None:
    @r.post("/snapshots", response_model=SnapshotOut, tags=["snapshots"])
    def create_snapshot(body: CreateSnapshotRequest, svc: Services, who: Caller) -> SnapshotOut:
        return create_snapshot_req.create_snapshot(svc, body, who.tenant)

    @r.get("/snapshots", response_model=SnapshotList, tags=["snapshots"])
    def describe_snapshots(svc: Services, who: Caller, snapshot_id: list[str] = queries.ids_query(),
                           filter: list[str] = queries.filters_query(),
                           max_results: int | None = queries.max_results_query(),
                           next_token: str | None = queries.next_token_query()) -> SnapshotList:
        return describe_snapshots_req.describe_snapshots(svc, who.tenant, snapshot_id, parse_filters(filter),
                                                         max_results, next_token)

    @r.get("/snapshots/{snapshot_id}", response_model=SnapshotOut, tags=["snapshots"])
    async def get_snapshot(snapshot_id: str, svc: Services, who: Caller,
                           wait: int = queries.wait_query()) -> SnapshotOut:
        """With ``wait``: answers once the snapshot is no longer pending or deleting (the CLI's --wait)."""
        return await queries.settled_read(svc, snapshot_id,
                                          lambda: describe_snapshots_req.get_snapshot(svc, snapshot_id, who.tenant),
                                          SNAPSHOT_BUSY, wait)

    @r.delete("/snapshots/{snapshot_id}", response_model=SnapshotOut, tags=["snapshots"])
    def delete_snapshot(snapshot_id: str, svc: Services, who: Caller) -> SnapshotOut:
        return delete_snapshot_req.delete_snapshot(svc, snapshot_id, who.tenant)

    @r.post("/snapshot-sets", response_model=SnapshotSetOut, tags=["snapshots"])
    def create_snapshot_set(body: CreateSnapshotSetRequest, svc: Services, who: Caller) -> SnapshotSetOut:
        """Snapshots of every volume attached to an instance, taken at one instant (the VM pauses briefly)."""
        return SnapshotSetOut(snapshots=create_snapshots_req.create_snapshot_set(svc, body, who.tenant))

    @r.post("/snapshot-copies", response_model=SnapshotOut, tags=["snapshots"])
    def copy_snapshot(body: CopySnapshotRequest, svc: Services, who: Caller) -> SnapshotOut:
        return copy_snapshot_req.copy_snapshot(svc, body, who.tenant)

    @r.get("/snapshots/{snapshot_id}/permissions", response_model=SnapshotPermissionsOut, tags=["snapshots"])
    def snapshot_permissions(snapshot_id: str, svc: Services, who: Caller) -> SnapshotPermissionsOut:
        with svc.db.read() as s:
            sharing.owned_snapshot(s, snapshot_id, who.tenant)
            return SnapshotPermissionsOut(snapshot_id=snapshot_id,
                                          create_volume_permission=sharing.grantees(s, snapshot_id))

    @r.post("/snapshots/{snapshot_id}/permissions", response_model=SnapshotPermissionsOut, tags=["snapshots"])
    def modify_snapshot_permissions(snapshot_id: str, body: SnapshotPermissionsRequest, svc: Services,
                                    who: Caller) -> SnapshotPermissionsOut:
        with svc.db.session() as s:
            granted = sharing.modify(s, snapshot_id, who.tenant, add=body.add, remove=body.remove)
        return SnapshotPermissionsOut(snapshot_id=snapshot_id, create_volume_permission=granted)
