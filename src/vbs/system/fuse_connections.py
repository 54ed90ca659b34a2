"""One request at a time on a writable FUSE export of qemu-storage-daemon (docs/drivers.md,
"Local-path connectors").

qemu-storage-daemon's FUSE export, up to and including QEMU 10.0 (Debian 12 ships 7.2), receives every
request into one buffer, and its write handler calls the block layer synchronously, which polls the
event loop: a second request the kernel already queued is read into the same buffer while the first
write is still being sent, and the first write stores the second one's bytes. QEMU fixed it upstream in
10.1 ("fuse: Copy write buffer content before polling"). Measured here on 7.2 with qemu-io through a
FUSE export: 250 concurrent O_DIRECT 4 KiB writes over io_uring left 131 blocks holding another
write's bytes; ``qemu-img convert -t none`` onto the export was wrong from offset 0. Through a local
path on an NBD export (what VBS serves) writes of 64 KiB and more are hit; a guest's ``dd conv=fsync``
through the ``virsh-path`` profile (``--cache none``) once read back other bytes in CI.

The kernel sends a FUSE file system concurrent requests only as *background* requests (asynchronous
direct I/O, readahead, writeback); synchronous ones are serialized on the inode's lock. Lowering the
connection's ``max_background`` to 1 (fusectl, ``/sys/fs/fuse/connections/N/max_background``) makes it
hand the daemon one request at a time, so a nested read never finds another write. The same qemu-io
runs then store every block as written, with O_DIRECT over threads, Linux AIO and io_uring alike. It
costs the daemon the concurrency that came only from that nesting: 4 KiB random I/O through the file
about a third as fast, sequential 1 MiB no slower (figures in docs/drivers.md).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vbs.errors import DriverError
from vbs.system.mounts import is_mounted, mount_pseudo

__all__ = ["FUSECTL", "one_request_at_a_time"]

log = logging.getLogger(__name__)

FUSECTL = Path("/sys/fs/fuse/connections")
_WHY = "qemu-storage-daemon's FUSE export corrupts writes the kernel sends it concurrently"


def _mount_fusectl(root: Path) -> None:
    """Mount the FUSE control file system (as systemd does at boot) where nothing is mounted yet."""
    if is_mounted(root):
        return
    try:
        mount_pseudo("fusectl", root)
    except OSError as exc:
        if is_mounted(root):
            return  # another process mounted it meanwhile
        raise DriverError(f"cannot mount the FUSE control file system on {root}: {exc.strerror} ({_WHY}, "
                          "and only its max_background setting prevents that)") from exc
    log.info("mounted the FUSE control file system on %s", root)


def one_request_at_a_time(path: Path, *, root: Path = FUSECTL) -> None:
    """Have the kernel send the FUSE file system mounted on ``path`` one background request at a time.
    Idempotent; raises ``DriverError`` when it cannot be set (the path must then not be handed out)."""
    try:
        dev = os.stat(path).st_dev
    except OSError as exc:
        raise DriverError(f"cannot read the FUSE mount on {path}: {exc.strerror}") from exc
    if os.major(dev) != 0:
        raise DriverError(f"{path} is not on a FUSE mount (device {os.major(dev)}:{os.minor(dev)})")
    if not root.is_dir():
        raise DriverError(f"no FUSE control file system at {root} ({_WHY})")
    connection = root / str(os.minor(dev))
    if not connection.is_dir():
        _mount_fusectl(root)
    setting = connection / "max_background"
    try:
        if setting.read_text().strip() != "1":
            setting.write_text("1\n")
        value = setting.read_text().strip()
    except OSError as exc:
        raise DriverError(f"cannot limit the FUSE connection of {path} to one request at a time: "
                          f"{setting}: {exc.strerror} ({_WHY})") from exc
    if value != "1":
        raise DriverError(f"the FUSE connection of {path} kept max_background={value[:20]} ({_WHY})")
