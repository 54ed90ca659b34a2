"""The NBD driver's point-in-time copy calls (``vbs.pools.exports.PointInTimeCopier``): what copies.py
runs in the daemon, under the driver's lock and desired state. A mixin of ``NbdExportDriver``."""

from __future__ import annotations

import logging
from pathlib import Path

from vbs import ids
from vbs.errors import IdempotentParameterMismatch
from vbs.pools.exports import ExportSource
from vbs.wire.storage import ItemStatus

from .instant_calls import Driver, checked_args, find_or_start

log = logging.getLogger("vbs.storage.exports.nbd.driver")  # the driver's records keep its name


class CopyCalls:
    """``ensure_copy`` and ``remove_copy`` of the NBD driver."""

    def ensure_copy(self: Driver, copy_id: str, key: str, source: ExportSource, target: Path) -> ItemStatus:
        """Copy ``source`` as it is now into ``target`` (an existing file of its size) while hosts
        keep writing to it; see the driver's module docstring. ``copying`` with its progress, then
        ``ready``; ``error`` if the job failed or its daemon restarted midway (never restarted: its
        instant is lost). ``RetryLater`` while a refresh of the key is not retired (a host still writes
        through an older chain, which the copy would not see)."""
        path, target = checked_args(copy_id, key, source, target, "copy target")
        with self._lock:
            served, copy, live = find_or_start(self, self._copies, copy_id, key, path, target)
            if served.key != key or copy.target != str(target):
                raise IdempotentParameterMismatch(f"copy {copy_id} is of {served.key} into {copy.target}")
            return self._copies.status(served, copy, live)

    def remove_copy(self: Driver, copy_id: str) -> None:
        """Cancel the copy if it runs, close its target and forget it; idempotent."""
        ids.check("snapshot", copy_id)
        with self._lock:
            self._load()
            live = self._view()
            self._copies.end(copy_id, live)  # also a job the state file lost
            found = self._copies.find(copy_id)
            if found is not None:
                served, copy = found
                served.copies.remove(copy)
                self._chains.collect(served, live)
                self._save()
                log.info("removed copy %s of %s", copy_id, served.key)
