"""The ``file`` backend: volumes and snapshots as raw sparse files in a pool directory.

Snapshots and clones are reflinks (FICLONE: O(1) on xfs and btrfs) where the filesystem can, else a
background sparse copy with progress. A finished file only ever appears by renaming its ``.partial``.
Hosts reach volumes through the pool's export driver (NBD, iSCSI).

A snapshot is a point-in-time copy of its volume, also while hosts write to it:
- on a reflink pool the clone is taken at one instant (every write the export daemon acknowledged
  is in the file);
- on a copy pool whose export driver copies at one instant (``PointInTimeCopier``: the NBD daemon,
  through which every write passes), the daemon runs the copy, exported or not;
- otherwise a volume that no host can write (not exported) is copied here, and no export of it is
  made until the copy is done (``connection_for`` raises ``RetryLater``); one that hosts write to
  is refused with ``PointInTimeUnavailable``: the hypervisor that writes to it copies it instead,
  into a snapshot *target* this backend exports to that host (``snapshot_target``).
A snapshot copy that was interrupted (agent or daemon restart) is an error, never restarted: the
instant it stood for is lost. Clones from snapshots restart: their source does not change.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from pathlib import Path

from pydantic import SecretStr

from vbs import ids
from vbs.config import NO_SNAPSHOT_STORE, StorageAgentConfig
from vbs.errors import DriverError, InvalidParameter, RetryLater
from vbs.pools.backend import Fill, ImageLayout, check_size
from vbs.pools.exports import ExportDriver, FileSource, PointInTimeCopier, PointInTimeViewer
from vbs.qemu.tls import X509Files
from vbs.storage.backends import file_io
from vbs.storage.backends.file_copies import STOP_TIMEOUT, CopyJobs, Kind
from vbs.storage.backends.file_io import FICLONE, CloneMethod
from vbs.storage.backends.file_pool import PoolFolder
from vbs.storage.backends.file_snapshots import Snapshots
from vbs.storage.backends.file_streams import Streams
from vbs.storage.copy import DEFAULT_CHUNK_BYTES, Job
from vbs.storage.luks import format_luks, header_bytes
from vbs.wire.connection import Connection, HostIdentity, NbdConnection
from vbs.wire.storage import ExportInfo, ItemStatus, PoolInfo, PoolInventory

__all__ = ["FileBackend", "FICLONE"]

log = logging.getLogger(__name__)


class FileBackend:
    """A pool of raw files under ``path``: ``volumes/<id>.raw`` and ``snapshots/<id>.raw``.

    ``path`` must exist (``PoolFolder``). ``clone_method`` forces reflink or copy; None detects it.
    ``exports`` serves the volumes to hosts (None: a pool that serves no host, for tools and tests).
    Its files and copy jobs are ``file_copies``'s, its snapshots ``file_snapshots``'s, its folder
    ``file_pool``'s.
    """

    def __init__(
        self,
        name: str,
        path: str | Path,
        *,
        exports: ExportDriver | None = None,
        clone_method: CloneMethod | None = None,
        copy_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        x509: X509Files | None = None,
        stream_snapshots: bool = False,
    ) -> None:
        self.name = name
        self.path = Path(path)
        self.exports = exports
        self._copier = exports if isinstance(exports, PointInTimeCopier) else None
        self._folder = PoolFolder(name, self.path)
        method: CloneMethod = "copy"
        if clone_method != "copy":
            method = file_io.probe_reflink(self.path, self.name)
            if clone_method == "reflink" and method != "reflink":
                raise DriverError(f"pool {name}: {self.path} does not support reflink")
        self._files = CopyJobs(name, self.path, clone_method=method, chunk_bytes=copy_chunk_bytes,
                               copier=self._copier, x509=x509)
        self._lock = self._files.lock
        self._jobs = self._files.jobs
        self._exporting: set[str] = set()  # volumes an export is being made for right now
        # Snapshots that go to the store are read in place on a copy pool: no full copy (file_streams).
        streams = (Streams(self._files, exports if isinstance(exports, PointInTimeViewer) else None)
                   if stream_snapshots and method == "copy" else None)
        self._snapshots = Snapshots(self._files, exports, self._copier, self._exporting, self._need_exports, streams)
        log.info("pool %s at %s: clone method %s", name, self.path, self.clone_method)

    @property
    def clone_method(self) -> CloneMethod:
        return self._files.clone_method

    @clone_method.setter
    def clone_method(self, method: CloneMethod) -> None:
        self._files.clone_method = method

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, exports: ExportDriver) -> FileBackend:
        return cls(cfg.pool_name, cfg.pool_path.resolve(), exports=exports, clone_method=cfg.clone_method,
                   x509=X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca),
                   stream_snapshots=cfg.snapshot_store.driver != NO_SNAPSHOT_STORE)

    # -- pool -------------------------------------------------------------------------------------

    def lost(self) -> str | None:
        """Why the pool's storage is gone, or None (``PoolFolder.lost``)."""
        return self._folder.lost()

    def pool_info(self) -> PoolInfo:
        lost = self.lost()
        capacity, free = self._folder.room()
        return PoolInfo(
            name=self.name,
            backend="file",
            # A lost pool has no room: nothing is placed in it.
            capacity_bytes=0 if lost else capacity,
            free_bytes=0 if lost else free,
            clone_method=self.clone_method,
            point_in_time=self.clone_method == "reflink" or self._copier is not None,
            encryption=True,
            lost=lost,
        )

    def inventory(self) -> PoolInventory:
        return self._folder.inventory(self._files)

    def volume_usage(self) -> dict[str, int]:
        """Bytes allocated to each complete volume file (sparse: what was written, not the size)."""
        return self._folder.volume_usage()

    def close(self) -> None:
        with self._lock:
            self._snapshots.forget()
            jobs: list[Job] = self._files.close()
            for job in jobs:
                job.wait(STOP_TIMEOUT)

    # -- volumes ----------------------------------------------------------------------------------
    def ensure_volume(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None = None) -> ItemStatus:
        return self._ensure(volume_id, size_bytes, source_snapshot_id)

    def ensure_encrypted_volume(self, volume_id: str, size_bytes: int, passphrase: SecretStr | None,
                                source_snapshot_id: str | None = None,
                                source_passphrase: SecretStr | None = None) -> ItemStatus:
        """A volume that is a LUKS container: empty under ``passphrase`` (hosts open it; this node never sees
        its plaintext), re-encrypted from a snapshot, or a clone of an encrypted snapshot."""
        if passphrase is None and source_snapshot_id is None:
            raise InvalidParameter(f"Volume {volume_id}: an encrypted volume needs a passphrase or a snapshot")
        return self._ensure(volume_id, size_bytes, source_snapshot_id, container=True, passphrase=passphrase,
                            source_passphrase=source_passphrase)

    def _ensure(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None, *, container: bool = False,
                passphrase: SecretStr | None = None, source_passphrase: SecretStr | None = None) -> ItemStatus:
        final = self._final("volume", volume_id)
        if source_snapshot_id is not None:
            ids.check("snapshot", source_snapshot_id)
        check_size(size_bytes)
        with self._lock:
            self._files.check_open()
            status = self._files.status("volume", volume_id, final)
            if status.state in ("ready", "copying"):
                return status
            self._jobs.pop(("volume", volume_id), None)  # error or stalled: forget it and start over
            if passphrase is not None and source_snapshot_id is not None:
                return self._files.convert(volume_id, final, source_snapshot_id, size_bytes, passphrase,
                                           source_passphrase)
            if passphrase is not None:
                return self._create_luks(final, size_bytes, passphrase)
            if source_snapshot_id is None:
                file_io.create_sparse(final, size_bytes)
                return file_io.ready(final)
            return self._files.clone("volume", volume_id, final, "snapshot", source_snapshot_id, size_bytes,
                                     container=container)

    @staticmethod
    def _create_luks(final: Path, size_bytes: int, passphrase: SecretStr) -> ItemStatus:
        """A LUKS container of ``size_bytes`` at ``final``, through its partial (under the pool's lock)."""
        partial = file_io.partial_of(final)
        partial.unlink(missing_ok=True)
        try:
            format_luks(partial, size_bytes, passphrase)
            file_io.publish(partial, final)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return file_io.ready(final)

    def volume_status(self, volume_id: str) -> ItemStatus:
        final = self._final("volume", volume_id)
        with self._lock:
            return self._files.status("volume", volume_id, final)

    def remove_volume(self, volume_id: str) -> None:
        self._files.remove("volume", volume_id)

    def resize_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        return self._resize(volume_id, size_bytes, container=False)

    def resize_encrypted_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        return self._resize(volume_id, size_bytes, container=True)

    def _resize(self, volume_id: str, size_bytes: int, *, container: bool) -> ItemStatus:
        final = self._final("volume", volume_id)
        check_size(size_bytes)
        with self._lock:
            try:
                fd = os.open(final, os.O_WRONLY | file_io.OPEN)
            except FileNotFoundError:
                raise self._files.missing("volume", volume_id) from None
            try:
                current = os.fstat(fd).st_size
                if container:
                    size_bytes += header_bytes(final)  # the payload grows to the size, its header in front
                if size_bytes < current:
                    raise InvalidParameter(
                        f"Volume {volume_id}: the new size {size_bytes} is smaller than the current "
                        f"size {current}; volumes can only grow"
                    )
                if size_bytes > current:
                    os.ftruncate(fd, size_bytes)
                    os.fsync(fd)
            except OSError as exc:
                raise file_io.refusal(f"resize {volume_id}", size_bytes, exc) from exc
            finally:
                os.close(fd)
            return file_io.ready(final)

    def pull_volume(self, volume_id: str, size_bytes: int, source: NbdConnection) -> ItemStatus:
        """Make the volume a copy of what ``source`` (another node's export of it) serves: a job that
        answers ``copying`` with progress, then ``ready``; see ``vbs.storage.pull``."""
        return self._volume_job(volume_id, size_bytes,
                                lambda final: self._files.pull(volume_id, final, size_bytes, source))

    # -- the snapshot store's side (``vbs.storage.stored_snapshots``) ---------------------------------

    def snapshot_image(self, snapshot_id: str) -> Path:
        return self._snapshots.image(snapshot_id)

    def snapshot_image_layout(self, snapshot_id: str) -> ImageLayout | None:
        return self._snapshots.layout(snapshot_id)

    def changed_since(self, snapshot_id: str, since: str) -> list[tuple[int, int]] | None:
        return self._snapshots.changed_since(snapshot_id, since)

    def keeps_snapshot_images(self) -> bool:
        return self.clone_method == "reflink"

    def fill_volume(self, volume_id: str, size_bytes: int, fill: Fill, *, what: str) -> ItemStatus:
        return self._volume_job(volume_id, size_bytes,
                                lambda final: self._files.fill(volume_id, final, size_bytes, fill, what=what))

    def _volume_job(self, volume_id: str, size_bytes: int, start: Callable[[Path], ItemStatus]) -> ItemStatus:
        """The status of the volume's job (a failed one is said once), or ``start(final)``'s if it has none
        and is not ready."""
        final = self._final("volume", volume_id)
        check_size(size_bytes)
        with self._lock:
            self._files.check_open()
            status = self._files.status("volume", volume_id, final)
            if status.state == "error":
                del self._jobs[("volume", volume_id)]  # said once; the next call starts over
            if status.state in ("ready", "copying", "error"):
                return status
            return start(final)

    def volume_path(self, volume_id: str) -> Path:
        """Where the raw data of a ready volume is (this backend's own; tools and tests use it)."""
        return self._ready_file("volume", volume_id)

    # -- snapshots (``file_snapshots``) -------------------------------------------------------------

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        return self._snapshots.ensure(snapshot_id, volume_id)

    def snapshot_status(self, snapshot_id: str) -> ItemStatus:
        return self._snapshots.status(snapshot_id)

    def remove_snapshot(self, snapshot_id: str) -> None:
        self._snapshots.remove(snapshot_id)

    def snapshot_target(self, snapshot_id: str, volume_id: str, host: HostIdentity) -> Connection:
        return self._snapshots.target(snapshot_id, volume_id, host)

    def finish_snapshot_target(self, snapshot_id: str, host_name: str) -> ItemStatus:
        return self._snapshots.finish_target(snapshot_id, host_name)

    # -- how hosts reach volumes ----------------------------------------------------------------------

    def connection_for(self, volume_id: str, host: HostIdentity, *, read_only: bool = False,
                       protocols: Collection[str] = ()) -> Connection:
        final = self._final("volume", volume_id)
        exports = self._need_exports()
        with self._lock:
            if not final.exists():
                raise self._files.missing("volume", volume_id)
            copying = self._snapshots.plain_copies_of(volume_id)
            if copying:
                raise RetryLater(f"The volume '{volume_id}' is being copied into snapshot {copying[0]}, which a "
                                 "writer would spoil; it can be attached once that snapshot is made (stored).")
            self._exporting.add(volume_id)
        try:
            return exports.ensure_export(volume_id, FileSource(final), host, read_only=read_only)
        finally:
            with self._lock:
                self._exporting.discard(volume_id)

    def remove_connection(self, volume_id: str, host_name: str) -> None:
        ids.check("volume", volume_id)
        self._need_exports().remove_export(volume_id, host_name)

    def refresh_connection(self, volume_id: str, host_name: str) -> Connection:
        final = self._final("volume", volume_id)
        return self._need_exports().refresh_export(volume_id, FileSource(final), host_name)

    def retire_connections(self, volume_id: str, host_name: str) -> None:
        ids.check("volume", volume_id)
        self._need_exports().retire_exports(volume_id, host_name)

    def native_connections(self) -> list[ExportInfo]:
        return []  # hosts reach files through exports only

    # -- internals --------------------------------------------------------------------------------

    def _final(self, kind: Kind, item_id: str) -> Path:
        return self._files.final(kind, item_id)

    def _ready_file(self, kind: Kind, item_id: str) -> Path:
        """The item's file, if it is ready (else why not: ``missing``)."""
        final = self._final(kind, item_id)
        with self._lock:
            if not final.exists():
                raise self._files.missing(kind, item_id)
        return final

    def _need_exports(self) -> ExportDriver:
        if self.exports is None:
            raise DriverError(f"pool {self.name} serves no host (it has no export driver)")
        return self.exports
