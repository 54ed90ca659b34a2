"""A CSI node's devices (docs/kubernetes.md "On the node"): the file a published volume is on this host (the
csi-node hypervisor profile links it into the disk directory: a qemu-storage-daemon FUSE export of the
volume's NBD export, made by the host agent's local paths), a loop device on it, its filesystem (made on
first use, grown to the device at every stage and online by NodeExpandVolume) and the mounts. Stateless:
what is set up is read back from the kernel (losetup, mountinfo), so every step is idempotent and survives
a restart of the driver."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from vbs import ids
from vbs.csi.errors import CsiError
from vbs.csi.requests import DEFAULT_FS, FS_TYPES
from vbs.system.argv import run
from vbs.system.mounts import detach_mount, is_mounted, mount_source

__all__ = ["NodeDevices"]

_TOOL_TIMEOUT = 300.0  # mkfs of a large volume over the network
_GROWN_WAIT_S = 10.0  # how long a node waits for its disk file to show the size the controller grew it to


class NodeDevices:
    def __init__(self, disk_dir: Path) -> None:
        self.disk_dir = Path(disk_dir)

    def disk(self, volume_id: str) -> Path:
        """The file that is ``volume_id`` on this host; NOT_FOUND when it is not published here."""
        if not ids.is_valid("volume", volume_id):
            raise CsiError("NOT_FOUND", f"volume {volume_id[:40]!r} does not exist")
        link = self.disk_dir / volume_id
        if not link.exists():
            raise CsiError("NOT_FOUND", f"volume {volume_id} is not published to this node (no {link})")
        return link.resolve()

    # -- loop devices ------------------------------------------------------------------------------

    def loops(self, volume_id: str) -> list[str]:
        """The loop devices on the volume's file (one, once staged), also when it is no longer published."""
        if not ids.is_valid("volume", volume_id):
            return []
        found = run(["losetup", "--json", "--list", "--output", "NAME,BACK-FILE"], timeout=30).stdout
        devices = json.loads(found or '{"loopdevices": []}').get("loopdevices", [])
        serial = ids.virtio_serial(volume_id)
        # The host agent's local path of a volume is <root>/<serial>/disk (vbs.connectors.local_path).
        return sorted(d["name"] for d in devices
                      if (d.get("back-file") or "").rstrip().removesuffix(" (deleted)").endswith(f"/{serial}/disk"))

    def attach_loop(self, volume_id: str, read_only: bool) -> str:
        existing = self.loops(volume_id)
        if existing:
            return existing[0]
        disk = self.disk(volume_id)
        argv = ["losetup", "--find", "--show", *(["--read-only"] if read_only else []), str(disk)]
        return run(argv, timeout=60).stdout.strip()

    def detach_loops(self, volume_id: str) -> None:
        for device in self.loops(volume_id):
            run(["losetup", "--detach", device], timeout=60, check=False)

    def refresh_loops(self, volume_id: str, required_bytes: int) -> int:
        """The volume's loop devices re-read the size of its file (``losetup -c``) once the file shows
        ``required_bytes`` (the host agent moved it onto the grown export); the device's size after.
        ``UNAVAILABLE`` when the file does not show that size in time (the sidecar retries)."""
        disk = self.disk(volume_id)
        loops = self.loops(volume_id)
        if not loops:
            raise CsiError("FAILED_PRECONDITION", f"{volume_id} is not staged on this node")
        deadline = time.monotonic() + _GROWN_WAIT_S
        while disk.stat().st_size < required_bytes:  # FUSE caches a file's size for a moment
            if time.monotonic() >= deadline:
                raise CsiError("UNAVAILABLE", f"{volume_id} shows {disk.stat().st_size} bytes on this node, not yet "
                                              f"{required_bytes}: try again")
            time.sleep(0.1)
        for device in loops:
            if self.size(device) < disk.stat().st_size:
                run(["losetup", "--set-capacity", device], timeout=60)
        return self.size(loops[0])

    def size(self, device: str) -> int:
        return int(run(["blockdev", "--getsize64", device], timeout=30).stdout.strip())

    def grow_filesystem(self, device: str, mount_point: Path) -> None:
        """The filesystem of ``device``, mounted at ``mount_point``, grown online to the device: ext4 by
        resize2fs on the device, xfs by xfs_growfs on the mount point. An ext4 resize refused for want of
        CAP_SYS_RESOURCE (the kernel asks for it) is FAILED_PRECONDITION: it grows at the next stage."""
        found = run(["blkid", "--probe", "--output", "value", "--match-tag", "TYPE", device], timeout=60,
                    check=False).stdout.strip()
        if found == "xfs":
            run(["xfs_growfs", str(mount_point)], timeout=_TOOL_TIMEOUT)
            return
        if found != "ext4":
            raise CsiError("FAILED_PRECONDITION", f"the volume holds a {found[:20] or 'unknown'} filesystem, not ext4 "
                                                  "or xfs")
        if not self._ext4_smaller(device):
            return
        grown = run(["resize2fs", device], timeout=_TOOL_TIMEOUT, check=False)
        if grown.returncode != 0:
            said = (grown.stdout + grown.stderr).strip()
            if "Permission denied" in said:
                raise CsiError("FAILED_PRECONDITION", "the kernel refused to grow the mounted ext4 filesystem: the "
                                                      "node plugin lacks CAP_SYS_RESOURCE; it grows when the volume "
                                                      "is staged again")
            raise CsiError("INTERNAL", f"resize2fs {device} failed: {said[-300:]}")

    def _ext4_smaller(self, device: str) -> bool:
        """Whether ext4 on ``device`` is smaller than the device by more than 1024 of its blocks."""
        head = run(["dumpe2fs", "-h", device], timeout=60).stdout
        fields = dict(line.split(":", 1) for line in head.splitlines() if ":" in line)
        block = int(fields["Block size"].strip())
        fs_bytes = int(fields["Block count"].strip()) * block
        return self.size(device) - fs_bytes >= block * 1024

    # -- filesystems and mounts --------------------------------------------------------------------

    def stage_filesystem(self, device: str, staging: Path, fs_type: str, read_only: bool) -> None:
        """``device``'s filesystem mounted at ``staging``: made first if the device has none, grown to the
        device after (a volume expanded while unstaged)."""
        if mount_source(staging) == device:
            return
        if is_mounted(staging):
            raise CsiError("FAILED_PRECONDITION", f"{staging} has something else mounted")
        found = run(["blkid", "--probe", "--output", "value", "--match-tag", "TYPE", device], timeout=60,
                    check=False).stdout.strip()
        wanted = fs_type or DEFAULT_FS
        if not found:
            if read_only:
                raise CsiError("FAILED_PRECONDITION", "a read-only volume without a filesystem cannot be mounted")
            run([f"mkfs.{wanted}", "-q", device], timeout=_TOOL_TIMEOUT)
            found = wanted
        if found not in FS_TYPES:
            raise CsiError("FAILED_PRECONDITION", f"the volume holds a {found[:20]} filesystem, not ext4 or xfs")
        if found == "ext4" and not read_only:
            self._grow_ext4(device)
        staging.mkdir(parents=True, exist_ok=True)
        # xfs refuses a second filesystem of the same UUID (a clone or a restore of a volume mounted here).
        options = ("ro" if read_only else "rw") + (",nouuid" if found == "xfs" else "")
        run(["mount", "-t", found, "-o", options, device, str(staging)], timeout=_TOOL_TIMEOUT)
        if found == "xfs" and not read_only:
            run(["xfs_growfs", str(staging)], timeout=_TOOL_TIMEOUT)  # online; nothing to do at the same size

    def _grow_ext4(self, device: str) -> None:
        """An ext4 smaller than its device (the volume was expanded while unstaged, or its online growth
        was refused) grown before it is mounted: offline, after the check resize2fs asks for."""
        if not self._ext4_smaller(device):
            return
        checked = run(["e2fsck", "-f", "-p", device], timeout=_TOOL_TIMEOUT, check=False)
        if checked.returncode not in (0, 1):  # 1: errors corrected
            raise CsiError("FAILED_PRECONDITION", f"e2fsck found errors it could not correct on {device}: "
                                                  f"{(checked.stdout + checked.stderr).strip()[-300:]}")
        run(["resize2fs", device], timeout=_TOOL_TIMEOUT)

    def bind(self, source: str, target: Path, *, block: bool, read_only: bool) -> None:
        """``source`` (the staged directory, or the loop device) bind-mounted at ``target``."""
        if is_mounted(target):
            return
        if block:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
        run(["mount", "--bind", *(["-o", "ro"] if read_only else []), source, str(target)], timeout=60)

    def is_mount(self, path: Path) -> bool:
        return is_mounted(path)

    def unmount(self, path: Path) -> None:
        detach_mount(path)

    def remove_target(self, target: Path) -> None:
        """The target path the node made at publish (a directory, or a file for a block volume)."""
        try:
            if target.is_dir():
                target.rmdir()
            elif target.exists():
                target.unlink()
        except OSError as exc:
            raise CsiError("INTERNAL", f"cannot remove {target}: {exc.strerror}") from exc

    def kind(self, path: Path) -> str:
        """"block" (a device, or a file a device is bound onto) or "mount" (a mounted directory) for a path
        a volume is published or staged at; NOT_FOUND for anything else."""
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError as exc:
            raise CsiError("NOT_FOUND", f"{path} does not exist") from exc
        if stat.S_ISBLK(mode) or (stat.S_ISREG(mode) and is_mounted(path)):
            return "block"
        if not is_mounted(path):
            raise CsiError("NOT_FOUND", f"{path} is not a published volume")
        return "mount"

    def mounted_from(self, path: Path) -> str | None:
        return mount_source(path)

    def stats(self, path: Path) -> tuple[str, int, int, int, int, int]:
        """("block", size, 0, 0, 0, 0) or ("mount", bytes total, used, available, inodes total, used)."""
        if self.kind(path) == "block":
            return ("block", self.size(str(path)), 0, 0, 0, 0)
        vfs = os.statvfs(path)
        total, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
        used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        return ("mount", total, used, free, vfs.f_files, vfs.f_files - vfs.f_ffree)
