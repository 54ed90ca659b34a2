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

Ceph is asked through its command-line tools (``rbd_cli``: why not the python3-rbd bindings in the
agent), and the snapshot path's calls through a long-lived child holding the bindings (``rbd_worker``:
the same timeouts, a process per backend instead of one per call; ``worker=False``, the agent's
``rbd_worker = false``, turns it off). Clones
and their flattens are ``rbd_clones``'s, removals and the trash ``rbd_trash``'s, snapshots
``rbd_snapshots``'s; what the snapshot store reads and writes (a snapshot's diff stream, a volume
restored through ``rbd import-diff``: docs/snapshots.md "RBD pools") ``rbd_stored``'s.

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
from vbs.errors import DriverError, InvalidParameter, NotFound, VbsError
from vbs.pools.backend import StreamFill, check_size
from vbs.pools.exports import ExportDriver, RbdSource
from vbs.storage.backends import rbd_access
from vbs.storage.backends.rbd_cli import (
    COMMAND_TIMEOUT_S,
    EEXIST,
    Listing,
    RbdTools,
    parse_fsid,
    parse_listing,
    parse_pool_stats,
)
from vbs.storage.backends.rbd_clones import IMAGE_FEATURES, Clones
from vbs.storage.backends.rbd_native import CephxAttachments
from vbs.storage.backends.rbd_snapshots import Snapshots
from vbs.storage.backends.rbd_stored import SnapshotStream, StoredImages
from vbs.storage.backends.rbd_trash import Trash
from vbs.storage.backends.rbd_worker import SYSTEM_PYTHON
from vbs.wire.connection import Connection, HostIdentity, RbdConnection
from vbs.wire.storage import (
    CloneChain,
    ExportInfo,
    ItemStatus,
    PoolInfo,
    PoolInventory,
    TrashedImage,
)

__all__ = ["RbdBackend", "Listing", "parse_listing", "parse_pool_stats", "parse_fsid", "IMAGE_FEATURES"]

log = logging.getLogger(__name__)

MAINTENANCE_INTERVAL_S = 300.0


