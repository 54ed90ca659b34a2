"""The export driver contract, shared by every export protocol (nbd, iscsi).

A driver serves volume files to hypervisor nodes; each export is made for one (volume, host) pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from vbs.connection import Connection, HostIdentity

__all__ = ["ExportInfo", "ExportDriver"]


@dataclass(frozen=True)
class ExportInfo:
    """One export the daemon really has now."""

    volume_id: str
    host: str
    protocol: str
    target: str  # NBD export name or iSCSI IQN


@runtime_checkable
class ExportDriver(Protocol):
    protocol: str

    def start(self) -> None:
        """Start or adopt the daemon; idempotent."""
        ...

    def stop(self) -> None:
        """Stop the daemon cleanly (by PID / QMP quit), removing its exports."""
        ...

    def ensure_export(
        self, volume_id: str, path: Path, host: HostIdentity, *, read_only: bool = False
    ) -> Connection:
        """Export ``path`` to ``host``; idempotent.

        The same (volume_id, host.name) gives the same connection info (same secrets) while the
        agent runs.
        """
        ...

    def remove_export(self, volume_id: str, host_name: str) -> None:
        """Remove the export of ``volume_id`` to ``host_name``; idempotent (absent is success)."""
        ...

    def list_exports(self) -> list[ExportInfo]:
        """What the daemon really has now: one entry per (volume, host) export."""
        ...

    def refresh_export(self, volume_id: str, path: Path, host_name: str) -> Connection:
        """After the volume file grew: a new export of ``path`` to ``host_name`` that reports the
        file's current size (NBD and iSCSI sizes are fixed when an export is made), while the
        export the host uses now keeps serving. Idempotent: if the current export already has the
        file's size it is returned. Persisted like every export (a restart keeps both); raises
        ``NotFound`` if ``volume_id`` is not exported to ``host_name``. ``ensure_export`` returns
        the new connection from then on.
        """
        ...

    def retire_exports(self, volume_id: str, host_name: str) -> None:
        """Remove the exports of ``volume_id`` to ``host_name`` that a refresh replaced, once the
        host moved to the new one (a client still on them is cut off). Idempotent."""
        ...

    def check(self) -> None:
        """Health check: if the daemon died, restart it and re-create every export that should exist."""
        ...
