"""Which byte ranges of a file may differ from another file it was reflinked from, told by the file
system's extent maps (FIEMAP) without reading either (docs/snapshots.md "Incremental uploads").

Two files that share a physical extent at the same logical offset hold the same bytes there: a write to
either would have copied that range elsewhere first (copy on write). So a range both map to the same
physical blocks, both marked ``FIEMAP_EXTENT_SHARED`` and carrying no other flag that makes the mapping
uncertain (unwritten, delayed, unknown, encoded, inline, tail), is unchanged; so is a range that is a
hole in both (it reads as zeros in both). Everything else counts as changed, as does all of the newer
file beyond the older one's end. When the file system cannot tell (no FIEMAP, another device), the
answer is None: read and hash everything.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from dataclasses import dataclass

__all__ = ["Extent", "file_extents", "changed_extents", "changed_of_maps", "FS_IOC_FIEMAP"]

FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap)
_FIEMAP_FLAG_SYNC = 0x1  # write dirty pages back first, so nothing is still only in memory
_HEADER = struct.Struct("=QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, reserved
_EXTENT = struct.Struct("=QQQQQIIII")  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 reserved
_BATCH = 512  # extents asked for per call
WINDOW = 256 << 20  # bytes of both files compared at a time

EXTENT_LAST = 0x1
EXTENT_SHARED = 0x2000
EXTENT_MERGED = 0x1000  # the file system merged block-mapped blocks into one extent: still exact
# Any flag beyond these makes an extent's physical address or content uncertain (FIEMAP_EXTENT_UNKNOWN,
# DELALLOC, ENCODED, DATA_ENCRYPTED, NOT_ALIGNED, DATA_INLINE, DATA_TAIL, UNWRITTEN, and any future one).
_CERTAIN = EXTENT_LAST | EXTENT_SHARED | EXTENT_MERGED

# The file system (or this kind of file) has no extent map to give.
_NO_FIEMAP = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS, errno.EBADR}


@dataclass(frozen=True)
class Extent:
    """One mapped range of a file: ``length`` bytes at ``logical`` in the file, at ``physical`` on its device."""

    logical: int
    physical: int
    length: int
    flags: int

    @property
    def end(self) -> int:
        return self.logical + self.length

    @property
    def certain_and_shared(self) -> bool:
        return bool(self.flags & EXTENT_SHARED) and not self.flags & ~_CERTAIN


def file_extents(fd: int, start: int, end: int) -> list[Extent] | None:
    """The extents of the open file ``fd`` that reach into ``[start, end)``, in order (None: the file system
    gives no extent map)."""
    extents: list[Extent] = []
    while start < end:
        buf = bytearray(_HEADER.size + _BATCH * _EXTENT.size)
        _HEADER.pack_into(buf, 0, start, end - start, _FIEMAP_FLAG_SYNC, 0, _BATCH, 0)
        try:
            fcntl.ioctl(fd, FS_IOC_FIEMAP, buf, True)
        except OSError as exc:
            if exc.errno in _NO_FIEMAP:
                return None
            raise
        mapped = _HEADER.unpack_from(buf, 0)[3]
        last = False
        for k in range(mapped):
            logical, physical, length, _r0, _r1, flags, _r2, _r3, _r4 = _EXTENT.unpack_from(
                buf, _HEADER.size + k * _EXTENT.size)
            extents.append(Extent(logical, physical, length, flags))
            last = last or bool(flags & EXTENT_LAST)
        if last or mapped < _BATCH:
            break  # the map of the range is complete: what it did not list are holes
        following = extents[-1].end
        if following <= start:
            return None  # no progress: a map we cannot trust to be complete
        start = following
    return extents


def _unchanged(older: list[Extent], newer: list[Extent], start: int, end: int) -> list[tuple[int, int]]:
    """The ranges ``[lo, hi)`` within ``[start, end)``, in order, where both files certainly hold the same
    bytes: the same shared physical blocks, or a hole in both."""
    same: list[tuple[int, int]] = []
    # The same shared blocks: where two certain shared extents overlap with the same physical displacement.
    a = [e for e in older if e.certain_and_shared]
    b = [e for e in newer if e.certain_and_shared]
    i = j = 0
    while i < len(a) and j < len(b):
        x, y = a[i], b[j]
        lo, hi = max(x.logical, y.logical, start), min(x.end, y.end, end)
        if lo < hi and x.physical - x.logical == y.physical - y.logical:
            same.append((lo, hi))
        if x.end <= y.end:
            i += 1
        else:
            j += 1
    # Holes in both: the gaps left by every extent of either file, whatever its flags.
    pos = start
    for extent in sorted(older + newer, key=lambda e: e.logical):
        if extent.logical > pos:
            same.append((pos, min(extent.logical, end)))
        pos = max(pos, extent.end)
        if pos >= end:
            break
    if pos < end:
        same.append((pos, end))
    return sorted((lo, hi) for lo, hi in same if lo < hi)


def _changed_in(older: list[Extent], newer: list[Extent], start: int, end: int) -> list[tuple[int, int]]:
    """The byte extents ``(offset, length)`` within ``[start, end)`` that may differ, in order."""
    changed: list[tuple[int, int]] = []
    pos = start
    for lo, hi in _unchanged(older, newer, start, end):
        if lo > pos:
            changed.append((pos, lo - pos))
        pos = max(pos, hi)
    if pos < end:
        changed.append((pos, end - pos))
    return changed


def _append(changed: list[tuple[int, int]], more: list[tuple[int, int]]) -> None:
    """``more`` after ``changed``, an extent that continues the last one merged into it."""
    for offset, length in more:
        if changed and changed[-1][0] + changed[-1][1] == offset:
            changed[-1] = (changed[-1][0], changed[-1][1] + length)
        else:
            changed.append((offset, length))


def changed_extents(older_fd: int, newer_fd: int, window: int = WINDOW) -> list[tuple[int, int]] | None:
    """The byte extents ``(offset, length)`` of the file ``newer_fd`` that may hold other bytes than
    the file ``older_fd`` at the same offsets, in order (more than what changed, never less); None when
    the file system cannot tell. Neither file may be written meanwhile (snapshot images are not). The maps
    are read ``window`` bytes at a time: a badly fragmented terabyte costs a window's extents in memory."""
    older, newer = os.fstat(older_fd), os.fstat(newer_fd)
    if older.st_dev != newer.st_dev:
        return None  # physical addresses of two devices say nothing about each other
    size, limit = newer.st_size, min(older.st_size, newer.st_size)
    changed: list[tuple[int, int]] = []
    for start in range(0, limit, window):
        end = min(start + window, limit)
        old_map, new_map = file_extents(older_fd, start, end), file_extents(newer_fd, start, end)
        if old_map is None or new_map is None:
            return None
        _append(changed, _changed_in(old_map, new_map, start, end))
    if limit < size:
        _append(changed, [(limit, size - limit)])  # all of a grown file beyond the older one's end
    return changed


def changed_of_maps(older: list[Extent], newer: list[Extent], older_size: int,
                    newer_size: int) -> list[tuple[int, int]]:
    """``changed_extents`` of two files' whole extent maps (each in order, as FIEMAP lists them) and sizes."""
    limit = min(older_size, newer_size)
    changed = _changed_in(older, newer, 0, limit)
    if limit < newer_size:
        _append(changed, [(limit, newer_size - limit)])
    return changed
