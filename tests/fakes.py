"""Fakes the unit tests share, each standing in for one collaborator of the code under test.

* ``RecordingEngine``: a workflow engine for tests of the API functions alone: it records each
  operation it is asked to begin and runs none (placement, quotas and parameters are what those tests
  look at).
* ``MemoryExports``: an export driver that only remembers what it was asked (no daemon);
  ``CopyingExports``: one that also copies at one instant, as the NBD daemon does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vbs import ids
from vbs.pools.exports import ExportSource
from vbs.wire.connection import Connection, HostIdentity, NbdConnection
from vbs.wire.storage import ExportInfo, ItemStatus


class RecordingEngine:
    """``begun``: (kind, resource id, params) of every operation, in order."""

    def __init__(self) -> None:
        self.begun: list[tuple[str, str, Any]] = []

    def stamp(self, session: Any) -> None:  # the real engine reads the database's time and a fence here
        return None

    def begin(self, session: Any, workflow: Any, resource_id: str, params: Any, *, new_resource: bool = False,
              stamp: Any = None) -> str:
        self.begun.append((workflow.kind, resource_id, params))
        return ids.new_id("operation")

    def submit(self, op_id: str, *, resuming: bool = False) -> None:
        pass


class MemoryExports:
    """An export driver that only remembers what it was asked (no daemon)."""

    protocol = "nbd"

    def __init__(self) -> None:
        self.exports: dict[tuple[str, str], Path] = {}

    def ensure_export(self, key: str, source: ExportSource, host: HostIdentity, *, read_only: bool = False
                      ) -> Connection:
        self.exports[(key, host.name)] = source.path
        return NbdConnection(host="127.0.0.1", port=10809, export=f"{key}-x")

    def remove_export(self, key: str, host_name: str) -> None:
        self.exports.pop((key, host_name), None)

    def is_exported(self, key: str) -> bool:
        return any(k == key for k, _ in self.exports)

    def list_exports(self) -> list[ExportInfo]:
        return [ExportInfo(key=k, host=h, protocol="nbd", target=f"{k}-x") for k, h in self.exports]


class CopyingExports(MemoryExports):
    """An export driver that copies at one instant, as the NBD daemon does (here: a plain read)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: dict[str, int] = {}
        self.fail_next = False

    def ensure_copy(self, copy_id: str, key: str, source: ExportSource, target: Path) -> ItemStatus:
        if copy_id not in self.copies:
            if not target.exists():
                return ItemStatus(state="error", error="no target")
            if self.fail_next:
                return ItemStatus(state="error", error="the copy was interrupted")
            data = source.path.read_bytes()
            written = data.rstrip(b"\0")
            with open(target, "r+b") as f:
                f.write(written)
                # As QEMU's backup job does: the zero tail becomes allocated (unwritten) space.
                os.posix_fallocate(f.fileno(), len(written), len(data) - len(written))
            assert os.stat(target).st_blocks * 512 >= len(data)
            self.copies[copy_id] = 1
            return ItemStatus(state="copying", progress=50)
        return ItemStatus(state="ready", progress=100)

    def remove_copy(self, copy_id: str) -> None:
        self.copies.pop(copy_id, None)
