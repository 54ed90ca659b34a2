"""The REST models of volumes: create, attach and detach, the answers that describe a volume and its
attachments, modifications of its size or type, and its move to another storage node."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from vbs.controller.rest.schemas.common import (
    MAX_SIZE_GIB,
    ClientToken,
    Comment,
    KmsKeyId,
    NodeName,
    PoolName,
    StorageZone,
    Tags,
    VolumeType,
    _Request,
)
from vbs.wire.base import SnapshotId


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


class VolumeList(BaseModel):
    volumes: list[VolumeOut]
    next_token: str | None = None


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
