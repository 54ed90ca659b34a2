"""The public REST API ``/v1`` and the agents' internal endpoints: thin handlers over the domain."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.auth.authenticator import Authenticator, require_admin
from vbs.controller.auth.keys import KeyStore, Principal
from vbs.controller.cluster import describe_controllers
from vbs.controller.db import Operation, OperationStep, Snapshot, Volume
from vbs.controller.db.states import UNFINISHED_OPERATION
from vbs.controller.fleet.describe_nodes import (
    availability_zones,
    describe_hosts,
    describe_storage_nodes,
    drain_storage_node,
)
from vbs.controller.fleet.nodes import live_storage_nodes, record_host_heartbeat, record_storage_heartbeat
from vbs.controller.placement import advice
from vbs.controller.requests import attach_volume as attach_volume_req
from vbs.controller.requests import copy_snapshot as copy_snapshot_req
from vbs.controller.requests import create_snapshot as create_snapshot_req
from vbs.controller.requests import create_snapshots as snapshot_sets
from vbs.controller.requests import create_volume as create_volume_req
from vbs.controller.requests import delete_snapshot as delete_snapshot_req
from vbs.controller.requests import delete_volume as delete_volume_req
from vbs.controller.requests import describe_instances as describe_instances_req
from vbs.controller.requests import describe_snapshots as describe_snapshots_req
from vbs.controller.requests import describe_volumes as describe_volumes_req
from vbs.controller.requests import detach_volume as detach_volume_req
from vbs.controller.requests import migrate_instance as live_migrations
from vbs.controller.requests import migrate_volume as moves
from vbs.controller.requests import modify_volume as modifications
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.requests import tags
from vbs.controller.requests.filters import DEFAULT_PAGE, MAX_RESULTS, page_limit, page_of, parse_filters
from vbs.controller.rest.completion import MAX_WAIT_S, SNAPSHOT_BUSY, VOLUME_BUSY, long_poll, recheck_interval
from vbs.controller.rest.schemas import (
    AdviceOut,
    AttachmentOut,
    AttachVolumeRequest,
    ControllerList,
    CopySnapshotRequest,
    CreateKeyRequest,
    CreateSnapshotRequest,
    CreateSnapshotSetRequest,
    CreateTagsRequest,
    CreateVolumeRequest,
    DeleteTagsRequest,
    DetachVolumeRequest,
    DrainOut,
    DrainRequest,
    HostList,
    InstanceList,
    InstanceMigrationOut,
    KeyList,
    KeyOut,
    MigrateInstanceRequest,
    MigrateVolumeRequest,
    MigrationOut,
    ModificationList,
    ModificationOut,
    ModifyVolumeRequest,
    OperationList,
    OperationOut,
    SnapshotList,
    SnapshotOut,
    SnapshotPermissionsOut,
    SnapshotPermissionsRequest,
    SnapshotSetOut,
    StepOut,
    StorageNodeList,
    VolumeList,
    VolumeOut,
    ZoneList,
)
from vbs.controller.runtime import Controller
from vbs.errors import AuthFailure, NotFound, UnauthorizedOperation
from vbs.trust.node_credentials import REFUSED, NodeIdentity
from vbs.trust.pki import PeerCertificate
from vbs.wire.base import Ack
from vbs.wire.connection import HOST_NAME_RE
from vbs.wire.host import HostHeartbeat
from vbs.wire.probes import MAX_PROBES, ProbeTarget, ProbeTargets
from vbs.wire.storage import StorageHeartbeat

T = TypeVar("T")


# The dependencies below only read the request: ``async`` runs them on the event loop, where a plain
# function would cost a worker-thread round trip each (two of a request's three hops before).
async def services(request: Request) -> Controller:
    return request.app.state.services  # type: ignore[no-any-return]


# Query parameters of every describe, bounded at the edge (400, never 500). Made per use, not shared:
# FastAPI records each parameter's name on its Query object, so one object must not serve two parameters.
def max_results_query() -> Any:
    return Query(default=None, description=f"1-{MAX_RESULTS}; default {DEFAULT_PAGE}")


def next_token_query() -> Any:
    return Query(default=None, max_length=160)


def wait_query() -> Any:
    return Query(default=0, ge=0, le=MAX_WAIT_S,
                 description=f"0-{MAX_WAIT_S}: seconds to wait until the answer is settled (a long-poll)")


async def settled_read(svc: Controller, key: str, read: Callable[[], T], settled: Callable[[T], bool],
                       wait_s: int) -> T:
    """``read()`` at once, or once ``settled`` within ``wait_s`` seconds (``vbs.controller.rest.completion``)."""
    return await long_poll(svc.engine.ends, key, read, settled, wait_s, recheck_interval(svc.db.dialect))


def ids_query() -> Any:
    return Query(default=[], max_length=1000)


def filters_query() -> Any:
    return Query(default=[], max_length=50, description="name=value, e.g. status=available")


async def caller(request: Request) -> Principal:
    """Who sent this request (``authenticated`` ran first: it is a dependency of every public route)."""
    return request.state.caller  # type: ignore[no-any-return]


async def admin(who: Principal = Depends(caller)) -> Principal:
    return require_admin(who)


def public_router(auth: Authenticator) -> APIRouter:
    async def authenticated(request: Request) -> None:
        request.state.caller = auth.check(request, await request.body())

    r = APIRouter(prefix="/v1", dependencies=[Depends(authenticated)])
    _volume_routes(r)
    _snapshot_routes(r)
    _node_routes(r)
    _admin_routes(r)
    return r


def _volume_routes(r: APIRouter) -> None:
    @r.post("/volumes", response_model=VolumeOut, tags=["volumes"])
    def create_volume(body: CreateVolumeRequest, svc: Controller = Depends(services),
                      who: Principal = Depends(caller)) -> Response:
        return Response(create_volume_req.create_volume_json(svc, body, who.tenant), media_type="application/json")

    @r.get("/volumes", response_model=VolumeList, tags=["volumes"])
    def describe_volumes(volume_id: list[str] = ids_query(), filter: list[str] = filters_query(),
                         max_results: int | None = max_results_query(), next_token: str | None = next_token_query(),
                         svc: Controller = Depends(services), who: Principal = Depends(caller)) -> Response:
        # Encoded from plain dicts (describe_volumes_req.VolumePage): no model per volume, no second validation.
        page = describe_volumes_req.volume_page(svc, who.tenant, volume_id, parse_filters(filter), max_results,
                                                next_token, deleted_by_id=True)
        return Response(page.json(), media_type="application/json")

    @r.get("/volumes/{volume_id}", response_model=VolumeOut, tags=["volumes"])
    async def get_volume(volume_id: str, wait: int = wait_query(), svc: Controller = Depends(services),
                         who: Principal = Depends(caller)) -> VolumeOut:
        """With ``wait``: answers once the volume is no longer creating or deleting (the CLI's --wait)."""
        return await settled_read(svc, volume_id, lambda: describe_volumes_req.get_volume(svc, volume_id, who.tenant),
                                  lambda v: v.status not in VOLUME_BUSY, wait)

    @r.delete("/volumes/{volume_id}", response_model=VolumeOut, tags=["volumes"])
    def delete_volume(volume_id: str, svc: Controller = Depends(services),
                      who: Principal = Depends(caller)) -> VolumeOut:
        return delete_volume_req.delete_volume(svc, volume_id, who.tenant)

    @r.post("/volumes/{volume_id}/attach", response_model=AttachmentOut, tags=["volumes"])
    def attach_volume(volume_id: str, body: AttachVolumeRequest, svc: Controller = Depends(services),
                      who: Principal = Depends(caller)) -> AttachmentOut:
        return attach_volume_req.attach_volume(svc, volume_id, body, who.tenant)

    @r.post("/volumes/{volume_id}/detach", response_model=AttachmentOut, tags=["volumes"])
    def detach_volume(volume_id: str, body: DetachVolumeRequest, svc: Controller = Depends(services),
                      who: Principal = Depends(caller)) -> AttachmentOut:
        return detach_volume_req.detach_volume(svc, volume_id, body, who.tenant)

    @r.get("/volumes/{volume_id}/advice", response_model=AdviceOut, tags=["volumes"])
    def volume_advice(volume_id: str, instance: str = Query(max_length=64),
                      io_gib: float | None = Query(None, gt=0, le=1 << 20),
                      random_ios: int = Query(0, ge=0, le=1 << 40),
                      memory_mib: int = Query(1024, ge=1, le=1 << 24),
                      svc: Controller = Depends(services), who: Principal = Depends(caller)) -> AdviceOut:
        """Remote access vs moving the VM or the volume, costed from the hosts' RTT probes."""
        return advice.advise(svc, volume_id, instance, who.tenant,
                             advice.Workload(io_gib=io_gib, random_ios=random_ios, memory_mib=memory_mib))

    @r.post("/volumes/{volume_id}/modify", response_model=ModificationOut, tags=["volumes"])
    def modify_volume(volume_id: str, body: ModifyVolumeRequest, svc: Controller = Depends(services),
                      who: Principal = Depends(caller)) -> ModificationOut:
        return modifications.modify_volume(svc, volume_id, body, who.tenant)

    @r.get("/volume-modifications", response_model=ModificationList, tags=["volumes"])
    def describe_modifications(volume_id: list[str] = ids_query(), filter: list[str] = filters_query(),
                               max_results: int | None = max_results_query(),
                               next_token: str | None = next_token_query(), svc: Controller = Depends(services),
                               who: Principal = Depends(caller)) -> ModificationList:
        return modifications.describe_modifications(svc, who.tenant, volume_id, parse_filters(filter), max_results,
                                                    next_token)

    @r.post("/tags", tags=["tags"])
    def create_tags(body: CreateTagsRequest, svc: Controller = Depends(services),
                    who: Principal = Depends(caller)) -> dict[str, bool]:
        with svc.db.session() as s:
            tags.create_tags(s, body.resource_ids, body.tags, who.tenant)
        return {"return": True}

    @r.post("/tags/delete", tags=["tags"])
    def delete_tags(body: DeleteTagsRequest, svc: Controller = Depends(services),
                    who: Principal = Depends(caller)) -> dict[str, bool]:
        with svc.db.session() as s:
            tags.delete_tags(s, body.resource_ids, body.keys, who.tenant)
        return {"return": True}


def _snapshot_routes(r: APIRouter) -> None:
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
                                  lambda x: x.status not in SNAPSHOT_BUSY, wait)

    @r.delete("/snapshots/{snapshot_id}", response_model=SnapshotOut, tags=["snapshots"])
    def delete_snapshot(snapshot_id: str, svc: Controller = Depends(services),
                        who: Principal = Depends(caller)) -> SnapshotOut:
        return delete_snapshot_req.delete_snapshot(svc, snapshot_id, who.tenant)

    @r.post("/snapshot-sets", response_model=SnapshotSetOut, tags=["snapshots"])
    def create_snapshot_set(body: CreateSnapshotSetRequest, svc: Controller = Depends(services),
                            who: Principal = Depends(caller)) -> SnapshotSetOut:
        """Snapshots of every volume attached to an instance, taken at one instant (the VM pauses briefly)."""
        return SnapshotSetOut(snapshots=snapshot_sets.create_snapshot_set(svc, body, who.tenant))

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


