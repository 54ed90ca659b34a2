"""The ``/v1`` routes of the fleet (tag ``nodes``): instances, hosts, storage nodes and their drain, the
live migration of an instance or a volume, the region and its availability zones."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from vbs.controller.fleet.describe_nodes import (
    availability_zones,
    describe_hosts,
    describe_storage_nodes,
    drain_storage_node,
)
from vbs.controller.requests import describe_instances as describe_instances_req
from vbs.controller.requests import migrate_instance as migrate_instance_req
from vbs.controller.requests import migrate_volume as migrate_volume_req
from vbs.controller.requests.filters import page_of
from vbs.controller.rest.queries import Caller, Services, admin, max_results_query, next_token_query
from vbs.controller.rest.schemas.nodes import (
    DrainOut,
    DrainRequest,
    HostList,
    InstanceList,
    InstanceMigrationOut,
    MigrateInstanceRequest,
    StorageNodeList,
    ZoneList,
)
from vbs.controller.rest.schemas.volumes import MigrateVolumeRequest, MigrationOut
from vbs.errors import NotFound
from vbs.wire.connection import HOST_NAME_RE


def node_routes(r: APIRouter) -> None:
    @r.get("/instances", response_model=InstanceList, tags=["nodes"])
    def instances(svc: Services, who: Caller, max_results: int | None = max_results_query(),
                  next_token: str | None = next_token_query()) -> InstanceList:
        """Every key may list instances (attaching needs an instance id); only its tenant's attachments show."""
        found, token = page_of(describe_instances_req.describe_instances(svc, who.tenant), lambda i: i.instance_id,
                               max_results, next_token)
        return InstanceList(instances=found, next_token=token)

    @r.get("/hosts", response_model=HostList, tags=["nodes"], dependencies=[Depends(admin)])
    def hosts(svc: Services, max_results: int | None = max_results_query(),
              next_token: str | None = next_token_query()) -> HostList:
        with svc.db.read() as s:
            found, token = page_of(describe_hosts(s, svc.cfg.heartbeat_timeout_s), lambda h: h.name, max_results,
                                   next_token)
        return HostList(hosts=found, next_token=token)

    @r.get("/storage-nodes", response_model=StorageNodeList, tags=["nodes"], dependencies=[Depends(admin)])
    def storage_nodes(svc: Services, max_results: int | None = max_results_query(),
                      next_token: str | None = next_token_query()) -> StorageNodeList:
        with svc.db.read() as s:
            found, token = page_of(describe_storage_nodes(s, svc.cfg.heartbeat_timeout_s, svc.cfg.availability_zone),
                                   lambda n: n.name, max_results, next_token)
        return StorageNodeList(storage_nodes=found, next_token=token)

    @r.post("/storage-nodes/{name}/drain", response_model=DrainOut, tags=["nodes"], dependencies=[Depends(admin)])
    def drain(name: str, svc: Services, body: DrainRequest | None = None) -> DrainOut:
        """No new volumes on this node (``undo``: again), clones of its snapshots excepted; what still lives there."""
        if not HOST_NAME_RE.fullmatch(name):
            raise NotFound(f"The storage node '{name[:64]}' does not exist.", code="InvalidStorageNode.NotFound")
        with svc.db.session() as s:
            return drain_storage_node(s, name, drained=not (body and body.undo),
                                      timeout_s=svc.cfg.heartbeat_timeout_s, default_zone=svc.cfg.availability_zone)

    @r.post("/instances/{instance_id}/migrations", response_model=InstanceMigrationOut, tags=["nodes"],
            dependencies=[Depends(admin)])
    def migrate_instance(instance_id: str, body: MigrateInstanceRequest, svc: Services) -> InstanceMigrationOut:
        """Live-migrate the instance to another host, its VBS disks with it (admin; the orchestrator started
        the destination VM there with -incoming defer)."""
        return migrate_instance_req.migrate_instance(svc, instance_id, body)

    @r.post("/volumes/{volume_id}/migrate", response_model=MigrationOut, tags=["nodes"],
            dependencies=[Depends(admin)])
    def migrate_volume(volume_id: str, body: MigrateVolumeRequest, svc: Services, who: Caller) -> MigrationOut:
        """Serve the volume from another storage node of the same shared storage (admin; instant for Ceph)."""
        return migrate_volume_req.migrate_volume(svc, volume_id, body, who.tenant)

    @r.get("/region", tags=["nodes"])
    def region(svc: Services, who: Caller) -> dict[str, str]:
        """The region this controller serves (the CLI's --region checks it)."""
        return {"region": svc.cfg.region, "default_availability_zone": svc.cfg.availability_zone}

    @r.get("/availability-zones", response_model=ZoneList, tags=["nodes"])
    def zones(svc: Services) -> ZoneList:
        """The zones of the storage nodes; every key may list them (creating a volume may name one)."""
        with svc.db.read() as s:
            return ZoneList(availability_zones=availability_zones(s, svc.cfg.heartbeat_timeout_s,
                                                                  svc.cfg.availability_zone, svc.cfg.region))
