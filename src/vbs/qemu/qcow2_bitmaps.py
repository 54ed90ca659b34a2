"""Reading one persistent dirty bitmap out of a qcow2 file: the way the NBD driver gets a QEMU dirty
bitmap's bits out of its daemon (QMP reports a bitmap's count, never its bits). The driver merges the
bitmap into a bitmap of a scratch qcow2 node it then closes, which makes QEMU write it to the file.

The layout read here is QEMU's documented one (docs/interop/qcow2.txt in QEMU's sources, "Bitmaps
extension" and "Bitmaps"): a header extension of type ``0x23852875`` gives the bitmap directory; each
directory entry names a bitmap, its granularity and its bitmap table; each table entry points to a
cluster of bits (or, at offset 0, says the whole cluster's bits are 0, or 1 with bit 0 set). Bit ``k``
of byte ``j`` of the ``i``-th cluster of bits covers granule ``(i * cluster_size + j) * 8 + k``.
Every size read is bounded by the file's own: a damaged file raises ``ValueError``, never reads wild.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

__all__ = ["read_bitmap"]

QCOW2_MAGIC = 0x514649FB
BITMAPS_EXTENSION = 0x23852875
IN_USE = 1  # the bitmap was not stored cleanly: its bits mean nothing
MAX_EXTENSIONS = 64


def _unpack(fmt: str, data: bytes, offset: int = 0) -> tuple[int, ...]:
    if offset + struct.calcsize(fmt) > len(data):
        raise ValueError("qcow2 file ends inside a structure")
    return struct.unpack_from(fmt, data, offset)


def _read(fd: int, offset: int, length: int, file_size: int) -> bytes:
    if offset < 0 or length < 0 or offset + length > file_size:
        raise ValueError(f"qcow2 structure at {offset} (+{length}) is beyond the file's {file_size} bytes")
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ValueError("short read of a qcow2 file")
    return data


def _directory(fd: int, file_size: int) -> tuple[int, bytes, int]:
    """The cluster size, the bitmap directory and the number of its entries."""
    header = _read(fd, 0, 104, file_size)
    magic, version = _unpack(">II", header)
    if magic != QCOW2_MAGIC or version < 3:
        raise ValueError("not a qcow2 (version 3) file")
    cluster_bits = _unpack(">I", header, 20)[0]
    if not 9 <= cluster_bits <= 21:
        raise ValueError(f"qcow2 cluster bits {cluster_bits} out of range")
    offset = _unpack(">I", header, 100)[0]  # the header's length: its extensions follow
    for _ in range(MAX_EXTENSIONS):
        kind, length = _unpack(">II", _read(fd, offset, 8, file_size))
        if kind == 0:
            break
        if kind == BITMAPS_EXTENSION:
            count, _reserved, dir_size, dir_offset = _unpack(">IIQQ", _read(fd, offset + 8, 24, file_size))
            return 1 << cluster_bits, _read(fd, dir_offset, dir_size, file_size), count
        offset += 8 + (length + 7) // 8 * 8
    raise ValueError("the qcow2 file has no bitmaps")


def read_bitmap(path: Path, name: str) -> tuple[int, list[tuple[int, int]]]:
    """The granularity of bitmap ``name`` in the qcow2 file ``path`` and the byte extents ``(offset,
    length)`` of its set bits, adjacent ones merged (``KeyError``: no such bitmap; ``ValueError``: the file
    is not one QEMU wrote cleanly)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        file_size = os.fstat(fd).st_size
        cluster_size, directory, count = _directory(fd, file_size)
        pos = 0
        for _ in range(count):
            table_offset, table_size, flags, _type, granularity_bits, name_size, extra_size = \
                _unpack(">QIIBBHI", directory, pos)
            start = pos + 24 + extra_size
            entry_name = directory[start:start + name_size].decode("utf-8", "replace")
            pos += (24 + extra_size + name_size + 7) // 8 * 8
            if entry_name == name:
                break
        else:
            raise KeyError(name)
        if flags & IN_USE:
            raise ValueError(f"bitmap {name} was not stored cleanly (in use)")
        if not 9 <= granularity_bits <= 31:
            raise ValueError(f"bitmap granularity bits {granularity_bits} out of range")
        granularity = 1 << granularity_bits
        table = _unpack(f">{table_size}Q", _read(fd, table_offset, 8 * table_size, file_size))
        bits_per_cluster = cluster_size * 8
        extents: list[tuple[int, int]] = []

        def add(first_granule: int, granules: int) -> None:
            offset, length = first_granule * granularity, granules * granularity
            if extents and extents[-1][0] + extents[-1][1] == offset:
                extents[-1] = (extents[-1][0], extents[-1][1] + length)
            else:
                extents.append((offset, length))

        for i, entry in enumerate(table):
            base = i * bits_per_cluster
            data_offset = entry & 0x00FFFFFFFFFFFE00
            if data_offset == 0:
                if entry & 1:
                    add(base, bits_per_cluster)
                continue
            bits = _read(fd, data_offset, cluster_size, file_size)
            for j, byte in enumerate(bits):
                if byte:
                    for k in range(8):
                        if byte >> k & 1:
                            add(base + j * 8 + k, 1)
        return granularity, extents
    finally:
        os.close(fd)
