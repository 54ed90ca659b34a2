"""The ``dir`` snapshot store: objects as files under one directory (another disk, an NFS mount).

A key's ``/`` are directories (``chunks/ab/ab12…`` is a file in one of 256 fan-out directories, so
no directory holds millions of entries). Every put writes a hidden temp file beside the target and
renames it into place: a reader sees the old object or the new one, never half of one. A plain put
fsyncs the file and the directory before it returns; the puts of a batch (an upload's chunks,
``DirBatch``) are synced together at its commit, before the manifest that lists them is written, so
until then a power cut may leave one short or empty (docs/snapshots.md, "Durability", says why
none is trusted unread, and why one read back whole may be). Directories are 0700 and files 0600:
a store holds every tenant's data. Temp files a crash left behind start with a dot; nothing reads
them, and docs/snapshots.md says how to clear them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from vbs.errors import DriverError, SnapshotStoreUnavailable
from vbs.snapshot_store.contract import (
    ObjectInfo,
    ObjectMissing,
    Trusted,
    Whole,
    check_key,
    check_prefix,
    parse_options,
)
from vbs.snapshot_store.parallel import bounded_map
from vbs.system.files import fsync_path

__all__ = ["DirStore", "DirStoreOptions", "DirBatch"]

# The store's own trouble, which a later try may not have: the disk or the mount went away.
_UNAVAILABLE = {errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.ESTALE, errno.ETIMEDOUT, errno.EROFS, errno.ENOTCONN}
# fsyncs in flight at a batch's commit: the file system merges those of one journal commit.
_SYNC_PARALLEL = 8


class DirStoreOptions(BaseModel):
    """``[storage_agent.snapshot_store]`` of a ``dir`` store: where (default ``<data-dir>/snapshots``)."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True, frozen=True)

    path: Path | None = None


class DirStore:
    """A snapshot store in a directory."""

    name = "dir"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise self._error(exc, "make") from exc
        if not self.root.is_dir():
            raise DriverError(f"the snapshot store {self.root} is not a directory")

    @classmethod
    def from_config(cls, options: Mapping[str, Any], *, default_dir: Path) -> DirStore:
        return cls(parse_options(DirStoreOptions, options, "dir").path or default_dir)

    def describe(self) -> str:
        return f"dir:{self.root}"

    def __repr__(self) -> str:
        return f"DirStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _error(self, exc: OSError, what: str, key: str = "") -> Exception:
        where = f"{self.root}/{key}" if key else str(self.root)
        if exc.errno in _UNAVAILABLE:
            return SnapshotStoreUnavailable(f"the snapshot store {self.root} could not {what} {key or 'itself'}: "
                                            f"{exc.strerror}", store=self.describe())
        return DriverError(f"the snapshot store could not {what} {where}: {exc.strerror or exc}")

    def _make_dirs(self, directory: Path) -> None:
        missing: list[Path] = []
        while directory != self.root and not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                continue
            fsync_path(d.parent)

    def put(self, key: str, data: bytes) -> None:
        self._write(key, data, durable=True)

    def batch(self, trust_before: float) -> DirBatch:
        return DirBatch(self, trust_before)

    def _write(self, key: str, data: bytes, *, durable: bool) -> Path:
        """Write ``key`` aside and rename it into place (fsyncing both if ``durable``); its path."""
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            self._make_dirs(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if durable:
                    os.fsync(fd)
                else:  # start writing it out now, so the commit's fsync has little left to wait for
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if durable:
                fsync_path(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):  # its directory may be what failed (not a directory)
                tmp.unlink(missing_ok=True)
            raise self._error(exc, "write", key) from exc
        return path

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissing(key) from None
        except OSError as exc:
            raise self._error(exc, "read", key) from exc

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._error(exc, "stat", key) from exc
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def has(self, key: str) -> bool:
        return self.head(key) is not None

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except NotADirectoryError:
            return
        except OSError as exc:
            raise self._error(exc, "delete", key) from exc

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        head, _, partial = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        yield from self._walk(start, head, partial)

    def _walk(self, directory: Path, key_dir: str, partial: str) -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise self._error(exc, "list", key_dir) from exc
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.startswith(partial):
                continue  # a put's temp file, or outside the prefix
            key = f"{key_dir}/{entry.name}" if key_dir else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    yield from self._walk(Path(entry.path), key, "")
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    yield ObjectInfo(key, st.st_size, st.st_mtime)
            except FileNotFoundError:
                continue  # deleted while listed


class DirBatch:
    """Puts of a ``dir`` store made durable together (docs/snapshots.md, "Durability"): each file is
    written aside and renamed into place without an fsync; ``commit`` fsyncs every file put, then
    every directory they were renamed into. An object already there is trusted unread if its last put
    was before ``trust_before``. A younger one may be another upload's, not yet synced, or one a crash
    left on the disk: it is read and trusted only if whole, and then synced by ``commit`` like a put
    (a process crash leaves what it wrote in the page cache, whole; a power cut may leave it empty or
    short, which the check catches); else the caller puts it again."""

    def __init__(self, store: DirStore, trust_before: float) -> None:
        self.store = store
        self.trust_before = trust_before
        self._lock = threading.Lock()
        self._written: set[Path] = set()

    def put(self, key: str, data: bytes) -> None:
        path = self.store._write(key, data, durable=False)
        with self._lock:
            self._written.add(path)

    def trusted(self, key: str, whole: Whole) -> Trusted | None:
        info = self.store.head(key)
        if info is None:
            return None
        if info.modified < self.trust_before:
            return "durable"
        path = self.store._path(key)
        try:
            blob = path.read_bytes()
        except OSError:
            return None  # gone since, or unreadable: put again
        if not whole(blob):
            return None
        with self._lock:
            self._written.add(path)  # synced at the commit, whatever file is there then (``_sync``)
        return "verified"

    def commit(self) -> None:
        with self._lock:
            files, self._written = sorted(self._written), set()
        directories = sorted({f.parent for f in files})
        for _ in bounded_map(self._sync, files, _SYNC_PARALLEL):
            pass
        for _ in bounded_map(self._sync, directories, _SYNC_PARALLEL):
            pass

    def _sync(self, path: Path) -> None:
        try:
            fsync_path(path)  # whatever file is there now: ours, or the same bytes put again since
        except FileNotFoundError:
            return  # deleted since (a collection's sweep): the upload's claims check puts it back
        except OSError as exc:
            raise self.store._error(exc, "sync", str(path.relative_to(self.store.root))) from exc
