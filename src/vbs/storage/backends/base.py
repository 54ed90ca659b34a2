"""The backend contract: what the storage agent asks of any place that holds volume data.

Every call is an idempotent executor step of a controller workflow (DESIGN §5): the controller may
repeat any of them after a crash, so "ensure" returns the current state instead of failing on a repeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

__all__ = ["Backend", "ItemStatus", "PoolInfo", "CloneMethod", "ItemState"]

CloneMethod = Literal["reflink", "copy"]

# ready: usable; copying: a background copy runs; stalled: a partial copy with no job behind it
# (the agent restarted), the next ensure restarts it; error: the last copy failed, the next ensure
# retries; absent: nothing there.
ItemState = Literal["ready", "copying", "stalled", "error", "absent"]


@dataclass(frozen=True)
class PoolInfo:
    name: str
    path: str
    capacity_bytes: int
    free_bytes: int
    clone_method: CloneMethod


@dataclass(frozen=True)
class ItemStatus:
    state: ItemState
    size_bytes: int = 0
    progress: int = 0  # percent, 0..100
    error: str | None = None


class Backend(Protocol):
    """One storage pool. Ids are validated by the backend; sizes are bytes."""

    name: str

    def pool_info(self) -> PoolInfo: ...

    def ensure_volume(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None = None) -> ItemStatus: ...

    def volume_status(self, volume_id: str) -> ItemStatus: ...

    def remove_volume(self, volume_id: str) -> None: ...

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus: ...

    def snapshot_status(self, snapshot_id: str) -> ItemStatus: ...

    def remove_snapshot(self, snapshot_id: str) -> None: ...

    def resize_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        """Grow only; a smaller size raises ``InvalidParameter``."""
        ...

    def volume_path(self, volume_id: str) -> Path:
        """Where the raw data of a ready volume is, for export drivers; ``NotFound`` otherwise."""
        ...

    def inventory(self) -> dict[str, list[str]]:
        """``{"volumes": [...], "snapshots": [...]}``: ids that are ready or in progress."""
        ...

    def close(self) -> None:
        """Stop background copies; their partial files stay and read as ``stalled`` later."""
        ...
