"""Snapshots of a ``file`` pool without reflink that go to the snapshot store with no full copy in the pool
(docs/snapshots.md "Snapshots go to the store"): the upload reads the volume at the snapshot's instant
straight into the store, so a snapshot needs room only for what hosts overwrite meanwhile.

- Where the export driver gives point-in-time views (``PointInTimeViewer``: the NBD daemon's fleecing),
  the snapshot is a view, exported volume or not; its scratch file is ``snapshots/<id>.scratch`` in the
  pool (what hosts overwrite before the upload is done), and ``snapshots/<id>.view`` names its volume
  (the upload reads where the volume or the scratch file has data: ``layout``).
- Otherwise a volume that no host can write is read in place: the snapshot is a *hold*,
  ``snapshots/<id>.hold`` (0600, naming the volume), and no export of the volume is made while it lasts
  (``connection_for`` answers ``RetryLater``), also after an agent restart.
- A volume that hosts write to with no view to take is the hypervisor's to copy (a snapshot target), as
  before: that copy is a file in the pool until it is stored.

The view or hold ends when the snapshot is stored, deleted or its upload is given up (``remove``).
"""

from __future__ import annotations

import os
from pathlib import Path

from vbs import ids
from vbs.errors import DriverError, NotFound
from vbs.pools.backend import ImageLayout
from vbs.pools.exports import FileSource, PointInTimeViewer, ViewChanges
from vbs.storage.backends.file_copies import DIRS, CopyJobs
from vbs.storage.copy import data_ranges
from vbs.system.files import write_private
from vbs.wire.storage import ItemStatus

__all__ = ["Streams"]

_HOLD, _VIEW, _SCRATCH = ".hold", ".view", ".scratch"
# QEMU 7.2's snapshot-access answers a read within one copy-before-write cluster (64 KiB, the filter's
# cluster size over a raw scratch file) exactly; a read across clusters that hosts overwrote meanwhile
# can return their new data, and its block status reports holes where the volume's blocks were
# discarded or zeroed after the instant (measured here: tests/test_nbd_views.py).
VIEW_READ_UNIT = 64 << 10


class Streams:
    """The views and holds of one pool, on its files (the caller holds the pool's lock)."""

    def __init__(self, files: CopyJobs, viewer: PointInTimeViewer | None) -> None:
        self._files = files
        self.viewer = viewer

    def _path(self, snapshot_id: str, suffix: str) -> Path:
        ids.check("snapshot", snapshot_id)
        return self._files.path / DIRS["snapshot"] / f"{snapshot_id}{suffix}"

    def view(self, snapshot_id: str, volume_id: str, source: Path) -> ItemStatus:
        """The daemon's view of the volume as it is now (``ready`` at once)."""
        assert self.viewer is not None
        write_private(self._path(snapshot_id, _VIEW), volume_id)  # which volume it reads (its layout)
        return self.viewer.ensure_view(snapshot_id, volume_id, FileSource(source), self._path(snapshot_id, _SCRATCH))

    def hold(self, snapshot_id: str, volume_id: str, source: Path) -> ItemStatus:
        """The volume itself, which no export is made of until the hold ends."""
        if not source.exists():
            raise self._files.missing("volume", volume_id)
        write_private(self._path(snapshot_id, _HOLD), volume_id)
        return self._held(snapshot_id, volume_id, source)

    def _held(self, snapshot_id: str, volume_id: str, source: Path) -> ItemStatus:
        try:
            return ItemStatus(state="ready", size_bytes=os.stat(source).st_size, progress=100)
        except FileNotFoundError:
            return ItemStatus(state="error", error=f"the volume {volume_id} that snapshot {snapshot_id} reads "
                                                   "in place is gone")

    def _hold_of(self, snapshot_id: str, suffix: str = _HOLD) -> str | None:
        """The volume a hold (or a view's marker) names."""
        try:
            volume_id = self._path(snapshot_id, suffix).read_text().strip()
        except FileNotFoundError:
            return None
        return ids.check("volume", volume_id)

    def status(self, snapshot_id: str) -> ItemStatus | None:
        """How a view or hold of the snapshot stands; None: it has neither."""
        volume_id = self._hold_of(snapshot_id)
        if volume_id is not None:
            return self._held(snapshot_id, volume_id, self._files.final("volume", volume_id))
        if self.viewer is None:
            return None
        try:
            path = self.viewer.view_path(snapshot_id)
            return ItemStatus(state="ready", size_bytes=os.stat(path).st_size, progress=100)
        except NotFound:
            return None
        except DriverError as exc:
            return ItemStatus(state="error", error=exc.message)

    def image(self, snapshot_id: str) -> Path | None:
        """The file the upload reads (the view, or the held volume); None: the snapshot has neither."""
        volume_id = self._hold_of(snapshot_id)
        if volume_id is not None:
            return self._files.final("volume", volume_id)
        if self.viewer is None:
            return None
        try:
            return self.viewer.view_path(snapshot_id)
        except NotFound:
            return None

    def changed_since(self, snapshot_id: str, since: str) -> list[tuple[int, int]] | None:
        """The extents of the snapshot's view that hosts may have written since the instant of ``since``'s
        view, as the export driver tracked them (None: not a view, or the driver cannot tell)."""
        if not isinstance(self.viewer, ViewChanges) or self._hold_of(snapshot_id, _VIEW) is None:
            return None
        return self.viewer.view_changes(snapshot_id, since)

    def layout(self, snapshot_id: str) -> ImageLayout | None:
        """How a view must be read: in whole clusters, its data where the volume has data now or the
        scratch file does (read in that order: a block discarded or zeroed after the instant had its old
        data copied to the scratch file first, so it is in one or the other). None: not a view."""
        volume_id = self._hold_of(snapshot_id, _VIEW)
        if self.viewer is None or volume_id is None:
            return None
        volume = self._files.final("volume", volume_id)
        ranges: list[tuple[int, int]] = []
        for path in (volume, self._path(snapshot_id, _SCRATCH)):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                ranges.extend(data_ranges(fd, os.fstat(fd).st_size))
            finally:
                os.close(fd)
        return ImageLayout(data=_merged(ranges, VIEW_READ_UNIT), unit=VIEW_READ_UNIT)

    def holds_of(self, volume_id: str) -> list[str]:
        """The snapshots that read ``volume_id`` in place now."""
        held = []
        with os.scandir(self._files.path / DIRS["snapshot"]) as entries:
            for entry in entries:
                snapshot_id = entry.name.removesuffix(_HOLD)
                if entry.name.endswith(_HOLD) and ids.is_valid("snapshot", snapshot_id) \
                        and self._hold_of(snapshot_id) == volume_id:
                    held.append(snapshot_id)
        return sorted(held)

    def remove(self, snapshot_id: str) -> None:
        """End the view or hold; its scratch file goes with it (also one a lost driver record left)."""
        if self.viewer is not None:
            self.viewer.remove_view(snapshot_id)
        for suffix in (_HOLD, _VIEW, _SCRATCH):
            self._path(snapshot_id, suffix).unlink(missing_ok=True)


def _merged(ranges: list[tuple[int, int]], unit: int) -> tuple[tuple[int, int], ...]:
    """``ranges`` widened to whole ``unit``s, sorted and merged."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((s // unit * unit, -(-e // unit) * unit) for s, e in ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)
