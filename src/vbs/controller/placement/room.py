"""Whether a pool's storage is full now, as its agent last reported it (docs/operations.md "A full pool").

Placement promises GiB (capacity x overcommit), but a thin pool fills with what guests write, not with
what was promised. A pool whose free bytes fell below a small reserve takes no new volume or snapshot:
they are refused with ``InsufficientVolumeCapacity`` before any row or file is made, whatever it still
has to promise. The reserve is 1 % of the pool, at most 1 GiB: what is left for the writes of its
volumes' guests while an operator frees space.
"""

from __future__ import annotations

from vbs.errors import InsufficientCapacity
from vbs.wire.storage import PoolInfo

__all__ = ["FULL_RESERVE_MAX_BYTES", "full_reserve_bytes", "is_full", "refuse_if_full"]

FULL_RESERVE_MAX_BYTES = 1 << 30


def full_reserve_bytes(capacity_bytes: int) -> int:
    """The free bytes under which a pool of ``capacity_bytes`` counts as full."""
    return min(FULL_RESERVE_MAX_BYTES, capacity_bytes // 100)


def is_full(pool: PoolInfo) -> bool:
    """The pool's free bytes are below its reserve (a lost pool is lost, not full)."""
    return pool.lost is None and pool.capacity_bytes > 0 and pool.free_bytes < full_reserve_bytes(pool.capacity_bytes)


def full_message(node: str, pool: PoolInfo) -> str:
    return (f"the pool {pool.name} on {node} is full: {pool.free_bytes} bytes free of {pool.capacity_bytes}, below "
            f"its reserve of {full_reserve_bytes(pool.capacity_bytes)}")


def refuse_if_full(node: str, pool: PoolInfo | None, what: str) -> None:
    """``InsufficientVolumeCapacity`` (503) for ``what`` on a full pool; nothing for a pool with room
    (or one the node does not report: its own checks decide then)."""
    if pool is not None and is_full(pool):
        raise InsufficientCapacity(f"There is not enough capacity for {what}: {full_message(node, pool)}. "
                                   "Free space in the pool (delete volumes or snapshots in it), then try again.",
                                   storage_node=node, pool=pool.name, free_bytes=pool.free_bytes)
