"""The backend contract: what the storage agent asks of any place that holds volume data.

Every call is an idempotent executor step of a controller workflow: the controller may repeat any
of them after a crash, so ``ensure_*`` answers the current state instead of failing on a repeat and
``remove_*`` succeeds when the thing is already gone.

How hosts reach a volume is the backend's answer too (``connection_for``): a backend of files asks
its export driver for an export, one whose hypervisors open its volumes natively (Ceph RBD)
answers with its own connection and needs no export at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import SecretStr

from vbs.config import StorageAgentConfig
from vbs.errors import InvalidParameter
from vbs.pools.exports import ExportDriver
from vbs.snapshot_store.volume_io import VolumeWriter
from vbs.wire.connection import Connection, HostIdentity, NbdConnection
from vbs.wire.storage import ExportInfo, ItemStatus, PoolInfo, PoolInventory

__all__ = ["Backend", "EncryptingBackend", "ReportsUsage", "PullingBackend", "SnapshotImages", "ImageLayout",
           "SnapshotImageLayouts", "Fill", "check_size", "SnapshotStreams", "SnapshotReader", "StreamFill",
           "SnapshotChanges"]

_SECTOR = 512


def check_size(size_bytes: object) -> None:
    """A size the contract takes: a positive whole number of 512-byte sectors (``InvalidParameter`` else)."""
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0 or size_bytes % _SECTOR:
        raise InvalidParameter(f"Invalid size: {size_bytes!r} (expecting a positive multiple of 512 bytes)")


@runtime_checkable
class Backend(Protocol):
    """One storage pool. Ids are validated by the backend; sizes are bytes."""

    name: str

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, exports: ExportDriver) -> Backend:
        """The pool this agent's config describes, serving hosts through ``exports``."""
        ...

    def pool_info(self) -> PoolInfo: ...

    def inventory(self) -> PoolInventory:
        """Ids of the volumes and snapshots that are ready or in progress."""
        ...

    # -- volumes ------------------------------------------------------------------------------------

    def ensure_volume(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None = None) -> ItemStatus:
        """Create the volume (empty, or a clone of a snapshot of this pool), or answer how far it got."""
        ...

    def volume_status(self, volume_id: str) -> ItemStatus: ...

    def remove_volume(self, volume_id: str) -> None: ...

    def resize_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        """Grow only; a smaller size raises ``InvalidParameter``."""
        ...

    # -- snapshots ----------------------------------------------------------------------------------

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        """A point-in-time copy of the volume, also while hosts write to it. Raises
        ``PointInTimeUnavailable`` when this node cannot give one now (a writer it does not control
        has the volume open): the controller then asks that writer (``snapshot_target``)."""
        ...

    def snapshot_status(self, snapshot_id: str) -> ItemStatus: ...

    def remove_snapshot(self, snapshot_id: str) -> None:
        """Also cancels a copy in progress and removes a snapshot target and its exports."""
        ...

    def snapshot_target(self, snapshot_id: str, volume_id: str, host: HostIdentity) -> Connection:
        """An empty snapshot of the volume's size that ``host`` may write, for a hypervisor that
        copies the volume into it at one instant. Idempotent."""
        ...

    def finish_snapshot_target(self, snapshot_id: str, host_name: str) -> ItemStatus:
        """The hypervisor's copy is complete: withdraw the host's access and make the snapshot
        ready. Idempotent (a ready snapshot stays ready)."""
        ...

    # -- how hosts reach volumes ----------------------------------------------------------------------

    def connection_for(self, volume_id: str, host: HostIdentity, *, read_only: bool = False,
                       protocols: Collection[str] = ()) -> Connection:
        """Let ``host`` reach the volume and say how. ``protocols``: what the host's hypervisor opens
        itself; a backend whose volumes it can open natively answers that connection, others ignore
        it. Raises ``RetryLater`` while it cannot be given safely yet (a copy of the volume that a
        new writer would spoil is running)."""
        ...

    def remove_connection(self, volume_id: str, host_name: str) -> None:
        """Withdraw ``host_name``'s access; a client still connected is cut off."""
        ...

    def refresh_connection(self, volume_id: str, host_name: str) -> Connection:
        """After the volume grew: a connection that shows its new size; the old one serves on
        until ``retire_connections``."""
        ...

    def retire_connections(self, volume_id: str, host_name: str) -> None: ...

    def native_connections(self) -> list[ExportInfo]:
        """Hosts that reach this pool's volumes without an export (a native connection's grant),
        listed with the exports for the reconciler; ``remove_connection`` withdraws one."""
        ...

    def close(self) -> None:
        """Stop background copies; their partial files stay and read as ``stalled`` later."""
        ...


@runtime_checkable
class EncryptingBackend(Protocol):
    """A backend that makes encrypted volumes (``PoolInfo.encryption``): LUKS containers that hosts open."""

    def ensure_encrypted_volume(self, volume_id: str, size_bytes: int, passphrase: SecretStr | None,
                                source_snapshot_id: str | None = None,
                                source_passphrase: SecretStr | None = None) -> ItemStatus:
        """Create the volume as a LUKS container whose payload is ``size_bytes``: empty under ``passphrase``,
        the snapshot's data re-encrypted under it (the snapshot plain, or a container under
        ``source_passphrase``), or (no ``passphrase``) a clone of an encrypted snapshot; or answer how far
        it got."""
        ...

    def resize_encrypted_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        """Grow a container's payload to ``size_bytes``."""
        ...


