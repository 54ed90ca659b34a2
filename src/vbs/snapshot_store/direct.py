"""Snapshots written and read block by block: what the EBS direct APIs need of the store.

A backup tool writes a snapshot one 512 KiB block at a time (``put_block``: the block becomes a chunk,
content-addressed as every chunk is, and all-zero blocks are not stored), then completes it
(``complete_snapshot``: the parent's manifest, if any, with the blocks written over it, becomes the new
snapshot's manifest). It reads a snapshot the same way (``read_block``), every chunk checked against
its id. The caller (the storage agent, for the controller) keeps which block went to which chunk until
the snapshot completes; the store keeps nothing for a pending snapshot but its chunks.

Garbage collection: a chunk put for a pending snapshot is claimed by no manifest and no marker until its
snapshot completes, so the GC's grace period (a day by default) is what keeps it. ``complete_snapshot``
writes the upload marker with every claim first, waits out a GC run that overlapped, and refuses to
write a manifest whose chunk is gone (a block put longer than the grace period ago): the snapshot fails
with the block named instead of restoring wrong data (docs/snapshots.md, "EBS direct APIs").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from vbs.errors import InvalidParameter, SnapshotDataError
from vbs.snapshot_store import format as fmt
from vbs.snapshot_store import gc_runs
from vbs.snapshot_store.blocks import block_count, block_ref
from vbs.snapshot_store.contract import SnapshotStore
from vbs.snapshot_store.format import BLOCK_SIZE, Manifest
from vbs.snapshot_store.format import chunk_id as content_id
from vbs.snapshot_store.manifests import save_manifest, save_marker
from vbs.snapshot_store.restore import fetch_chunk

__all__ = ["put_block", "complete_snapshot", "read_block", "block_chunks"]


def put_block(store: SnapshotStore, tenant_key: bytes, data: bytes) -> str | None:
    """Put one block of a pending snapshot as a chunk: its id, or None for an all-zero block (not stored).
    A block whose chunk the store has is put again, so that it is young for the GC's grace period."""
    if len(data) != BLOCK_SIZE:
        raise InvalidParameter(f"a block is {BLOCK_SIZE} bytes, not {len(data)}")
    if data.count(0) == len(data):
        return None
    cid = content_id(tenant_key, data)
    store.put(fmt.chunk_key(cid), fmt.encode_chunk(data))
    return cid


def complete_snapshot(store: SnapshotStore, *, snapshot_id: str, volume_id: str, tenant: str, tenant_key: bytes,
                      volume_size: int, parent: Manifest | None, blocks: Mapping[int, str | None],
                      clock: Callable[[], float] = time.time, gc_poll_s: float = 5.0) -> Manifest:
    """Write the manifest of ``snapshot_id``: ``parent``'s chunks (none without a parent), with each block
    of ``blocks`` (index to chunk id, None for zeros) over them. ``SnapshotDataError`` names a chunk the
    store lacks; nothing is written then."""
    fmt.check_tenant(tenant)
    count = block_count(volume_size)
    if parent is not None:
        if parent.chunk_size != BLOCK_SIZE:
            raise InvalidParameter(f"the parent snapshot {parent.snapshot_id} is stored in {parent.chunk_size}-byte "
                                   f"chunks, not {BLOCK_SIZE}-byte blocks: write the snapshot without a parent")
        if parent.key_id != fmt.key_id(tenant_key) or parent.tenant != tenant:
            raise InvalidParameter(f"the parent snapshot {parent.snapshot_id} is another tenant's")
    chunks = {i: c for i, c in (parent.chunks.items() if parent is not None else ()) if i < count}
    for index, cid in blocks.items():
        if not 0 <= index < count:
            raise InvalidParameter(f"block {index} is past the end of a {volume_size}-byte volume")
        if cid is None:
            chunks.pop(index, None)
        else:
            chunks[index] = cid
    started = clock()
    runs_before = gc_runs.runs_seen(store)
    claims = frozenset(chunks.values())
    save_marker(store, fmt.UploadMarker(snapshot_id, volume_id, tenant, datetime.fromtimestamp(started, UTC), claims))
    runs_after = gc_runs.runs_seen(store)
    if gc_runs.overlapped(runs_before, runs_after):
        gc_runs.wait_for_runs(store, runs_after, poll_s=gc_poll_s, clock=clock)
    for index, cid in sorted(chunks.items()):
        if index in blocks and not store.has(fmt.chunk_key(cid)):
            store.delete(fmt.marker_key(snapshot_id))
            raise SnapshotDataError(f"block {index} of {snapshot_id} is no longer in the snapshot store "
                                    f"{store.describe()} (written too long ago: put it again)", snapshot_id=snapshot_id)
    manifest = Manifest(snapshot_id, volume_id, tenant, volume_size, fmt.key_id(tenant_key),
                        dict(sorted(chunks.items())), datetime.fromtimestamp(clock(), UTC),
                        parent.snapshot_id if parent else None).check()
    save_manifest(store, manifest)
    store.delete(fmt.marker_key(snapshot_id))
    return manifest


def read_block(store: SnapshotStore, manifest: Manifest, block_index: int, tenant_key: bytes) -> bytes:
    """Block ``block_index`` of a stored snapshot, checked against its chunk's id (zeros where it has none;
    a last block shorter than ``BLOCK_SIZE`` is padded with zeros, as the volume reads)."""
    ref = block_ref(manifest, block_index)
    if ref is None:
        return bytes(BLOCK_SIZE)
    data = fetch_chunk(store, manifest, ref.chunk_index, tenant_key)[ref.offset:ref.offset + ref.length]
    return data + bytes(BLOCK_SIZE - len(data))


def block_chunks(manifest: Manifest) -> dict[int, str]:
    """Each non-zero block of ``manifest``, by index, with the id of the chunk that holds it."""
    per_chunk = manifest.chunk_size // BLOCK_SIZE
    out: dict[int, str] = {}
    for index, cid in manifest.chunks.items():
        first = index * per_chunk
        for block in range(first, min(first + per_chunk, block_count(manifest.volume_size))):
            out[block] = cid
    return out
