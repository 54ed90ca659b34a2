"""Real filesystems for tests: a sparse image on a loop device, formatted and mounted for one block.

Needs root and loop devices. Whatever happens inside the block, the mount and the loop device are
undone on exit, so a failing test never leaves a device behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from vbs.system import argv

__all__ = ["loop_filesystem"]

_MKFS = {
    "xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"],
    "btrfs": ["mkfs.btrfs", "-q", "-f"],
    # No reflink: the copy path on a filesystem small enough to fill up.
    "ext4": ["mkfs.ext4", "-q", "-F", "-m", "0"],
}


@contextlib.contextmanager
def loop_filesystem(workdir: Path, fstype: str = "xfs", size_mib: int = 1024) -> Iterator[Path]:
    """Yield the mount point of a fresh ``fstype`` filesystem of ``size_mib`` made under ``workdir``."""
    if fstype not in _MKFS:
        raise ValueError(f"unsupported fstype {fstype!r}: one of {sorted(_MKFS)}")
    fd, name = tempfile.mkstemp(prefix=f"{fstype}-", suffix=".img", dir=workdir)
    image = Path(name)
    device: str | None = None
    mountpoint: Path | None = None
    mounted = False
    try:
        try:
            os.ftruncate(fd, size_mib << 20)
        finally:
            os.close(fd)
        device = argv.run(["losetup", "--find", "--show", str(image)], timeout=30).stdout.strip()
        argv.run([*_MKFS[fstype], device], timeout=120)
        mountpoint = Path(tempfile.mkdtemp(prefix=f"{fstype}-mnt-", dir=workdir))
        argv.run(["mount", "-t", fstype, device, str(mountpoint)], timeout=60)
        mounted = True
        yield mountpoint
    finally:
        try:
            if mounted and mountpoint is not None:
                _unmount(mountpoint)
        finally:
            if device:
                # With a lazy unmount still pending the device is busy: autoclear frees it later.
                argv.run(["losetup", "-d", device], timeout=30, check=False)
            if mountpoint is not None:
                with contextlib.suppress(OSError):
                    mountpoint.rmdir()
            image.unlink(missing_ok=True)


def _unmount(mountpoint: Path) -> None:
    # A thread of a failed test may still hold a file open for a moment: retry, then detach lazily
    # so the test run never leaves a mount behind.
    for _ in range(20):
        if argv.run(["umount", str(mountpoint)], timeout=60, check=False).returncode == 0:
            return
        time.sleep(0.1)
    argv.run(["umount", "--lazy", str(mountpoint)], timeout=60)
