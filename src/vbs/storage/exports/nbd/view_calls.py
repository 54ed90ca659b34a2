"""The NBD driver's point-in-time view calls (``vbs.pools.exports.PointInTimeViewer``): what views.py makes
in the daemon, under the driver's lock and desired state. A mixin of ``NbdExportDriver``."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from vbs import ids
from vbs.errors import IdempotentParameterMismatch, InvalidParameter, NotFound, SnapshotSourceLost
from vbs.pools.exports import ExportSource, FileSource
from vbs.storage.exports.supervised import check_key, source_file
from vbs.wire.storage import ItemStatus

from .chains import Chains
from .state import Live, Served
from .views import LOST, Views

log = logging.getLogger("vbs.storage.exports.nbd.driver")  # the driver's records keep its name


class _Driver(Protocol):
    """What the calls use of the driver they are mixed into."""

    @property
    def _lock(self) -> AbstractContextManager[Any]: ...

    @property
    def _views(self) -> Views: ...

    @property
    def _chains(self) -> Chains: ...

    def _up(self) -> None: ...

    def _load(self) -> None: ...

    def _view(self) -> Live: ...

    def _save(self) -> None: ...

    def _serving(self, key: str, source: ExportSource) -> Served | None: ...


class ViewCalls:
    """``ensure_view``, ``view_path`` and ``remove_view`` of the NBD driver."""

    def ensure_view(self: _Driver, view_id: str, key: str, source: ExportSource, scratch: Path) -> ItemStatus:
        """Show ``source`` as it is now, while hosts keep writing to it, as a file (``view_path``); what they
        overwrite meanwhile goes to the new sparse file ``scratch``. ``ready`` at once; ``error`` once its
        daemon restarted (never re-made: its instant is lost). ``RetryLater`` as for ``ensure_copy``."""
        ids.check("snapshot", view_id)
        check_key(key)
        path = source_file(key, source)
        scratch = Path(scratch)
        if not scratch.is_absolute():
            raise InvalidParameter(f"scratch file must be absolute: {scratch}")
        with self._lock:
            self._up()
            live = self._view()
            found = self._views.find(view_id)
            if found is None:
                served = self._serving(key, FileSource(path)) or Served(key=key, path=str(path))
                found = self._views.start(view_id, served, scratch, live)
            served, view = found
            if served.key != key or view.scratch != str(scratch):
                raise IdempotentParameterMismatch(f"view {view_id} is of {served.key} with scratch {view.scratch}")
            if self._views.check(served, live):
                self._save()
            if view.lost:
                return ItemStatus(state="error", size_bytes=view.size, error=LOST)
            return ItemStatus(state="ready", size_bytes=view.size, progress=100)

    def view_path(self: _Driver, view_id: str) -> Path:
        """The file that reads as the view's source at its instant (``NotFound``: no such view)."""
        ids.check("snapshot", view_id)
        with self._lock:
            self._up()
            found = self._views.find(view_id)
            if found is None:
                raise NotFound(f"no point-in-time view {view_id} here", code="InvalidSnapshot.NotFound")
            served, view = found
            if self._views.check(served, self._view()):
                self._save()
            if view.lost:
                raise SnapshotSourceLost(f"{view_id}: {LOST}")
            return Path(view.mount)

    def remove_view(self: _Driver, view_id: str) -> None:
        """Take the view out of the daemon, remove its scratch file and forget it; idempotent."""
        ids.check("snapshot", view_id)
        with self._lock:
            self._load()
            found = self._views.find(view_id)
            if found is None:
                return
            served, view = found
            live = self._view()
            self._views.close(served, view, live)
            served.views.remove(view)
            self._chains.collect(served, live)
            self._save()
            log.info("removed point-in-time view %s of %s", view_id, served.key)
