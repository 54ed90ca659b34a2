"""Restore a snapshot from the store onto a volume: every chunk fetched, checked and written.

Every chunk is decompressed and hashed again under the tenant's key before a byte of it is written;
one that is missing or does not match stops the restore with an error naming the chunk (id and
index) and the snapshot. Zero chunks are holes: skipped on a target known to read as zeros (a file
this restore created or found empty), written as zeros otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vbs.errors import ChunkCorrupt, ChunkMissing, InvalidParameter, SnapshotDataError
from vbs.snapshot_store.contract import ObjectMissing, SnapshotStore
from vbs.snapshot_store.format import Manifest, chunk_key, decode_chunk, key_id
from vbs.snapshot_store.parallel import bounded_map
from vbs.snapshot_store.upload import Progress
from vbs.snapshot_store.volume_io import FileWriter, Target, VolumeWriter

__all__ = ["RestoreResult", "restore_snapshot", "fetch_chunk"]


@dataclass
class RestoreResult:
    chunks_written: int = 0
    chunks_zero: int = 0
    bytes_fetched: int = 0
    seconds: float = 0.0


def fetch_chunk(store: SnapshotStore, manifest: Manifest, index: int, tenant_key: bytes) -> bytes:
    """The checked plaintext of chunk ``index`` of ``manifest`` (zeros if it has none)."""
    cid = manifest.chunks.get(index)
    length = manifest.chunk_length(index)
    if cid is None:
        return bytes(length)
    return _fetch(store, manifest, index, cid, tenant_key)[0]


def _fetch(store: SnapshotStore, manifest: Manifest, index: int, cid: str, tenant_key: bytes) -> tuple[bytes, int]:
    where = f"chunk {cid} (index {index}, at byte {index * manifest.chunk_size}) of {manifest.snapshot_id}"
    try:
        blob = store.get(chunk_key(cid))
    except ObjectMissing:
        raise ChunkMissing(f"{where} is missing from the snapshot store {store.describe()}",
                           snapshot_id=manifest.snapshot_id, chunk_id=cid, chunk_index=index) from None
    try:
        return decode_chunk(blob, tenant_key, cid, length=manifest.chunk_length(index)), len(blob)
    except ValueError as exc:
        raise ChunkCorrupt(f"{where} is corrupt in the snapshot store {store.describe()}: {exc}",
                           snapshot_id=manifest.snapshot_id, chunk_id=cid, chunk_index=index) from None


def check_key_for(manifest: Manifest, tenant_key: bytes) -> None:
    if key_id(tenant_key) != manifest.key_id:
        raise SnapshotDataError(f"{manifest.snapshot_id} was stored under the key {manifest.key_id} of tenant "
                                f"{manifest.tenant}; the key given is {key_id(tenant_key)}",
                                snapshot_id=manifest.snapshot_id)


def restore_snapshot(store: SnapshotStore, manifest: Manifest, target: VolumeWriter | Target, *, tenant_key: bytes,
                     progress: Progress | None = None, parallel: int = 8, zeroed: bool | None = None) -> RestoreResult:
    """Write snapshot ``manifest`` onto ``target`` (a ``VolumeWriter``, a path or an fd), which is
    made ``volume_size`` bytes long if it is a regular file. ``zeroed``: whether the target already
    reads as zeros (default: only a regular file this call found empty or made)."""
    if parallel < 1:
        raise InvalidParameter(f"parallel must be at least 1, not {parallel}")
    check_key_for(manifest, tenant_key)
    if isinstance(target, VolumeWriter):
        return _restore(store, manifest, target, tenant_key, progress, parallel, bool(zeroed))
    with FileWriter(target, manifest.volume_size) as writer:
        return _restore(store, manifest, writer, tenant_key, progress, parallel,
                        writer.zeroed if zeroed is None else zeroed)


def _restore(store: SnapshotStore, manifest: Manifest, writer: VolumeWriter, tenant_key: bytes,
             progress: Progress | None, parallel: int, zeroed: bool) -> RestoreResult:
    started = time.monotonic()
    result = RestoreResult()
    size = manifest.volume_size

    def one(index: int) -> tuple[int, int]:
        cid = manifest.chunks.get(index)
        if cid is None:
            writer.write_at(index * manifest.chunk_size, bytes(manifest.chunk_length(index)))
            return index, 0
        data, fetched = _fetch(store, manifest, index, cid, tenant_key)
        writer.write_at(index * manifest.chunk_size, data)
        return index, fetched

    indexes = range(manifest.chunk_count) if not zeroed else sorted(manifest.chunks)
    done = 0 if not zeroed else size - sum(manifest.chunk_length(i) for i in manifest.chunks)
    if progress:
        progress(done, size)
    for index, fetched in bounded_map(one, indexes, parallel):
        if fetched:
            result.chunks_written += 1
            result.bytes_fetched += fetched
        done += manifest.chunk_length(index)
        if progress:
            progress(done, size)
    result.chunks_zero = manifest.chunk_count - len(manifest.chunks)
    writer.flush()
    result.seconds = time.monotonic() - started
    return result

