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

import functools
import logging
import os
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Literal

from pydantic import SecretStr

from vbs import ids
from vbs.config import StorageAgentConfig
from vbs.errors import (
    DriverError,
    IncorrectState,
    InvalidParameter,
    NotFound,
    PointInTimeUnavailable,
    RetryLater,
)
from vbs.pools.exports import ExportDriver, FileSource, PointInTimeCopier
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.storage.backends import file_io
from vbs.storage.backends.file_io import FICLONE, CloneMethod
from vbs.storage.copy import DEFAULT_CHUNK_BYTES, CopyJob, Job, ProgressCallback, sparsify
from vbs.storage.luks import convert_to_luks, format_luks, header_bytes
from vbs.storage.pull import pull
from vbs.wire.connection import Connection, HostIdentity, NbdConnection
from vbs.wire.storage import ExportInfo, ItemStatus, PoolInfo, PoolInventory

__all__ = ["FileBackend", "FICLONE"]

log = logging.getLogger(__name__)

Kind = Literal["volume", "snapshot"]

# A cancelled copy stops after its current chunk; this only guards against a hung device.
_STOP_TIMEOUT = 120.0
_PULL_SECRETS = ".vbs-pull"  # the key files and client certificate of pulls from other nodes (0700)
_DIRS: dict[Kind, str] = {"volume": "volumes", "snapshot": "snapshots"}
_NOT_FOUND_CODES: dict[Kind, str] = {
    "volume": "InvalidVolume.NotFound",
    "snapshot": "InvalidSnapshot.NotFound",
}
_INTERRUPTED = "the snapshot copy was interrupted; its point in time is lost: delete the snapshot and take another"


