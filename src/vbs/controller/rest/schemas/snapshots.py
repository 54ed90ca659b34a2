"""The REST models of snapshots: create one or the set of an instance's volumes, copy one, the answers
that describe them, and who else may create volumes from a snapshot (createVolumePermission)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field

from vbs.controller.rest.schemas.common import Comment, KmsKeyId, Tags, _Request
from vbs.wire.base import SnapshotId, VolumeId


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
    # Where its data lives (docs/snapshots.md): "pool" (its pool only: not stored, or not yet), "store"
    # (the snapshot store only: a copy pool gave its copy up) or "pool+store" (a reflink pool's fast tier
    # too); the upload's state (None: it goes to no store; uploading, stored, error) and the bytes of its
    # chunks that are not zeros.
    data_location: str = "pool"
    store_state: str | None = None
    stored_bytes: int | None = None
    # "standard" or "archive" (docs/snapshot-tiers.md); a temporary restore's end.
    storage_tier: str = "standard"
    restore_expires_at: datetime | None = None


class SnapshotList(BaseModel):
    snapshots: list[SnapshotOut]
    next_token: str | None = None