def _node_routes(r: APIRouter) -> None:
    @r.get("/instances", response_model=InstanceList, tags=["nodes"])
    def instances(max_results: int | None = max_results_query(), next_token: str | None = next_token_query(),
                  svc: Controller = Depends(services), who: Principal = Depends(caller)) -> InstanceList:
        """Every key may list instances (attaching needs an instance id); only its tenant's attachments show."""
        found, token = page_of(describe_instances_req.describe_instances(svc, who.tenant), lambda i: i.instance_id,
                               max_results, next_token)
        return InstanceList(instances=found, next_token=token)

    @r.get("/hosts", response_model=HostList, tags=["nodes"], dependencies=[Depends(admin)])
    def hosts(max_results: int | None = max_results_query(), next_token: str | None = next_token_query(),
              svc: Controller = Depends(services)) -> HostList:
        with svc.db.read() as s:
            found, token = page_of(describe_hosts(s, svc.cfg.heartbeat_timeout_s), lambda h: h.name, max_results,
                                   next_token)
        return HostList(hosts=found, next_token=token)

    @r.get("/storage-nodes", response_model=StorageNodeList, tags=["nodes"], dependencies=[Depends(admin)])
    def storage_nodes(max_results: int | None = max_results_query(), next_token: str | None = next_token_query(),
                      svc: Controller = Depends(services)) -> StorageNodeList:
        with svc.db.read() as s:
            found, token = page_of(describe_storage_nodes(s, svc.cfg.heartbeat_timeout_s, svc.cfg.availability_zone),
                                   lambda n: n.name, max_results, next_token)
        return StorageNodeList(storage_nodes=found, next_token=token)

    @r.post("/storage-nodes/{name}/drain", response_model=DrainOut, tags=["nodes"], dependencies=[Depends(admin)])
    def drain(name: str, body: DrainRequest | None = None, svc: Controller = Depends(services)) -> DrainOut:
        """No new volumes on this node (``undo``: again), clones of its snapshots excepted; what still lives there."""
        if not HOST_NAME_RE.fullmatch(name):
            raise NotFound(f"The storage node '{name[:64]}' does not exist.", code="InvalidStorageNode.NotFound")
        with svc.db.session() as s:
            return drain_storage_node(s, name, drained=not (body and body.undo),
                                      timeout_s=svc.cfg.heartbeat_timeout_s, default_zone=svc.cfg.availability_zone)

    @r.post("/instances/{instance_id}/migrations", response_model=InstanceMigrationOut, tags=["nodes"],
            dependencies=[Depends(admin)])
    def migrate_instance(instance_id: str, body: MigrateInstanceRequest,
                         svc: Controller = Depends(services)) -> InstanceMigrationOut:
        """Live-migrate the instance to another host, its VBS disks with it (admin; the orchestrator started
        the destination VM there with -incoming defer)."""
        return live_migrations.migrate_instance(svc, instance_id, body)

    @r.post("/volumes/{volume_id}/migrate", response_model=MigrationOut, tags=["nodes"],
            dependencies=[Depends(admin)])
    def migrate_volume(volume_id: str, body: MigrateVolumeRequest, svc: Controller = Depends(services),
                       who: Principal = Depends(caller)) -> MigrationOut:
        """Serve the volume from another storage node of the same shared storage (admin; instant for Ceph)."""
        return moves.migrate_volume(svc, volume_id, body, who.tenant)

    @r.get("/region", tags=["nodes"])
    def region(svc: Controller = Depends(services), who: Principal = Depends(caller)) -> dict[str, str]:
        """The region this controller serves (the CLI's --region checks it)."""
        return {"region": svc.cfg.region, "default_availability_zone": svc.cfg.availability_zone}

    @r.get("/availability-zones", response_model=ZoneList, tags=["nodes"])
    def zones(svc: Controller = Depends(services)) -> ZoneList:
        """The zones of the storage nodes; every key may list them (creating a volume may name one)."""
        with svc.db.read() as s:
            return ZoneList(availability_zones=availability_zones(s, svc.cfg.heartbeat_timeout_s,
                                                                  svc.cfg.availability_zone, svc.cfg.region))


