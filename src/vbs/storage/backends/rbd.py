"""The ``rbd`` backend: volumes as Ceph RBD images, snapshots as image snapshots, clones as RBD clones.

A volume ``vol-…`` is the image ``<rbd_pool>/vol-…``; a snapshot ``snap-…`` is the image snapshot
``<rbd_pool>/vol-…@snap-…`` of the volume it was taken from (point in time by construction: RBD
snapshots are taken at one instant also while clients write). A volume made from a snapshot is a
clone of it (clone v2 where the cluster requires mimic clients or newer; else the snapshot is
protected first, as clone v1 needs).

Deletion, as Cinder and ceph-csi learnt it: a volume whose image still has snapshots (EBS keeps
snapshots after their volume is deleted; deleted snapshots that clones still read stay in the
image's trash namespace) is moved to the RBD trash (``rbd trash mv``). Its snapshots stay listed and
cloneable (the image is restored under ``vbs-retired-vol-…`` for the clone, then trashed again), and
a purge pass removes it (``rbd trash rm`` by id) once it has no snapshot left: after every removal
and every ``MAINTENANCE_INTERVAL_S``. Images renamed ``vbs-retired-vol-…`` by older agents (or left
so by a crash during such a clone) are moved to the trash by the same pass.

Clone chains: a volume made from a snapshot whose chain of clones would be deeper than
``max_clone_depth`` is still a clone at once (usable, attachable), then flattened in the background
(``rbd flatten``, ``max_flattens`` at once, its percentage in the volume's status). At start and in
every pass the agent flattens what is still too deep, so an agent restart resumes them. A volume has
at most ``max_snapshots_per_volume`` snapshots (450 by default; the pool reports it, the controller
refuses the next one before anything is made, and so does the backend).

Ceph is asked through its command-line tools (``rbd_cli``: why not the python3-rbd bindings).

Hosts reach a volume in one of two ways. A host whose hypervisor opens RBD itself (its
capabilities list ``rbd``; the controller says so in the connection request) gets an
``RbdConnection``: the cluster's monitors, the image, and a cephx user made for this one attachment
whose caps reach that image's objects only (``rbd_access``); the user is removed with the
connection. Any other host gets an export, as with the ``file`` backend: the export daemon opens the
image itself (``RbdSource``: qemu-storage-daemon's librbd, as the agent's cephx user, its key read
from the keyring the conf names) and serves it over NBD (or tgtd's rbd store serves it over iSCSI).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Collection
from pathlib import Path

from pydantic import SecretStr

from vbs import ids
from vbs.config import CEPH_USER_RE, RBD_POOL_RE, StorageAgentConfig
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound, VbsError, VolumeSnapshotLimitExceeded
from vbs.pools.exports import ExportDriver, RbdSource
from vbs.storage.backends import rbd_access
from vbs.storage.backends.rbd_chains import (
    RETIRED_PREFIX,
    Flattener,
    TrashEntry,
    parse_snaps,
    parse_watchers,
    volume_of,
)
from vbs.storage.backends.rbd_cli import (
    COMMAND_TIMEOUT_S,
    EBUSY,
    EEXIST,
    EINVAL,
    ENOENT,
    ENOTEMPTY,
    Listing,
    RbdTools,
    ToolError,
    parse_fsid,
    parse_listing,
    parse_pool_stats,
)
from vbs.storage.backends.rbd_native import CephxAttachments
from vbs.wire.connection import Connection, HostIdentity, RbdConnection
from vbs.wire.storage import (
    CloneChain,
    ExportInfo,
    ItemStatus,
    PoolInfo,
    PoolInventory,
    TrashedImage,
)

__all__ = ["RbdBackend", "Listing", "parse_listing", "parse_pool_stats", "parse_fsid"]

log = logging.getLogger(__name__)

IMAGE_FEATURES = "layering,exclusive-lock,object-map,fast-diff,deep-flatten"
MAINTENANCE_INTERVAL_S = 300.0
FLATTEN_STALL_S = 600.0
_SECTOR = 512


class RbdBackend:
    """One VBS pool in the Ceph pool ``rbd_pool`` of the cluster ``ceph_conf`` describes."""

    def __init__(self, name: str, ceph_conf: Path, *, ceph_user: str = "admin", rbd_pool: str = "rbd",
                 timeout_s: float = COMMAND_TIMEOUT_S, exports: ExportDriver | None = None,
                 max_clone_depth: int = 5, max_flattens: int = 2, max_snapshots_per_volume: int = 450,
                 maintenance_interval_s: float = MAINTENANCE_INTERVAL_S) -> None:
        if not re.fullmatch(CEPH_USER_RE, ceph_user):
            raise InvalidParameter(f"invalid Ceph user {ceph_user[:64]!r}")
        if not re.fullmatch(RBD_POOL_RE, rbd_pool):
            raise InvalidParameter(f"invalid RBD pool {rbd_pool[:64]!r}")
        for what, value, top in (("max_clone_depth", max_clone_depth, 16), ("max_flattens", max_flattens, 16),
                                 ("max_snapshots_per_volume", max_snapshots_per_volume, 450)):
            if not 1 <= value <= top:
                raise InvalidParameter(f"{what} must be 1-{top}, not {value}")
        if not ceph_conf.is_file():
            raise DriverError(f"pool {name}: the Ceph configuration {ceph_conf} is not a file")
        self.name = name
        self.ceph_conf = ceph_conf
        self.ceph_user = ceph_user
        self.rbd_pool = rbd_pool
        self.timeout_s = timeout_s
        self.exports = exports
        self.max_clone_depth = max_clone_depth
        self.max_snapshots_per_volume = max_snapshots_per_volume
        # One call at a time: each is short, and an ensure never races a remove of the same image.
        self._lock = threading.Lock()
        self._cli = RbdTools(name, ceph_conf, ceph_user, rbd_pool, timeout_s)
        self._cephx = CephxAttachments(self._cli)
        self.flattener = Flattener(lambda volume: self._argv("rbd", "flatten", self._cli.spec(volume)),
                                   max_running=max_flattens, stall_s=FLATTEN_STALL_S,
                                   should_run=self._too_deep, done=self._flattened,
                                   prepare=self._object_map_off, finish=self._object_map_on)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._maintenance_interval_s = maintenance_interval_s
        self._maintainer = threading.Thread(target=self._maintain_loop, name=f"rbd-maintain-{name}", daemon=True)
        self._maintainer.start()
        self._fsid: str | None = None

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, exports: ExportDriver) -> RbdBackend:
        if cfg.ceph_conf is None:
            raise InvalidParameter("the rbd backend needs ceph_conf (--ceph-conf)")
        return cls(cfg.pool_name, cfg.ceph_conf.resolve(), ceph_user=cfg.ceph_user, rbd_pool=cfg.rbd_pool,
                   exports=exports, max_clone_depth=cfg.rbd_max_clone_depth, max_flattens=cfg.rbd_max_flattens,
                   max_snapshots_per_volume=cfg.rbd_max_snapshots_per_volume)

    # -- the tools ----------------------------------------------------------------------------------

    def _argv(self, tool: str, *args: str) -> list[str]:
        return self._cli.argv(tool, *args)

    def _listing(self) -> Listing:
        return self._cli.listing()

    def _image_size(self, image: str) -> int | None:
        info = self._cli.info(self._cli.spec(image))
        return None if info is None else int(info["size"])

    def _status(self, volume_id: str, size: int) -> ItemStatus:
        """Ready (usable); a progress below 100 while a background flatten of it is that far."""
        progress = self.flattener.progress(volume_id)
        return ItemStatus(state="ready", size_bytes=size, progress=100 if progress is None else progress)

    # -- pool -------------------------------------------------------------------------------------

    def pool_info(self) -> PoolInfo:
        capacity, free = parse_pool_stats(self._cli.tool("ceph", "df", "--format", "json"), self.rbd_pool)
        return PoolInfo(name=self.name, backend="rbd", capacity_bytes=capacity, free_bytes=free,
                        clone_method="rbd-clone", point_in_time=True, monitors=self._cephx.monitors(),
                        max_snapshots_per_volume=self.max_snapshots_per_volume,
                        shared_id=f"ceph:{self._cluster_fsid()}/{self.rbd_pool}")

    def _cluster_fsid(self) -> str:
        """The cluster's fsid (asked once): agents on the same Ceph pool report the same shared id."""
        if self._fsid is None:
            self._fsid = parse_fsid(self._cli.tool("ceph", "fsid", "--format", "json"))
        return self._fsid

    def inventory(self) -> PoolInventory:
        with self._lock:
            listing = self._listing()
        trash = [TrashedImage(id=e.id, name=e.name, snapshots=len(e.live_snapshots),
                              children=len(e.snaps) - len(e.live_snapshots), kept_for=e.kept_for)
                 for e in sorted(listing.trash.values(), key=lambda e: e.name)]
        chains = [CloneChain(volume_id=v, depth=len(links), parents=links)
                  for v in sorted(listing.volumes) if len(links := listing.chain(v)) > 1]
        return PoolInventory(volumes=sorted(listing.volumes), snapshots=sorted(listing.snapshots), trash=trash,
                             chains=chains, flattens=self.flattener.report())

    def close(self) -> None:
        """Stop the maintenance pass and the flattens (what they copied stays; the next start resumes)."""
        self._stop.set()
        self._wake.set()
        self.flattener.close()
        if self._maintainer is not threading.current_thread():
            self._maintainer.join(timeout=self.timeout_s + 10)

    # -- the trash and the chains ---------------------------------------------------------------------

    def maintain(self) -> None:
        """One pass: purge the trash (and images renamed ``vbs-retired-``), and flatten the clones
        deeper than ``max_clone_depth``. Idempotent; run at start, after flattens and periodically."""
        with self._lock:
            listing = self._purge()
        for volume in sorted(listing.volumes):
            if listing.depth(volume) > self.max_clone_depth:
                self.flattener.submit(volume)

    def _maintain_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.maintain()
            except VbsError as exc:
                log.warning("pool %s: maintenance pass failed: %s", self.name, exc.message)
            self._wake.wait(self._maintenance_interval_s)
            self._wake.clear()

    def _purge(self) -> Listing:
        """Trash the images renamed ``vbs-retired-`` that have snapshots and remove those without,
        then remove every trashed image of VBS that has no snapshot left. The caller holds the lock."""
        listing = self._listing()
        for image in sorted(listing.retired):
            try:
                snaps = parse_snaps(self._cli.rbd("snap", "ls", "--all", "--format", "json", self._cli.spec(image)))
                if snaps:
                    self._cli.rbd("trash", "mv", self._cli.spec(image))
                    log.info("pool %s: %s moved to the trash (%d snapshots left)", self.name, image, len(snaps))
                else:
                    self._cli.rbd("rm", self._cli.spec(image))
            except ToolError as exc:
                if exc.errno not in (ENOENT, EBUSY, ENOTEMPTY):
                    raise
        if listing.retired:
            listing = self._listing()
        for entry in list(listing.trash.values()):
            if entry.kept_for == "nothing":
                self._cli.rbd_tolerant("trash", "rm", f"{self.rbd_pool}/{entry.id}", tolerate=(ENOENT, ENOTEMPTY))
                log.info("pool %s: %s (%s) purged from the trash", self.name, entry.name, entry.id)
                del listing.trash[entry.name]
        return listing

    def _flattened(self, volume_id: str, ok: bool) -> None:
        """A flatten ended: a purge may now remove what only that clone kept (a failed one waits for
        the next periodic pass, so a flatten that keeps failing does not spin)."""
        if ok:
            self._wake.set()

    def _purge_after_removal(self) -> None:
        """A purge after a removal, which has happened: a purge that fails (an image another client
        trashed with a later expiry, a cluster that stops answering) is the next pass's to retry."""
        try:
            self._purge()
        except VbsError as exc:
            log.warning("pool %s: purge after a removal failed: %s", self.name, exc.message)

    def _too_deep(self, volume_id: str) -> bool:
        """Whether ``volume_id`` needs a flatten now (asked just before one starts): deeper than the
        limit, and no clone reads from a snapshot of it. A clone below it is deeper still and is
        flattened first; then this one: flattens go deepest first, never two along one chain."""
        listing = self._listing()
        return (volume_id in listing.volumes and listing.depth(volume_id) > self.max_clone_depth
                and not listing.has_clones(volume_id))

    def _object_map_off(self, volume_id: str) -> None:
        """Before a flatten: switch the image's object map off, so that the flatten copies up every
        object its parents hold. With the map on, ``rbd flatten`` skips an object the map marks as
        existing, and librbd marks one before its copy-up writes it: an interrupted copy-up (a flatten
        stopped, a client that died) leaves a mark without the object, which the flatten skips and
        which reads as zeros once the parent is cut. On Ceph 16.2 a flatten stopped half-way and run
        again lost the objects in flight, also after ``object-map rebuild``; with the map off, none."""
        if {"object-map", "fast-diff"} & self._features(volume_id):
            self._cli.rbd("feature", "disable", self._cli.spec(volume_id), "fast-diff,object-map",
                          timeout_s=FLATTEN_STALL_S)

    def _object_map_on(self, volume_id: str) -> None:
        """After a flatten (completed, stopped or failed): the object map back on (Ceph builds it
        anew from the objects). A crash in between leaves it off until a later flatten of the image,
        if one is still needed (a flatten that had completed needs none: its map stays off)."""
        features = self._features(volume_id)
        if features and "object-map" not in features:
            self._cli.rbd("feature", "enable", self._cli.spec(volume_id), "object-map,fast-diff",
                          timeout_s=FLATTEN_STALL_S)

    def _features(self, volume_id: str) -> set[str]:
        """The features of the volume's image (empty if it is gone)."""
        info = self._cli.info(self._cli.spec(volume_id))
        features = info.get("features") if info is not None else None
        return {f for f in features if isinstance(f, str)} if isinstance(features, list) else set()

    # -- volumes ----------------------------------------------------------------------------------

    def ensure_volume(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None = None) -> ItemStatus:
        ids.check("volume", volume_id)
        if source_snapshot_id is not None:
            ids.check("snapshot", source_snapshot_id)
        _check_size(size_bytes)
        with self._lock:
            if source_snapshot_id is not None:
                current = self._clone(volume_id, source_snapshot_id, size_bytes)
            else:
                size = self._image_size(volume_id)
                if size is None:
                    self._create(volume_id, size_bytes)
                    size = self._image_size(volume_id)
                current = size or 0
            if current < size_bytes:  # a clone of a smaller snapshot whose grow a crash interrupted
                self._cli.rbd("resize", "--size", f"{size_bytes}B", self._cli.spec(volume_id))
                current = size_bytes
            return self._status(volume_id, current)

    def _create(self, volume_id: str, size_bytes: int) -> None:
        self._cli.rbd_tolerant("create", "--size", f"{size_bytes}B", "--image-feature", IMAGE_FEATURES,
                           self._cli.spec(volume_id), tolerate=(EEXIST,))

    def _clone(self, volume_id: str, snapshot_id: str, size_bytes: int) -> int:
        """Clone the snapshot as the volume unless the pool has it already; the volume's size now. The
        pool's listing answers both (one ``ls -l``, one ``trash ls``): no ``info`` before or after."""
        listing = self._listing()
        if volume_id in listing.volumes:  # a repeat
            return listing.volumes[volume_id]
        found = listing.snapshots.get(snapshot_id)
        if found is None:
            raise NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")
        image, snap_size = found
        if size_bytes < snap_size:
            raise InvalidParameter(f"The size {size_bytes} is smaller than the snapshot {snapshot_id} ({snap_size})")
        entry = listing.trash.get(image)
        # A flatten of the parent image stops before its snapshot gains a clone, and again after (one
        # that started meanwhile): see _too_deep. The next pass resumes it once no clone reads from it.
        self.flattener.cancel(image)
        made = (self._clone_named(image, snapshot_id, volume_id) if entry is None
                else self._clone_trashed(entry, snapshot_id, volume_id))
        self.flattener.cancel(image)
        if 1 + listing.depth(image) > self.max_clone_depth:
            log.info("pool %s: %s is %d clones deep (limit %d): flattening it", self.name, volume_id,
                     1 + listing.depth(image), self.max_clone_depth)
            self.flattener.submit(volume_id)
        # A clone has its snapshot's size; one made meanwhile by a repeat (EEXIST) is asked.
        return snap_size if made else (self._image_size(volume_id) or 0)

    def _clone_named(self, image: str, snapshot_id: str, volume_id: str) -> bool:
        """Whether this call made the clone (False: it existed)."""
        argv = ["clone", "--image-feature", IMAGE_FEATURES, self._cli.spec(image, snapshot_id),
                self._cli.spec(volume_id)]
        try:
            self._cli.rbd(*argv)
        except ToolError as exc:
            if exc.errno == EEXIST:
                return False
            if exc.errno != EINVAL:
                raise
            # Clone v1 (a cluster that still admits pre-mimic clients): the parent must be protected.
            self._cli.rbd("snap", "protect", self._cli.spec(image, snapshot_id))
            self._cli.rbd(*argv)
        return True

    def _clone_trashed(self, entry: TrashEntry, snapshot_id: str, volume_id: str) -> bool:
        """``rbd clone`` opens its parent by name: restore the trashed image under ``vbs-retired-…``
        for the clone, then trash it again (a crash between leaves it named, and the purge trashes it)."""
        named = RETIRED_PREFIX + (volume_of(entry.name) or entry.id)
        self._cli.rbd("trash", "restore", "--image", named, f"{self.rbd_pool}/{entry.id}")
        try:
            return self._clone_named(named, snapshot_id, volume_id)
        finally:
            self._cli.rbd_tolerant("trash", "mv", self._cli.spec(named), tolerate=(ENOENT,))

    def volume_status(self, volume_id: str) -> ItemStatus:
        ids.check("volume", volume_id)
        with self._lock:
            size = self._image_size(volume_id)
        return ItemStatus(state="absent") if size is None else self._status(volume_id, size)

    def remove_volume(self, volume_id: str) -> None:
        ids.check("volume", volume_id)
        with self._lock:
            self.flattener.cancel(volume_id)  # a flatten holds the image open; what it copied goes with it
            if self._image_size(volume_id) is None:
                return
            try:
                self._cli.rbd("rm", self._cli.spec(volume_id))
            except ToolError as exc:
                if exc.errno == ENOENT:
                    return
                if exc.errno == EBUSY:
                    raise IncorrectState(f"The volume '{volume_id}' is still open on a host.") from None
                if exc.errno != ENOTEMPTY:
                    raise
                # Its snapshots outlive it (EBS), or clones read deleted ones: to the trash until none is
                # left. `rbd trash mv` takes an image that a client has open, which `rbd rm` refuses: ask.
                if parse_watchers(self._cli.rbd("status", "--format", "json", self._cli.spec(volume_id))):
                    raise IncorrectState(f"The volume '{volume_id}' is still open on a host.") from None
                self._cli.rbd("trash", "mv", self._cli.spec(volume_id))
                log.info("pool %s: volume %s moved to the trash: snapshots of it remain", self.name, volume_id)
            self._purge_after_removal()  # its parent may have been waiting for its last clone

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
                self._cli.rbd("resize", "--size", f"{size_bytes}B", self._cli.spec(volume_id))
            return self._status(volume_id, size_bytes)

    # -- snapshots --------------------------------------------------------------------------------

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        ids.check("snapshot", snapshot_id)
        ids.check("volume", volume_id)
        spec = self._cli.spec(volume_id, snapshot_id)
        with self._lock:
            # Two tool calls: make it (a repeat answers EEXIST), then list the volume's own snapshots
            # (one image, not the pool) for its size and the count. The controller refuses a snapshot
            # past the limit before it asks; one that got here anyway is taken back.
            try:
                self._cli.rbd("snap", "create", spec)
                made = True
            except ToolError as exc:
                if exc.errno == ENOENT:  # no image: a repeat after the volume was deleted, or no volume
                    found = self._listing().snapshots.get(snapshot_id)
                    if found is not None:
                        return _ready(found[1])
                    raise NotFound(f"The volume '{volume_id}' does not exist.",
                                   code="InvalidVolume.NotFound") from None
                if exc.errno != EEXIST:
                    raise
                made = False
            have = self._snapshots_of(volume_id) or {}
            if made and len(have) > self.max_snapshots_per_volume:
                self._cli.rbd_tolerant("snap", "rm", spec, tolerate=(ENOENT,))
                raise VolumeSnapshotLimitExceeded(
                    f"The volume '{volume_id}' has {len(have) - 1} snapshots, the most pool {self.name} allows; "
                    "delete one first.", volume_id=volume_id, limit=self.max_snapshots_per_volume)
            size = have.get(snapshot_id)
            if size is None:
                raise DriverError(f"pool {self.name}: snapshot {snapshot_id} was made but is not listed")
            return _ready(size)

    def _snapshots_of(self, volume_id: str) -> dict[str, int] | None:
        """The VBS snapshots of the volume's image and their sizes, or None if it has no image."""
        try:
            snaps = parse_snaps(self._cli.rbd("snap", "ls", "--all", "--format", "json", self._cli.spec(volume_id)))
        except ToolError as exc:
            if exc.errno == ENOENT:
                return None
            raise
        return {s.name: s.size for s in snaps if not s.trashed and ids.is_valid("snapshot", s.name)}

    def snapshot_status(self, snapshot_id: str) -> ItemStatus:
        ids.check("snapshot", snapshot_id)
        with self._lock:
            found = self._listing().snapshots.get(snapshot_id)
        return ItemStatus(state="absent") if found is None else _ready(found[1])

    def remove_snapshot(self, snapshot_id: str) -> None:
        ids.check("snapshot", snapshot_id)
        with self._lock:
            listing = self._listing()
            found = listing.snapshots.get(snapshot_id)
            if found is None:
                return
            entry = listing.trash.get(found[0])
            if entry is not None:  # clone v2: with clones left, it goes to the image's trash namespace
                self._cli.rbd_tolerant("snap", "rm", *self._cli.by_id(entry.id), "--snap", snapshot_id,
                                       tolerate=(ENOENT,))
            else:
                self._remove_named_snapshot(found[0], snapshot_id)
            if entry is not None or found[0].startswith(RETIRED_PREFIX):
                self._purge_after_removal()

    def _remove_named_snapshot(self, image: str, snapshot_id: str) -> None:
        spec = self._cli.spec(image, snapshot_id)
        try:
            self._cli.rbd("snap", "rm", spec)
        except ToolError as exc:
            if exc.errno == ENOENT:
                return
            if exc.errno != EBUSY:
                raise
            # A protected snapshot (clone v1): unprotecting fails while clones of it remain.
            try:
                self._cli.rbd("snap", "unprotect", spec)
            except ToolError as again:
                if again.errno == EBUSY:
                    raise IncorrectState(f"The snapshot '{snapshot_id}' has volumes cloned from it.") from None
                raise
            self._cli.rbd("snap", "rm", spec)

    def snapshot_target(self, snapshot_id: str, volume_id: str, host: HostIdentity) -> Connection:
        raise DriverError(f"pool {self.name}: RBD snapshots are point in time; no hypervisor copy is needed")

    def finish_snapshot_target(self, snapshot_id: str, host_name: str) -> ItemStatus:
        raise DriverError(f"pool {self.name}: RBD snapshots are point in time; no hypervisor copy is needed")

    # -- how hosts reach volumes ----------------------------------------------------------------------

    def connection_for(self, volume_id: str, host: HostIdentity, *, read_only: bool = False,
                       protocols: Collection[str] = ()) -> Connection:
        """A host whose hypervisor opens RBD itself gets the image and a cephx key of its own for
        this attachment (``rbd_access``); any other gets an export of the image."""
        ids.check("volume", volume_id)
        if "rbd" in protocols:
            return self._native(volume_id, host.name, read_only)
        return self._need_exports().ensure_export(volume_id, self._source(volume_id), host, read_only=read_only)

    def remove_connection(self, volume_id: str, host_name: str) -> None:
        """Both kinds go (the backend does not remember which one the host got): the export, if
        any, and the attachment's cephx user (absent is fine)."""
        ids.check("volume", volume_id)
        if self.exports is not None:
            self.exports.remove_export(volume_id, host_name)
        self._cephx.remove_user(volume_id, rbd_access.attachment_user(host_name, volume_id))

    def refresh_connection(self, volume_id: str, host_name: str) -> Connection:
        """After a grow: a native connection is the same one (QEMU's rbd node is told the new size);
        an export gets a connection of the image's new size (the one in use serves on)."""
        ids.check("volume", volume_id)
        caps = self._cephx.attachment_caps(volume_id, host_name)
        if caps is not None:
            return self._native(volume_id, host_name, read_only="allow rwx" not in caps.get("osd", ""))
        return self._need_exports().refresh_export(volume_id, self._source(volume_id), host_name)

    def retire_connections(self, volume_id: str, host_name: str) -> None:
        ids.check("volume", volume_id)
        if self._cephx.attachment_caps(volume_id, host_name) is None:
            self._need_exports().retire_exports(volume_id, host_name)

    def native_connections(self) -> list[ExportInfo]:
        """The attachments' cephx users of this pool's images, as the reconciler sees exports."""
        return self._cephx.users()

    def _native(self, volume_id: str, host_name: str, read_only: bool) -> RbdConnection:
        user = rbd_access.attachment_user(host_name, volume_id)
        with self._lock:
            chain = self._cephx.image_chain(volume_id)
            caps = rbd_access.osd_caps(volume_id, chain, read_only=read_only)
            key = self._cephx.cephx_key(user, caps)
            monitors = self._cephx.monitors()
        return RbdConnection(monitors=monitors, pool=self.rbd_pool, image=volume_id, user=user,
                             key=SecretStr(key), read_only=read_only)

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

