"""Garbage collection of the snapshot store on a schedule (docs/snapshots.md, "Garbage collection").

Each storage agent with a store looks every ``check_every_s`` whether a collection began in the store
within ``interval_s`` (by the run ids every collection writes first, whichever agent ran it); if none
did, it runs one: the upload markers whose manifest is written are cleared (an agent that stopped
between writing a manifest and deleting its marker leaves one), then the chunks that no manifest and no
upload claims, older than ``grace_s``, are deleted. Agents sharing a store thus collect it about once per
interval between them; two that start together only do the same safe work twice. The controller is
not involved: the store is the agents' to read and write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from vbs.errors import VbsError
from vbs.net.repeating import Periodic
from vbs.snapshot_store import gc_runs
from vbs.snapshot_store.contract import SnapshotStore
from vbs.snapshot_store.format import marker_key
from vbs.snapshot_store.gc import GcReport, collect_garbage
from vbs.snapshot_store.manifests import find_manifest, markers

__all__ = ["StoreGc"]

log = logging.getLogger(__name__)


class StoreGc:
    """The schedule of one agent's collections of its store (``interval_s`` 0: never)."""

    def __init__(self, store: SnapshotStore, *, interval_s: float, grace_s: float,
                 check_every_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.check_every_s = check_every_s if check_every_s is not None else min(max(interval_s / 24, 60.0), 3600.0)
        self._clock = clock
        self._passes = Periodic("store-gc", lambda: self.check_every_s, self._collect_if_due, log=log,
                                what=f"snapshot store {store.describe()} not collected")

    def start(self) -> None:
        if self.interval_s > 0:
            self._passes.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._passes.stop(timeout)

    def due(self) -> bool:
        """No collection began in the store within the interval (a run id starts with its start time)."""
        started = [int(run_id.split("-", 1)[0]) for run_id in gc_runs.runs_seen(self.store).started
                   if run_id.split("-", 1)[0].isdigit()]
        return not started or max(started) < self._clock() - self.interval_s

    def run_once(self) -> GcReport:
        """Clear the markers of finished uploads, then collect the garbage."""
        cleared = 0
        for marker in list(markers(self.store)):
            if find_manifest(self.store, marker.snapshot_id) is not None:
                self.store.delete(marker_key(marker.snapshot_id))
                cleared += 1
        report = collect_garbage(self.store, grace_s=self.grace_s, clock=self._clock)
        log.info("snapshot store %s collected: %d chunk(s) seen, %d deleted, %d kept by the %gs grace, "
                 "%d finished upload marker(s) cleared%s", self.store.describe(), report.chunks_seen,
                 report.chunks_deleted, report.kept_by_grace, self.grace_s, cleared,
                 f"; uploads older than the grace: {', '.join(report.stale_uploads)}" if report.stale_uploads else "")
        return report

    def _collect_if_due(self) -> None:
        try:
            if self.due():
                self.run_once()
        except VbsError as exc:  # the store is down, or a manifest is damaged: try again later
            log.warning("snapshot store %s not collected: %s", self.store.describe(), exc.message)
