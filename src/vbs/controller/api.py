"""The public REST API ``/v1`` and the agents' internal endpoints: thin handlers over the domain."""

from __future__ import annotations

import os
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from vbs import ids
from vbs.controller import attachments, modifications, snapshots, tags, volumes
from vbs.controller.auth import Authenticator
from vbs.controller.db import Operation, OperationStep
from vbs.controller.filters import parse_filters
from vbs.controller.nodes import describe_hosts, describe_storage_nodes, record_host_heartbeat, record_storage_heartbeat
from vbs.controller.runtime import Controller
from vbs.controller.schemas import (
    AttachmentOut,
    AttachVolumeRequest,
    CreateSnapshotRequest,
    CreateTagsRequest,
    CreateVolumeRequest,
    DeleteTagsRequest,
    DetachVolumeRequest,
    HostList,
    InstanceList,
    ModificationList,
    ModificationOut,
    ModifyVolumeRequest,
    OperationOut,
    SnapshotList,
    SnapshotOut,
    StepOut,
    StorageNodeList,
    VolumeList,
    VolumeOut,
)
from vbs.errors import NotFound
from vbs.web import token_checker
from vbs.wire.base import Ack
from vbs.wire.host import HostHeartbeat
from vbs.wire.storage import StorageHeartbeat


def services(request: Request) -> Controller:
    return request.app.state.services  # type: ignore[no-any-return]


def public_router(auth: Authenticator) -> APIRouter:
    async def authenticated(request: Request) -> str:
        return auth.check(request, await request.body())

    r = APIRouter(prefix="/v1", dependencies=[Depends(authenticated)])

    @r.post("/volumes", response_model=VolumeOut, tags=["volumes"])
    def create_volume(body: CreateVolumeRequest, svc: Controller = Depends(services)) -> VolumeOut:
        return volumes.create_volume(svc, body)

    @r.get("/volumes", response_model=VolumeList, tags=["volumes"])
    def describe_volumes(
        volume_id: list[str] = Query(default=[], max_length=1000),
        filter: list[str] = Query(default=[], max_length=50, description="name=value, e.g. status=available"),
        max_results: int | None = Query(default=None),
        next_token: str | None = Query(default=None, max_length=64),
        svc: Controller = Depends(services),
    ) -> VolumeList:
        return volumes.describe_volumes(svc, volume_id, parse_filters(filter), max_results, next_token)

    @r.get("/volumes/{volume_id}", response_model=VolumeOut, tags=["volumes"])
    def get_volume(volume_id: str, svc: Controller = Depends(services)) -> VolumeOut:
        return volumes.get_volume(svc, volume_id)

    @r.delete("/volumes/{volume_id}", response_model=VolumeOut, tags=["volumes"])
    def delete_volume(volume_id: str, svc: Controller = Depends(services)) -> VolumeOut:
        return volumes.delete_volume(svc, volume_id)

    @r.post("/volumes/{volume_id}/attach", response_model=AttachmentOut, tags=["volumes"])
    def attach_volume(volume_id: str, body: AttachVolumeRequest, svc: Controller = Depends(services)) -> AttachmentOut:
        return attachments.attach_volume(svc, volume_id, body)

    @r.post("/volumes/{volume_id}/detach", response_model=AttachmentOut, tags=["volumes"])
    def detach_volume(volume_id: str, body: DetachVolumeRequest, svc: Controller = Depends(services)) -> AttachmentOut:
        return attachments.detach_volume(svc, volume_id, body)

    @r.post("/volumes/{volume_id}/modify", response_model=ModificationOut, tags=["volumes"])
    def modify_volume(volume_id: str, body: ModifyVolumeRequest,
                      svc: Controller = Depends(services)) -> ModificationOut:
        return modifications.modify_volume(svc, volume_id, body)

    @r.get("/volume-modifications", response_model=ModificationList, tags=["volumes"])
    def describe_modifications(
        volume_id: list[str] = Query(default=[], max_length=1000),
        filter: list[str] = Query(default=[], max_length=50),
        max_results: int | None = Query(default=None),
        next_token: str | None = Query(default=None, max_length=64),
        svc: Controller = Depends(services),
    ) -> ModificationList:
        return modifications.describe_modifications(svc, volume_id, parse_filters(filter), max_results, next_token)

    @r.get("/hosts", response_model=HostList, tags=["nodes"])
    def hosts(svc: Controller = Depends(services)) -> HostList:
        with svc.db.session() as s:
            return HostList(hosts=describe_hosts(s, svc.cfg.heartbeat_timeout_s))

    @r.get("/instances", response_model=InstanceList, tags=["nodes"])
    def instances(svc: Controller = Depends(services)) -> InstanceList:
        return InstanceList(instances=attachments.describe_instances(svc))

    @r.post("/snapshots", response_model=SnapshotOut, tags=["snapshots"])
    def create_snapshot(body: CreateSnapshotRequest, svc: Controller = Depends(services)) -> SnapshotOut:
        return snapshots.create_snapshot(svc, body)

    @r.get("/snapshots", response_model=SnapshotList, tags=["snapshots"])
    def describe_snapshots(
        snapshot_id: list[str] = Query(default=[], max_length=1000),
        filter: list[str] = Query(default=[], max_length=50),
        max_results: int | None = Query(default=None),
        next_token: str | None = Query(default=None, max_length=64),
        svc: Controller = Depends(services),
    ) -> SnapshotList:
        return snapshots.describe_snapshots(svc, snapshot_id, parse_filters(filter), max_results, next_token)

    @r.get("/snapshots/{snapshot_id}", response_model=SnapshotOut, tags=["snapshots"])
    def get_snapshot(snapshot_id: str, svc: Controller = Depends(services)) -> SnapshotOut:
        return snapshots.get_snapshot(svc, snapshot_id)

    @r.delete("/snapshots/{snapshot_id}", response_model=SnapshotOut, tags=["snapshots"])
    def delete_snapshot(snapshot_id: str, svc: Controller = Depends(services)) -> SnapshotOut:
        return snapshots.delete_snapshot(svc, snapshot_id)

    @r.post("/tags", tags=["tags"])
    def create_tags(body: CreateTagsRequest, svc: Controller = Depends(services)) -> dict[str, bool]:
        with svc.db.session() as s:
            tags.create_tags(s, body.resource_ids, body.tags)
        return {"return": True}

    @r.post("/tags/delete", tags=["tags"])
    def delete_tags(body: DeleteTagsRequest, svc: Controller = Depends(services)) -> dict[str, bool]:
        with svc.db.session() as s:
            tags.delete_tags(s, body.resource_ids, body.keys)
        return {"return": True}

    @r.get("/storage-nodes", response_model=StorageNodeList, tags=["nodes"])
    def storage_nodes(svc: Controller = Depends(services)) -> StorageNodeList:
        with svc.db.session() as s:
            return StorageNodeList(storage_nodes=describe_storage_nodes(s, svc.cfg.heartbeat_timeout_s))

    @r.get("/admin/check", tags=["admin"])
    def check(svc: Controller = Depends(services)) -> dict[str, Any]:
        """Compare the agents' real inventory with the DB; change nothing."""
        return svc.reconciler.run(repair=False).as_dict()

    @r.post("/admin/reconcile", tags=["admin"])
    def reconcile(now: bool = False, svc: Controller = Depends(services)) -> dict[str, Any]:
        """Repair drift now; ``now=true`` also removes orphans without waiting for their grace period."""
        return svc.reconciler.run(repair=True, ignore_grace=now).as_dict()

    @r.get("/operations/{operation_id}", response_model=OperationOut, tags=["operations"])
    def get_operation(operation_id: str, svc: Controller = Depends(services)) -> OperationOut:
        if not ids.is_valid("operation", operation_id):
            raise NotFound(f"The operation '{operation_id[:40]}' does not exist.", code="InvalidOperation.NotFound")
        with svc.db.session() as s:
            op = s.get(Operation, operation_id)
            if op is None:
                raise NotFound(f"The operation '{operation_id}' does not exist.", code="InvalidOperation.NotFound")
            steps = s.scalars(select(OperationStep).where(OperationStep.operation_id == op.id)
                              .order_by(OperationStep.position)).all()
            return OperationOut(operation_id=op.id, kind=op.kind, resource_id=op.resource_id, status=op.status,
                                error=op.error, attempts=op.attempts, created_at=op.created_at,
                                updated_at=op.updated_at,
                                steps=[StepOut(name=st.name, state=st.state, error=st.error) for st in steps])

    return r


