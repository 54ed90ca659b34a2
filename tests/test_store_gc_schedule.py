"""The storage agent's garbage collection of its snapshot store on a schedule (vbs.storage.store_gc): at
most one collection per interval among the agents sharing a store, finished uploads' markers cleared,
and the chunks of deleted snapshots gone once past the grace period."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.snapshot_stores import ACME, SNAP, VOL, MiB, make_volume
from vbs.snapshot_store import DirStore, SnapshotStore, delete_snapshot, gc_runs, upload_snapshot
from vbs.snapshot_store.format import UploadMarker, chunk_key, marker_key
from vbs.snapshot_store.manifests import save_marker
from vbs.storage.store_gc import StoreGc

pytestmark = pytest.mark.unit

DAY = 86400.0


def dir_store(tmp_path: Path) -> SnapshotStore:
    return DirStore.from_config({}, default_dir=tmp_path / "snapshots")


def upload(store: SnapshotStore, path: Path, snap: str) -> set[str]:
    result = upload_snapshot(store, path, path.stat().st_size, snapshot_id=snap, volume_id=VOL, tenant="acme",
                             tenant_key=ACME, gc_poll_s=0.05)
    return {chunk_key(c) for c in result.manifest.chunk_ids()}


def test_a_collection_is_due_once_per_interval_whichever_agent_ran_the_last(tmp_path: Path) -> None:
    store = dir_store(tmp_path)
    now = time.time()
    first = StoreGc(store, interval_s=DAY, grace_s=DAY, clock=lambda: now)
    assert first.due(), "a store never collected is due"
    first.run_once()
    # Another agent of the same store sees the run in the store itself.
    second = StoreGc(dir_store(tmp_path), interval_s=DAY, grace_s=DAY, clock=lambda: now + DAY / 2)
    assert not second.due()
    assert StoreGc(store, interval_s=DAY, grace_s=DAY, clock=lambda: now + DAY + 1).due()


def test_a_run_clears_finished_uploads_markers_and_the_chunks_of_deleted_snapshots(tmp_path: Path) -> None:
    store = dir_store(tmp_path)
    make_volume(tmp_path / "a.raw", 3 * MiB, seed=1)
    make_volume(tmp_path / "b.raw", 3 * MiB, seed=2)
    chunks_a = upload(store, tmp_path / "a.raw", SNAP[0])
    chunks_b = upload(store, tmp_path / "b.raw", SNAP[1])
    delete_snapshot(store, SNAP[0])
    # An agent stopped between writing SNAP[1]'s manifest and deleting its marker; SNAP[2] is uploading.
    started = UploadMarker(SNAP[1], VOL, "acme", datetime.now(UTC))
    save_marker(store, started)
    live = UploadMarker(SNAP[2], VOL, "acme", started.started_at)
    save_marker(store, live)

    report = StoreGc(store, interval_s=DAY, grace_s=DAY, clock=lambda: time.time() + 2 * DAY).run_once()
    assert report.chunks_deleted == len(chunks_a)
    stored = {info.key for info in store.list("chunks/")}
    assert stored == chunks_b
    assert not store.has(marker_key(SNAP[1])), "a marker whose manifest is written is cleared"
    assert store.has(marker_key(SNAP[2])), "an upload in flight keeps its marker"


def test_the_schedule_runs_a_collection_in_the_background_and_stops(tmp_path: Path) -> None:
    store = dir_store(tmp_path)
    gc = StoreGc(store, interval_s=DAY, grace_s=DAY, check_every_s=0.05)
    gc.start()
    try:
        deadline = time.monotonic() + 30
        while not gc_runs.runs_seen(store).finished and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gc.stop()
    seen = gc_runs.runs_seen(store)
    assert len(seen.finished) == 1 and seen.started == seen.finished, "one run, finished; none since"


def test_an_interval_of_zero_never_collects(tmp_path: Path) -> None:
    before = {t.name for t in threading.enumerate()}
    gc = StoreGc(dir_store(tmp_path), interval_s=0, grace_s=DAY, check_every_s=0.01)
    gc.start()
    assert "store-gc" not in {t.name for t in threading.enumerate()} - before, "no schedule is started"
    gc.stop()