def _admin_routes(r: APIRouter) -> None:
    @r.get("/controllers", response_model=ControllerList, tags=["admin"], dependencies=[Depends(admin)])
    def controllers(svc: Controller = Depends(services)) -> ControllerList:
        """The controllers on this database: live ones, their operations and singleton loops."""
        return ControllerList(controllers=describe_controllers(svc.db, svc.cfg.operation_lease_s))

    @r.get("/admin/check", tags=["admin"], dependencies=[Depends(admin)])
    def check(svc: Controller = Depends(services)) -> dict[str, Any]:
        """Compare the agents' real inventory with the DB; change nothing."""
        return svc.reconciler.run(repair=False).as_dict()

    @r.post("/admin/reconcile", tags=["admin"], dependencies=[Depends(admin)])
    def reconcile(now: bool = False, svc: Controller = Depends(services)) -> dict[str, Any]:
        """Repair drift now; ``now=true`` also removes orphans without waiting for their grace period."""
        return svc.reconciler.run(repair=True, ignore_grace=now).as_dict()

    @r.get("/operations/{operation_id}", response_model=OperationOut, tags=["operations"])
    async def get_operation(operation_id: str, wait: int = wait_query(), svc: Controller = Depends(services),
                            who: Principal = Depends(caller)) -> OperationOut:
        """Any operation to an admin; to a user, those on its tenant's volumes and snapshots. With ``wait``:
        answers once the operation ended, or after ``wait`` seconds with its current state (the CLI's --wait)."""
        return await settled_read(svc, operation_id, lambda: describe_operation(svc, operation_id, who),
                                  lambda op: op.status not in UNFINISHED_OPERATION, wait)

    @r.get("/operations", response_model=OperationList, tags=["operations"])
    def list_operations(resource_id: str = Query(max_length=32), max_results: int | None = max_results_query(),
                        svc: Controller = Depends(services), who: Principal = Depends(caller)) -> OperationList:
        """The operations of one volume or snapshot, newest first (the web console's timeline)."""
        return operations_of(svc, resource_id, who, max_results)

    @r.post("/keys", response_model=KeyOut, tags=["keys"], dependencies=[Depends(admin)])
    def create_key(body: CreateKeyRequest, request: Request) -> KeyOut:
        key = _key_store(request).create(body.tenant, body.role)
        return KeyOut(access_key_id=key.access_key_id, tenant=body.tenant, role=body.role,
                      secret_access_key=key.secret_access_key)

    @r.post("/keys/{access_key_id}/rotate", response_model=KeyOut, tags=["keys"], dependencies=[Depends(admin)])
    def rotate_key(access_key_id: str, request: Request) -> KeyOut:
        """A new key for the same tenant and role; the old one works until it is deleted (no downtime)."""
        key, info = _key_store(request).successor(access_key_id)
        return KeyOut(access_key_id=key.access_key_id, tenant=info.tenant, role=info.role,
                      secret_access_key=key.secret_access_key)

    @r.get("/keys", response_model=KeyList, tags=["keys"], dependencies=[Depends(admin)])
    def list_keys(request: Request) -> KeyList:
        return KeyList(keys=[KeyOut(access_key_id=k.access_key_id, tenant=k.tenant, role=k.role,
                                    bootstrap=k.bootstrap) for k in _key_store(request).list()])

    @r.delete("/keys/{access_key_id}", tags=["keys"], dependencies=[Depends(admin)])
    def delete_key(access_key_id: str, request: Request) -> dict[str, bool]:
        _key_store(request).delete(access_key_id)
        return {"return": True}