class RbdBackend:
    """One VBS pool in the Ceph pool ``rbd_pool`` of the cluster ``ceph_conf`` describes."""

    def __init__(self, name: str, ceph_conf: Path, *, ceph_user: str = "admin", rbd_pool: str = "rbd",
                 timeout_s: float = COMMAND_TIMEOUT_S, exports: ExportDriver | None = None,
                 max_clone_depth: int = 5, max_flattens: int = 2, max_snapshots_per_volume: int = 450,
                 maintenance_interval_s: float = MAINTENANCE_INTERVAL_S, worker: bool = True,
                 worker_python: Path = SYSTEM_PYTHON) -> None:
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
        self.rbd_pool = rbd_pool
        self.exports = exports
        # One call at a time: each is short, and an ensure never races a remove of the same image.
        self._lock = threading.Lock()
        # The cephx user and the timeout are the tools' alone.
        self._cli = RbdTools(name, ceph_conf, ceph_user, rbd_pool, timeout_s, worker=worker,
                             worker_python=worker_python)
        self._cephx = CephxAttachments(self._cli)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._clones = Clones(self._cli, max_clone_depth=max_clone_depth, max_flattens=max_flattens, wake=self._wake)
        self.flattener = self._clones.flattener
        self._trash = Trash(self._cli)
        self._snapshots = Snapshots(self._cli, self._trash, max_snapshots_per_volume=max_snapshots_per_volume)
        self._stored = StoredImages(self._cli, self._lock, self._clones)
        self._maintenance_interval_s = maintenance_interval_s
        self._maintainer = threading.Thread(target=self._maintain_loop, name=f"rbd-maintain-{name}", daemon=True)
        self._maintainer.start()
        self._fsid: str | None = None

    @property
    def max_clone_depth(self) -> int:
        return self._clones.max_clone_depth

    @max_clone_depth.setter
    def max_clone_depth(self, depth: int) -> None:
        self._clones.max_clone_depth = depth

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, exports: ExportDriver) -> RbdBackend:
        if cfg.ceph_conf is None:
            raise InvalidParameter("the rbd backend needs ceph_conf (--ceph-conf)")
        return cls(cfg.pool_name, cfg.ceph_conf.resolve(), ceph_user=cfg.ceph_user, rbd_pool=cfg.rbd_pool,
                   exports=exports, max_clone_depth=cfg.rbd_max_clone_depth, max_flattens=cfg.rbd_max_flattens,
                   max_snapshots_per_volume=cfg.rbd_max_snapshots_per_volume, worker=cfg.rbd_worker)

    # -- the tools ----------------------------------------------------------------------------------

    def _listing(self) -> Listing:
        return self._cli.listing()

    def _image_size(self, image: str) -> int | None:
        return self._cli.image_size(image)

    def _status(self, volume_id: str, size: int) -> ItemStatus:
        """Ready (usable); a progress below 100 while a background flatten of it is that far."""
        progress = self.flattener.progress(volume_id)
        return ItemStatus(state="ready", size_bytes=size, progress=100 if progress is None else progress)

    # -- pool -------------------------------------------------------------------------------------

    def pool_info(self) -> PoolInfo:
        capacity, free = parse_pool_stats(self._cli.tool("ceph", "df", "--format", "json"), self.rbd_pool)
        return PoolInfo(name=self.name, backend="rbd", capacity_bytes=capacity, free_bytes=free,
                        clone_method="rbd-clone", point_in_time=True, monitors=self._cephx.monitors(),
                        max_snapshots_per_volume=self._snapshots.max_snapshots_per_volume,
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
        self._stored.close()
        if self._maintainer is not threading.current_thread():
            self._maintainer.join(timeout=self._cli.timeout_s + 10)
        self._cli.close()  # the rbd worker, by its PID

    # -- the trash and the chains (``rbd_trash``, ``rbd_clones``) -------------------------------------

    def maintain(self) -> None:
        """One pass: purge the trash (and images renamed ``vbs-retired-``), and flatten the clones
        deeper than ``max_clone_depth``. Idempotent; run at start, after flattens and periodically."""
        with self._lock:
            listing = self._trash.purge()
        self._clones.flatten_too_deep(listing)

    def _maintain_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.maintain()
            except VbsError as exc:
                log.warning("pool %s: maintenance pass failed: %s", self.name, exc.message)
            self._wake.wait(self._maintenance_interval_s)
            self._wake.clear()

    # -- volumes ----------------------------------------------------------------------------------

    def ensure_volume(self, volume_id: str, size_bytes: int, source_snapshot_id: str | None = None) -> ItemStatus:
        ids.check("volume", volume_id)
        if source_snapshot_id is not None:
            ids.check("snapshot", source_snapshot_id)
        check_size(size_bytes)
        with self._lock:
            if source_snapshot_id is not None:
                current = self._clones.clone(volume_id, source_snapshot_id, size_bytes)
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

    def volume_status(self, volume_id: str) -> ItemStatus:
        ids.check("volume", volume_id)
        restoring = self._stored.status(volume_id)
        if restoring is not None:
            return restoring
        with self._lock:
            size = self._image_size(volume_id)
        return ItemStatus(state="absent") if size is None else self._status(volume_id, size)

    def remove_volume(self, volume_id: str) -> None:
        ids.check("volume", volume_id)
        self._stored.stop(volume_id)  # a restore from the snapshot store, if one runs
        with self._lock:
            self.flattener.cancel(volume_id)  # a flatten holds the image open; what it copied goes with it
            self._stored.remove_partial(volume_id)
            self._trash.remove_volume(volume_id)

    def resize_volume(self, volume_id: str, size_bytes: int) -> ItemStatus:
        ids.check("volume", volume_id)
        check_size(size_bytes)
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

    # -- the snapshot store's reads and writes (``rbd_stored``) --------------------------------------------

    def keeps_snapshot_images(self) -> bool:
        return True  # the RBD snapshot stays: clones of it are instant

    def open_snapshot(self, snapshot_id: str, since: str | None = None) -> SnapshotStream:
        return self._stored.open_snapshot(snapshot_id, since)

    def fill_volume_with(self, volume_id: str, size_bytes: int, fill: StreamFill, *, what: str) -> ItemStatus:
        ids.check("volume", volume_id)
        with self._lock:
            restoring = self._stored.status(volume_id, forget=True)
            if restoring is not None:
                return restoring
            size = self._image_size(volume_id)
            if size is not None:
                return self._status(volume_id, size)
            return self._stored.fill(volume_id, size_bytes, fill, what=what)

    # -- snapshots (``rbd_snapshots``) ---------------------------------------------------------------

    def ensure_snapshot(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        ids.check("snapshot", snapshot_id)
        ids.check("volume", volume_id)
        with self._lock:
            return self._snapshots.ensure(snapshot_id, volume_id)

    def snapshot_status(self, snapshot_id: str) -> ItemStatus:
        ids.check("snapshot", snapshot_id)
        with self._lock:
            return self._snapshots.status(snapshot_id)

    def remove_snapshot(self, snapshot_id: str) -> None:
        ids.check("snapshot", snapshot_id)
        with self._lock:
            self._snapshots.remove(snapshot_id)

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
        return RbdSource(pool=self.rbd_pool, image=volume_id, conf=self.ceph_conf, user=self._cli.ceph_user,
                         size_bytes=size)

