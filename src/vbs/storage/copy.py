"""Sparse-aware file copy with progress and cancellation, and a thread that runs one.

Used where a backend cannot clone in O(1): only the data extents (SEEK_DATA/SEEK_HOLE) are copied,
with copy_file_range so the kernel moves the bytes, in chunks so progress and cancel stay responsive.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

__all__ = [
    "CopyJob",
    "CopyCancelled",
    "sparse_copy",
    "data_ranges",
    "DEFAULT_CHUNK_BYTES",
]

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024

# copy_file_range refuses some pairs of files (other filesystem types, FUSE, old kernels): fall back
# to reading and writing ourselves.
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_FALLBACK_BUFFER = 8 * 1024 * 1024

ProgressCallback = Callable[[int, int], None]
JobState = Literal["pending", "running", "done", "failed", "cancelled"]


class CopyCancelled(Exception):
    """The copy stopped because its cancel event was set."""


def data_ranges(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, end)`` of every data extent below ``size``; holes are skipped."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after pos
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP) and pos == 0:
                # A filesystem without hole reporting: everything counts as data.
                yield (0, size)
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield (start, end)
        pos = end


def _copy_range_rw(src_fd: int, dst_fd: int, count: int, offset: int) -> int:
    data = os.pread(src_fd, min(count, _FALLBACK_BUFFER), offset)
    if not data:
        return 0
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(dst_fd, view[written:], offset + written)
    return written


def sparse_copy(
    src_fd: int,
    dst_fd: int,
    *,
    size_bytes: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    cancel: threading.Event | None = None,
    progress: ProgressCallback | None = None,
) -> int:
    """Copy the data of ``src_fd`` into ``dst_fd`` at the same offsets and return the bytes copied.

    ``dst_fd`` is sized to ``max(size of src, size_bytes)`` first, so whatever is not copied stays a
    hole. ``progress(done, total)`` is called after every chunk, ``total`` being the data bytes of the
    source. Raises ``CopyCancelled`` when ``cancel`` is set (checked between chunks).
    """
    src_size = os.fstat(src_fd).st_size
    os.ftruncate(dst_fd, max(src_size, size_bytes or 0))
    # Extents are listed up front so progress has a denominator; data written to the source after
    # this point may be missed, which is why callers copy only files nobody writes to.
    ranges = list(data_ranges(src_fd, src_size))
    total = sum(end - start for start, end in ranges)
    done = 0
    use_cfr = True
    if progress is not None:
        progress(done, total)
    for start, end in ranges:
        offset = start
        while offset < end:
            if cancel is not None and cancel.is_set():
                raise CopyCancelled()
            count = min(chunk_bytes, end - offset)
            copied = -1
            if use_cfr:
                try:
                    copied = os.copy_file_range(src_fd, dst_fd, count, offset, offset)
                except OSError as exc:
                    if exc.errno not in _NO_COPY_FILE_RANGE or done > 0:
                        raise
                    use_cfr = False
            if copied < 0:
                copied = _copy_range_rw(src_fd, dst_fd, count, offset)
            if copied == 0:
                # The source shrank under us: nothing more to read anywhere past this point.
                os.fsync(dst_fd)
                return done
            offset += copied
            done += copied
            if progress is not None:
                progress(done, total)
    os.fsync(dst_fd)
    return done


class CopyJob:
    """One sparse copy in a background thread: ``src_fd`` into a new file at ``dst_path``.

    The job owns ``src_fd`` and closes it when it ends; holding it open means the source may be
    unlinked meanwhile without harm. On success ``on_success`` runs in the job's thread (a backend
    renames the file there); on failure the destination is removed and ``error`` says why. A
    cancelled job leaves the destination for its owner to keep or remove.
    """

    def __init__(
        self,
        src_fd: int,
        dst_path: Path,
        size_bytes: int,
        *,
        on_success: Callable[[], None] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        name: str = "vbs-copy",
    ) -> None:
        self.dst_path = dst_path
        self.size_bytes = size_bytes
        self.done_bytes = 0
        self.total_bytes = 0
        self.state: JobState = "pending"
        self.error: str | None = None
        self._src_fd = src_fd
        self._on_success = on_success
        self._chunk_bytes = chunk_bytes
        self._cancel = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def progress(self) -> int:
        if self.state == "done":
            return 100
        if self.total_bytes == 0:
            return 0
        return min(100, self.done_bytes * 100 // self.total_bytes)

    @property
    def running(self) -> bool:
        return self.state in ("pending", "running")

    def start(self) -> None:
        self.state = "running"
        try:
            self._thread.start()
        except BaseException:
            self.state = "failed"
            self.error = "could not start a copy thread"
            os.close(self._src_fd)
            self._finished.set()
            raise

    def cancel(self) -> None:
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the job has ended (done, failed or cancelled)."""
        return self._finished.wait(timeout)

    def _progress(self, done: int, total: int) -> None:
        self.done_bytes = done
        self.total_bytes = total

    def _run(self) -> None:
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
            dst_fd = os.open(self.dst_path, flags, 0o600)
            try:
                sparse_copy(
                    self._src_fd,
                    dst_fd,
                    size_bytes=self.size_bytes,
                    chunk_bytes=self._chunk_bytes,
                    cancel=self._cancel,
                    progress=self._progress,
                )
            finally:
                os.close(dst_fd)
            if self._cancel.is_set():
                raise CopyCancelled()
            if self._on_success is not None:
                self._on_success()
            self.state = "done"
        except CopyCancelled:
            self.state = "cancelled"
        except Exception as exc:  # any failure must end as a reported state, never a dead thread
            self.error = _describe(exc)
            self.state = "failed"
            try:
                os.unlink(self.dst_path)
            except OSError:
                pass  # already gone, or the owner removes it on the next ensure or remove
        finally:
            os.close(self._src_fd)
            self._finished.set()


def _describe(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"copy failed: {os.strerror(exc.errno)}"
    return f"copy failed: {exc}"
