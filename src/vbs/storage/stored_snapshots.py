"""The storage agent's side of the snapshot store (docs/snapshots.md): uploads of its pools' snapshots,
restores of volumes from the store, and deletions of manifests. The controller only records.

- An **upload** runs in a thread per snapshot (``upload_snapshot`` puts 8 chunks at a time), reading the
  pool's point-in-time image of the snapshot (a file pool's image file, or the reader of a pool whose
  volumes are not files: an RBD snapshot's stream), incremental against the parent snapshot's manifest:
  on a reflink pool only the chunks its file does not share with the parent's file are read, on a copy
  pool whose NBD daemon served the volume since the parent's view only the blocks its dirty bitmap saw
  written, on an RBD pool only those its diff reports changed, else everything is read and hashed
  (chunks the store holds are not sent again; docs/snapshots.md "Incremental uploads"). A repeated call
  answers how far it got; after an agent restart the next call starts it again and nothing stored is
  sent again; a snapshot whose manifest is in the store is answered at once. Once stored, a pool whose
  clones are copies (no reflink) gives up its full copy: the store is where the snapshot lives.
- A **restore** fills a new volume's partial file (or partial RBD image, through the pool's writer) from
  a manifest, every chunk checked against its id; a missing or corrupt chunk fails the volume with the
  chunk and the snapshot named, and the partial goes (nothing half-written is ever published).
- The store's own trouble (``SnapshotStoreUnavailable``, a ``RetryLater``) is raised to the controller,
  whose workflow retries with back-off: the snapshot stays pending, with the reason.

The store key arrives with each upload and restore call, from the controller; the tenant's key is
derived from it here (``StoreKey``) and kept only for the job's life. It is never logged or written.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from vbs.errors import DriverError, IncorrectState, InvalidParameter, RetryLater, SnapshotSourceLost
from vbs.pools.backend import (
    Backend,
    ImageLayout,
    SnapshotChanges,
    SnapshotImageLayouts,
    SnapshotImages,
    SnapshotStreams,
)
from vbs.snapshot_store import StoreKey, open_store
from vbs.snapshot_store.blocks import BlockRange, ranges_of_extents
from vbs.snapshot_store.contract import SnapshotStore
from vbs.snapshot_store.format import Manifest
from vbs.snapshot_store.manifests import delete_snapshot, find_manifest, load_manifest
from vbs.snapshot_store.restore import restore_snapshot
from vbs.snapshot_store.upload import upload_snapshot
from vbs.snapshot_store.volume_io import FileReader, FileWriter, VolumeReader, VolumeWriter
from vbs.storage.archive_tier import ArchiveTier
from vbs.storage.copy import CopyCancelled, Job, data_ranges
from vbs.storage.luks import convert_to_luks, header_bytes
from vbs.wire.storage import ItemStatus, PoolInfo, RestoreVolume, StoredStatus, StoreSnapshot

__all__ = ["StoredSnapshots"]

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 120.0


class _Cancellable:
    """A reader or writer that stops (``CopyCancelled``) at its next chunk once ``cancel`` is set."""

    def __init__(self, inner: VolumeReader | VolumeWriter | _SparseReader, cancel: threading.Event) -> None:
        self._inner = inner
        self._cancel = cancel

    def _check(self) -> None:
        if self._cancel.is_set():
            raise CopyCancelled()

    def read_at(self, offset: int, length: int) -> bytes:
        self._check()
        assert isinstance(self._inner, VolumeReader)
        return self._inner.read_at(offset, length)

    def write_at(self, offset: int, data: bytes) -> None:
        self._check()
        assert isinstance(self._inner, VolumeWriter)
        self._inner.write_at(offset, data)

    def flush(self) -> None:
        assert isinstance(self._inner, VolumeWriter)
        self._inner.flush()


class _SparseReader:
    """Reads of a snapshot image that answer a range in one of its holes with zeros without reading it
    (SEEK_DATA/SEEK_HOLE, listed once: nobody writes a snapshot image): a thin 1 TiB volume with little
    data costs its data, not a terabyte of reads of zeros. An image with a ``layout`` (a point-in-time
    view) is read where its layout says, in aligned reads of its unit, with the kernel's read-ahead off
    (it would merge them)."""

    def __init__(self, reader: FileReader, size: int, layout: ImageLayout | None = None) -> None:
        self._reader = reader
        self._unit = layout.unit if layout is not None else 0
        if layout is not None:
            os.posix_fadvise(reader.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._extents = list(layout.data) if layout is not None else list(data_ranges(reader.fd, size))
        self._starts = [start for start, _ in self._extents]
        self._zeros: dict[int, bytes] = {}

    def read_at(self, offset: int, length: int) -> bytes:
        # The last extent starting before the range's end is the only one that may reach into it.
        k = bisect.bisect_left(self._starts, offset + length) - 1
        if k < 0 or self._extents[k][1] <= offset:
            zeros = self._zeros.get(length)
            if zeros is None:
                zeros = self._zeros[length] = bytes(length)
            return zeros
        unit = self._unit
        if not unit:
            return self._reader.read_at(offset, length)
        pos, end = offset, offset + length
        parts = []
        while pos < end:
            step = min(end, (pos // unit + 1) * unit) - pos
            parts.append(self._reader.read_at(pos, step))
            pos += step
        return b"".join(parts)


class _Source:
    """Where an upload reads the snapshot: a file pool's image file (found at once), or the reader a pool
    without files gives (``SnapshotStreams``: an RBD snapshot), with the extents changed since the previous
    stored snapshot when the pool can tell (``SnapshotChanges`` for images: a reflink pool, or a view whose
    daemon tracked the writes)."""

    def __init__(self, images: SnapshotImages | SnapshotStreams, snapshot_id: str) -> None:
        self._images, self._snapshot_id = images, snapshot_id
        self._image = None if isinstance(images, SnapshotStreams) else images.snapshot_image(snapshot_id)
        self.size_bytes = 0 if self._image is None else self._image.stat().st_size

    @contextmanager
    def open(self, since: str | None) -> Iterator[tuple[VolumeReader | _SparseReader, int, list[BlockRange] | None]]:
        if self._image is not None:
            # Read as the image's layout says (a point-in-time view: docs/snapshots.md), or as a plain file.
            images = self._images
            layout = images.snapshot_image_layout(self._snapshot_id) \
                if isinstance(images, SnapshotImageLayouts) else None
            # On a reflink pool, the extents this image does not share with the previous one's (unread: the
            # previous manifest has them); else every chunk is read and hashed.
            changed = images.changed_since(self._snapshot_id, since) \
                if since is not None and isinstance(images, SnapshotChanges) else None
            with FileReader(self._image) as file:
                size = os.fstat(file.fd).st_size
                yield _SparseReader(file, size, layout), size, None if changed is None else ranges_of_extents(changed)
            return
        assert isinstance(self._images, SnapshotStreams)
        reader = self._images.open_snapshot(self._snapshot_id, since)
        try:
            yield reader, reader.size, None if reader.changed is None else ranges_of_extents(reader.changed)
        finally:
            reader.close()


@dataclass
class _Upload:
    pool: str
    job: Job | None = None  # None: being started
    answer: StoredStatus | None = None  # set once the manifest is written


def _facts(manifest: Manifest, store: str, *, pool_copy: bool, chunks_uploaded: int = 0,
           uploaded_bytes: int = 0) -> StoredStatus:
    return StoredStatus(state="ready", progress=100, size_bytes=manifest.volume_size, store=store,
                        chunks=len(manifest.chunks), chunks_uploaded=chunks_uploaded,
                        stored_bytes=sum(manifest.chunk_length(i) for i in manifest.chunks),
                        uploaded_bytes=uploaded_bytes, pool_copy=pool_copy)


class StoredSnapshots:
    """This agent's store (None: it has none, and snapshots stay in their pools) and its jobs."""

    def __init__(self, store: SnapshotStore | None, location: str | None = None,
                 archive: ArchiveTier | None = None) -> None:
        """``location``: how the pools report the store (default: its own description). Agents that report
        the same one are taken to share it: any of them restores the others' snapshots. ``archive``: the
        moves to and from a separate archive store (docs/snapshot-tiers.md), if there is one."""
        self.store = store
        self.archive = archive or ArchiveTier(store, None)
        self._location = location
        self._lock = threading.Lock()
        self._uploads: dict[str, _Upload] = {}
        self._opened: set[str] = set()  # check values of store keys open_store accepted

    # -- what the pools report -----------------------------------------------------------------------

    @property
    def location(self) -> str | None:
        if self.store is None:
            return None
        return self._location or self.store.describe()

    def pool_info(self, backend: Backend) -> PoolInfo:
        """The pool as the heartbeat reports it, with the store its snapshots go to (if they do)."""
        info = backend.pool_info()
        if self.store is None or not isinstance(backend, SnapshotImages | SnapshotStreams):
            return info
        return info.model_copy(update={"snapshot_store": self.location, "archive_store": self.archive.location})

    # -- uploads -------------------------------------------------------------------------------------------

    def _need(self, backend: Backend, pool: str) -> tuple[SnapshotStore, SnapshotImages | SnapshotStreams]:
        if self.store is None:
            raise DriverError("this storage agent has no snapshot store ([storage_agent.snapshot_store] driver "
                              "= \"none\")")
        if not isinstance(backend, SnapshotImages | SnapshotStreams):
            raise DriverError(f"pool {pool} ({backend.pool_info().backend}) cannot put its snapshots into the "
                              "snapshot store yet: they stay in the pool")
        return self.store, backend

    def tenant_key(self, store: SnapshotStore, secret: SecretStr, tenant: str) -> bytes:
        key = StoreKey(bytes.fromhex(secret.get_secret_value()))
        check = key.check_value()
        if check not in self._opened:
            open_store(store, key)  # made on first use; refused if another key made it
            with self._lock:
                self._opened.add(check)
        return key.tenant_key(tenant)

    def upload(self, backend: Backend, pool: str, snapshot_id: str, req: StoreSnapshot) -> StoredStatus:
        """Upload the snapshot (started now if it is not under way or stored), or say how far it got."""
        store, images = self._need(backend, pool)
        where = self.location or store.describe()
        keeps = images.keeps_snapshot_images()
        with self._lock:
            upload = self._uploads.get(snapshot_id)
            if upload is not None:
                answer = self._answer(snapshot_id, upload)
                if answer is not None:
                    return answer
        # Not under way here: stored already (an earlier run, another agent), or to start.
        manifest = find_manifest(store, snapshot_id)
        if manifest is not None:
            self._check_stored(manifest, snapshot_id, req)
            if not keeps:
                backend.remove_snapshot(snapshot_id)  # an earlier run stored it and stopped before this
            return _facts(manifest, where, pool_copy=keeps)
        source = _Source(images, snapshot_id)  # a file pool's image is found now
        tenant_key = self.tenant_key(store, req.store_key, req.tenant)
        previous = find_manifest(store, req.parent_snapshot_id) if req.parent_snapshot_id else None
        with self._lock:
            upload = self._uploads.get(snapshot_id)
            if upload is not None:  # another call started it meanwhile
                return self._answer(snapshot_id, upload) or StoredStatus(state="copying", store=where)
            upload = self._uploads[snapshot_id] = _Upload(pool)

        def work(cancel: threading.Event, progress: Callable[[int, int], None]) -> None:
            with source.open(previous.snapshot_id if previous else None) as (reader, size, changed):
                done = upload_snapshot(store, _Cancellable(reader, cancel), size, snapshot_id=snapshot_id,
                                       volume_id=req.volume_id, tenant=req.tenant, tenant_key=tenant_key,
                                       previous=previous, changed_blocks=changed, progress=progress)
            if cancel.is_set():
                raise CopyCancelled()
            if not keeps:
                backend.remove_snapshot(snapshot_id)  # the store holds it now: no full copy stays here
            upload.answer = _facts(done.manifest, where, pool_copy=keeps, chunks_uploaded=done.chunks_put,
                                   uploaded_bytes=done.bytes_put)
            log.info("snapshot %s stored in %s: %d chunks, %d read, %d new (%d bytes sent), %d verified%s",
                     snapshot_id, where, len(done.manifest.chunks), done.chunks_read, done.chunks_put, done.bytes_put,
                     done.chunks_verified, "" if keeps else "; the pool keeps nothing of it")

        job = Job(work, size_bytes=source.size_bytes, name=f"vbs-store-{snapshot_id}", what="upload")
        try:
            job.start()
            upload.job = job
        except BaseException:
            with self._lock:
                self._uploads.pop(snapshot_id, None)
            raise
        log.info("uploading snapshot %s of pool %s to %s%s", snapshot_id, pool, where,
                 f", incremental against {previous.snapshot_id}" if previous is not None else "")
        return StoredStatus(state="copying", size_bytes=job.size_bytes, store=where)

    def _answer(self, snapshot_id: str, upload: _Upload) -> StoredStatus | None:
        """What an upload under way or ended here says (the caller holds the lock); None: nothing (it
        was cancelled, or its failure was said and forgotten): start over."""
        job = upload.job
        if job is None or job.running:
            return StoredStatus(state="copying", size_bytes=job.size_bytes if job else 0,
                                progress=job.progress if job else 0, store=self.location)
        if job.state == "done" and upload.answer is not None:
            return upload.answer
        del self._uploads[snapshot_id]  # said once: the next call starts over
        if job.state == "failed":
            log.warning("snapshot %s: %s", snapshot_id, job.error)
            exc = job.exception
            if isinstance(exc, RetryLater):
                raise exc  # the store is down: the controller retries later, the snapshot stays pending
            if isinstance(exc, SnapshotSourceLost):
                raise exc  # its point in time is gone: the controller ends the snapshot now, not after retries
            return StoredStatus(state="error", size_bytes=job.size_bytes, error=job.error, store=self.location)
        return None

    @staticmethod
    def _check_stored(manifest: Manifest, snapshot_id: str, req: StoreSnapshot) -> None:
        if manifest.volume_id != req.volume_id or manifest.tenant != req.tenant:
            raise IncorrectState(f"the snapshot store holds {snapshot_id} of another volume or tenant",
                                 snapshot_id=snapshot_id)

    def status(self, backend: Backend, pool: str, snapshot_id: str) -> StoredStatus:
        """How the snapshot's upload stands, starting nothing (``absent``: neither under way nor stored)."""
        store, images = self._need(backend, pool)
        with self._lock:
            upload = self._uploads.get(snapshot_id)
            job = upload.job if upload is not None else None
            if upload is not None and (job is None or job.running):
                return StoredStatus(state="copying", size_bytes=job.size_bytes if job else 0,
                                    progress=job.progress if job else 0, store=self.location)
            if upload is not None and upload.answer is not None:
                return upload.answer
            if job is not None and job.state == "failed":
                return StoredStatus(state="error", size_bytes=job.size_bytes, error=job.error, store=self.location)
        manifest = find_manifest(store, snapshot_id)
        if manifest is None:
            return StoredStatus(state="absent", store=self.location)
        return _facts(manifest, self.location or store.describe(), pool_copy=images.keeps_snapshot_images())

    def delete(self, snapshot_id: str) -> None:
        """Forget the snapshot in the store: an upload under way is stopped, its manifest (and marker)
        deleted; its chunks go with the next garbage collection. Idempotent."""
        if self.store is None:
            raise DriverError("this storage agent has no snapshot store")
        with self._lock:
            upload = self._uploads.pop(snapshot_id, None)
        if upload is not None and upload.job is not None:
            upload.job.cancel()
            if not upload.job.wait(STOP_TIMEOUT_S):
                with self._lock:
                    self._uploads.setdefault(snapshot_id, upload)
                raise DriverError(f"the upload of {snapshot_id} did not stop within {STOP_TIMEOUT_S:g}s")
        delete_snapshot(self.store, snapshot_id)
        log.info("snapshot %s deleted from the snapshot store %s", snapshot_id, self.store.describe())
        self.archive.delete(snapshot_id)

    # -- restores ------------------------------------------------------------------------------------------

    def restore(self, backend: Backend, pool: str, volume_id: str, req: RestoreVolume) -> ItemStatus:
        """Make the volume from the snapshot's manifest in the store (a job), or say how far it got."""
        store, images = self._need(backend, pool)
        status = backend.volume_status(volume_id)
        if status.state in ("ready", "copying"):
            return status  # under way, or made (the key is not needed again)
        tenant_key = self.tenant_key(store, req.store_key, req.tenant)
        manifest = load_manifest(store, req.snapshot_id)
        if manifest.tenant != req.tenant:
            raise IncorrectState(f"the snapshot store holds {req.snapshot_id} for another tenant",
                                 snapshot_id=req.snapshot_id)
        luks, source_luks = req.luks_passphrase, req.source_luks_passphrase
        if isinstance(images, SnapshotStreams):
            return _fill_stream(images, store, manifest, volume_id, req, tenant_key)

        def fill(partial: Path, cancel: threading.Event, progress: Callable[[int, int], None]) -> None:
            if luks is not None:
                _restore_reencrypted(store, manifest, partial, tenant_key, req.size_bytes, luks, source_luks,
                                     cancel, progress)
                return
            with FileWriter(partial, manifest.volume_size) as writer:
                restore_snapshot(store, manifest, _Cancellable(writer, cancel), tenant_key=tenant_key,
                                 progress=progress, zeroed=writer.zeroed)
            _grow(partial, req.size_bytes + (header_bytes(partial) if req.encrypted else 0), manifest)

        # The pool's job logs its start ("filling volume … (restore of snap-…)").
        return images.fill_volume(volume_id, req.size_bytes, fill, what=f"restore of {req.snapshot_id}")

    def close(self) -> None:
        self.archive.close()
        with self._lock:
            uploads = list(self._uploads.values())
            self._uploads.clear()
        jobs = [u.job for u in uploads if u.job is not None]
        for job in jobs:
            job.cancel()
        for job in jobs:
            job.wait(STOP_TIMEOUT_S)


