"""The export driver contract: how a storage node serves its data to hypervisor nodes (NBD, iSCSI).

An export driver serves *sources* (a volume file, or an RBD image the daemon opens through librbd)
under *keys*: a volume id, or the id of a snapshot that a hypervisor copies into. Each export is
made for one (key, host) pair. Backends own their data and ask their export driver for exports
(``Backend.connection_for``); the driver knows nothing of pools.

Drivers whose daemon sits in the data path can also take point-in-time copies of what they serve
(``PointInTimeCopier``): every write of every host reaches the volume through that daemon, so a
copy-before-write job there sees the volume at one instant, also while hosts write to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from vbs.config import CEPH_USER_RE, RBD_POOL_RE, StorageAgentConfig
from vbs.errors import InvalidParameter
from vbs.wire.connection import Connection, HostIdentity
from vbs.wire.qos import ExportLimits
from vbs.wire.storage import ExportInfo, ItemStatus

__all__ = ["FileSource", "RbdSource", "ExportSource", "ExportDriver", "PointInTimeCopier", "PointInTimeViewer",
           "LimitEnforcer", "ViewChanges"]


@dataclass(frozen=True)
class FileSource:
    """A file on this node: raw (the ``file`` backend's volumes and snapshot targets), or a qcow2
    image (the ``command`` backend's ``qemu-img`` profile), which only a daemon that opens image
    formats serves (NBD; not tgt). ``size_bytes``: a qcow2 image's virtual size as its backend just
    read it (its file's size says nothing of it); a raw file's is its own size."""

    path: Path
    format: str = "raw"
    size_bytes: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.format not in ("raw", "qcow2"):
            raise InvalidParameter(f"invalid image format {str(self.format)[:16]!r} (raw or qcow2)")
        if self.format != "raw" and self.size_bytes is None:
            raise InvalidParameter(f"a {self.format} source must say its virtual size")


# An RBD image name as VBS makes them (vol-…, vbs-retired-vol-…): no "@" or "/" (a snapshot or a
# namespace would follow), nothing QEMU's or Ceph's option parsers split on.
RBD_IMAGE_RE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,126}"


@dataclass(frozen=True)
class RbdSource:
    """An RBD image that the export daemon opens itself (librbd), as the cephx ``user``.

    ``conf`` is the cluster's ``ceph.conf``; the user's key reaches the daemon only through the
    keyring file that conf names (never on an argv, in a log or in a state file). ``size_bytes``
    is the image's size as the backend just read it: NBD and iSCSI fix an export's size when it is
    made, so the driver compares it with what it serves to know when a grown image needs a new
    opening (it is not part of the source's identity).
    """

    pool: str
    image: str
    conf: Path
    user: str = "admin"
    size_bytes: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.pool, str) or not re.fullmatch(RBD_POOL_RE, self.pool):
            raise InvalidParameter(f"invalid RBD pool {str(self.pool)[:64]!r}")
        if not isinstance(self.image, str) or not re.fullmatch(RBD_IMAGE_RE, self.image):
            raise InvalidParameter(f"invalid RBD image name {str(self.image)[:130]!r}")
        if not isinstance(self.user, str) or not re.fullmatch(CEPH_USER_RE, self.user):
            raise InvalidParameter(f"invalid Ceph user {str(self.user)[:64]!r}")
        conf = Path(self.conf)
        if not conf.is_absolute() or "\0" in str(conf):
            raise InvalidParameter(f"the Ceph configuration path must be absolute: {str(conf)[:200]}")
        object.__setattr__(self, "conf", conf)
        size = self.size_bytes
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise InvalidParameter(f"invalid RBD image size {size!r}")


ExportSource = FileSource | RbdSource


@runtime_checkable
class ExportDriver(Protocol):
    """One export daemon of a storage node. Every call is idempotent: absent is success for
    removals, and the same (key, host) gets the same connection (same names and secrets) for as
    long as the agent's state directory lives."""

    protocol: str

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, state_dir: Path) -> ExportDriver:
        """The driver for this agent, keeping its desired state and daemon files in ``state_dir``."""
        ...

    def start(self) -> None:
        """Start the daemon or adopt the one an earlier agent left; re-create what should exist."""
        ...

    def stop(self) -> None:
        """Stop the daemon (by PID); the desired exports are kept and ``start`` brings them back."""
        ...

    def close(self) -> None:
        """Let go of the daemon without stopping it: exports keep serving, the next agent adopts it."""
        ...

    def check(self) -> None:
        """If the daemon died or hangs, restart it and re-create every export that should exist."""
        ...

    def ensure_export(self, key: str, source: ExportSource, host: HostIdentity, *, read_only: bool = False
                      ) -> Connection:
        """Serve ``source`` under ``key`` to ``host`` only."""
        ...

    def remove_export(self, key: str, host_name: str) -> None:
        """Withdraw ``host_name``'s export of ``key``; a client still connected is cut off."""
        ...

    def refresh_export(self, key: str, source: ExportSource, host_name: str) -> Connection:
        """After the source grew: a connection that reports its new size (NBD and iSCSI fix the
        size when an export is made), while the one the host uses keeps serving. ``NotFound`` if
        ``key`` is not exported to ``host_name``; from then on ``ensure_export`` answers the new one."""
        ...

    def retire_exports(self, key: str, host_name: str) -> None:
        """Remove what a refresh replaced, once the host moved to the new connection."""
        ...

    def is_exported(self, key: str) -> bool:
        """Whether any host has an export of ``key`` (desired or live)."""
        ...

    def list_exports(self) -> list[ExportInfo]:
        """What the daemon really has now: one entry per (key, host)."""
        ...


@runtime_checkable
class PointInTimeCopier(Protocol):
    """An export driver that can copy a source it serves (or could serve) at one instant."""

    def ensure_copy(self, copy_id: str, key: str, source: ExportSource, target: Path) -> ItemStatus:
        """Copy ``source`` as it is when the copy starts into the new file ``target``, while hosts
        keep writing to it. Idempotent: a running copy answers its progress, a finished one
        ``ready``; one whose daemon restarted midway is ``error`` (its instant is lost)."""
        ...

    def remove_copy(self, copy_id: str) -> None:
        """Cancel and forget the copy (``target`` is the caller's to remove)."""
        ...


@runtime_checkable
class LimitEnforcer(Protocol):
    """An export driver whose daemon sits in the data path and throttles what it serves: every export
    of a key shares one limit (QEMU throttle group), whatever host or how many hosts read it."""

    def set_limits(self, key: str, limits: ExportLimits) -> bool:
        """The limits of every export of ``key``, now and those made later, also after a daemon
        restart; changed live under connected clients. Whether they are enforced (False: ``key`` is
        served by exports made before the driver could throttle them)."""
        ...


@runtime_checkable
class PointInTimeViewer(Protocol):
    """An export driver that can show a source it serves as it is at one instant without copying it
    (docs/snapshots.md): writes that hosts make meanwhile first put the old data into a sparse scratch
    file, so the view needs room only for what they overwrite. What the snapshot store's upload reads."""

    def ensure_view(self, view_id: str, key: str, source: ExportSource, scratch: Path) -> ItemStatus:
        """Hold a view of ``source`` as it is now, its scratch the new file ``scratch`` (which the
        driver makes and removes). ``ready`` at once; idempotent; ``error`` once its daemon restarted
        (its instant is lost)."""
        ...

    def view_path(self, view_id: str) -> Path:
        """A file that reads as the view's source at its instant (``NotFound``: no such view)."""
        ...

    def remove_view(self, view_id: str) -> None:
        """End the view (hosts no longer pay for it) and remove its scratch file; idempotent."""
        ...


@runtime_checkable
class ViewChanges(Protocol):
    """A ``PointInTimeViewer`` that tracks, while it serves a source, which blocks hosts write (the NBD
    driver: QEMU dirty bitmaps, one started with each view): what may differ between two views' instants,
    without reading either. Optional: without it an upload reads and hashes every chunk."""

    def view_changes(self, view_id: str, since: str) -> list[tuple[int, int]] | None:
        """The byte extents ``(offset, length)`` of view ``view_id`` that may differ from what the source
        held at the instant of the earlier view ``since`` (more than changed, never less), or None: the
        driver cannot tell (it did not see every write since then)."""
        ...