class FileBackend:
    """A pool of raw files under ``path``: ``volumes/<id>.raw`` and ``snapshots/<id>.raw``.

    ``path`` must exist: creating it would silently fill the parent filesystem when the pool's own
    filesystem failed to mount. ``clone_method`` forces reflink or copy; None detects it.
    ``exports`` serves the volumes to hosts (None: a pool that serves no host, for tools and tests).
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
    ) -> None:
        self.name = name
        self.path = Path(path)
        self.exports = exports
        self._copier = exports if isinstance(exports, PointInTimeCopier) else None
        if not self.path.is_dir():
            raise DriverError(f"pool {name}: {self.path} is not a directory")
        try:
            for sub in _DIRS.values():
                (self.path / sub).mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise DriverError(f"pool {name}: cannot prepare {self.path}: {exc.strerror}") from exc
        self._chunk_bytes = copy_chunk_bytes
        # This node's certificate, as the client of another node's export it pulls a volume from.
        self._x509 = x509
        self._lock = threading.Lock()
        # Only caller threads touch these (under the lock); job threads only touch files, so waiting
        # for a cancelled job while holding the lock cannot deadlock.
        self._jobs: dict[tuple[Kind, str], Job] = {}
        self._plain_snapshots: dict[str, str] = {}  # snapshot id -> volume it copies with no daemon
        self._exporting: set[str] = set()  # volumes an export is being made for right now
        self._closed = False
        if clone_method == "copy":
            self.clone_method: CloneMethod = "copy"
        else:
            detected = file_io.probe_reflink(self.path, self.name)
            if clone_method == "reflink" and detected != "reflink":
                raise DriverError(f"pool {name}: {self.path} does not support reflink")
            self.clone_method = detected
        log.info("pool %s at %s: clone method %s", name, self.path, self.clone_method)

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, exports: ExportDriver) -> FileBackend:
        return cls(cfg.pool_name, cfg.pool_path.resolve(), exports=exports, clone_method=cfg.clone_method,
                   x509=X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))

    # -- pool -------------------------------------------------------------------------------------

    def pool_info(self) -> PoolInfo:
        st = os.statvfs(self.path)
        return PoolInfo(
            name=self.name,
            backend="file",
            capacity_bytes=st.f_blocks * st.f_frsize,
            free_bytes=st.f_bavail * st.f_frsize,
            clone_method=self.clone_method,
            point_in_time=self.clone_method == "reflink" or self._copier is not None,
            encryption=True,
        )

    def inventory(self) -> PoolInventory:
        found: dict[Kind, set[str]] = {"volume": set(), "snapshot": set()}
        with self._lock:
            for kind, sub in _DIRS.items():
                with os.scandir(self.path / sub) as entries:
                    for entry in entries:
                        item_id = entry.name.removesuffix(".partial").removesuffix(".raw")
                        if entry.name.endswith((".raw", ".raw.partial")) and ids.is_valid(kind, item_id):
                            found[kind].add(item_id)
                found[kind].update(item_id for (k, item_id), job in self._jobs.items() if k == kind and job.running)
        return PoolInventory(volumes=sorted(found["volume"]), snapshots=sorted(found["snapshot"]))

    def volume_usage(self) -> dict[str, int]:
        """Bytes allocated to each complete volume file (sparse: what was written, not the size)."""
        used: dict[str, int] = {}
        try:
            with os.scandir(self.path / _DIRS["volume"]) as entries:
                for entry in entries:
                    volume_id = entry.name.removesuffix(".raw")
                    if entry.name.endswith(".raw") and ids.is_valid("volume", volume_id):
                        try:
                            used[volume_id] = entry.stat(follow_symlinks=False).st_blocks * 512
                        except FileNotFoundError:
                            continue  # removed meanwhile
        except OSError as exc:
            log.warning("pool %s: cannot list volumes for their usage: %s", self.name, exc.strerror)
        return used

    def close(self) -> None:
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._plain_snapshots.clear()
            for job in jobs:
                job.cancel()
            for job in jobs:
                job.wait(_STOP_TIMEOUT)

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
        file_io.check_size(size_bytes)
        with self._lock:
            self._check_open()
            status = self._status("volume", volume_id, final)
            if status.state in ("ready", "copying"):
                return status
            self._jobs.pop(("volume", volume_id), None)  # error or stalled: forget it and start over
            if passphrase is not None and source_snapshot_id is not None:
                return self._convert(volume_id, final, source_snapshot_id, size_bytes, passphrase, source_passphrase)
            if passphrase is not None:
                return self._create_luks(final, size_bytes, passphrase)
            if source_snapshot_id is None:
                file_io.create_sparse(final, size_bytes)
                return file_io.ready(final)
            return self._clone("volume", volume_id, final, "snapshot", source_snapshot_id, size_bytes,
                               container=container)

    def _convert(self, volume_id: str, final: Path, source_id: str, size_bytes: int, passphrase: SecretStr,
                 source_passphrase: SecretStr | None) -> ItemStatus:
        """Start re-encrypting snapshot ``source_id`` into ``final`` (a job: every block is written anew)."""
        source = self._final("snapshot", source_id)
        if not source.exists():
            raise self._missing("snapshot", source_id)
        partial = file_io.partial_of(final)
        partial.unlink(missing_ok=True)

        def work(_cancel: object, _progress: object) -> None:
            convert_to_luks(source, partial, size_bytes, passphrase, source_passphrase)

        job = Job(work, size_bytes=size_bytes, on_success=functools.partial(file_io.publish, partial, final),
                  on_failure=lambda: partial.unlink(missing_ok=True), name=f"vbs-encrypt-{volume_id}")
        job.start()
        self._jobs[("volume", volume_id)] = job
        log.info("re-encrypting snapshot %s into volume %s", source_id, volume_id)
        return ItemStatus(state="copying", size_bytes=size_bytes, progress=0)

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
            return self._status("volume", volume_id, final)

    def remove_volume(self, volume_id: str) -> None:
        self._remove("volume", volume_id)

    def resize_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        return self._resize(volume_id, size_bytes, container=False)

    def resize_encrypted_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        return self._resize(volume_id, size_bytes, container=True)

    def _resize(self, volume_id: str, size_bytes: int, *, container: bool) -> ItemStatus:
        final = self._final("volume", volume_id)
        file_io.check_size(size_bytes)
        with self._lock:
            try:
                fd = os.open(final, os.O_WRONLY | file_io.OPEN)
            except FileNotFoundError:
                raise self._missing("volume", volume_id) from None
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
        final = self._final("volume", volume_id)
        file_io.check_size(size_bytes)
        with self._lock:
            self._check_open()
            status = self._status("volume", volume_id, final)
            if status.state == "error":
                del self._jobs[("volume", volume_id)]  # said once; the next call starts over
            if status.state in ("ready", "copying", "error"):
                return status
            file_io.create_sparse(final, size_bytes, publish_it=False, at=file_io.partial_of(final))
            secrets_dir = self.path / _PULL_SECRETS
            secrets_dir.mkdir(mode=0o700, exist_ok=True)
            x509_dir = qemu_x509_dir(self._x509, secrets_dir / "x509", "client") if self._x509 else None
            work = functools.partial(pull, source, file_io.partial_of(final), size_bytes, secrets_dir=secrets_dir,
                                     x509_dir=x509_dir)
            job = Job(lambda cancel, progress: work(cancel=cancel, progress=progress), size_bytes=size_bytes,
                      on_success=functools.partial(file_io.publish, file_io.partial_of(final), final),
                      on_failure=lambda: file_io.partial_of(final).unlink(missing_ok=True),
                      name=f"vbs-pull-{volume_id}")
            job.start()
            self._jobs[("volume", volume_id)] = job
            log.info("pulling volume %s from %s", volume_id, source.host or source.socket)
            return ItemStatus(state="copying", size_bytes=size_bytes, progress=0)

    def volume_path(self, volume_id: str) -> Path:
        """Where the raw data of a ready volume is (this backend's own; tools and tests use it)."""
        final = self._final("volume", volume_id)
        with self._lock:
            if not final.exists():
                raise self._missing("volume", volume_id)
        return final

    # -- snapshots --------------------------------------------------------------------------------

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        final = self._final("snapshot", snapshot_id)
        source = self._final("volume", volume_id)
        with self._lock:
            self._check_open()
            status = self._snapshot_state(snapshot_id, volume_id, final)
            if status.state != "absent":
                return status
            if self.clone_method == "reflink":
                return self._clone("snapshot", snapshot_id, final, "volume", volume_id, None)
            if self._copier is not None:
                return self._start_daemon_copy(snapshot_id, volume_id, source, final)
            if volume_id in self._exporting or (self.exports is not None and self.exports.is_exported(volume_id)):
                raise PointInTimeUnavailable(
                    f"The volume '{volume_id}' is exported to a host and this storage node cannot copy it at "
                    "one instant; its hypervisor must take the copy.")
            status = self._clone("snapshot", snapshot_id, final, "volume", volume_id, None)
            if status.state == "copying":
                self._plain_snapshots[snapshot_id] = volume_id
            return status

    def snapshot_status(self, snapshot_id: str) -> ItemStatus:
        final = self._final("snapshot", snapshot_id)
        with self._lock:
            return self._status("snapshot", snapshot_id, final)

    def remove_snapshot(self, snapshot_id: str) -> None:
        final = self._final("snapshot", snapshot_id)
        if self._copier is not None:
            self._copier.remove_copy(snapshot_id)
        if self.exports is not None:
            for export in self.exports.list_exports():
                if export.key == snapshot_id:
                    self.exports.remove_export(snapshot_id, export.host)
        self._remove("snapshot", snapshot_id)
        with self._lock:
            self._plain_snapshots.pop(snapshot_id, None)
        log.debug("removed snapshot %s (%s)", snapshot_id, final.name)

    def snapshot_target(self, snapshot_id: str, volume_id: str, host: HostIdentity) -> Connection:
        final = self._final("snapshot", snapshot_id)
        source = self._final("volume", volume_id)
        exports = self._need_exports()
        partial = file_io.partial_of(final)
        with self._lock:
            self._check_open()
            if final.exists():
                raise IncorrectState(f"The snapshot '{snapshot_id}' is complete already.")
            if ("snapshot", snapshot_id) in self._jobs:
                raise IncorrectState(f"The snapshot '{snapshot_id}' is being copied on this node.")
            if not partial.exists():
                try:
                    size = os.stat(source).st_size
                except FileNotFoundError:
                    raise self._missing("volume", volume_id) from None
                file_io.create_sparse(partial, size, publish_it=False)
        return exports.ensure_export(snapshot_id, FileSource(partial), host, read_only=False)

    def finish_snapshot_target(self, snapshot_id: str, host_name: str) -> ItemStatus:
        final = self._final("snapshot", snapshot_id)
        exports = self._need_exports()
        exports.remove_export(snapshot_id, host_name)
        with self._lock:
            job = self._jobs.get(("snapshot", snapshot_id))
            if final.exists() or job is not None:
                return self._status("snapshot", snapshot_id, final)
            partial = file_io.partial_of(final)
            if not partial.exists():
                raise self._missing("snapshot", snapshot_id)
            # The hypervisor's copy wrote zeros as data (an iSCSI target has no other way): give the
            # space back before the snapshot is published.
            self._start_finish(snapshot_id, final, scan_data=True)
            return self._status("snapshot", snapshot_id, final)

    # -- how hosts reach volumes ----------------------------------------------------------------------

    def connection_for(self, volume_id: str, host: HostIdentity, *, read_only: bool = False,
                       protocols: Collection[str] = ()) -> Connection:
        final = self._final("volume", volume_id)
        exports = self._need_exports()
        with self._lock:
            if not final.exists():
                raise self._missing("volume", volume_id)
            copying = self._plain_copies_of(volume_id)
            if copying:
                raise RetryLater(f"The volume '{volume_id}' is being copied into snapshot {copying[0]}, which a "
                                 "writer would spoil; it can be attached once the copy is done.")
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

    # -- internals (callers hold self._lock where the name says nothing else) ---------------------

    def _final(self, kind: Kind, item_id: str) -> Path:
        ids.check(kind, item_id)
        return self.path / _DIRS[kind] / f"{item_id}.raw"

    def _check_open(self) -> None:
        if self._closed:
            raise DriverError(f"pool {self.name} is closed")

    def _need_exports(self) -> ExportDriver:
        if self.exports is None:
            raise DriverError(f"pool {self.name} serves no host (it has no export driver)")
        return self.exports

    def _plain_copies_of(self, volume_id: str) -> list[str]:
        """Snapshots being copied from ``volume_id`` here, with no daemon to see later writes."""
        for snap in [s for s, v in self._plain_snapshots.items() if v == volume_id]:
            job = self._jobs.get(("snapshot", snap))
            # A published snapshot is done, even while its job thread is still returning.
            if job is None or not job.running or self._final("snapshot", snap).exists():
                del self._plain_snapshots[snap]
        return [s for s, v in self._plain_snapshots.items() if v == volume_id]

    def _job(self, kind: Kind, item_id: str) -> Job | None:
        """The job of an item if it still runs or its failure is still to be reported."""
        job = self._jobs.get((kind, item_id))
        if job is not None and not (job.running or job.state == "failed"):
            del self._jobs[(kind, item_id)]
            return None
        return job

    def _status(self, kind: Kind, item_id: str, final: Path) -> ItemStatus:
        if final.exists():
            return file_io.ready(final)
        job = self._job(kind, item_id)
        if job is not None and job.running:
            return ItemStatus(state="copying", size_bytes=job.size_bytes, progress=job.progress)
        if job is not None:
            return ItemStatus(state="error", size_bytes=job.size_bytes, error=job.error)
        try:
            return ItemStatus(state="stalled", size_bytes=os.lstat(file_io.partial_of(final)).st_size)
        except FileNotFoundError:
            return ItemStatus(state="absent")

    def _snapshot_state(self, snapshot_id: str, volume_id: str, final: Path) -> ItemStatus:
        """Where a snapshot stands for an ``ensure``: ``absent`` means start it now."""
        status = self._status("snapshot", snapshot_id, final)
        if status.state != "stalled":
            return status
        # A partial with no job of ours behind it: the export daemon's copy, a hypervisor's, or an
        # interrupted one.
        if self._copier is not None:
            copy = self._copier.ensure_copy(snapshot_id, volume_id, FileSource(self._final("volume", volume_id)),
                                            file_io.partial_of(final))
            if copy.state == "ready":
                self._start_finish(snapshot_id, final, scan_data=False)
                return self._status("snapshot", snapshot_id, final)
            return copy
        if self.exports is not None and self.exports.is_exported(snapshot_id):
            raise IncorrectState(f"The snapshot '{snapshot_id}' is being copied by a hypervisor; finish it there.")
        return ItemStatus(state="error", size_bytes=status.size_bytes, error=_INTERRUPTED)

    def _start_daemon_copy(self, snapshot_id: str, volume_id: str, source: Path, final: Path) -> ItemStatus:
        try:
            size = os.stat(source).st_size
        except FileNotFoundError:
            raise self._missing("volume", volume_id) from None
        st = os.statvfs(self.path)
        if st.f_bavail * st.f_frsize < size:
            # The daemon's copy job allocates the whole size while it runs (zero ranges included);
            # the unwritten part is given back when it is done.
            raise DriverError(f"snapshot {snapshot_id}: a point-in-time copy of {volume_id} needs {size} bytes free "
                              f"in pool {self.name} while it runs")
        partial = file_io.partial_of(final)
        file_io.create_sparse(partial, size, publish_it=False)
        assert self._copier is not None
        try:
            status = self._copier.ensure_copy(snapshot_id, volume_id, FileSource(source), partial)
        except Exception:
            partial.unlink(missing_ok=True)
            raise
        if status.state == "ready":
            self._start_finish(snapshot_id, final, scan_data=False)
            return self._status("snapshot", snapshot_id, final)
        return status

    def _start_finish(self, snapshot_id: str, final: Path, *, scan_data: bool) -> None:
        """Give back the space a copy made by someone else allocated for zeros, then publish it."""
        partial = file_io.partial_of(final)

        def work(cancel: threading.Event, progress: ProgressCallback) -> None:
            fd = os.open(partial, os.O_RDWR | file_io.OPEN)
            try:
                sparsify(fd, scan_data=scan_data, cancel=cancel, progress=progress)
            finally:
                os.close(fd)

        def publish() -> None:
            file_io.publish(partial, final)
            if self._copier is not None:
                # Only now: until the snapshot is published, the daemon's record of the copy is what
                # tells a finished copy from one to start (a new one would be of a later instant).
                try:
                    self._copier.remove_copy(snapshot_id)
                except DriverError as exc:
                    log.warning("snapshot %s: the export daemon's copy record stays: %s", snapshot_id, exc.message)

        job = Job(work, size_bytes=os.lstat(partial).st_size, on_success=publish, on_failure=partial.unlink,
                  name=f"vbs-finish-{snapshot_id}")
        job.start()
        self._jobs[("snapshot", snapshot_id)] = job

    def _missing(self, kind: Kind, item_id: str) -> IncorrectState | NotFound:
        final = self._final(kind, item_id)
        if self._job(kind, item_id) is not None or file_io.partial_of(final).exists():
            return IncorrectState(f"The {kind} '{item_id}' is not ready yet.")
        return NotFound(f"The {kind} '{item_id}' does not exist.", code=_NOT_FOUND_CODES[kind])

    def _clone(
        self,
        kind: Kind,
        item_id: str,
        final: Path,
        source_kind: Kind,
        source_id: str,
        size_bytes: int | None,
        *,
        container: bool = False,
    ) -> ItemStatus:
        """Make ``final`` a copy of the source item: a reflink at once, or a copy job started now. A
        ``container``'s size is its payload's (its LUKS header on top)."""
        partial = file_io.partial_of(final)
        try:
            src_fd = os.open(self._final(source_kind, source_id), os.O_RDONLY | file_io.OPEN)
        except FileNotFoundError:
            # A stalled partial whose source is gone can never finish: drop it with the error.
            partial.unlink(missing_ok=True)
            raise self._missing(source_kind, source_id) from None
        try:
            source_size = os.fstat(src_fd).st_size
            if size_bytes is not None and container:
                size_bytes += header_bytes(self._final(source_kind, source_id))
            if size_bytes is not None and size_bytes < source_size:
                raise InvalidParameter(
                    f"The size {size_bytes} is smaller than the snapshot {source_id} ({source_size})"
                )
            size = max(source_size, size_bytes or 0)
            cloned = self.clone_method == "reflink" and file_io.reflink(src_fd, partial, size)
            if not cloned:
                job = CopyJob(
                    src_fd,
                    partial,
                    size,
                    on_success=functools.partial(file_io.publish, partial, final),
                    chunk_bytes=self._chunk_bytes,
                    name=f"vbs-copy-{item_id}",
                )
        except BaseException:
            os.close(src_fd)
            raise
        if cloned:
            os.close(src_fd)
            try:
                file_io.publish(partial, final)
            except OSError as exc:
                partial.unlink(missing_ok=True)
                raise DriverError(f"clone {item_id}: {exc.strerror}") from exc
            return file_io.ready(final)
        job.start()  # owns src_fd from here on
        self._jobs[(kind, item_id)] = job
        log.info("copying %s %s from %s %s", kind, item_id, source_kind, source_id)
        return ItemStatus(state="copying", size_bytes=size, progress=job.progress)

    def _remove(self, kind: Kind, item_id: str) -> None:
        final = self._final(kind, item_id)
        with self._lock:
            job = self._jobs.pop((kind, item_id), None)
            if job is not None:
                job.cancel()
                if not job.wait(_STOP_TIMEOUT):
                    self._jobs[(kind, item_id)] = job
                    raise DriverError(f"remove {item_id}: its copy did not stop within {_STOP_TIMEOUT:g}s")
            try:
                file_io.partial_of(final).unlink(missing_ok=True)
                final.unlink(missing_ok=True)
                file_io.fsync_dir(final.parent)
            except OSError as exc:
                raise DriverError(f"remove {item_id}: {exc.strerror}") from exc
