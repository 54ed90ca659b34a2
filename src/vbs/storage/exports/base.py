"""The export driver contract: how a storage node serves its data to hypervisor nodes (NBD, iSCSI).

An export driver serves *sources* (a volume file today; an RBD image later) under *keys*: a volume
id, or the id of a snapshot that a hypervisor copies into. Each export is made for one (key, host)
pair. Backends own their data and ask their export driver for exports (``Backend.connection_for``);
the driver knows nothing of pools.

Drivers whose daemon sits in the data path can also take point-in-time copies of what they serve
(``PointInTimeCopier``): every write of every host reaches the volume through that daemon, so a
copy-before-write job there sees the volume at one instant, also while hosts write to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from vbs.config import StorageAgentConfig
from vbs.wire.connection import Connection, HostIdentity
from vbs.wire.storage import ExportInfo, ItemStatus

__all__ = ["FileSource", "ExportSource", "ExportDriver", "PointInTimeCopier"]


@dataclass(frozen=True)
class FileSource:
    """A raw file on this node (the ``file`` backend's volumes and snapshot targets)."""

    path: Path


ExportSource = FileSource


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
