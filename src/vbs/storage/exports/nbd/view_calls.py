"""The NBD driver's point-in-time view calls (``vbs.pools.exports.PointInTimeViewer``): what views.py makes
in the daemon, under the driver's lock and desired state. A mixin of ``NbdExportDriver``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vbs import ids
from vbs.errors import IdempotentParameterMismatch, NotFound, SnapshotSourceLost
from vbs.pools.exports import ExportSource
from vbs.wire.storage import ItemStatus

from .instant_calls import Driver, checked_args, find_or_start
from .state import Served, View
from .views import LOST

log = logging.getLogger("vbs.storage.exports.nbd.driver")  # the driver's records keep its name


@contextmanager
def _found(driver: Driver, view_id: str, prepare: Callable[[], None]) -> Iterator[tuple[Served, View] | None]:
    """Check ``view_id``, then, under the driver's lock once ``prepare`` ran (the driver's ``_up``: the
    daemon serving the desired state, or ``_load``: only the desired state), give the view and the key's
    desired item it belongs to (None: there is no such view)."""
    ids.check("snapshot", view_id)
    with driver._lock:
        prepare()
        yield driver._views.find(view_id)


class ViewCalls:
    """``ensure_view``, ``view_path``, ``view_changes`` and ``remove_view`` of the NBD driver."""

    def ensure_view(self: Driver, view_id: str, key: str, source: ExportSource, scratch: Path) -> ItemStatus:
        """Show ``source`` as it is now, while hosts keep writing to it, as a file (``view_path``); what they
        overwrite meanwhile goes to the new sparse file ``scratch``. ``ready`` at once; ``error`` once its
        daemon restarted (never re-made: its instant is lost). ``RetryLater`` as for ``ensure_copy``."""
        path, scratch = checked_args(view_id, key, source, scratch, "scratch file")
        with self._lock:
            served, view, live = find_or_start(self, self._views, view_id, key, path, scratch)
            if served.key != key or view.scratch != str(scratch):
                raise IdempotentParameterMismatch(f"view {view_id} is of {served.key} with scratch {view.scratch}")
            if self._views.check(served, live):
                self._save()
            if view.lost:
                return ItemStatus(state="error", size_bytes=view.size, error=LOST)
            return ItemStatus(state="ready", size_bytes=view.size, progress=100)

    def view_path(self: Driver, view_id: str) -> Path:
        """The file that reads as the view's source at its instant (``NotFound``: no such view)."""
        with _found(self, view_id, self._up) as found:
            if found is None:
                raise NotFound(f"no point-in-time view {view_id} here", code="InvalidSnapshot.NotFound")
            served, view = found
            if self._views.check(served, self._view()):
                self._save()
            if view.lost:
                raise SnapshotSourceLost(f"{view_id}: {LOST}")
            return Path(view.mount)

    def view_changes(self: Driver, view_id: str, since: str) -> list[tuple[int, int]] | None:
        """The byte extents of view ``view_id`` that hosts may have written since the instant of the view
        ``since`` (more than changed, never less), told by the daemon's dirty bitmap (tracking.py); None: it
        cannot tell, and every chunk is read."""
        ids.check("snapshot", view_id)
        ids.check("snapshot", since)
        with self._lock:
            self._up()
            found = self._views.find(view_id)
            if found is None:
                return None
            served, view = found
            if view.lost or not self._views.alive(view, self._view()):
                return None
            return self._views.changes(served, view, since)

    def remove_view(self: Driver, view_id: str) -> None:
        """Take the view out of the daemon, remove its scratch file and forget it; idempotent."""
        with _found(self, view_id, self._load) as found:
            if found is None:
                return
            served, view = found
            live = self._view()
            self._views.close(served, view, live)
            served.views.remove(view)
            self._chains.collect(served, live)
            self._save()
            log.info("removed point-in-time view %s of %s", view_id, served.key)
