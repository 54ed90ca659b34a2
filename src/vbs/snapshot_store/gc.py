"""Garbage collection: mark every chunk a manifest or an upload claims, sweep the rest once old.

A run, in this order (docs/snapshots.md, "Garbage collection", says why the order matters):
1. write its run object (``gc_runs.begin_run``), so that any upload that might lose a chunk to it
   sees it and checks its chunks before writing its manifest;
2. mark: the claims of every upload marker, then every chunk of every manifest. A marker or a
   manifest that cannot be read stops the run before it deletes anything;
3. sweep: delete each chunk that is unmarked and older than the grace period (by the store's clock),
   stopping at the run's deadline;
4. delete the markers of uploads abandoned before the grace period (docs/snapshots.md, "Durability":
   this sweep took every chunk such an upload may have left unsynced), if the sweep went to its end;
5. write its done object, and forget runs that finished long ago.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vbs.snapshot_store import gc_runs
from vbs.snapshot_store.contract import SnapshotStore
from vbs.snapshot_store.format import CHUNKS, UploadMarker, is_chunk_id, marker_key
from vbs.snapshot_store.manifests import load_manifest, load_marker, markers, snapshot_ids

__all__ = ["GcReport", "collect_garbage", "DEFAULT_GRACE_S", "DEFAULT_MAX_DURATION_S"]

DEFAULT_GRACE_S = 24 * 3600.0
DEFAULT_MAX_DURATION_S = 6 * 3600.0


@dataclass
class GcReport:
    run_id: str
    manifests: int = 0
    markers: int = 0
    chunks_seen: int = 0
    chunks_marked: int = 0
    chunks_deleted: int = 0
    bytes_freed: int = 0
    kept_by_grace: int = 0
    stopped_at_deadline: bool = False
    # Uploads whose marker is older than the grace period: crashed, or slow; the controller knows which.
    stale_uploads: list[str] = field(default_factory=list)
    abandoned_markers_deleted: int = 0


def collect_garbage(store: SnapshotStore, *, grace_s: float = DEFAULT_GRACE_S,
                    max_duration_s: float = DEFAULT_MAX_DURATION_S, clock: Callable[[], float] = time.time,
                    dry_run: bool = False) -> GcReport:
    """Delete the chunks no manifest and no upload in flight needs, once older than ``grace_s``."""
    started = clock()
    run = gc_runs.begin_run(store, started, max_duration_s)
    report = GcReport(run.run_id)
    try:
        marked: set[str] = set()
        abandoned: list[UploadMarker] = []
        for marker in markers(store):
            report.markers += 1
            marked.update(marker.claims)
            if marker.abandoned_at is not None:
                if marker.abandoned_at.timestamp() < started - grace_s - gc_runs.CLOCK_SKEW_S:
                    abandoned.append(marker)
            elif marker.started_at.timestamp() < started - grace_s:
                report.stale_uploads.append(marker.snapshot_id)
        for snapshot_id in snapshot_ids(store):
            manifest = load_manifest(store, snapshot_id)  # a damaged one raises: never sweep unsure
            report.manifests += 1
            marked.update(manifest.chunks.values())
        report.chunks_marked = len(marked)

        cutoff = started - grace_s
        for info in store.list(CHUNKS):
            cid = info.key.rsplit("/", 1)[-1]
            if not is_chunk_id(cid) or info.key != f"{CHUNKS}{cid[:2]}/{cid}":
                continue  # not VBS's: never deleted
            report.chunks_seen += 1
            if cid in marked:
                continue
            if info.modified >= cutoff:
                report.kept_by_grace += 1
                continue
            if clock() > run.deadline:
                report.stopped_at_deadline = True
                break
            if not dry_run:
                store.delete(info.key)
            report.chunks_deleted += 1
            report.bytes_freed += info.size
        if not report.stopped_at_deadline and not dry_run:
            report.abandoned_markers_deleted = _forget_abandoned(store, abandoned)
    finally:
        gc_runs.end_run(store, run, clock())
    if not dry_run:
        gc_runs.prune_runs(store, clock() - gc_runs.RUNS_KEPT_S, keep=run.run_id)
    return report


def _forget_abandoned(store: SnapshotStore, abandoned: list[UploadMarker]) -> int:
    """Delete the markers of ``abandoned`` uploads still abandoned as they were when marked."""
    deleted = 0
    for marker in abandoned:
        if load_marker(store, marker.snapshot_id) == marker:
            store.delete(marker_key(marker.snapshot_id))
            deleted += 1
    return deleted
