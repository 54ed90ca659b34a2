"""Upload a point-in-time image of a volume into the store: its chunks, then its manifest.

Only what is new is read and sent: with a list of changed blocks and the volume's previous
manifest, unchanged chunks are taken from that manifest unread; every chunk read is hashed, and one
whose id the previous manifest or the store already has is not sent again. All-zero chunks are
neither hashed nor stored. A crashed upload run again sends nothing the store holds whole.

The steps (docs/snapshots.md, "An upload"):
1. note the GC runs and the uploads in flight, write the upload marker (before the first chunk);
2. read, hash and put chunks, ``parallel`` at a time, in a batch of the store (a ``dir`` store syncs
   them at the batch's commit); a chunk the store holds is trusted unread if it was put before every
   upload in flight began, else read back, checked and synced at the commit, or put again if it is
   not whole (docs/snapshots.md, "Durability");
3. write the marker again with the ids of every chunk of the manifest (its claims);
4. if a GC ran beside steps 1–3, wait for it to end and put back any claimed chunk it deleted;
5. commit the batch, write the manifest (its presence means every chunk it lists is durable), delete
   the marker.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial

from vbs import ids
from vbs.errors import IncorrectState, InvalidParameter, SnapshotDataError
from vbs.snapshot_store import gc_runs
from vbs.snapshot_store.blocks import BlockRange, chunks_of_ranges
from vbs.snapshot_store.contract import SnapshotStore, StoreBatch, Trusted, open_batch
from vbs.snapshot_store.format import (
    CHUNK_SIZE,
    Manifest,
    UploadMarker,
    check_tenant,
    chunk_id,
    chunk_key,
    encode_chunk,
    is_whole_chunk,
    key_id,
    marker_key,
)
from vbs.snapshot_store.manifests import find_manifest, load_marker, save_manifest, save_marker, trust_before
from vbs.snapshot_store.parallel import bounded_map
from vbs.snapshot_store.volume_io import FileReader, Target, VolumeReader

__all__ = ["UploadResult", "upload_snapshot", "Progress"]

Progress = Callable[[int, int], None]


@dataclass
class UploadResult:
    """What an upload did: ``chunks_read`` were read and hashed, of which ``chunks_zero`` were zeros,
    ``chunks_known`` already in the previous manifest or the store, and ``chunks_put`` sent
    (``bytes_put`` bytes, compressed); ``chunks_unread`` came from the previous manifest unread.
    ``chunks_verified``, of the known, were found in a ``dir`` store too young to trust unread, read
    back whole and synced (docs/snapshots.md, "Durability"). ``chunks_restored`` were put back after
    a GC deleted them mid-upload."""

    manifest: Manifest
    chunks_read: int = 0
    chunks_zero: int = 0
    chunks_known: int = 0
    chunks_put: int = 0
    chunks_unread: int = 0
    chunks_verified: int = 0
    chunks_restored: int = 0
    bytes_read: int = 0
    bytes_put: int = 0
    already_stored: bool = False


_ZEROS: dict[int, bytes] = {}


def _zero(length: int) -> bytes:
    zero = _ZEROS.get(length)
    if zero is None:
        zero = _ZEROS[length] = bytes(length)
    return zero


@dataclass
class _Upload:
    store: SnapshotStore
    batch: StoreBatch
    reader: VolumeReader
    size: int
    tenant_key: bytes
    previous: Manifest | None
    chunk_size: int
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _handled: set[str] = field(default_factory=set, init=False)  # chunk ids met so far: a repeat is not put
    _ours: set[str] = field(default_factory=set, init=False)  # chunk ids put or verified: the batch syncs them

    def length(self, index: int) -> int:
        return min(self.chunk_size, self.size - index * self.chunk_size)

    def read(self, index: int) -> bytes:
        return self.reader.read_at(index * self.chunk_size, self.length(index))

    def chunk(self, index: int) -> tuple[int, str | None, str, int]:
        """Read, hash and if need be put chunk ``index``: (index, id or None, what happened, bytes put)."""
        data = self.read(index)
        if data == _zero(len(data)):
            return index, None, "zero", 0
        cid = chunk_id(self.tenant_key, data)
        if self.previous is not None and self.previous.chunks.get(index) == cid:
            return index, cid, "known", 0
        with self._lock:
            repeat = cid in self._handled  # another chunk of this volume with the same bytes
            self._handled.add(cid)
        if repeat:
            return index, cid, "known", 0
        found = self._found(cid, len(data))
        if found is not None:
            return index, cid, "known" if found == "durable" else "verified", 0
        blob = encode_chunk(data)
        self._store(cid, blob)
        return index, cid, "put", len(blob)

    def _found(self, cid: str, length: int) -> Trusted | None:
        """Whether the store holds chunk ``cid`` for certain (docs/snapshots.md, "Durability"): a young
        one is read back and checked as a restore would (``decode_chunk``), and the batch syncs it."""
        found = self.batch.trusted(chunk_key(cid), partial(is_whole_chunk, tenant_key=self.tenant_key, cid=cid,
                                                           length=length))
        if found == "verified":
            with self._lock:
                self._ours.add(cid)
        return found

    def _store(self, cid: str, blob: bytes) -> None:
        self.batch.put(chunk_key(cid), blob)
        with self._lock:
            self._ours.add(cid)

    def put_back(self, item: tuple[str, int]) -> str | None:
        """Put chunk ``cid`` (read again at ``index``) if the store lost it; its id if it did."""
        cid, index = item
        with self._lock:
            ours = cid in self._ours
        if self.store.has(chunk_key(cid)) and (ours or self._found(cid, self.length(index)) is not None):
            return None
        data = self.read(index)
        if chunk_id(self.tenant_key, data) != cid:
            raise SnapshotDataError(f"chunk {index} of the volume changed during its upload (it hashed to {cid} "
                                    "before): the source is not a point-in-time image", chunk_index=index)
        self._store(cid, encode_chunk(data))
        return cid


def _unread_chunks(size: int, chunk_size: int, previous: Manifest | None,
                   changed_blocks: Collection[BlockRange] | None) -> set[int]:
    """The chunks whose bytes the previous manifest has for certain: none without a change list."""
    if previous is None or changed_blocks is None:
        return set()
    touched = chunks_of_ranges(changed_blocks, chunk_size)
    count = -(-size // chunk_size)
    # A chunk the previous volume had whole and this one has whole; the grown tail of a resized
    # volume is read whatever the change list says.
    whole_before = previous.volume_size // chunk_size
    return {i for i in range(min(count, whole_before)) if i not in touched and (i + 1) * chunk_size <= size}


def _usable_previous(previous: Manifest | None, tenant: str, tenant_key: bytes, chunk_size: int) -> Manifest | None:
    if previous is None:
        return None
    if previous.tenant != tenant or previous.key_id != key_id(tenant_key) or previous.chunk_size != chunk_size:
        return None  # another tenant's or another layout's: it proves nothing about these bytes
    return previous


def upload_snapshot(store: SnapshotStore, source: VolumeReader | Target, size: int, *, snapshot_id: str,
                    volume_id: str, tenant: str, tenant_key: bytes, previous: Manifest | None = None,
                    changed_blocks: Collection[BlockRange] | None = None, progress: Progress | None = None,
                    parallel: int = 8, chunk_size: int = CHUNK_SIZE, clock: Callable[[], float] = time.time,
                    gc_poll_s: float = 5.0) -> UploadResult:
    """Store snapshot ``snapshot_id`` of ``volume_id`` (``size`` bytes read from ``source``: a
    ``VolumeReader``, a path or an fd) for ``tenant``; return its manifest and what it took.

    ``previous`` is the volume's last stored manifest, if any; ``changed_blocks`` the 512 KiB blocks
    written since it was taken, when the pool can tell (else every chunk is read and hashed). Safe to
    run again after a crash or a failure: what the store holds whole is not sent again, and a snapshot
    whose manifest exists is answered at once.
    """
    ids.check("snapshot", snapshot_id)
    ids.check("volume", volume_id)
    check_tenant(tenant)
    if size <= 0 or size % 512:
        raise InvalidParameter(f"Invalid size: {size!r} (expecting a positive multiple of 512 bytes)")
    if parallel < 1:
        raise InvalidParameter(f"parallel must be at least 1, not {parallel}")
    existing = find_manifest(store, snapshot_id)
    if existing is not None:
        if existing.volume_id != volume_id or existing.volume_size != size or existing.tenant != tenant:
            raise IncorrectState(f"the store already holds {snapshot_id}, of another volume, size or tenant",
                                 snapshot_id=snapshot_id)
        return UploadResult(existing, already_stored=True)

    if isinstance(source, VolumeReader):
        return _upload(store, source, size, snapshot_id, volume_id, tenant, tenant_key, previous, changed_blocks,
                       progress, parallel, chunk_size, clock, gc_poll_s)
    with FileReader(source) as reader:
        return _upload(store, reader, size, snapshot_id, volume_id, tenant, tenant_key, previous, changed_blocks,
                       progress, parallel, chunk_size, clock, gc_poll_s)


def _first_start(store: SnapshotStore, snapshot_id: str, now: float) -> float:
    """When this snapshot's upload first began: a try run again keeps its marker's start, so what the
    earlier try put stays younger than every upload's trust horizon until this one has committed."""
    try:
        earlier = load_marker(store, snapshot_id)
    except SnapshotDataError:
        return now
    return now if earlier is None else min(now, earlier.started_at.timestamp())