def _key_store(request: Request) -> KeyStore:
    return request.app.state.keys  # type: ignore[no-any-return]


def describe_operation(svc: Controller, operation_id: str, who: Principal) -> OperationOut:
    if not ids.is_valid("operation", operation_id):
        raise operation_not_found(operation_id)
    with svc.db.read() as s:
        op = s.get(Operation, operation_id)
        if op is None or not (who.is_admin or _owns(s, op.resource_id, who.tenant)):
            raise operation_not_found(operation_id)
        return _operation_out(s, op)


def operations_of(svc: Controller, resource_id: str, who: Principal, max_results: int | None) -> OperationList:
    """``resource_id``'s operations, newest first: any resource's to an admin, else its tenant's only
    (another tenant's volume has none, as it does not exist for this caller)."""
    kind = "volume" if resource_id.startswith("vol-") else "snapshot"
    ids.check(kind, resource_id)
    limit = page_limit(max_results, [])
    with svc.db.read() as s:
        if not (who.is_admin or _owns(s, resource_id, who.tenant)):
            return OperationList(operations=[])
        ops = s.scalars(select(Operation).where(Operation.resource_id == resource_id)
                        .order_by(Operation.created_at.desc(), Operation.id).limit(limit)).all()
        return OperationList(operations=[_operation_out(s, op) for op in ops])


