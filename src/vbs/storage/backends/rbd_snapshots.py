"""The snapshots of an ``rbd`` pool: image snapshots of their volume (point in time by
construction), at most ``max_snapshots_per_volume`` a volume, and their removal (into the image's
trash namespace while clones read them, unprotected first as clone v1 needs)."""

from __future__ import annotations

from vbs import ids
from vbs.errors import DriverError, IncorrectState, NotFound, VolumeSnapshotLimitExceeded
from vbs.storage.backends.rbd_chains import RETIRED_PREFIX, parse_snaps
from vbs.storage.backends.rbd_cli import EBUSY, EEXIST, ENOENT, RbdTools, ToolError
from vbs.storage.backends.rbd_trash import Trash
from vbs.wire.storage import ItemStatus


class Snapshots:
    """Snapshots in the pool ``cli`` reaches. The caller holds the backend's lock."""

    def __init__(self, cli: RbdTools, trash: Trash, *, max_snapshots_per_volume: int) -> None:
        self._cli = cli
        self._trash = trash
        self.max_snapshots_per_volume = max_snapshots_per_volume

    def ensure(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        cli = self._cli
        spec = cli.spec(volume_id, snapshot_id)
        # Two tool calls: make it (a repeat answers EEXIST), then list the volume's own snapshots
        # (one image, not the pool) for its size and the count. The controller refuses a snapshot
        # past the limit before it asks; one that got here anyway is taken back.
        try:
            cli.rbd("snap", "create", spec)
            made = True
        except ToolError as exc:
            if exc.errno == ENOENT:  # no image: a repeat after the volume was deleted, or no volume
                found = cli.listing().snapshots.get(snapshot_id)
                if found is not None:
                    return ready(found[1])
                raise NotFound(f"The volume '{volume_id}' does not exist.",
                               code="InvalidVolume.NotFound") from None
            if exc.errno != EEXIST:
                raise
            made = False
        have = self._snapshots_of(volume_id) or {}
        if made and len(have) > self.max_snapshots_per_volume:
            cli.rbd_tolerant("snap", "rm", spec, tolerate=(ENOENT,))
            raise VolumeSnapshotLimitExceeded(
                f"The volume '{volume_id}' has {len(have) - 1} snapshots, the most pool {cli.name} allows; "
                "delete one first.", volume_id=volume_id, limit=self.max_snapshots_per_volume)
        size = have.get(snapshot_id)
        if size is None:
            raise DriverError(f"pool {cli.name}: snapshot {snapshot_id} was made but is not listed")
        return ready(size)

    def status(self, snapshot_id: str) -> ItemStatus:
        found = self._cli.listing().snapshots.get(snapshot_id)
        return ItemStatus(state="absent") if found is None else ready(found[1])

    def remove(self, snapshot_id: str) -> None:
        cli = self._cli
        listing = cli.listing()
        found = listing.snapshots.get(snapshot_id)
        if found is None:
            return
        entry = listing.trash.get(found[0])
        if entry is not None:  # clone v2: with clones left, it goes to the image's trash namespace
            cli.rbd_tolerant("snap", "rm", *cli.by_id(entry.id), "--snap", snapshot_id, tolerate=(ENOENT,))
        else:
            self._remove_named(found[0], snapshot_id)
        if entry is not None or found[0].startswith(RETIRED_PREFIX):
            self._trash.purge_after_removal()

    def _snapshots_of(self, volume_id: str) -> dict[str, int] | None:
        """The VBS snapshots of the volume's image and their sizes, or None if it has no image."""
        try:
            snaps = parse_snaps(self._cli.rbd("snap", "ls", "--all", "--format", "json", self._cli.spec(volume_id)))
        except ToolError as exc:
            if exc.errno == ENOENT:
                return None
            raise
        return {s.name: s.size for s in snaps if not s.trashed and ids.is_valid("snapshot", s.name)}

    def _remove_named(self, image: str, snapshot_id: str) -> None:
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


def ready(size: int) -> ItemStatus:
    return ItemStatus(state="ready", size_bytes=size, progress=100)