def _upload(store: SnapshotStore, reader: VolumeReader, size: int, snapshot_id: str, volume_id: str, tenant: str,
            tenant_key: bytes, previous: Manifest | None, changed_blocks: Collection[BlockRange] | None,
            progress: Progress | None, parallel: int, chunk_size: int, clock: Callable[[], float],
            gc_poll_s: float) -> UploadResult:
    started = clock()
    runs_before = gc_runs.runs_seen(store)
    # Asked before this upload's marker is written: a resumed upload's first try counts as in flight.
    batch = open_batch(store, lambda: trust_before(store, started))
    first_start = _first_start(store, snapshot_id, started)
    marker = UploadMarker(snapshot_id, volume_id, tenant, datetime.fromtimestamp(first_start, UTC))
    save_marker(store, marker)

    usable = _usable_previous(previous, tenant, tenant_key, chunk_size)
    upload = _Upload(store, batch, reader, size, tenant_key, usable, chunk_size)
    count = -(-size // chunk_size)
    unread = _unread_chunks(size, chunk_size, usable, changed_blocks)
    chunks: dict[int, str] = {}
    tally: Counter[str] = Counter()
    done = 0
    if usable is not None:
        for index in unread:
            cid = usable.chunks.get(index)
            if cid is not None:
                chunks[index] = cid
            done += upload.length(index)
    if progress:
        progress(done, size)

    to_read = (i for i in range(count) if i not in unread)
    for index, cid, what, put in bounded_map(upload.chunk, to_read, parallel):
        if cid is not None:
            chunks[index] = cid
        tally[what] += 1
        tally["bytes_put"] += put
        done += upload.length(index)
        if progress:
            progress(done, size)

    manifest = Manifest(snapshot_id, volume_id, tenant, size, key_id(tenant_key), dict(sorted(chunks.items())),
                        datetime.fromtimestamp(clock(), UTC), previous.snapshot_id if previous else None,
                        chunk_size).check()
    result = UploadResult(manifest, chunks_read=count - len(unread), chunks_zero=tally["zero"],
                          chunks_known=tally["known"] + tally["verified"], chunks_put=tally["put"],
                          chunks_unread=len(unread), chunks_verified=tally["verified"],
                          bytes_read=size - sum(upload.length(i) for i in unread), bytes_put=tally["bytes_put"])
    claims = frozenset(chunks.values())
    save_marker(store, UploadMarker(snapshot_id, volume_id, tenant, marker.started_at, claims))

    runs_after = gc_runs.runs_seen(store)
    if gc_runs.overlapped(runs_before, runs_after) or clock() - started > gc_runs.RUNS_KEPT_S:
        gc_runs.wait_for_runs(store, runs_after, poll_s=gc_poll_s, clock=clock)
        first_index = {cid: index for index, cid in sorted(chunks.items(), reverse=True)}
        for restored in bounded_map(upload.put_back, first_index.items(), parallel):
            result.chunks_restored += restored is not None

    batch.commit()  # every chunk put is durable before the manifest that lists it
    save_manifest(store, manifest)
    store.delete(marker_key(snapshot_id))
    return result
