"""The REST API's request and response models (pydantic), apart from the DB tables.

Requests are strict: unknown fields, wrong JSON types and out-of-range values are refused at the
edge with ``InvalidParameterValue`` before anything reaches the domain or a driver.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from vbs.wire.base import SnapshotId, VolumeId
from vbs.wire.connection import HOST_NAME_RE
from vbs.wire.host import HypervisorCapabilities
from vbs.wire.probes import Probe
from vbs.wire.storage import POOL_NAME_RE, ZONE_NAME_RE

MAX_SIZE_GIB = 16384
COMMENT_MAX = 255
TAG_KEY_MAX = 128
TAG_VALUE_MAX = 256
TAGS_MAX = 50

# Printable text: no control characters (they break logs, terminals and XML answers).
_TEXT_RE = re.compile(r"^[^\x00-\x1f\x7f]*$")
_TAG_KEY_RE = re.compile(r"^[^\x00-\x1f\x7f]{1,128}$")


def _text(value: str) -> str:
    if not _TEXT_RE.fullmatch(value):
        raise ValueError("must not contain control characters")
    return value


def _tags(value: dict[str, str]) -> dict[str, str]:
    if len(value) > TAGS_MAX:
        raise ValueError(f"at most {TAGS_MAX} tags per resource")
    for key, val in value.items():
        if not _TAG_KEY_RE.fullmatch(key):
            raise ValueError(f"tag key {key[:40]!r} must be 1-{TAG_KEY_MAX} printable characters")
        if key.lower().startswith("aws:"):
            raise ValueError("tag keys starting with 'aws:' are reserved")
        if len(val) > TAG_VALUE_MAX or not _TEXT_RE.fullmatch(val):
            raise ValueError(f"tag value for {key[:40]!r} must be at most {TAG_VALUE_MAX} printable characters")
    return value


Comment = Annotated[str, Field(max_length=COMMENT_MAX), AfterValidator(_text)]
Tags = Annotated[dict[str, str], AfterValidator(_tags)]
ClientToken = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[\x21-\x7e]+$")]
VolumeType = Literal["standard", "gp2", "gp3", "io1", "io2", "st1", "sc1"]
StorageZone = Annotated[str, Field(pattern=ZONE_NAME_RE)]
NodeName = Annotated[str, Field(pattern=HOST_NAME_RE.pattern)]
PoolName = Annotated[str, Field(pattern=POOL_NAME_RE)]


KmsKeyId = Annotated[str, Field(min_length=1, max_length=2048, pattern=r"^[A-Za-z0-9:/_.+=@-]+$")]


# What no metadata database can store: a lone UTF-16 surrogate (JSON's "\ud800" decodes to one; it
# has no UTF-8 form, SQLite raises) and NUL (PostgreSQL's text refuses it).
_UNSTORABLE_RE = re.compile("[\x00\ud800-\udfff]")
UNSTORABLE = "must not contain NUL characters or lone UTF-16 surrogates (text that cannot be stored)"


def refuse_unstorable(value: Any, where: str = "body") -> None:
    """Raise ValueError for any string in ``value`` (a JSON document: keys too) that cannot be stored."""
    if isinstance(value, str):
        if not value.isascii() or "\x00" in value:
            if _UNSTORABLE_RE.search(value):
                raise ValueError(f"{where} {UNSTORABLE}")
    elif isinstance(value, dict):
        for key, item in value.items():
            refuse_unstorable(key, f"{where} (a key)")
            refuse_unstorable(item, f"{where}.{key}" if isinstance(key, str) and key.isprintable() else where)
    elif isinstance(value, list | tuple):
        for item in value:
            refuse_unstorable(item, where)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        # Once for every string of every request body, whatever its field: a 400, never a 500.
        refuse_unstorable(data)
        return data


class CreateVolumeRequest(_Request):
    size_gib: int | None = Field(None, ge=1, le=MAX_SIZE_GIB)
    comment: Comment = ""
    snapshot_id: SnapshotId | None = None
    volume_type: VolumeType = "gp3"
    iops: int | None = Field(None, ge=100, le=256000)
    throughput: int | None = Field(None, ge=1, le=4000)
    multi_attach: bool = False
    # A LUKS container hosts open (vbs.controller.auth.encryption); kms_key_id is recorded as given.
    encrypted: bool = False
    kms_key_id: KmsKeyId | None = None
    placement: Literal["shared", "local"] = "shared"
    # placement local: the host whose local pool holds it, and whether it outlives its detach.
    host: NodeName | None = None
    persistent: bool = False
    tags: Tags = Field(default_factory=dict)
    client_token: ClientToken | None = None
    # Where it may go (the scheduler picks within): a zone, a storage node, a pool of that name.
    availability_zone: StorageZone | None = None
    storage_node: NodeName | None = None
    pool: PoolName | None = None


class CreateSnapshotRequest(_Request):
    volume_id: VolumeId
    comment: Comment = ""
    tags: Tags = Field(default_factory=dict)


class CreateSnapshotSetRequest(_Request):
    """Snapshots of the volumes attached to one instance, crash-consistent as a set (EC2 CreateSnapshots)."""
    instance_id: Annotated[str, Field(pattern=r"^i-[0-9a-f]{17}$")]
    comment: Comment = ""
    tags: Tags = Field(default_factory=dict)
    copy_tags_from_volume: bool = False
    exclude_volume_ids: list[VolumeId] = Field(default_factory=list, max_length=100)


class SnapshotSetOut(BaseModel):
    snapshots: list[SnapshotOut]


class CopySnapshotRequest(_Request):
    source_snapshot_id: SnapshotId
    comment: Comment = ""
    tags: Tags = Field(default_factory=dict)
    # A copy keeps its source's encryption and key; encrypting or re-keying on copy is refused (not yet).
    encrypted: bool = False
    kms_key_id: KmsKeyId | None = None


Grantee = Annotated[str, Field(pattern=r"^(all|[a-z0-9][a-z0-9_-]{0,62})$")]


class SnapshotPermissionsRequest(_Request):
    """Tenants (or ``all``) to grant or revoke createVolumePermission."""
    add: list[Grantee] = Field(default_factory=list, max_length=100)
    remove: list[Grantee] = Field(default_factory=list, max_length=100)


class SnapshotPermissionsOut(BaseModel):
    snapshot_id: str
    create_volume_permission: list[str]


class CreateTagsRequest(_Request):
    resource_ids: list[str] = Field(min_length=1, max_length=1000)
    tags: Tags


class DeleteTagsRequest(_Request):
    resource_ids: list[str] = Field(min_length=1, max_length=1000)
    keys: list[Annotated[str, Field(min_length=1, max_length=TAG_KEY_MAX)]] = Field(default_factory=list)


class AttachmentOut(BaseModel):
    attachment_id: str
    volume_id: str
    instance_id: str | None
    host: str
    vm_id: str
    device: str
    mode: str
    state: str
    state_reason: str | None = None
    attach_time: datetime
    operation_id: str | None = None
    # Said once, in the answer of attach-volume (a high measured RTT to the volume's storage node).
    warnings: list[str] = []


class MigrationProgressOut(BaseModel):
    """A move of the volume to another storage node under way (``vbs migrate-volume``): how far its copy is."""

    operation_id: str
    kind: str
    target_node: str
    target_pool: str
    progress: int
    state: str


class VolumeOut(BaseModel):
    volume_id: str
    size_gib: int
    comment: str
    snapshot_id: str | None
    volume_type: str
    iops: int | None
    throughput: int | None
    multi_attach: bool
    encrypted: bool = False
    kms_key_id: str | None = None
    placement: str
    # placement local: the host whose local pool holds it (storage_node names it too), and whether it
    # outlives its detach (a non-persistent one is removed at detach, like an instance store).
    host: str | None = None
    persistent: bool = False
    status: str
    status_reason: str | None
    progress: int
    storage_node: str
    pool: str
    availability_zone: str
    # Bytes the volume holds on its storage (a file pool's allocated blocks) as of the node's last
    # heartbeat; None where the backend does not tell (RBD) or the node has not reported it yet.
    used_bytes: int | None = None
    # EC2's volume status check (DescribeVolumeStatus): ok, impaired (its storage node stopped
    # heartbeating, or the volume is in error), insufficient-data (not serving I/O yet or any more).
    volume_status: Literal["ok", "impaired", "insufficient-data"]
    created_at: datetime
    tags: dict[str, str]
    attachments: list[AttachmentOut]
    migration: MigrationProgressOut | None = None


class SnapshotOut(BaseModel):
    snapshot_id: str
    volume_id: str
    volume_size_gib: int
    comment: str
    status: str
    status_reason: str | None
    progress: int
    storage_node: str
    pool: str
    started_at: datetime
    tags: dict[str, str]
    owner: str  # the tenant that owns it (another's, for a snapshot shared with the caller)
    encrypted: bool = False
    kms_key_id: str | None = None
    source_snapshot_id: str | None = None  # what a CopySnapshot copied


class VolumeList(BaseModel):
    volumes: list[VolumeOut]
    next_token: str | None = None


class SnapshotList(BaseModel):
    snapshots: list[SnapshotOut]
    next_token: str | None = None


class StepOut(BaseModel):
    name: str
    state: str
    error: str | None


class OperationOut(BaseModel):
    operation_id: str
    kind: str
    resource_id: str
    status: str
    error: str | None
    attempts: int
    created_at: datetime
    updated_at: datetime
    steps: list[StepOut]


class OperationList(BaseModel):
    operations: list[OperationOut]


class PoolOut(BaseModel):
    name: str
    backend: str
    capacity_bytes: int
    free_bytes: int
    clone_method: str
    point_in_time: bool
    shared_id: str | None = None  # the same storage as other agents' pools with this id (Ceph)


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


class StorageNodeList(BaseModel):
    storage_nodes: list[StorageNodeOut]
    next_token: str | None = None


class DrainRequest(_Request):
    undo: bool = False


class MigrateVolumeRequest(_Request):
    """Serve the volume from ``storage_node`` (its pool ``pool``: by default the one of the same
    shared storage)."""

    storage_node: NodeName
    pool: PoolName | None = None


class MigrationOut(BaseModel):
    volume_id: str
    source_node: str
    source_pool: str
    target_node: str
    target_pool: str
    operation_id: str


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


DEVICE_RE = r"^(/dev/)?(vd|xvd|sd)[b-z]{1,2}$"


# VBS's own instance id, or SCHEME:ID of an external cloud (its resolver checks the ID strictly).
INSTANCE_REF_RE = r"^i-[0-9a-f]{17}$|^[a-z][a-z0-9-]{0,31}:[^\x00-\x1f\x7f]{1,160}$"


class AttachVolumeRequest(_Request):
    """Either ``instance_id`` (VBS's ``i-…``, or an external cloud's ``SCHEME:ID`` that a resolver
    maps), or ``host`` and ``vm_id`` together."""

    instance_id: str | None = Field(None, max_length=200, pattern=INSTANCE_REF_RE)
    host: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")
    vm_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    device: str = Field("vdb", pattern=DEVICE_RE)
    read_only: bool = False


class DetachVolumeRequest(_Request):
    instance_id: str | None = Field(None, max_length=32, pattern=r"^i-[0-9a-f]{17}$")
    force: bool = False


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


class HostList(BaseModel):
    hosts: list[HostOut]
    next_token: str | None = None


class InstanceList(BaseModel):
    instances: list[InstanceOut]
    next_token: str | None = None


class ModifyVolumeRequest(_Request):
    size_gib: int | None = Field(None, ge=1, le=MAX_SIZE_GIB)
    volume_type: VolumeType | None = None
    iops: int | None = Field(None, ge=100, le=256000)
    throughput: int | None = Field(None, ge=1, le=4000)
    multi_attach: bool | None = None


class ModificationOut(BaseModel):
    modification_id: str
    volume_id: str
    state: str
    status_message: str | None
    original_size_gib: int
    target_size_gib: int
    original_volume_type: str
    target_volume_type: str
    original_iops: int | None
    target_iops: int | None
    original_throughput: int | None
    target_throughput: int | None
    progress: int
    start_time: datetime
    end_time: datetime | None


class ModificationList(BaseModel):
    modifications: list[ModificationOut]
    next_token: str | None = None


class CreateKeyRequest(_Request):
    tenant: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    role: Literal["admin", "user", "metrics"] = "user"


class KeyOut(BaseModel):
    access_key_id: str
    tenant: str
    role: str
    bootstrap: bool = False
    # Only in the answer to the request that made the key: it is never shown again.
    secret_access_key: str | None = None


class KeyList(BaseModel):
    keys: list[KeyOut]


class AdviceOption(BaseModel):
    """One way to run the workload: where the VM and the data would be, what the move costs, what the
    I/O costs there (seconds, from the RTT model), and the command that does it."""

    action: Literal["stay-remote", "migrate-instance", "migrate-volume"]
    host: str
    storage_node: str
    rtt_ms: float
    mbps: float
    iops: float
    move_s: float
    io_s: float
    total_s: float
    # The I/O (GiB, at the asked mix) from which this move costs less than staying remote; None
    # when it never does (no faster than staying) or for staying itself.
    breakeven_io_gib: float | None = None
    command: str | None = None


class AdviceModelOut(BaseModel):
    source: str
    protocol: str
    link_mbps: float
    # Data in flight per round trip (MiB); None when the measurements span one RTT only.
    window_mib: float | None
    copy_mbps: float
    copy_source: str


class MeasuredProbe(BaseModel):
    host: str
    storage_node: str
    rtt_ms: float
    mbps: float
    measured_at: datetime


class AdviceOut(BaseModel):
    volume_id: str
    instance_id: str
    io_gib: float
    random_ios: int
    memory_mib: int
    model: AdviceModelOut
    options: list[AdviceOption]
    recommended: str
    notes: list[str] = []
    # The probes the answer was computed from (every live host's latest of each storage node).
    measured: list[MeasuredProbe] = []
