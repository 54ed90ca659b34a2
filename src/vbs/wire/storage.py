"""What the controller and a storage agent say to each other: requests, answers and the heartbeat."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    SecretStr,
    field_serializer,
    field_validator,
)

from vbs.wire.base import SnapshotId, VolumeId, Wire, left_out_while_empty
from vbs.wire.connection import (
    ADDRESS_RE,
    HOST_NAME_RE,
    MAX_MONITORS,
    MONITOR_RE,
    POOL_NAME_RE,
    Connection,
    HostIdentity,
    NbdConnection,
    ProtocolName,
)
from vbs.wire.qos import ExportLimits

__all__ = [
    "ItemState",
    "ItemStatus",
    "PoolInfo",
    "PoolInventory",
    "TrashedImage",
    "CloneChain",
    "FlattenProgress",
    "Inventory",
    "EnsureVolume",
    "ResizeVolume",
    "EnsureSnapshot",
    "StoreSnapshot",
    "StoredStatus",
    "TierMove",
    "RestoreVolume",
    "CheckStore",
    "StoreProblem",
    "StoreCheckReport",
    "MAX_CHECKED_SNAPSHOTS",
    "TENANT_RE",
    "ConnectionRequest",
    "ConnectionAnswer",
    "PullVolume",
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
    "MAX_USAGE_REPORTED",
    "NODE_URL_RE",
    "SHARED_ID_RE",
]

MAX_VOLUME_BYTES = 64 << 40
ZONE_NAME_RE = r"^[a-z0-9-]{1,32}$"
MAX_POOLS = 64
# Volumes whose used bytes one heartbeat reports (about 40 bytes each: well within a request body).
MAX_USAGE_REPORTED = 10_000
NODE_URL_RE = r"^https?://[A-Za-z0-9.:\[\]-]+(:\d+)?/?$"
SHARED_ID_RE = r"^[a-z][a-z0-9]{0,15}:[A-Za-z0-9._/-]{1,200}$"
TENANT_RE = r"^[a-z0-9][a-z0-9_-]{0,62}$"
# Where a pool's snapshots are stored, as its store describes itself (``dir:/srv/snaps``,
# ``s3://bucket/prefix/ at URL``): never a secret. Agents that report the same one share the store.
STORE_RE = r"^[^\x00-\x1f]{1,1024}$"
# Why a pool's storage is gone (its directory removed, its file system not mounted): one line.
LOST_RE = r"^[^\x00-\x1f]{1,500}$"
# The store key the controller hands over with each upload and restore: 32 bytes, in hex.
StoreKeyHex = Annotated[SecretStr, Field(min_length=64, max_length=64),
                        AfterValidator(lambda v: _hex_key(v))]


def _hex_key(v: SecretStr) -> SecretStr:
    if not re.fullmatch(r"[0-9a-f]{64}", v.get_secret_value()):
        raise ValueError("a store key is 64 lowercase hex digits")
    return v


# ready: usable; copying: a background copy runs; stalled: a partial copy with no job behind it
# (the agent restarted) that the next ensure restarts; error: the last copy failed (the next ensure
# retries, except for a point-in-time copy, whose instant is lost); absent: nothing there. A ready
# volume with a progress below 100 is usable while a background flatten (RBD) is that far.
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
    # It makes encrypted volumes (LUKS containers hosts open): the backend has ``ensure_encrypted_volume``.
    encryption: bool = False
    # The most snapshots one volume of this pool may have (RBD: 450 by default); None: no limit (files).
    max_snapshots_per_volume: int | None = Field(None, ge=1, le=100_000)
    # The Ceph monitors of an ``rbd`` pool's cluster: the only ones the controller lets a connection
    # of this node send a host to. Empty for pools that hand out no native connections.
    monitors: list[Annotated[str, Field(pattern=f"^(?:{MONITOR_RE.pattern})$")]] = Field(default_factory=list,
                                                                               max_length=MAX_MONITORS)
    # The snapshot store this pool's snapshots go to (its description: agents that report the same one
    # share it, and any of them restores the others' snapshots); None: they stay in the pool only.
    snapshot_store: str | None = Field(None, pattern=STORE_RE)
    # The separate archive store archived snapshots move to (docs/snapshot-tiers.md); None: they stay in
    # the snapshot store.
    archive_store: str | None = Field(None, pattern=STORE_RE)
    # Set when the pool's storage is gone (docs/operations.md "A lost pool"): it then reports no room,
    # and the controller marks its volumes lost.
    lost: str | None = Field(None, pattern=LOST_RE)

    _older_controllers = left_out_while_empty("monitors", "max_snapshots_per_volume", "shared_id", "snapshot_store",
                                              "lost", "archive_store")


class PoolList(Wire):
    pools: list[PoolInfo] = Field(max_length=MAX_POOLS)


MAX_POOL_DETAILS = 10_000
MAX_CHAIN_DEPTH = 64
_RBD_NAME = r"[A-Za-z0-9._-]{1,128}"


class TrashedImage(Wire):
    """The image of a deleted volume that a pool keeps (RBD: in Ceph's trash) and why:
    ``snapshots``, VBS snapshots of it are live; ``children``, only deleted snapshots that clones
    still read from; ``nothing``, the next purge removes it."""

    id: str = Field(pattern=r"^[0-9a-f]{1,64}$")
    name: str = Field(pattern=f"^{_RBD_NAME}$")
    snapshots: int = Field(ge=0)
    children: int = Field(ge=0)
    kept_for: Literal["snapshots", "children", "nothing"]


class CloneChain(Wire):
    """A volume cloned from a snapshot of a clone: its parents nearest first (``image@snapshot``;
    a deleted snapshot that a clone still reads has a UUID for a name) and the chain's depth."""

    volume_id: VolumeId
    depth: int = Field(ge=1, le=MAX_CHAIN_DEPTH)
    parents: list[str] = Field(max_length=MAX_CHAIN_DEPTH)

    @field_validator("parents")
    @classmethod
    def _links(cls, v: list[str]) -> list[str]:
        for link in v:
            if not re.fullmatch(f"{_RBD_NAME}@{_RBD_NAME}", link):
                raise ValueError("a parent is IMAGE@SNAPSHOT")
        return v


class FlattenProgress(Wire):
    """A background flatten (copying what a clone reads from its parents into it): queued or running."""

    volume_id: VolumeId
    state: Literal["queued", "running"]
    progress: int = Field(ge=0, le=100)


class PoolInventory(Wire):
    """Ids of the volumes and snapshots a pool holds, ready or in progress; for RBD also its trash,
    its clone chains deeper than one and its flattens."""

    volumes: list[str] = Field(default_factory=list)
    snapshots: list[str] = Field(default_factory=list)
    trash: list[TrashedImage] = Field(default_factory=list, max_length=MAX_POOL_DETAILS)
    chains: list[CloneChain] = Field(default_factory=list, max_length=MAX_POOL_DETAILS)
    flattens: list[FlattenProgress] = Field(default_factory=list, max_length=MAX_POOL_DETAILS)
    # The pool's storage is gone (PoolInfo.lost): it lists nothing, and says why.
    lost: str | None = Field(None, pattern=LOST_RE)

    _older_controllers = left_out_while_empty("lost")


class Inventory(Wire):
    pools: dict[str, PoolInventory]


class EnsureVolume(Wire):
    size_bytes: int = Field(ge=1, le=MAX_VOLUME_BYTES, strict=True)
    source_snapshot_id: SnapshotId | None = None
    # The volume is a LUKS container (its size is the payload's; the header is on top). Said by the
    # controller, never guessed from the data: a guest may write a LUKS header of its own.
    encrypted: bool = False
    # The LUKS passphrase to format it with, or to re-encrypt the snapshot under (which is plain, or a
    # container under ``source_luks_passphrase``); absent for a clone of an encrypted snapshot.
    luks_passphrase: SecretStr | None = Field(None, min_length=16, max_length=256)
    source_luks_passphrase: SecretStr | None = Field(None, min_length=16, max_length=256)

    @field_serializer("luks_passphrase", "source_luks_passphrase", when_used="json")
    def _reveal(self, v: SecretStr | None) -> str | None:
        return v.get_secret_value() if v is not None else None


class ResizeVolume(Wire):
    size_bytes: int = Field(ge=1, le=MAX_VOLUME_BYTES, strict=True)
    encrypted: bool = False  # a LUKS container: its payload grows to the size


class EnsureSnapshot(Wire):
    volume_id: VolumeId


class StoreSnapshot(Wire):
    """Put the pool's snapshot (of ``volume_id``, owned by ``tenant``) into the snapshot store, incremental
    against ``parent_snapshot_id``'s manifest if the store has it. ``store_key``: the controller's, from
    which the agent derives the tenant's key (never kept, logged or put in a file)."""

    volume_id: VolumeId
    tenant: str = Field(pattern=TENANT_RE)
    parent_snapshot_id: SnapshotId | None = None
    store_key: StoreKeyHex

    @field_serializer("store_key", when_used="json")
    def _reveal(self, v: SecretStr) -> str:
        return v.get_secret_value()


class TierMove(Wire):
    """Move ``tenant``'s snapshot between the snapshot store and the archive store (docs/snapshot-tiers.md);
    a ``permanent`` restore then drops the archive's copy. ``store_key``: as with an upload."""

    tenant: str = Field(pattern=TENANT_RE)
    store_key: StoreKeyHex
    permanent: bool = False

    @field_serializer("store_key", when_used="json")
    def _reveal(self, v: SecretStr) -> str:
        return v.get_secret_value()


class StoredStatus(ItemStatus):
    """Where a snapshot's upload into the store stands: ``copying`` with progress, ``ready`` with what the
    manifest holds, ``error`` with the reason, ``absent``. ``size_bytes``: the image's (the manifest's
    volume size); ``stored_bytes``: the bytes of its chunks that are not zeros (what a restore writes);
    ``uploaded_bytes``: what this upload sent (compressed; 0 when the store had everything).
    ``pool_copy``: the pool still holds its own copy (the fast tier of a reflink pool), or not (a copy
    pool gives its full copy up once the snapshot is stored)."""

    store: str | None = Field(None, pattern=STORE_RE)
    chunks: int = Field(0, ge=0)
    chunks_uploaded: int = Field(0, ge=0)
    stored_bytes: int = Field(0, ge=0)
    uploaded_bytes: int = Field(0, ge=0)
    pool_copy: bool = True


class RestoreVolume(Wire):
    """Make the volume from ``snapshot_id``'s manifest in the snapshot store (``tenant``'s), every chunk
    checked: as it was stored (a plain image, or an encrypted one's LUKS container as it is), grown to
    ``size_bytes`` (a container's payload with ``encrypted``); with ``luks_passphrase``, re-encrypted
    under it (the snapshot's container opened with ``source_luks_passphrase``, or plain)."""

    snapshot_id: SnapshotId
    size_bytes: int = Field(ge=1, le=MAX_VOLUME_BYTES, strict=True)
    tenant: str = Field(pattern=TENANT_RE)
    store_key: StoreKeyHex
    encrypted: bool = False
    luks_passphrase: SecretStr | None = Field(None, min_length=16, max_length=256)
    source_luks_passphrase: SecretStr | None = Field(None, min_length=16, max_length=256)

    @field_serializer("store_key", "luks_passphrase", "source_luks_passphrase", when_used="json")
    def _reveal(self, v: SecretStr | None) -> str | None:
        return v.get_secret_value() if v is not None else None


# Snapshots one check of a store may name (a manifest id is 21 bytes: about 600 KB of request).
MAX_CHECKED_SNAPSHOTS = 25_000


class CheckStore(Wire):
    """Check ``snapshot_ids`` in the agent's snapshot store: every manifest readable and every chunk it
    lists present; ``deep``: every chunk fetched and hashed again under its tenant's key, derived from
    ``store_key`` (needed then only, never kept)."""

    snapshot_ids: list[SnapshotId] = Field(max_length=MAX_CHECKED_SNAPSHOTS)
    deep: bool = False
    store_key: StoreKeyHex | None = None
    # In the agent's archive store instead (docs/snapshot-tiers.md).
    archive: bool = False

    @field_serializer("store_key", when_used="json")
    def _reveal(self, v: SecretStr | None) -> str | None:
        return v.get_secret_value() if v is not None else None

    _older_agents = left_out_while_empty("archive")


class StoreProblem(Wire):
    """One thing wrong in the store: a snapshot's manifest that cannot be read (``manifest``), stored under
    another key than its tenant's (``key``), or one of its chunks ``missing`` or ``corrupt``."""

    snapshot_id: SnapshotId
    kind: Literal["manifest", "key", "missing", "corrupt"]
    detail: str = Field(max_length=1024)
    chunk_id: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    chunk_index: int | None = Field(None, ge=0)


class StoreCheckReport(Wire):
    """What a check of the store found (``problems`` in snapshot and chunk order)."""

    store: str = Field(pattern=STORE_RE)
    snapshots: int = Field(ge=0)
    chunks_checked: int = Field(ge=0)
    bytes_checked: int = Field(ge=0)
    problems: list[StoreProblem] = Field(max_length=1_000_000)


class ConnectionRequest(Wire):
    """Make ``host`` able to reach the volume (an export, an ACL entry, a key)."""

    host: HostIdentity
    read_only: bool = False
    # What the host's hypervisor opens itself (its heartbeat's capabilities): a backend whose volumes
    # it can open natively (``rbd``) answers such a connection instead of an export. Absent (older
    # controllers): none.
    protocols: list[ProtocolName] = Field(default_factory=list, max_length=8)
    # The volume's limits, for a node whose export daemon enforces them (NBD); absent: unlimited.
    limits: ExportLimits | None = None

    _older_agents = left_out_while_empty("protocols", "limits")


class PullVolume(Wire):
    """Make the volume (``size_bytes``) a copy of what ``source`` serves: another storage node's
    export of it to this node (the volume moves here)."""

    size_bytes: int = Field(ge=1, le=MAX_VOLUME_BYTES, strict=True)
    source: NbdConnection


class ConnectionAnswer(Wire):
    connection: Connection
    # The storage node enforces ``limits`` on this connection (its export daemon throttles it); False:
    # the hypervisor must (an iSCSI target, a native RBD connection, an older agent).
    limits_enforced: bool = False

    _older_controllers = left_out_while_empty("limits_enforced")


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
    # The bytes each volume holds in its pool (a sparse file's allocated blocks), from backends that can
    # tell cheaply: the console's size against used. Up to MAX_USAGE_REPORTED volumes.
    volume_usage: dict[VolumeId, Annotated[int, Field(ge=0)]] = Field(default_factory=dict,
                                                                      max_length=MAX_USAGE_REPORTED)

    _older_controllers = left_out_while_empty("volume_usage")
