"""The ``file`` backend: volumes and snapshots as raw sparse files in a pool directory.

Snapshots and clones are reflinks (FICLONE: O(1) on xfs and btrfs) where the filesystem can, else a
background sparse copy with progress. A finished file only ever appears by renaming its ``.partial``.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Literal

from vbs import ids
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound
from vbs.storage.backends.base import CloneMethod, ItemStatus, PoolInfo
from vbs.storage.copy import DEFAULT_CHUNK_BYTES, CopyJob

__all__ = ["FileBackend", "FICLONE"]

log = logging.getLogger(__name__)

FICLONE = getattr(fcntl, "FICLONE", 0x40049409)  # fcntl only names it from Python 3.12

# What FICLONE answers when the filesystem (or this pair of files) cannot share extents.
_NO_REFLINK = {errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS}
# The agent runs as root in a directory it owns: never follow a link planted there.
_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW
# A cancelled copy stops after its current chunk; this only guards against a hung device.
_STOP_TIMEOUT = 120.0
_PROBE_PREFIX = ".vbs-reflink-probe-"
_SECTOR = 512

Kind = Literal["volume", "snapshot"]
_DIRS: dict[Kind, str] = {"volume": "volumes", "snapshot": "snapshots"}
_NOT_FOUND_CODES: dict[Kind, str] = {
    "volume": "InvalidVolume.NotFound",
    "snapshot": "InvalidSnapshot.NotFound",
}


class FileBackend:
    """A pool of raw files under ``path``: ``volumes/<id>.raw`` and ``snapshots/<id>.raw``.

    ``path`` must exist: creating it would silently fill the parent filesystem when the pool's own
    filesystem failed to mount. ``clone_method`` forces reflink or copy; None detects it.
    """

    def __init__(
        self,
        name: str,
        path: str | Path,
        *,
        clone_method: CloneMethod | None = None,
        copy_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.name = name
        self.path = Path(path)
        if not self.path.is_dir():
            raise DriverError(f"pool {name}: {self.path} is not a directory")
        try:
            for sub in _DIRS.values():
                (self.path / sub).mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise DriverError(f"pool {name}: cannot prepare {self.path}: {exc.strerror}") from exc
        self._chunk_bytes = copy_chunk_bytes
        self._lock = threading.Lock()
        # Only caller threads touch the registry (under the lock); copy threads only touch files,
        # so waiting for a cancelled job while holding the lock cannot deadlock.
        self._jobs: dict[tuple[Kind, str], CopyJob] = {}
        self._closed = False
        if clone_method == "copy":
            self.clone_method: CloneMethod = "copy"
        else:
            detected = self._probe_reflink()
            if clone_method == "reflink" and detected != "reflink":
                raise DriverError(f"pool {name}: {self.path} does not support reflink")
            self.clone_method = detected
        log.info("pool %s at %s: clone method %s", name, self.path, self.clone_method)

    # -- pool -------------------------------------------------------------------------------------

    def pool_info(self) -> PoolInfo:
        st = os.statvfs(self.path)
        return PoolInfo(
            name=self.name,
            path=str(self.path),
            capacity_bytes=st.f_blocks * st.f_frsize,
            free_bytes=st.f_bavail * st.f_frsize,
            clone_method=self.clone_method,
        )

    def inventory(self) -> dict[str, list[str]]:
        result: dict[str, list[str]] = {}
        with self._lock:
            for kind, sub in _DIRS.items():
                found: set[str] = set()
                with os.scandir(self.path / sub) as entries:
                    for entry in entries:
                        item_id = entry.name.removesuffix(".partial").removesuffix(".raw")
                        if entry.name.endswith((".raw", ".raw.partial")) and ids.is_valid(kind, item_id):
                            found.add(item_id)
                found.update(item_id for (k, item_id), job in self._jobs.items() if k == kind and job.running)
                result[sub] = sorted(found)
        return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            for job in jobs:
                job.cancel()
            for job in jobs:
                job.wait(_STOP_TIMEOUT)

    # -- volumes ----------------------------------------------------------------------------------

    def ensure_volume(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None = None) -> ItemStatus:
        final = self._final("volume", volume_id)
        if source_snapshot_id is not None:
            ids.check("snapshot", source_snapshot_id)
        _check_size(size_bytes)
        with self._lock:
            self._check_open()
            current = self._existing("volume", volume_id, final)
            if current is not None:
                return current
            if source_snapshot_id is None:
                self._create_sparse(final, size_bytes)
                return _ready(final)
            return self._clone("volume", volume_id, final, "snapshot", source_snapshot_id, size_bytes)

    def volume_status(self, volume_id: str) -> ItemStatus:
        final = self._final("volume", volume_id)
        with self._lock:
            return self._status("volume", volume_id, final)

    def remove_volume(self, volume_id: str) -> None:
        self._remove("volume", volume_id)

    def resize_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        final = self._final("volume", volume_id)
        _check_size(size_bytes)
        with self._lock:
            try:
                fd = os.open(final, os.O_WRONLY | _OPEN)
            except FileNotFoundError:
                raise self._missing("volume", volume_id) from None
            try:
                current = os.fstat(fd).st_size
                if size_bytes < current:
                    raise InvalidParameter(
                        f"Volume {volume_id}: the new size {size_bytes} is smaller than the current "
                        f"size {current}; volumes can only grow"
                    )
                if size_bytes > current:
                    os.ftruncate(fd, size_bytes)
                    os.fsync(fd)
            except OSError as exc:
                raise DriverError(f"resize {volume_id}: {exc.strerror}") from exc
            finally:
                os.close(fd)
            return _ready(final)

    def volume_path(self, volume_id: str) -> Path:
        final = self._final("volume", volume_id)
        with self._lock:
            if not final.exists():
                raise self._missing("volume", volume_id)
        return final

    # -- snapshots --------------------------------------------------------------------------------

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        final = self._final("snapshot", snapshot_id)
        ids.check("volume", volume_id)
        with self._lock:
            self._check_open()
            current = self._existing("snapshot", snapshot_id, final)
            if current is not None:
                return current
            return self._clone("snapshot", snapshot_id, final, "volume", volume_id, None)

    def snapshot_status(self, snapshot_id: str) -> ItemStatus:
        final = self._final("snapshot", snapshot_id)
        with self._lock:
            return self._status("snapshot", snapshot_id, final)

    def remove_snapshot(self, snapshot_id: str) -> None:
        self._remove("snapshot", snapshot_id)

    # -- internals (callers hold self._lock where the name says nothing else) ---------------------

    def _final(self, kind: Kind, item_id: str) -> Path:
        ids.check(kind, item_id)
        return self.path / _DIRS[kind] / f"{item_id}.raw"

    def _check_open(self) -> None:
        if self._closed:
            raise DriverError(f"pool {self.name} is closed")

    def _job(self, kind: Kind, item_id: str) -> CopyJob | None:
        """The job of an item if it still runs or its failure is still to be reported."""
        job = self._jobs.get((kind, item_id))
        if job is not None and not (job.running or job.state == "failed"):
            del self._jobs[(kind, item_id)]
            return None
        return job

    def _status(self, kind: Kind, item_id: str, final: Path) -> ItemStatus:
        if final.exists():
            return _ready(final)
        job = self._job(kind, item_id)
        if job is not None and job.running:
            return ItemStatus("copying", job.size_bytes, job.progress)
        if job is not None:
            return ItemStatus("error", job.size_bytes, 0, job.error)
        try:
            return ItemStatus("stalled", os.lstat(_partial(final)).st_size)
        except FileNotFoundError:
            return ItemStatus("absent")

    def _existing(self, kind: Kind, item_id: str, final: Path) -> ItemStatus | None:
        """The status to answer an ensure with when nothing new must start, else None."""
        status = self._status(kind, item_id, final)
        if status.state in ("ready", "copying"):
            return status
        # error or stalled: forget the failure and start over.
        self._jobs.pop((kind, item_id), None)
        return None

    def _missing(self, kind: Kind, item_id: str) -> IncorrectState | NotFound:
        final = self._final(kind, item_id)
        if self._job(kind, item_id) is not None or _partial(final).exists():
            return IncorrectState(f"The {kind} '{item_id}' is not ready yet.")
        return NotFound(f"The {kind} '{item_id}' does not exist.", code=_NOT_FOUND_CODES[kind])

    def _create_sparse(self, final: Path, size_bytes: int) -> None:
        partial = _partial(final)
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN, 0o600)
            try:
                os.ftruncate(fd, size_bytes)
                os.fsync(fd)
            finally:
                os.close(fd)
            _publish(partial, final)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            raise DriverError(f"create {final.stem}: {exc.strerror}") from exc

    def _clone(
        self,
        kind: Kind,
        item_id: str,
        final: Path,
        source_kind: Kind,
        source_id: str,
        size_bytes: int | None,
    ) -> ItemStatus:
        """Make ``final`` a copy of the source item: a reflink at once, or a copy job started now."""
        partial = _partial(final)
        try:
            src_fd = os.open(self._final(source_kind, source_id), os.O_RDONLY | _OPEN)
        except FileNotFoundError:
            # A stalled partial whose source is gone can never finish: drop it with the error.
            partial.unlink(missing_ok=True)
            raise self._missing(source_kind, source_id) from None
        try:
            source_size = os.fstat(src_fd).st_size
            if size_bytes is not None and size_bytes < source_size:
                raise InvalidParameter(
                    f"The size {size_bytes} is smaller than the snapshot {source_id} ({source_size})"
                )
            size = max(source_size, size_bytes or 0)
            cloned = self.clone_method == "reflink" and self._reflink(src_fd, partial, size)
            if not cloned:
                job = CopyJob(
                    src_fd,
                    partial,
                    size,
                    on_success=functools.partial(_publish, partial, final),
                    chunk_bytes=self._chunk_bytes,
                    name=f"vbs-copy-{item_id}",
                )
        except BaseException:
            os.close(src_fd)
            raise
        if cloned:
            os.close(src_fd)
            try:
                _publish(partial, final)
            except OSError as exc:
                partial.unlink(missing_ok=True)
                raise DriverError(f"clone {item_id}: {exc.strerror}") from exc
            return _ready(final)
        job.start()  # owns src_fd from here on
        self._jobs[(kind, item_id)] = job
        log.info("copying %s %s from %s %s", kind, item_id, source_kind, source_id)
        return ItemStatus("copying", size, job.progress)

    def _reflink(self, src_fd: int, partial: Path, size: int) -> bool:
        """Clone into ``partial``; False if this pair cannot be cloned (then copy instead)."""
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN, 0o600)
            try:
                fcntl.ioctl(fd, FICLONE, src_fd)
                if size > os.fstat(fd).st_size:
                    os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            if exc.errno in _NO_REFLINK:
                log.warning("reflink refused (%s) for %s: copying instead", exc.strerror, partial.name)
                return False
            raise DriverError(f"reflink {partial.name}: {exc.strerror}") from exc
        return True

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
                _partial(final).unlink(missing_ok=True)
                final.unlink(missing_ok=True)
                _fsync_dir(final.parent)
            except OSError as exc:
                raise DriverError(f"remove {item_id}: {exc.strerror}") from exc

    def _probe_reflink(self) -> CloneMethod:
        for stale in self.path.glob(_PROBE_PREFIX + "*"):
            stale.unlink(missing_ok=True)
        tag = secrets.token_hex(4)
        src, dst = (self.path / f"{_PROBE_PREFIX}{tag}-{end}" for end in ("src", "dst"))
        fds: list[int] = []
        try:
            fds.append(os.open(src, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, 0o600))
            os.write(fds[0], b"vbs reflink probe\n" * 228)  # one real block, as a volume has
            fds.append(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o600))
            try:
                fcntl.ioctl(fds[1], FICLONE, fds[0])
            except OSError as exc:
                if exc.errno in _NO_REFLINK:
                    return "copy"
                raise
            return "reflink"
        except OSError as exc:
            raise DriverError(f"pool {self.name}: cannot use {self.path}: {exc.strerror}") from exc
        finally:
            for fd in fds:
                os.close(fd)
            src.unlink(missing_ok=True)
            dst.unlink(missing_ok=True)


def _partial(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


def _ready(final: Path) -> ItemStatus:
    return ItemStatus("ready", os.lstat(final).st_size, 100)


def _publish(partial: Path, final: Path) -> None:
    """Make a finished partial visible under its final name, durably."""
    os.rename(partial, final)
    _fsync_dir(final.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_size(size_bytes: object) -> None:
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0 or size_bytes % _SECTOR:
        raise InvalidParameter(f"Invalid size: {size_bytes!r} (expecting a positive multiple of 512 bytes)")
