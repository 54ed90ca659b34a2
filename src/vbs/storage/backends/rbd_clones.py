"""The clones of an ``rbd`` pool: a volume made from a snapshot (of a named or a trashed image),
and the background flattens of clone chains deeper than ``max_clone_depth`` (the ``Flattener`` of
``rbd_chains`` with this pool's hooks: which volume needs one now, the object map off and on)."""

from __future__ import annotations

import logging
import threading

from vbs.errors import InvalidParameter, NotFound
from vbs.storage.backends.rbd_chains import RETIRED_PREFIX, Flattener, TrashEntry, volume_of
from vbs.storage.backends.rbd_cli import EEXIST, EINVAL, ENOENT, Listing, RbdTools, ToolError

log = logging.getLogger("vbs.storage.backends.rbd")  # the backend's records keep their name

IMAGE_FEATURES = "layering,exclusive-lock,object-map,fast-diff,deep-flatten"
FLATTEN_STALL_S = 600.0


class Clones:
    """Clones and their flattens in the pool ``cli`` reaches; ``wake`` starts the next maintenance
    pass early (after a flatten that completed)."""

    def __init__(self, cli: RbdTools, *, max_clone_depth: int, max_flattens: int, wake: threading.Event) -> None:
        self._cli = cli
        self.max_clone_depth = max_clone_depth
        self._wake = wake
        self.flattener = Flattener(lambda volume: cli.argv("rbd", "flatten", cli.spec(volume)),
                                   max_running=max_flattens, stall_s=FLATTEN_STALL_S,
                                   should_run=self._too_deep, done=self._flattened,
                                   prepare=self._object_map_off, finish=self._object_map_on)

    def clone(self, volume_id: str, snapshot_id: str, size_bytes: int) -> int:
        """Clone the snapshot as the volume unless the pool has it already; the volume's size now. The
        pool's listing answers both (one ``ls -l``, one ``trash ls``): no ``info`` before or after.
        The caller holds the backend's lock."""
        listing = self._cli.listing()
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
            log.info("pool %s: %s is %d clones deep (limit %d): flattening it", self._cli.name, volume_id,
                     1 + listing.depth(image), self.max_clone_depth)
            self.flattener.submit(volume_id)
        # A clone has its snapshot's size; one made meanwhile by a repeat (EEXIST) is asked.
        return snap_size if made else (self._cli.image_size(volume_id) or 0)

    def flatten_too_deep(self, listing: Listing) -> None:
        """Submit a flatten of every volume of ``listing`` deeper than the limit."""
        for volume in sorted(listing.volumes):
            if listing.depth(volume) > self.max_clone_depth:
                self.flattener.submit(volume)

    def reading_clone(self, entry: TrashEntry, snapshot_id: str, name: str) -> None:
        """The image ``name``, a clone of a snapshot of the trashed image ``entry``: a name to read the
        snapshot by (``rbd export-diff`` takes no image id). An existing one is kept (it reads the same);
        the caller holds the backend's lock and removes it after reading."""
        self._clone_trashed(entry, snapshot_id, name)

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
        self._cli.rbd("trash", "restore", "--image", named, f"{self._cli.rbd_pool}/{entry.id}")
        try:
            return self._clone_named(named, snapshot_id, volume_id)
        finally:
            self._cli.rbd_tolerant("trash", "mv", self._cli.spec(named), tolerate=(ENOENT,))

    def _flattened(self, volume_id: str, ok: bool) -> None:
        """A flatten ended: a purge may now remove what only that clone kept (a failed one waits for
        the next periodic pass, so a flatten that keeps failing does not spin)."""
        if ok:
            self._wake.set()

    def _too_deep(self, volume_id: str) -> bool:
        """Whether ``volume_id`` needs a flatten now (asked just before one starts): deeper than the
        limit, and no clone reads from a snapshot of it. A clone below it is deeper still and is
        flattened first; then this one: flattens go deepest first, never two along one chain."""
        listing = self._cli.listing()
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
