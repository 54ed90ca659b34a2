"""Copy one snapshot from a store into another (the standard store to an archive store and back:
docs/snapshot-tiers.md): its manifest, and every chunk it lists that the target lacks, each one checked
against its id before it is put.

The target sees the copy as it sees an upload (docs/snapshots.md, "An upload"), so its garbage collection
and its other writers stay safe:
1. note the target's GC runs, write an upload marker claiming every chunk of the manifest;
2. put the chunks the target does not hold for certain (``StoreBatch.trusted``), ``parallel`` at a time,
   each read from the source and checked (``is_whole_chunk``) first: a corrupt one fails the copy, named;
3. if a GC ran beside steps 1–2, wait for it to end and put back any chunk it deleted;
4. commit the batch, write the manifest, delete the marker.
A manifest already in the target means the copy was made (its presence says every chunk it lists is
durable): the copy is then done at once. A crashed copy run again puts nothing the target holds whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

from vbs.errors import IncorrectState, SnapshotDataError
from vbs.snapshot_store import gc_runs
from vbs.snapshot_store.contract import ObjectMissing, SnapshotStore, StoreBatch, open_batch
from vbs.snapshot_store.format import UploadMarker, chunk_key, is_whole_chunk, key_id, marker_key
from vbs.snapshot_store.manifests import (
    find_manifest,
    load_manifest,
    load_marker,
    save_manifest,
    save_marker,
    trust_before,
)
from vbs.snapshot_store.parallel import bounded_map

__all__ = ["CopyResult", "copy_snapshot"]


@dataclass
class CopyResult:
    """What a copy did: ``chunks`` the manifest lists (distinct), ``chunks_put`` sent (``bytes_put``
    bytes), ``chunks_restored`` put back after a GC beside it; ``already`` the target had the manifest."""

    chunks: int = 0
    chunks_put: int = 0
    bytes_put: int = 0
    chunks_restored: int = 0
    already: bool = False


@dataclass
class _Copy:
    source: SnapshotStore
    target: SnapshotStore
    batch: StoreBatch
    tenant_key: bytes
    snapshot_id: str

    def whole(self, cid: str, length: int) -> Callable[[bytes], bool]:
        return partial(is_whole_chunk, tenant_key=self.tenant_key, cid=cid, length=length)

    def chunk(self, item: tuple[str, int]) -> int:
        """Put chunk ``cid`` (``length`` bytes once decoded) unless the target holds it: the bytes put."""
        cid, length = item
        if self.batch.trusted(chunk_key(cid), self.whole(cid, length)) is not None:
            return 0
        return self.put(cid, length)

    def put(self, cid: str, length: int) -> int:
        try:
            blob = self.source.get(chunk_key(cid))
        except ObjectMissing:
            raise SnapshotDataError(f"the chunk {cid} of {self.snapshot_id} is missing from "
                                    f"{self.source.describe()}", snapshot_id=self.snapshot_id) from None
        if not is_whole_chunk(blob, self.tenant_key, cid, length):
            raise SnapshotDataError(f"the chunk {cid} of {self.snapshot_id} in {self.source.describe()} is "
                                    "corrupt (it does not hash to its id)", snapshot_id=self.snapshot_id)
        self.batch.put(chunk_key(cid), blob)
        return len(blob)

    def put_back(self, item: tuple[str, int]) -> bool:
        cid, length = item
        if self.target.has(chunk_key(cid)):
            return False
        self.put(cid, length)
        return True


def copy_snapshot(source: SnapshotStore, target: SnapshotStore, snapshot_id: str, *, tenant_key: bytes,
                  progress: Callable[[int, int], None] | None = None, parallel: int = 8,
                  clock: Callable[[], float] = time.time, gc_poll_s: float = 5.0) -> CopyResult:
    """Make ``target`` hold ``snapshot_id`` whole, as ``source`` does (``NotFound`` if neither has its
    manifest). ``tenant_key``: the snapshot's tenant's, which every chunk is checked with."""
    if find_manifest(target, snapshot_id) is not None:
        return CopyResult(already=True)
    manifest = load_manifest(source, snapshot_id)
    if manifest.key_id != key_id(tenant_key):
        raise IncorrectState(f"the snapshot {snapshot_id} was stored under another key than the one given",
                             snapshot_id=snapshot_id)
    lengths: dict[str, int] = {}
    for index, cid in sorted(manifest.chunks.items()):
        lengths.setdefault(cid, manifest.chunk_length(index))
    started = clock()
    runs_before = gc_runs.runs_seen(target)
    batch = open_batch(target, lambda: trust_before(target, started))
    earlier = load_marker(target, snapshot_id)
    first = started if earlier is None else min(started, earlier.started_at.timestamp())
    save_marker(target, UploadMarker(snapshot_id, manifest.volume_id, manifest.tenant,
                                     datetime.fromtimestamp(first, UTC), frozenset(lengths)))
    copy = _Copy(source, target, batch, tenant_key, snapshot_id)
    result = CopyResult(chunks=len(lengths))
    total, done = len(lengths), 0
    if progress:
        progress(0, total)
    for put in bounded_map(copy.chunk, lengths.items(), parallel):
        done += 1
        if put:
            result.chunks_put += 1
            result.bytes_put += put
        if progress:
            progress(done, total)
    runs_after = gc_runs.runs_seen(target)
    if gc_runs.overlapped(runs_before, runs_after) or clock() - started > gc_runs.RUNS_KEPT_S:
        gc_runs.wait_for_runs(target, runs_after, poll_s=gc_poll_s, clock=clock)
        result.chunks_restored = sum(bounded_map(copy.put_back, lengths.items(), parallel))
    batch.commit()  # every chunk is durable in the target before the manifest that lists it
    save_manifest(target, manifest)
    target.delete(marker_key(snapshot_id))
    return result
