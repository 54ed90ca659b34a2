"""The storage agent's side of the EBS direct APIs: blocks of a snapshot written into and read from its
snapshot store one at a time (vbs.snapshot_store.direct), for the controller, which keeps which block
went to which chunk until the snapshot completes. Stateless here, as every agent call: any agent that
uses the same store answers the same.

Manifests are immutable once written, so the last few read are kept in memory: a backup tool reads a
snapshot's blocks one request at a time, and each would otherwise read and decode its manifest again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from vbs.errors import DriverError
from vbs.snapshot_store.contract import SnapshotStore
from vbs.snapshot_store.direct import block_chunks, complete_snapshot, put_block, read_block
from vbs.snapshot_store.format import Manifest
from vbs.snapshot_store.manifests import load_manifest
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.wire.direct_blocks import BlockData, BlockRead, BlockWrite, BlockWritten, DirectManifest, SnapshotBlockList

__all__ = ["DirectBlocks"]

MANIFESTS_KEPT = 8


class DirectBlocks:
    def __init__(self, stored: StoredSnapshots) -> None:
        self._stored = stored
        self._lock = threading.Lock()
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()

    def _store(self) -> SnapshotStore:
        if self._stored.store is None:
            raise DriverError("this storage agent has no snapshot store ([storage_agent.snapshot_store] driver "
                              "= \"none\")")
        return self._stored.store

    def _manifest(self, snapshot_id: str) -> Manifest:
        with self._lock:
            found = self._manifests.get(snapshot_id)
            if found is not None:
                self._manifests.move_to_end(snapshot_id)
                return found
        manifest = load_manifest(self._store(), snapshot_id)
        with self._lock:
            self._manifests[snapshot_id] = manifest
            while len(self._manifests) > MANIFESTS_KEPT:
                self._manifests.popitem(last=False)
        return manifest

    def forget(self, snapshot_id: str) -> None:
        """The snapshot was deleted from the store: its manifest is not answered from memory any more."""
        with self._lock:
            self._manifests.pop(snapshot_id, None)

    def put(self, req: BlockWrite) -> BlockWritten:
        store = self._store()
        key = self._stored.tenant_key(store, req.store_key, req.tenant)
        return BlockWritten(chunk_id=put_block(store, key, req.data))

    def complete(self, snapshot_id: str, req: DirectManifest) -> SnapshotBlockList:
        store = self._store()
        key = self._stored.tenant_key(store, req.store_key, req.tenant)
        parent = self._manifest(req.parent_snapshot_id) if req.parent_snapshot_id else None
        manifest = complete_snapshot(store, snapshot_id=snapshot_id, volume_id=req.volume_id, tenant=req.tenant,
                                     tenant_key=key, volume_size=req.volume_size, parent=parent,
                                     blocks=dict(req.blocks))
        return self._listing(manifest)

    def blocks(self, snapshot_id: str) -> SnapshotBlockList:
        return self._listing(self._manifest(snapshot_id))

    def read(self, snapshot_id: str, req: BlockRead) -> BlockData:
        store = self._store()
        key = self._stored.tenant_key(store, req.store_key, req.tenant)
        return BlockData(data=read_block(store, self._manifest(snapshot_id), req.block_index, key))

    def _listing(self, manifest: Manifest) -> SnapshotBlockList:
        store = self._store()
        chunks = block_chunks(manifest)
        stored_bytes = sum(manifest.chunk_length(i) for i in manifest.chunks)
        return SnapshotBlockList(volume_size=manifest.volume_size, store=self._stored.location or store.describe(),
                                 stored_bytes=stored_bytes, blocks=sorted(chunks.items()))
