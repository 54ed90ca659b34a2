"""The ``rbd`` backend: volumes as Ceph RBD images, snapshots as image snapshots, clones as RBD clones.

A volume ``vol-…`` is the image ``<rbd_pool>/vol-…``; a snapshot ``snap-…`` is the image snapshot
``<rbd_pool>/vol-…@snap-…`` of the volume it was taken from (point in time by construction: RBD
snapshots are taken at one instant also while clients write). A volume made from a snapshot is a
clone of it (clone v2 where the cluster requires mimic clients or newer; else the snapshot is
protected first, as clone v1 needs). A volume deleted while snapshots of it remain is renamed
``vbs-retired-vol-…`` and removed with its last snapshot.

Why the ``rbd`` and ``ceph`` command-line tools and not the python3-rbd bindings: a librbd or
librados call can block for ever (a mon or OSD that does not answer; Cinder wraps every call in a
thread with a timeout and still leaks the thread), and a hung call holds the GIL-free C library
inside the agent. A child process run with a timeout is killed when it overruns, and nothing of it
stays in the agent; ``--format json`` gives typed answers, and the cost (a process per call, about
30-50 ms) is small next to a workflow step. The tools get an argv list (no shell), a minimal
environment, the cluster's ``ceph.conf`` and the cephx user name: the key is read by the tool from
the keyring file the conf names and never appears on an argv or in a log.

Hosts reach a volume through the agent's export driver, as with the ``file`` backend: the export
daemon opens the image itself (``RbdSource``: qemu-storage-daemon's librbd, as the agent's cephx
user, its key read from the keyring the conf names) and serves it over NBD. So the controller, host
agents and hypervisor drivers see an NBD connection and need nothing of Ceph.

Not here yet (issue 11, later parts): hypervisors that open RBD natively, per-tenant cephx keys,
tgt's ``--bstype rbd`` for the iSCSI export, clone depth limits and flattening, the RBD trash.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from vbs import ids
from vbs.config import CEPH_USER_RE, RBD_POOL_RE, StorageAgentConfig
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound
from vbs.processes import minimal_environment
from vbs.storage.exports.base import ExportDriver, RbdSource
from vbs.wire.connection import Connection, HostIdentity
from vbs.wire.storage import ItemStatus, PoolInfo, PoolInventory

__all__ = ["RbdBackend", "Listing", "parse_listing", "parse_pool_stats", "parse_fsid"]

log = logging.getLogger(__name__)

IMAGE_FEATURES = "layering,exclusive-lock,object-map,fast-diff,deep-flatten"
RETIRED_PREFIX = "vbs-retired-"
COMMAND_TIMEOUT_S = 60.0
_FSID_RE = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_SECTOR = 512
# What the rbd tool exits with (the errno of the failed call).
_ENOENT, _EBUSY, _EEXIST, _EINVAL, _ENOTEMPTY = 2, 16, 17, 22, 39


@dataclass
class Listing:
    """What ``rbd ls -l`` says of a pool: volume sizes, and each snapshot's image and size."""

    volumes: dict[str, int] = field(default_factory=dict)
    snapshots: dict[str, tuple[str, int]] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)


def parse_listing(text: str) -> Listing:
    """``rbd ls -l --format json`` of a pool. Entries that are not VBS's (other names) are skipped."""
    listing = Listing()
    entries = json.loads(text or "[]")
    if not isinstance(entries, list):
        raise DriverError("rbd ls: unexpected answer")
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        image, size, snap = entry.get("image"), entry.get("size"), entry.get("snapshot")
        if not isinstance(image, str) or not isinstance(size, int):
            continue
        volume = image.removeprefix(RETIRED_PREFIX)
        if not ids.is_valid("volume", volume):
            continue
        if snap is None:
            if image == volume:
                listing.volumes[volume] = size
            else:
                listing.retired.add(image)
        elif ids.is_valid("snapshot", snap):
            listing.snapshots[snap] = (image, size)
    return listing


def parse_fsid(text: str) -> str:
    """``ceph fsid --format json``: the cluster's fsid (a UUID)."""
    answer = json.loads(text)
    fsid = answer.get("fsid") if isinstance(answer, dict) else None
    if not isinstance(fsid, str) or not re.fullmatch(_FSID_RE, fsid):
        raise DriverError("ceph fsid: unexpected answer")
    return fsid