def _fill_stream(images: SnapshotStreams, store: SnapshotStore, manifest: Manifest, volume_id: str,
                 req: RestoreVolume, tenant_key: bytes) -> ItemStatus:
    """The restore onto a pool without files (an RBD image): made at its size, so it reads as zeros and only
    the snapshot's non-zero chunks are written. Such pools make no encrypted volumes."""
    if req.encrypted or req.luks_passphrase is not None:
        raise InvalidParameter(f"The volume '{volume_id}' is encrypted; its pool makes no encrypted volumes.")
    if req.size_bytes < manifest.volume_size:
        raise InvalidParameter(f"the size {req.size_bytes} is smaller than the snapshot {manifest.snapshot_id} "
                               f"({manifest.volume_size})")

    def fill(writer: VolumeWriter, cancel: threading.Event, progress: Callable[[int, int], None]) -> None:
        restore_snapshot(store, manifest, _Cancellable(writer, cancel), tenant_key=tenant_key, progress=progress,
                         zeroed=True)

    return images.fill_volume_with(volume_id, req.size_bytes, fill, what=f"restore of {req.snapshot_id}")


def _grow(path: Path, size: int, manifest: Manifest) -> None:
    """The restored image at the new volume's size (never smaller than the snapshot's)."""
    if size < manifest.volume_size:
        raise InvalidParameter(f"the size {size} is smaller than the snapshot {manifest.snapshot_id} "
                               f"({manifest.volume_size})")
    if size > manifest.volume_size:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)


def _restore_reencrypted(store: SnapshotStore, manifest: Manifest, partial: Path, tenant_key: bytes, size: int,
                         luks: SecretStr, source_luks: SecretStr | None, cancel: threading.Event,
                         progress: Callable[[int, int], None]) -> None:
    """The snapshot restored beside the partial (a hidden file the pool's listings skip), then re-encrypted
    into it under ``luks`` as a clone of a snapshot in the pool would be; the restored copy goes."""
    source = partial.with_name(f".{partial.name}.restore")
    source.unlink(missing_ok=True)
    try:
        with FileWriter(source, manifest.volume_size) as writer:
            restore_snapshot(store, manifest, _Cancellable(writer, cancel), tenant_key=tenant_key,
                             progress=lambda done, total: progress(done // 2, total), zeroed=writer.zeroed)
        if cancel.is_set():
            raise CopyCancelled()
        convert_to_luks(source, partial, size, luks, source_luks)
        progress(manifest.volume_size, manifest.volume_size)
    finally:
        source.unlink(missing_ok=True)
