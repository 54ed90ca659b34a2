"""The storage agent's calls on its snapshot store and archive store: uploads of pool snapshots,
restores into volumes, tier moves, checks, and the EBS direct APIs' blocks.

Each call is idempotent and keyed by snapshot or volume id, as the pool calls in ``vbs.storage.api``;
long work answers a job's status (``copying`` with progress, then ``ready``).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from vbs import ids
from vbs.pools.backend import Backend
from vbs.storage.direct_blocks import DirectBlocks
from vbs.storage.store_check import check_snapshots
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.wire.direct_blocks import BlockData, BlockRead, BlockWrite, BlockWritten, DirectManifest, SnapshotBlockList
from vbs.wire.storage import (
    CheckStore,
    ItemStatus,
    Removed,
    RestoreVolume,
    StoreCheckReport,
    StoredStatus,
    StoreSnapshot,
    TierMove,
)

__all__ = ["add_store_routes"]


def add_store_routes(router: APIRouter, pool: Callable[[str], Backend], stored: StoredSnapshots) -> None:
    """The snapshot store's calls (``stored_snapshots``), the archive store's (``archive_tier``) and the
    direct APIs' blocks (``direct_blocks``); ``pool``: a pool of this node by name (``NotFound``)."""
    direct = DirectBlocks(stored)

    # -- the snapshot store --------------------------------------------------------------------------

    @router.put("/pools/{pool_name}/snapshots/{snapshot_id}/stored")
    def store_snapshot(pool_name: str, snapshot_id: str, body: StoreSnapshot) -> StoredStatus:
        """Put the pool's snapshot into the store (a job): ``copying`` with progress, then ``ready`` with
        what its manifest holds; ``SnapshotStoreUnavailable`` while the store cannot be reached."""
        return stored.upload(pool(pool_name), pool_name, ids.check("snapshot", snapshot_id), body)

    @router.get("/pools/{pool_name}/snapshots/{snapshot_id}/stored")
    def stored_status(pool_name: str, snapshot_id: str) -> StoredStatus:
        return stored.status(pool(pool_name), pool_name, ids.check("snapshot", snapshot_id))

    @router.delete("/snapshot-store/snapshots/{snapshot_id}")
    def delete_stored(snapshot_id: str) -> Removed:
        """Delete the snapshot's manifest from the store (its chunks go with garbage collection)."""
        stored.delete(ids.check("snapshot", snapshot_id))
        direct.forget(snapshot_id)
        return Removed()

    @router.put("/pools/{pool_name}/volumes/{volume_id}/restore")
    def restore_volume(pool_name: str, volume_id: str, body: RestoreVolume) -> ItemStatus:
        """Make the volume from a snapshot in the store, every chunk checked: ``copying``, then ``ready``."""
        return stored.restore(pool(pool_name), pool_name, ids.check("volume", volume_id), body)

    @router.post("/snapshot-store/check")
    def check_store(body: CheckStore) -> StoreCheckReport:
        """Check the named snapshots in the store: manifests read, chunks found (``deep``: hashed again)."""
        if body.archive:
            return check_snapshots(stored.archive.archive, stored.archive.location, body, what="archive")
        return check_snapshots(stored.store, stored.location, body)

    # -- the archive store ---------------------------------------------------------------------------

    @router.put("/archive-store/snapshots/{snapshot_id}")
    def archive_stored(snapshot_id: str, body: TierMove) -> StoredStatus:
        """Move the snapshot from the snapshot store into the archive store (a job): ``copying`` with
        progress, then ``ready`` once only the archive holds it."""
        return stored.archive.archive_snapshot(ids.check("snapshot", snapshot_id), body)

    @router.put("/snapshot-store/snapshots/{snapshot_id}/from-archive")
    def restore_archived(snapshot_id: str, body: TierMove) -> StoredStatus:
        """Copy the snapshot back from the archive store (a job; ``permanent``: then out of the archive)."""
        return stored.archive.restore(ids.check("snapshot", snapshot_id), body)

    # -- the EBS direct APIs' blocks -----------------------------------------------------------------

    @router.post("/snapshot-store/blocks")
    def put_block(body: BlockWrite) -> BlockWritten:
        """Put one block of a pending snapshot into the store: the id of its chunk (None: all zeros)."""
        return direct.put(body)

    @router.put("/snapshot-store/snapshots/{snapshot_id}/manifest")
    def complete_direct(snapshot_id: str, body: DirectManifest) -> SnapshotBlockList:
        """Write the manifest of a snapshot written block by block (its parent's blocks with its own over
        them); a block whose chunk the store lost fails it, named."""
        return direct.complete(ids.check("snapshot", snapshot_id), body)

    @router.get("/snapshot-store/snapshots/{snapshot_id}/blocks")
    def snapshot_blocks(snapshot_id: str) -> SnapshotBlockList:
        """The stored snapshot's non-zero blocks and the chunk of each."""
        return direct.blocks(ids.check("snapshot", snapshot_id))

    @router.post("/snapshot-store/snapshots/{snapshot_id}/blocks/read")
    def read_block(snapshot_id: str, body: BlockRead) -> BlockData:
        """One block of a stored snapshot, checked against its chunk's id."""
        return direct.read(ids.check("snapshot", snapshot_id), body)
