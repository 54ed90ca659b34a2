"""What the controller and a storage agent say to each other: requests, answers and the heartbeat."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from vbs.wire.base import SnapshotId, VolumeId, Wire
from vbs.wire.connection import ADDRESS_RE, HOST_NAME_RE, Connection, HostIdentity

__all__ = [
    "ItemState",
    "ItemStatus",
    "PoolInfo",
    "PoolInventory",
    "Inventory",
    "EnsureVolume",
    "ResizeVolume",
    "EnsureSnapshot",
    "ConnectionRequest",
    "ConnectionAnswer",
    "SnapshotTargetRequest",
    "ExportInfo",
    "ExportList",
    "PoolList",
    "Removed",
    "StorageHeartbeat",
    "MAX_VOLUME_BYTES",
    "POOL_NAME_RE",
    "ZONE_NAME_RE",
    "MAX_POOLS",
    "NODE_URL_RE",
    "SHARED_ID_RE",
]

MAX_VOLUME_BYTES = 64 << 40
POOL_NAME_RE = r"^[a-z0-9][a-z0-9_-]{0,62}$"
ZONE_NAME_RE = r"^[a-z0-9-]{1,32}$"
MAX_POOLS = 64
NODE_URL_RE = r"^https?://[A-Za-z0-9.:\[\]-]+(:\d+)?/?$"
SHARED_ID_RE = r"^[a-z][a-z0-9]{0,15}:[A-Za-z0-9._/-]{1,200}$"


# ready: usable; copying: a background copy runs; stalled: a partial copy with no job behind it
# (the agent restarted) that the next ensure restarts; error: the last copy failed (the next ensure
# retries, except for a point-in-time copy, whose instant is lost); absent: nothing there.
ItemState = Literal["ready", "copying", "stalled", "error", "absent"]


class ItemStatus(Wire):
    """Where a volume or snapshot stands on its storage node."""

    state: ItemState
    size_bytes: int = Field(0, ge=0)
    progress: int = Field(0, ge=0, le=100)
    error: str | None = Field(None, max_length=2000)


class PoolInfo(Wire):
    """One pool as its agent reports it. ``point_in_time``: the node itself can take a point-in-time
    snapshot of a volume that hosts are writing to (reflink, or an export daemon that copies)."""

    name: str = Field(pattern=POOL_NAME_RE)
    backend: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")
    capacity_bytes: int = Field(ge=0)
    free_bytes: int = Field(ge=0)
    clone_method: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")
    point_in_time: bool
    # Storage that several agents serve (a Ceph pool: ``ceph:<fsid>/<pool>``): every agent that
    # reports the same id reaches the same volumes, and the scheduler counts the pool once. None: the
    # pool is this agent's alone (files on its disks).
    shared_id: str | None = Field(None, pattern=SHARED_ID_RE)


class PoolList(Wire):
    pools: list[PoolInfo] = Field(max_length=MAX_POOLS)


class PoolInventory(Wire):
    """Ids of the volumes and snapshots a pool holds, ready or in progress."""

    volumes: list[str] = Field(default_factory=list)
    snapshots: list[str] = Field(default_factory=list)


class Inventory(Wire):
    pools: dict[str, PoolInventory]


class EnsureVolume(Wire):
    size_bytes: int = Field(ge=1, le=MAX_VOLUME_BYTES, strict=True)
    source_snapshot_id: SnapshotId | None = None


class ResizeVolume(Wire):
    size_bytes: int = Field(ge=1, le=MAX_VOLUME_BYTES, strict=True)


class EnsureSnapshot(Wire):
    volume_id: VolumeId


class ConnectionRequest(Wire):
    """Make ``host`` able to reach the volume (an export, an ACL entry, a key)."""

    host: HostIdentity
    read_only: bool = False


class ConnectionAnswer(Wire):
    connection: Connection


class SnapshotTargetRequest(Wire):
    """Make an empty snapshot file of the volume's size writable by ``host``, whose hypervisor will
    copy the volume into it at one instant (a point-in-time copy the storage node cannot take)."""

    volume_id: VolumeId
    host: HostIdentity


class ExportInfo(Wire):
    """One export a storage node's daemon really has now. ``key``: a volume id, or the id of a
    snapshot that a hypervisor is copying into."""

    key: str = Field(max_length=32)
    host: str = Field(pattern=HOST_NAME_RE.pattern)
    protocol: str = Field(max_length=16)
    target: str = Field(max_length=255)


class ExportList(Wire):
    exports: list[ExportInfo]


class Removed(Wire):
    """The answer of every idempotent removal: it is gone (or never was)."""

    state: Literal["absent"] = "absent"


class StorageHeartbeat(Wire):
    """What a storage agent reports every few seconds (and at start)."""

    name: str = Field(pattern=HOST_NAME_RE.pattern)
    url: str = Field(pattern=NODE_URL_RE)
    address: str = Field(pattern=ADDRESS_RE)
    started_at: datetime
    pools: list[PoolInfo] = Field(max_length=MAX_POOLS)
    exports: list[ExportInfo] = Field(default_factory=list, max_length=100_000)
    # None (and agents older than zones): the controller's own zone.
    availability_zone: str | None = Field(None, pattern=ZONE_NAME_RE)
