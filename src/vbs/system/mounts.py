"""Mount points as the kernel lists them (/proc/self/mountinfo), and lazy unmounts: shared by the local
paths of the host connectors (FUSE files) and the CSI node's staged and published volumes."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
from pathlib import Path

from vbs.errors import DriverError

__all__ = ["is_mounted", "mount_source", "mount_pseudo", "detach_mount"]

_MNT_DETACH = 2


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \\040 and such.
    return field.encode().decode("unicode_escape")


def mount_source(path: Path) -> str | None:
    """What is mounted at ``path`` (the newest mount's source: a device, or the FUSE daemon's name), or
    None when nothing is; a bind mount of a directory shows its filesystem's source."""
    target = str(path)
    found = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if _unescape(fields[4]) != target:
                    continue
                # Field 5 is the mount point; after the optional fields and "-": type, source, options.
                rest = fields[fields.index("-") + 1:]
                found = _unescape(rest[1]) if len(rest) > 1 else ""
    except (OSError, ValueError):
        return None
    return found


def is_mounted(path: Path) -> bool:
    return mount_source(path) is not None


def mount_pseudo(fstype: str, path: Path) -> None:
    """Mount the kernel's file system ``fstype`` (no device: fusectl, sysfs...) on ``path``; ``OSError``
    with the kernel's errno when it refuses."""
    if _libc().mount(fstype.encode(), os.fsencode(str(path)), fstype.encode(), 0, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))


def detach_mount(path: Path) -> None:
    """Detach every mount at ``path`` (lazily: a mount still in use goes once it is let go)."""
    while is_mounted(path):
        if _libc().umount2(os.fsencode(str(path)), _MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT):
                return
            raise DriverError(f"cannot unmount {path}: {os.strerror(err)}")