def internal_router(token: str | None) -> APIRouter:
    r = APIRouter(prefix="/internal/v1", dependencies=[Depends(token_checker(token))], include_in_schema=False)

    @r.post("/storage-heartbeat")
    def storage_heartbeat(body: StorageHeartbeat, svc: Controller = Depends(services)) -> Ack:
        with svc.db.session() as s:
            record_storage_heartbeat(s, body)
        return Ack()

    @r.post("/host-heartbeat")
    def host_heartbeat(body: HostHeartbeat, svc: Controller = Depends(services)) -> Ack:
        with svc.db.session() as s:
            record_host_heartbeat(s, body)
        return Ack()

    if os.environ.get("VBS_TEST_HOOKS") == "1":
        r.include_router(test_hooks_router())

    return r


class StepHook(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(max_length=32)
    step: str = Field(max_length=64)
    when: Literal["before", "after"] = "before"


def test_hooks_router() -> APIRouter:
    """Failure injection and step holds for the tests (only with ``VBS_TEST_HOOKS=1``)."""
    r = APIRouter(prefix="/test")

    @r.post("/fail-step")
    def fail_step(body: StepHook, svc: Controller = Depends(services)) -> dict[str, str]:
        svc.engine.inject_failure(body.kind, body.step, body.when)
        return {"status": "armed"}

    @r.post("/hold-step")
    def hold_step(body: StepHook, svc: Controller = Depends(services)) -> dict[str, str]:
        svc.engine.hold(body.kind, body.step)
        return {"status": "armed"}

    @r.post("/held-step")
    def held_step(body: StepHook, svc: Controller = Depends(services)) -> dict[str, bool]:
        return {"held": svc.engine.held(body.kind, body.step)}

    @r.post("/release-step")
    def release_step(body: StepHook, svc: Controller = Depends(services)) -> dict[str, str]:
        svc.engine.release(body.kind, body.step)
        return {"status": "released"}

    return r


def install_routes(app: FastAPI, token: str | None, auth: Authenticator) -> None:
    @app.get("/health", include_in_schema=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    async def authenticated(request: Request) -> str:
        return auth.check(request, await request.body())

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authenticated)])
    def openapi() -> dict[str, Any]:
        return app.openapi()

    app.include_router(public_router(auth))
    app.include_router(internal_router(token))
