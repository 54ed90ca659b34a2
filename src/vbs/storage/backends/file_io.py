"""The file operations of the ``file`` backend: sparse files and reflinks (FICLONE), published only
by renaming their ``.partial`` durably, the reflink probe of a pool directory, and the errors a
file system's refusal maps to."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
from pathlib import Path
from typing import Literal

from vbs.errors import DriverError, InsufficientCapacity, InvalidParameter, VbsError
from vbs.wire.storage import ItemStatus

log = logging.getLogger(__name__)

FICLONE = getattr(fcntl, "FICLONE", 0x40049409)  # fcntl only names it from Python 3.12

CloneMethod = Literal["reflink", "copy"]

# What FICLONE answers when the filesystem (or this pair of files) cannot share extents.
NO_REFLINK = {errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS}
# The agent runs as root in a directory it owns: never follow a link planted there.
OPEN = os.O_CLOEXEC | os.O_NOFOLLOW
_PROBE_PREFIX = ".vbs-reflink-probe-"


def partial_of(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


def ready(final: Path) -> ItemStatus:
    return ItemStatus(state="ready", size_bytes=os.lstat(final).st_size, progress=100)


def publish(partial: Path, final: Path) -> None:
    """Make a finished partial visible under its final name, durably."""
    os.rename(partial, final)
    fsync_dir(final.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refusal(action: str, size_bytes: int, exc: OSError) -> VbsError:
    """A size the pool's file system refuses for good is the caller's to change, not a fault to retry."""
    if exc.errno == errno.EFBIG:
        return InvalidParameter(f"{action}: {size_bytes} bytes is more than this pool's file system holds in "
                                "one file")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientCapacity(f"{action}: the pool is out of space ({exc.strerror})")
    return DriverError(f"{action}: {exc.strerror}")


def create_sparse(final: Path, size_bytes: int, *, publish_it: bool = True, at: Path | None = None) -> None:
    """A sparse file of ``size_bytes`` at ``final`` (through its partial when ``publish_it``; at ``at``
    instead when given, not published)."""
    path = at if at is not None else partial_of(final) if publish_it else final
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | OPEN, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        if publish_it:
            publish(path, final)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise refusal(f"create {final.stem}", size_bytes, exc) from exc


def reflink(src_fd: int, partial: Path, size: int) -> bool:
    """Clone into ``partial``; False if this pair cannot be cloned (then copy instead)."""
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | OPEN, 0o600)
        try:
            fcntl.ioctl(fd, FICLONE, src_fd)
            if size > os.fstat(fd).st_size:
                os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        if exc.errno in NO_REFLINK:
            log.warning("reflink refused (%s) for %s: copying instead", exc.strerror, partial.name)
            return False
        raise DriverError(f"reflink {partial.name}: {exc.strerror}") from exc
    return True


def probe_reflink(path: Path, pool_name: str) -> CloneMethod:
    """Whether the file system of ``path`` clones files (``reflink``) or not (``copy``)."""
    for stale in path.glob(_PROBE_PREFIX + "*"):
        stale.unlink(missing_ok=True)
    tag = secrets.token_hex(4)
    src, dst = (path / f"{_PROBE_PREFIX}{tag}-{end}" for end in ("src", "dst"))
    fds: list[int] = []
    try:
        fds.append(os.open(src, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN, 0o600))
        os.write(fds[0], b"vbs reflink probe\n" * 228)  # one real block, as a volume has
        fds.append(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN, 0o600))
        try:
            fcntl.ioctl(fds[1], FICLONE, fds[0])
        except OSError as exc:
            if exc.errno in NO_REFLINK:
                return "copy"
            raise
        return "reflink"
    except OSError as exc:
        raise DriverError(f"pool {pool_name}: cannot use {path}: {exc.strerror}") from exc
    finally:
        for fd in fds:
            os.close(fd)
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