@runtime_checkable
class ReportsUsage(Protocol):
    """A backend that can tell cheaply, at every heartbeat, the bytes each of its volumes holds (a file
    pool: allocated blocks). Optional: a backend without it (RBD: ``rbd du`` reads every object map)
    leaves its volumes' usage unknown."""

    def volume_usage(self) -> dict[str, int]: ...


@runtime_checkable
class PullingBackend(Protocol):
    """A backend whose volumes are its node's own (files): one moves here by being pulled from the
    export of the node it leaves."""

    def pull_volume(self, volume_id: str, size_bytes: int, source: NbdConnection) -> ItemStatus:
        """Copy what ``source`` serves into the volume (made here of ``size_bytes``): ``copying`` with
        progress, then ``ready``; a failed copy answers ``error`` once (the next call starts over), a
        stalled one (the agent restarted) starts over."""
        ...


# Writes a volume's data into the file it is given (its partial), honouring the cancel event between
# chunks and reporting (done, total) bytes.
Fill = Callable[[Path, threading.Event, Callable[[int, int], None]], None]


@runtime_checkable
class SnapshotImages(Protocol):
    """A backend whose snapshots are files this agent reads, which is what the snapshot store takes
    (docs/snapshots.md): the storage agent uploads a ready snapshot's image, and fills a volume from
    the store. Optional: a backend with neither this nor ``SnapshotStreams`` keeps its snapshots in the pool
    only."""

    def snapshot_image(self, snapshot_id: str) -> Path:
        """The file of a ready snapshot: a point-in-time image nobody writes to (``NotFound`` if the
        pool has none, ``IncorrectState`` while it is being made)."""
        ...

    def keeps_snapshot_images(self) -> bool:
        """Whether a stored snapshot stays in the pool too: its fast tier, when clones of it are instant
        (reflink). A pool that copies gives its full copy up once the snapshot is stored."""
        ...

    def fill_volume(self, volume_id: str, size_bytes: int, fill: Fill, *, what: str) -> ItemStatus:
        """Make the volume by running ``fill`` on its partial file in a job (``what`` names it in an
        error): ``copying`` with progress, then ``ready``; a failed job answers ``error`` once (the next
        call starts over), a stalled one (the agent restarted) starts over."""
        ...


@runtime_checkable
class SnapshotChanges(Protocol):
    """A ``SnapshotImages`` backend that can tell, without reading them, which bytes of a snapshot's image
    may differ from an earlier snapshot's (a reflink pool: the extents the two files do not share; a copy
    pool whose export driver tracks writes: the blocks written between the two snapshots' views;
    docs/snapshots.md "Incremental uploads"). Optional: without it every chunk is read and hashed."""

    def changed_since(self, snapshot_id: str, since: str) -> list[tuple[int, int]] | None:
        """The byte extents ``(offset, length)`` of ``snapshot_id``'s image that may differ from ``since``'s
        (more than changed, never less; all beyond ``since``'s end), or None: the pool cannot tell (``since``
        is no longer in the pool, or its file system keeps no shared extents)."""
        ...


@runtime_checkable
class SnapshotReader(Protocol):
    """A ready snapshot's bytes as a backend without files gives them (``read_at``, of ``size`` bytes), and
    the byte extents ``(offset, length)`` written since the earlier snapshot it was asked about (``changed``;
    None: it cannot tell, and every chunk is read). ``close`` ends it."""

    size: int
    changed: list[tuple[int, int]] | None

    def read_at(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


# Writes a volume's data through the writer it is given (onto a new volume that reads as zeros), honouring
# the cancel event between chunks and reporting (done, total) bytes.
StreamFill = Callable[[VolumeWriter, threading.Event, Callable[[int, int], None]], None]


@runtime_checkable
class SnapshotStreams(Protocol):
    """A backend whose snapshots and volumes are not files (RBD images), read and written by the snapshot store
    through the backend's own readers and writers (docs/snapshots.md "RBD pools")."""

    def keeps_snapshot_images(self) -> bool:
        """Whether a stored snapshot stays in the pool too (its fast tier)."""
        ...

    def open_snapshot(self, snapshot_id: str, since: str | None = None) -> SnapshotReader:
        """A reader of a ready snapshot; with ``since`` (the volume's previous stored snapshot), the extents
        changed since it when the pool still holds it and can tell."""
        ...

    def fill_volume_with(self, volume_id: str, size_bytes: int, fill: StreamFill, *, what: str) -> ItemStatus:
        """Make the volume by running ``fill`` on a writer of it in a job: ``copying`` with progress, then
        ``ready``; a failed job answers ``error`` once and leaves nothing (the next call starts over)."""
        ...


@dataclass(frozen=True)
class ImageLayout:
    """How to read a snapshot image that is not a plain file (a point-in-time view, docs/snapshots.md):
    ``data``, the byte ranges that may hold data (the rest reads as zeros: its own holes are not to be
    trusted), and ``unit``, the size of the aligned reads it answers exactly (a larger read may not be)."""

    data: tuple[tuple[int, int], ...]
    unit: int


@runtime_checkable
class SnapshotImageLayouts(Protocol):
    """A ``SnapshotImages`` backend some of whose images must be read as their layout says. Optional."""

    def snapshot_image_layout(self, snapshot_id: str) -> ImageLayout | None:
        """The layout of the snapshot's image, or None: a plain file (its holes are holes)."""
        ...
