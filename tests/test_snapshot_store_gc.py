"""Garbage collection beside uploads, against each driver: only chunks that no manifest and no upload
needs, and only once older than the grace period; an upload in flight never loses a chunk to it, in
each order the two can interleave.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.snapshot_stores import ACME, SNAP, VOL, MiB, Recording, a_minute_later, make_volume, moto_endpoint, store
from vbs.errors import SnapshotDataError
from vbs.snapshot_store import (
    CHUNK_SIZE,
    SnapshotStore,
    collect_garbage,
    delete_snapshot,
    gc_runs,
    restore_snapshot,
    upload_snapshot,
)
from vbs.snapshot_store.format import chunk_key, decode_marker
from vbs.snapshot_store.gc import GcReport
from vbs.snapshot_store.upload import UploadResult

pytestmark = pytest.mark.unit

__all__ = ["moto_endpoint", "store"]  # fixtures, used by name


HOUR = 3600.0


def later(seconds: float) -> Callable[[], float]:
    """A clock that far ahead: everything already stored looks that old to a collection."""
    return lambda: time.time() + seconds


def upload(store: SnapshotStore, path: Path, snap: str, **kwargs: Any) -> UploadResult:
    return upload_snapshot(store, path, path.stat().st_size, snapshot_id=snap, volume_id=VOL, tenant="acme",
                           tenant_key=ACME, gc_poll_s=0.05, **kwargs)


def chunks(store: SnapshotStore) -> set[str]:
    return {info.key for info in store.list("chunks/")}


def test_gc_deletes_the_chunks_of_deleted_snapshots_once_past_the_grace(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "a.raw", 4 * CHUNK_SIZE, seed=1)
    make_volume(tmp_path / "b.raw", 4 * CHUNK_SIZE, seed=2)
    a = upload(store, tmp_path / "a.raw", SNAP[0]).manifest
    b = upload(store, tmp_path / "b.raw", SNAP[1]).manifest
    delete_snapshot(store, SNAP[0])

    young = collect_garbage(store, grace_s=HOUR)
    assert young.chunks_deleted == 0 and young.kept_by_grace == 4 and chunks(store) == {
        chunk_key(c) for c in a.chunk_ids() | b.chunk_ids()}

    old = collect_garbage(store, grace_s=HOUR, clock=later(2 * HOUR))
    assert old.chunks_deleted == 4 and old.bytes_freed > 4 * CHUNK_SIZE and old.manifests == 1
    assert chunks(store) == {chunk_key(c) for c in b.chunk_ids()}
    restore_snapshot(store, b, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == (tmp_path / "b.raw").read_bytes()


def test_gc_keeps_a_chunk_two_snapshots_share_until_both_are_gone(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 2 * MiB)
    first = upload(store, path, SNAP[0]).manifest
    second = upload(store, path, SNAP[1], previous=first).manifest
    delete_snapshot(store, SNAP[0])

    assert collect_garbage(store, grace_s=0, clock=later(HOUR)).chunks_deleted == 0
    delete_snapshot(store, SNAP[1])
    assert collect_garbage(store, grace_s=0, clock=later(HOUR)).chunks_deleted == len(second.chunks)
    assert not chunks(store)


def test_gc_never_deletes_what_it_does_not_know(store: SnapshotStore) -> None:
    store.put("chunks/ab/not-a-chunk-id", b"x")
    store.put("chunks/" + "cd/" + "ab" * 32, b"an id in the wrong fan-out directory")

    report = collect_garbage(store, grace_s=0, clock=later(HOUR))

    assert report.chunks_deleted == 0 and len(chunks(store)) == 2


def test_a_damaged_manifest_stops_gc_before_it_deletes_anything(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "a.raw", 2 * CHUNK_SIZE)
    upload(store, tmp_path / "a.raw", SNAP[0])
    make_volume(tmp_path / "b.raw", 2 * CHUNK_SIZE, seed=9)
    upload(store, tmp_path / "b.raw", SNAP[1])
    delete_snapshot(store, SNAP[1])
    store.put(f"manifests/{SNAP[0]}", b"VBSM\x01\x01")

    with pytest.raises(SnapshotDataError, match=SNAP[0]):
        collect_garbage(store, grace_s=0, clock=later(HOUR))

    assert len(chunks(store)) == 4
    assert gc_runs.overlapped(gc_runs.RunsSeen(frozenset(), frozenset()), gc_runs.runs_seen(store))
    assert not gc_runs.runs_seen(store).started - gc_runs.runs_seen(store).finished  # it said it stopped


def test_chunks_an_upload_in_flight_put_are_kept_by_the_grace(store: SnapshotStore, tmp_path: Path) -> None:
    """A collection in the middle of an upload, before the upload has claimed anything: what the upload
    already put is younger than the grace period, so nothing is deleted and nothing is put again."""
    path = tmp_path / "vol.raw"
    data = make_volume(path, 8 * CHUNK_SIZE)
    recording = Recording(store)
    reports: list[GcReport] = []

    def collect_once(key: str, _: object) -> None:
        if key.startswith("chunks/") and not reports:
            reports.append(collect_garbage(store, grace_s=HOUR))

    recording.after["put"] = collect_once
    done = upload(recording, path, SNAP[0], parallel=1)

    assert reports[0].chunks_deleted == 0 and reports[0].kept_by_grace >= 1
    assert done.chunks_restored == 0 and done.chunks_put == 8
    restore_snapshot(store, done.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


def test_an_upload_puts_back_an_old_chunk_a_gc_deleted_after_the_upload_found_it(store: SnapshotStore,
                                                                                   tmp_path: Path) -> None:
    """The race deduplication opens: the upload finds a chunk of a deleted snapshot in the store and
    will not send it; a collection then deletes it (unreferenced, old). The upload sees that a
    collection ran beside it, waits for it, checks its chunks and sends the lost one again."""
    path = tmp_path / "vol.raw"
    data = make_volume(path, 4 * CHUNK_SIZE)
    old = upload(store, path, SNAP[0]).manifest
    delete_snapshot(store, SNAP[0])  # its chunks are garbage now, but still there
    a_minute_later(store)  # and old enough for an upload to trust them
    recording = Recording(store)
    deleted: list[int] = []

    def collect_after_first_hit(key: str, found: object) -> None:
        if found and not deleted:
            deleted.append(collect_garbage(store, grace_s=0, clock=later(HOUR)).chunks_deleted)

    recording.after["has"] = collect_after_first_hit
    done = upload(recording, path, SNAP[1], parallel=1)

    assert deleted == [4]  # the collection took every chunk, including the one the upload had found
    # The first chunk was found (and lost), the three after it were sent; the lost one was sent again.
    assert done.chunks_known == 1 and done.chunks_put == 3 and done.chunks_restored == 1
    assert chunks(store) == {chunk_key(c) for c in old.chunk_ids()}
    restore_snapshot(store, done.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


def test_a_gc_that_starts_after_the_claims_keeps_every_claimed_chunk(store: SnapshotStore, tmp_path: Path) -> None:
    """The collection starts once the upload has written its claims but not its manifest: it marks
    the claims, so it deletes nothing the upload needs, however old, and the upload puts nothing back."""
    path = tmp_path / "vol.raw"
    data = make_volume(path, 4 * CHUNK_SIZE)
    upload(store, path, SNAP[0])
    delete_snapshot(store, SNAP[0])
    recording = Recording(store)
    reports: list[GcReport] = []

    def collect_after_claims(key: str, blob: object) -> None:
        if key.startswith("uploads/") and not reports and decode_marker(bytes(blob), SNAP[1]).claims:  # type: ignore[call-overload]
            reports.append(collect_garbage(store, grace_s=0, clock=later(HOUR)))

    recording.after["put"] = collect_after_claims
    done = upload(recording, path, SNAP[1])

    assert reports[0].chunks_deleted == 0 and reports[0].markers == 1 and reports[0].chunks_marked == 4
    # The collection began after the upload's first look at the runs: the upload checks its chunks anyway.
    assert done.chunks_restored == 0
    restore_snapshot(store, done.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


def test_an_upload_waits_for_a_running_gc_before_writing_its_manifest(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 2 * MiB)
    run = gc_runs.begin_run(store, time.time(), max_duration_s=HOUR)  # a collection in progress elsewhere
    finished = threading.Timer(0.5, gc_runs.end_run, args=(store, run, time.time()))
    finished.start()
    t0 = time.monotonic()

    try:
        done = upload(store, path, SNAP[0])
    finally:
        finished.join()

    assert time.monotonic() - t0 >= 0.45
    assert store.has(f"manifests/{SNAP[0]}") and done.chunks_restored == 0


def test_an_upload_does_not_wait_for_a_gc_past_its_deadline(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, MiB)
    gc_runs.begin_run(store, time.time() - 2 * HOUR, max_duration_s=HOUR)  # crashed long ago, never finished

    done = upload(store, path, SNAP[0])

    assert done.manifest.snapshot_id == SNAP[0]


def test_gc_reports_uploads_that_never_finished(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 2 * MiB)
    crashing = Recording(store)
    crashing.fail_put_after = 1
    with pytest.raises(OSError):
        upload(crashing, path, SNAP[0], parallel=1)

    assert collect_garbage(store, grace_s=HOUR).stale_uploads == []
    report = collect_garbage(store, grace_s=HOUR, clock=later(2 * HOUR))
    assert report.stale_uploads == [SNAP[0]] and report.chunks_deleted == 1  # its marker claimed nothing yet


def test_finished_runs_are_forgotten_after_a_month(store: SnapshotStore) -> None:
    collect_garbage(store, grace_s=HOUR)
    assert len(gc_runs.runs_seen(store).finished) == 1

    collect_garbage(store, grace_s=HOUR, clock=later(31 * 24 * HOUR))

    seen = gc_runs.runs_seen(store)
    assert len(seen.started) == 1 and seen.started == seen.finished
