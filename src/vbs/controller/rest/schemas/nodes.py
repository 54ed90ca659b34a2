"""The REST models of the fleet: controllers, storage nodes and their pools and drain, hosts and their
instances, an instance's live migration, and the availability zones."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from vbs.controller.rest.schemas.common import NodeName, _Request
from vbs.controller.rest.schemas.volumes import AttachmentOut
from vbs.wire.host import HypervisorCapabilities
from vbs.wire.probes import Probe


class PoolOut(BaseModel):
    name: str
    backend: str
    capacity_bytes: int
    free_bytes: int
    clone_method: str
    point_in_time: bool
    shared_id: str | None = None  # the same storage as other agents' pools with this id (Ceph)
    lost: str | None = None  # why the pool's storage is gone (docs/operations.md "A lost pool")
    # Free bytes below the reserve: no new volumes or snapshots here (docs/operations.md "A full pool").
    full: bool = False


class ControllerOut(BaseModel):
    controller_id: str
    url: str
    state: str
    started_at: datetime
    last_seen: datetime
    operations_held: int
    singletons: list[str]


class ControllerList(BaseModel):
    controllers: list[ControllerOut]


class StorageNodeOut(BaseModel):
    name: str
    url: str
    state: str
    drained: bool
    availability_zone: str
    last_heartbeat: datetime
    pools: list[PoolOut]
    # The node's VBS release and wire version as its last heartbeat named them (None: not named).
    vbs_version: str | None = None
    wire_version: int | None = None


class StorageNodeList(BaseModel):
    storage_nodes: list[StorageNodeOut]
    next_token: str | None = None


class DrainRequest(_Request):
    undo: bool = False


class MigrateInstanceRequest(_Request):
    """Live-migrate the instance to ``host``, where the orchestrator started its destination VM (same VM
    id, QEMU ``-incoming defer``); its VBS disks follow it."""

    host: NodeName
    timeout_s: float = Field(600.0, ge=10, le=86400)


class InstanceMigrationOut(BaseModel):
    instance_id: str
    vm_id: str
    source_host: str
    target_host: str
    volume_ids: list[str]
    # Whether an external orchestrator runs the migrate (detected by VBS) or VBS does.
    external: bool
    operation_id: str


class ResidentOut(BaseModel):
    """A volume or snapshot that lives on a storage node (any tenant's: what an operator must move)."""

    id: str
    tenant: str
    pool: str
    size_gib: int
    status: str


class DrainOut(BaseModel):
    storage_node: StorageNodeOut
    volumes: list[ResidentOut]
    snapshots: list[ResidentOut]


class ZoneOut(BaseModel):
    zone_name: str
    zone_id: str
    region_name: str
    state: Literal["available", "unavailable"]


class ZoneList(BaseModel):
    availability_zones: list[ZoneOut]


class InstanceOut(BaseModel):
    instance_id: str
    host: str
    vm_id: str
    name: str
    state: str
    volumes: list[AttachmentOut]
    # The ids external clouds give it ({"nova": "<uuid>"}): attach-volume --instance nova:<uuid>.
    cloud_ids: dict[str, str] = {}


class HostOut(BaseModel):
    name: str
    url: str
    address: str
    state: str
    last_heartbeat: datetime
    instances: int
    hypervisor: str
    capabilities: HypervisorCapabilities
    # The host's latest RTT probe of each storage node (vbs.host.probes).
    probes: list[Probe] = []
    # Semi-shared storage: the host's own pools, where local volumes go.
    local_pools: list[PoolOut] = []
    vbs_version: str | None = None  # as StorageNodeOut's
    wire_version: int | None = None


class HostList(BaseModel):
    hosts: list[HostOut]
    next_token: str | None = None


class InstanceList(BaseModel):
    instances: list[InstanceOut]
    next_token: str | None = None