def parse_pool_stats(text: str, pool: str) -> tuple[int, int]:
    """``ceph df --format json``: the (capacity, free) bytes of ``pool``, after its replication."""
    answer = json.loads(text)
    for entry in answer.get("pools", []) if isinstance(answer, dict) else []:
        if isinstance(entry, dict) and entry.get("name") == pool:
            stats = entry.get("stats", {})
            stored, free = stats.get("stored", 0), stats.get("max_avail", 0)
            if isinstance(stored, int) and isinstance(free, int) and stored >= 0 and free >= 0:
                return stored + free, free
    raise DriverError(f"ceph df does not list the pool {pool!r}")


class _ToolError(DriverError):
    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno


class RbdBackend:
    """One VBS pool in the Ceph pool ``rbd_pool`` of the cluster ``ceph_conf`` describes."""

    def __init__(self, name: str, ceph_conf: Path, *, ceph_user: str = "admin", rbd_pool: str = "rbd",
                 timeout_s: float = COMMAND_TIMEOUT_S, exports: ExportDriver | None = None) -> None:
        if not re.fullmatch(CEPH_USER_RE, ceph_user):
            raise InvalidParameter(f"invalid Ceph user {ceph_user[:64]!r}")
        if not re.fullmatch(RBD_POOL_RE, rbd_pool):
            raise InvalidParameter(f"invalid RBD pool {rbd_pool[:64]!r}")
        if not ceph_conf.is_file():
            raise DriverError(f"pool {name}: the Ceph configuration {ceph_conf} is not a file")
        self.name = name
        self.ceph_conf = ceph_conf
        self.ceph_user = ceph_user
        self.rbd_pool = rbd_pool
        self.timeout_s = timeout_s
        self.exports = exports
        # One call at a time: each is short, and an ensure never races a remove of the same image.
        self._lock = threading.Lock()
        self._fsid: str | None = None

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, exports: ExportDriver) -> RbdBackend:
        if cfg.ceph_conf is None:
            raise InvalidParameter("the rbd backend needs ceph_conf (--ceph-conf)")
        return cls(cfg.pool_name, cfg.ceph_conf.resolve(), ceph_user=cfg.ceph_user, rbd_pool=cfg.rbd_pool,
                   exports=exports)

    # -- the tools ----------------------------------------------------------------------------------

    def _tool(self, tool: str, *args: str) -> str:
        t = int(self.timeout_s)
        argv = [tool, "--conf", str(self.ceph_conf), "--id", self.ceph_user,
                "--rados-mon-op-timeout", str(t), "--rados-osd-op-timeout", str(t),
                "--client-mount-timeout", str(t), *args]
        try:
            proc = subprocess.run(argv, env=minimal_environment(), stdin=subprocess.DEVNULL,  # noqa: S603
                                  capture_output=True, text=True, timeout=self.timeout_s + 5)
        except subprocess.TimeoutExpired:
            raise DriverError(f"pool {self.name}: {tool} {args[0]} did not answer within {self.timeout_s:g}s") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [""])[-1][:500]
            raise _ToolError(f"pool {self.name}: {tool} {args[0]} failed: {last}", proc.returncode)
        return proc.stdout

    def _rbd(self, *args: str) -> str:
        return self._tool("rbd", *args)  # progress goes to stderr, which only an error shows

    def _spec(self, image: str, snap: str | None = None) -> str:
        return f"{self.rbd_pool}/{image}" + (f"@{snap}" if snap else "")

    def _listing(self) -> Listing:
        return parse_listing(self._rbd("ls", "-l", "--format", "json", self.rbd_pool))

    def _image_size(self, image: str) -> int | None:
        info = self._image_info(image)
        return None if info is None else info[0]

    def _image_info(self, image: str) -> tuple[int, str | None] | None:
        """The size of ``image`` and the image its parent snapshot is of (a clone), or None if it is absent."""
        try:
            info = json.loads(self._rbd("info", "--format", "json", self._spec(image)))
        except _ToolError as exc:
            if exc.errno == _ENOENT:
                return None
            raise
        size = info.get("size") if isinstance(info, dict) else None
        if not isinstance(size, int):
            raise DriverError(f"pool {self.name}: rbd info {image}: no size")
        parent = info.get("parent")
        parent_image = parent.get("image") if isinstance(parent, dict) else None
        return size, parent_image if isinstance(parent_image, str) else None

    # -- pool -------------------------------------------------------------------------------------

    def pool_info(self) -> PoolInfo:
        capacity, free = parse_pool_stats(self._tool("ceph", "df", "--format", "json"), self.rbd_pool)
        return PoolInfo(name=self.name, backend="rbd", capacity_bytes=capacity, free_bytes=free,
                        clone_method="rbd-clone", point_in_time=True,
                        shared_id=f"ceph:{self._cluster_fsid()}/{self.rbd_pool}")

    def _cluster_fsid(self) -> str:
        """The cluster's fsid (asked once): agents on the same Ceph pool report the same shared id."""
        if self._fsid is None:
            self._fsid = parse_fsid(self._tool("ceph", "fsid", "--format", "json"))
        return self._fsid

    def inventory(self) -> PoolInventory:
        with self._lock:
            listing = self._listing()
        return PoolInventory(volumes=sorted(listing.volumes), snapshots=sorted(listing.snapshots))

    def close(self) -> None:
        """Nothing runs in the background."""

    # -- volumes ----------------------------------------------------------------------------------

    def ensure_volume(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None = None) -> ItemStatus:
        ids.check("volume", volume_id)
        if source_snapshot_id is not None:
            ids.check("snapshot", source_snapshot_id)
        _check_size(size_bytes)
        with self._lock:
            current = self._image_size(volume_id)
            if current is None:
                if source_snapshot_id is None:
                    self._create(volume_id, size_bytes)
                else:
                    self._clone(volume_id, source_snapshot_id, size_bytes)
                current = self._image_size(volume_id) or 0
            if current < size_bytes:  # a clone of a smaller snapshot whose grow a crash interrupted
                self._rbd("resize", "--size", f"{size_bytes}B", self._spec(volume_id))
                current = size_bytes
            return _ready(current)

    def _create(self, volume_id: str, size_bytes: int) -> None:
        try:
            self._rbd("create", "--size", f"{size_bytes}B", "--image-feature", IMAGE_FEATURES, self._spec(volume_id))
        except _ToolError as exc:
            if exc.errno != _EEXIST:
                raise

    def _clone(self, volume_id: str, snapshot_id: str, size_bytes: int) -> None:
        found = self._listing().snapshots.get(snapshot_id)
        if found is None:
            raise NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")
        image, snap_size = found
        if size_bytes < snap_size:
            raise InvalidParameter(f"The size {size_bytes} is smaller than the snapshot {snapshot_id} ({snap_size})")
        argv = ["clone", "--image-feature", IMAGE_FEATURES, self._spec(image, snapshot_id), self._spec(volume_id)]
        try:
            self._rbd(*argv)
        except _ToolError as exc:
            if exc.errno == _EEXIST:
                return
            if exc.errno != _EINVAL:
                raise
            # Clone v1 (a cluster that still admits pre-mimic clients): the parent must be protected.
            self._rbd("snap", "protect", self._spec(image, snapshot_id))
            self._rbd(*argv)

    def volume_status(self, volume_id: str) -> ItemStatus:
        ids.check("volume", volume_id)
        with self._lock:
            size = self._image_size(volume_id)
        return ItemStatus(state="absent") if size is None else _ready(size)

    def remove_volume(self, volume_id: str) -> None:
        ids.check("volume", volume_id)
        with self._lock:
            info = self._image_info(volume_id)
            if info is None:
                return
            try:
                self._rbd("rm", self._spec(volume_id))
                if info[1] is not None and info[1].startswith(RETIRED_PREFIX):
                    self._remove_retired(info[1])  # its last clone went: the deleted parent may go too
            except _ToolError as exc:
                if exc.errno == _ENOENT:
                    return
                if exc.errno == _EBUSY:
                    raise IncorrectState(f"The volume '{volume_id}' is still open on a host.") from None
                if exc.errno != _ENOTEMPTY:
                    raise
                # Its snapshots outlive it (EBS): keep the image under a name no volume has.
                self._rbd("rename", self._spec(volume_id), self._spec(RETIRED_PREFIX + volume_id))
                log.info("volume %s retired: snapshots of it remain", volume_id)

    def resize_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        ids.check("volume", volume_id)
        _check_size(size_bytes)
        with self._lock:
            current = self._image_size(volume_id)
            if current is None:
                raise NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound")
            if size_bytes < current:
                raise InvalidParameter(f"Volume {volume_id}: the new size {size_bytes} is smaller than the current "
                                       f"size {current}; volumes can only grow")
            if size_bytes > current:
                self._rbd("resize", "--size", f"{size_bytes}B", self._spec(volume_id))
            return _ready(size_bytes)

    # -- snapshots --------------------------------------------------------------------------------

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        ids.check("snapshot", snapshot_id)
        ids.check("volume", volume_id)
        with self._lock:
            found = self._listing().snapshots.get(snapshot_id)
            if found is not None:
                return _ready(found[1])
            try:
                self._rbd("snap", "create", self._spec(volume_id, snapshot_id))
            except _ToolError as exc:
                if exc.errno == _ENOENT:
                    raise NotFound(f"The volume '{volume_id}' does not exist.",
                                   code="InvalidVolume.NotFound") from None
                if exc.errno != _EEXIST:
                    raise
            found = self._listing().snapshots.get(snapshot_id)
            if found is None:
                raise DriverError(f"pool {self.name}: snapshot {snapshot_id} was made but is not listed")
            return _ready(found[1])

    def snapshot_status(self, snapshot_id: str) -> ItemStatus:
        ids.check("snapshot", snapshot_id)
        with self._lock:
            found = self._listing().snapshots.get(snapshot_id)
        return ItemStatus(state="absent") if found is None else _ready(found[1])

    def remove_snapshot(self, snapshot_id: str) -> None:
        ids.check("snapshot", snapshot_id)
        with self._lock:
            found = self._listing().snapshots.get(snapshot_id)
            if found is None:
                return
            image = found[0]
            spec = self._spec(image, snapshot_id)
            try:
                self._rbd("snap", "rm", spec)
            except _ToolError as exc:
                if exc.errno == _ENOENT:
                    return
                if exc.errno != _EBUSY:
                    raise
                # A protected snapshot (clone v1): unprotecting fails while clones of it remain.
                try:
                    self._rbd("snap", "unprotect", spec)
                except _ToolError as again:
                    if again.errno == _EBUSY:
                        raise IncorrectState(f"The snapshot '{snapshot_id}' has volumes cloned from it.") from None
                    raise
                self._rbd("snap", "rm", spec)
            if image.startswith(RETIRED_PREFIX):
                self._remove_retired(image)

    def _remove_retired(self, image: str) -> None:
        """The image of a deleted volume, once no snapshot of it is left (clones of a snapshot in
        Ceph's trash keep it until they go)."""
        try:
            self._rbd("rm", self._spec(image))
        except _ToolError as exc:
            if exc.errno not in (_ENOENT, _ENOTEMPTY, _EBUSY):
                raise

    def snapshot_target(self, snapshot_id: str, volume_id: str, host: HostIdentity) -> Connection:
        raise DriverError(f"pool {self.name}: RBD snapshots are point in time; no hypervisor copy is needed")

    def finish_snapshot_target(self, snapshot_id: str, host_name: str) -> ItemStatus:
        raise DriverError(f"pool {self.name}: RBD snapshots are point in time; no hypervisor copy is needed")

    # -- how hosts reach volumes ----------------------------------------------------------------------

    def connection_for(self, volume_id: str, host: HostIdentity, *, read_only: bool = False) -> Connection:
        ids.check("volume", volume_id)
        return self._need_exports().ensure_export(volume_id, self._source(volume_id), host, read_only=read_only)

    def remove_connection(self, volume_id: str, host_name: str) -> None:
        ids.check("volume", volume_id)
        self._need_exports().remove_export(volume_id, host_name)

    def refresh_connection(self, volume_id: str, host_name: str) -> Connection:
        """After a grow: a connection of the image's new size (the one in use serves on)."""
        ids.check("volume", volume_id)
        return self._need_exports().refresh_export(volume_id, self._source(volume_id), host_name)

    def retire_connections(self, volume_id: str, host_name: str) -> None:
        ids.check("volume", volume_id)
        self._need_exports().retire_exports(volume_id, host_name)

    def _need_exports(self) -> ExportDriver:
        if self.exports is None:
            raise DriverError(f"pool {self.name}: this storage agent has no export driver to serve volumes to hosts")
        return self.exports

    def _source(self, volume_id: str) -> RbdSource:
        """The volume's image with its size now (``NotFound`` if it has none)."""
        with self._lock:
            size = self._image_size(volume_id)
        if size is None:
            raise NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound")
        return RbdSource(pool=self.rbd_pool, image=volume_id, conf=self.ceph_conf, user=self.ceph_user,
                         size_bytes=size)


def _ready(size: int) -> ItemStatus:
    return ItemStatus(state="ready", size_bytes=size, progress=100)


def _check_size(size_bytes: object) -> None:
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0 or size_bytes % _SECTOR:
        raise InvalidParameter(f"Invalid size: {size_bytes!r} (expecting a positive multiple of 512 bytes)")