def _operation_out(s: Session, op: Operation) -> OperationOut:
    steps = s.scalars(select(OperationStep).where(OperationStep.operation_id == op.id)
                      .order_by(OperationStep.position)).all()
    return OperationOut(operation_id=op.id, kind=op.kind, resource_id=op.resource_id, status=op.status,
                        error=op.error, attempts=op.attempts, created_at=op.created_at, updated_at=op.updated_at,
                        steps=[StepOut(name=st.name, state=st.state, error=st.error) for st in steps])


def operation_not_found(operation_id: str) -> NotFound:
    return NotFound(f"The operation '{operation_id[:40]}' does not exist.", code="InvalidOperation.NotFound")


def _owns(s: Session, resource_id: str, tenant: str) -> bool:
    table: type[Volume] | type[Snapshot] = Volume if resource_id.startswith("vol-") else Snapshot
    return s.scalar(select(table.tenant).where(table.id == resource_id)) == tenant


def internal_router(*, insecure: bool) -> APIRouter:
    """The agents' endpoints. A node token says which node calls (the edge checked it and left the
    node in the request's state; a request without one passes only on an ``--insecure``
    controller): a node reports only as itself, and a storage node's token is no host's."""
    r = APIRouter(prefix="/internal/v1", include_in_schema=False)

    def same_node(request: Request, kind: str, name: str, address: str) -> None:
        who: NodeIdentity | None = getattr(request.state, "node", None)
        if who is None:
            if insecure:
                return
            raise AuthFailure(REFUSED)
        if who.kind != kind or who.name != name:
            raise UnauthorizedOperation(f"the credential of {who.kind} node {who.name} cannot report as "
                                        f"{kind} node {name[:63]}")
        cert: PeerCertificate | None = getattr(request.state, "node_cert", None)
        if cert is not None and not cert.names_address(address):
            # Hosts connect to the address a storage node reports, and exports admit a host's
            # address: a node reports only an address its certificate names.
            raise UnauthorizedOperation(f"{kind} node {name} reports the address {address[:255]!r}, which its "
                                        "certificate does not name")

    @r.post("/storage-heartbeat")
    def storage_heartbeat(body: StorageHeartbeat, request: Request, svc: Controller = Depends(services)) -> Ack:
        same_node(request, "storage", body.name, body.address)
        with svc.db.session() as s:
            record_storage_heartbeat(s, body)
        return Ack()

    @r.post("/host-heartbeat")
    def host_heartbeat(body: HostHeartbeat, request: Request, svc: Controller = Depends(services)) -> Ack:
        same_node(request, "host", body.name, body.address)
        with svc.db.session() as s:
            record_host_heartbeat(s, body)
        return Ack()

    @r.get("/probe-targets")
    def probe_targets(request: Request, svc: Controller = Depends(services)) -> ProbeTargets:
        """The live storage nodes a host probes, each with a ticket its agent accepts (vbs.trust.probe_tickets)."""
        who: NodeIdentity | None = getattr(request.state, "node", None)
        if who is None and not insecure:
            raise AuthFailure(REFUSED)
        if who is not None and who.kind != "host":
            raise UnauthorizedOperation("only hosts probe storage nodes")
        host = who.name if who is not None else "insecure-host"
        with svc.db.read() as s:
            nodes = [(n.name, n.url) for n in live_storage_nodes(s, svc.cfg.heartbeat_timeout_s)][:MAX_PROBES]
        return ProbeTargets(targets=[ProbeTarget(storage_node=name, url=url, ticket=svc.agents.probe_ticket(name, host))
                                     for name, url in nodes])

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
        svc.engine.faults.inject_failure(body.kind, body.step, body.when)
        return {"status": "armed"}

    @r.post("/hold-step")
    def hold_step(body: StepHook, svc: Controller = Depends(services)) -> dict[str, str]:
        svc.engine.faults.hold(body.kind, body.step)
        return {"status": "armed"}

    @r.post("/held-step")
    def held_step(body: StepHook, svc: Controller = Depends(services)) -> dict[str, bool]:
        return {"held": svc.engine.faults.held(body.kind, body.step)}

    @r.post("/release-step")
    def release_step(body: StepHook, svc: Controller = Depends(services)) -> dict[str, str]:
        svc.engine.faults.release(body.kind, body.step)
        return {"status": "released"}

    return r


def install_routes(app: FastAPI, auth: Authenticator, *, insecure: bool) -> None:
    @app.get("/health", include_in_schema=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    async def authenticated(request: Request) -> None:
        auth.check(request, await request.body())

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authenticated)])
    def openapi() -> dict[str, Any]:
        return app.openapi()

    app.include_router(public_router(auth))
    app.include_router(internal_router(insecure=insecure))
