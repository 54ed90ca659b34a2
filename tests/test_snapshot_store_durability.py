"""A ``dir`` store's uploads are durable per upload, not per chunk (docs/snapshots.md, "Durability"):
chunk files are fsynced together before the manifest, and a chunk found in the store that may not be
synced — put since an upload in flight began, or by an upload given up unfinished — is never trusted
unread: it is read back and checked, and synced with the upload's own chunks if whole, put again if
not. A chunk file emptied or cut short as a power cut leaves one is thus replaced, not listed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.snapshot_stores import ACME, SNAP, MiB, Recording, a_minute_later, make_volume
from vbs.snapshot_store import CHUNK_SIZE, DirStore, collect_garbage, delete_snapshot, restore_snapshot, upload_snapshot
from vbs.snapshot_store import dir as dir_store
from vbs.snapshot_store.format import chunk_key
from vbs.snapshot_store.gc_runs import CLOCK_SKEW_S
from vbs.snapshot_store.manifests import load_marker
from vbs.snapshot_store.upload import UploadResult
from vbs.system.files import fsync_path

pytestmark = pytest.mark.unit

VOL_A, VOL_B = "vol-0000000000000000a", "vol-0000000000000000b"
HOUR = 3600.0


def later(seconds: float) -> Callable[[], float]:
    """A clock that far ahead: an upload or a collection that begins then."""
    return lambda: time.time() + seconds


def upload(store: Any, path: Path, snap: str, *, volume: str = VOL_A, **kwargs: Any) -> UploadResult:
    return upload_snapshot(store, path, path.stat().st_size, snapshot_id=snap, volume_id=volume, tenant="acme",
                           tenant_key=ACME, gc_poll_s=0.05, **kwargs)


def crash_after(store: DirStore, path: Path, snap: str, puts: int, *, power_cut: bool = True) -> set[Path]:
    """An upload of ``path`` that dies after ``puts`` chunk puts (its batch never committed): the chunk
    files it left, each emptied as a power cut before any writeback would leave it (unless not
    ``power_cut``: the process died, what it wrote is whole in the page cache)."""
    crashing = Recording(store)
    crashing.fail_put_after = puts
    with pytest.raises(OSError, match="simulated crash"):
        upload(crashing, path, snap, parallel=1)
    files = {f for f in (store.root / "chunks").rglob("*") if f.is_file()}
    assert len(files) == puts
    for f in files if power_cut else ():
        f.write_bytes(b"")
    return files


@pytest.fixture
def store(tmp_path: Path) -> DirStore:
    return DirStore(tmp_path / "snapshots")


def test_chunk_files_are_synced_once_together_after_the_last_put_and_before_the_manifest(
        store: DirStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 4 * MiB)
    events: list[str] = []
    chunks_dir = store.root / "chunks"

    def spy(p: str | Path) -> None:
        p = Path(p)
        if p.is_relative_to(chunks_dir) and p != chunks_dir:
            events.append(f"sync {p.relative_to(store.root)}")
        fsync_path(p)

    monkeypatch.setattr(dir_store, "fsync_path", spy)
    recording = Recording(store)
    recording.after["put"] = lambda key, _: events.append(f"put {key}")

    done = upload(recording, path, SNAP[0])

    puts = [e for e in events if e.startswith("put chunks/")]
    syncs = [e for e in events if e.startswith("sync ")]
    files = {f"sync {chunk_key(c)}" for c in done.manifest.chunk_ids()}
    directories = {f"sync {chunk_key(c).rsplit('/', 1)[0]}" for c in done.manifest.chunk_ids()}
    assert len(puts) == 4 * MiB // CHUNK_SIZE and done.chunks_put == len(puts)
    # Each chunk file once, then each directory one was renamed into once: nothing before the last put.
    assert sorted(syncs) == sorted(files | directories) and len(syncs) == len(files) + len(directories)
    assert set(syncs[:len(files)]) == files
    manifest_put = events.index(f"put manifests/{SNAP[0]}")
    assert events.index(puts[-1]) < events.index(syncs[0]) and events.index(syncs[-1]) < manifest_put
    assert recording.count("commit", "batch") == 1


def test_a_resumed_upload_replaces_the_chunks_a_power_cut_emptied(store: DirStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    data = make_volume(path, 3 * MiB)
    emptied = crash_after(store, path, SNAP[0], 3)

    done = upload(store, path, SNAP[0])

    assert done.chunks_known == 0 and done.chunks_verified == 0 and done.chunks_put == 3 * MiB // CHUNK_SIZE
    assert all(f.stat().st_size > 0 for f in emptied)
    restore_snapshot(store, done.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


def test_a_resumed_upload_verifies_its_first_tries_chunks_and_replaces_those_a_power_cut_cut(
        store: DirStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first try's process died (its chunks whole in the page cache, never synced), then two of
    them were emptied and cut short as a power cut would: run again, the upload reads back every chunk
    it finds, keeps the whole ones as they are (not written again, synced by its commit) and puts the
    two damaged ones again with those the first try never reached."""
    path = tmp_path / "vol.raw"
    data = make_volume(path, 4 * MiB)
    count = 4 * MiB // CHUNK_SIZE
    first = sorted(crash_after(store, path, SNAP[0], 5, power_cut=False))
    emptied, cut = first[0], first[1]
    emptied.write_bytes(b"")
    cut.write_bytes(cut.read_bytes()[:1000])
    whole = {f.name: f.stat().st_ino for f in first[2:]}
    synced: list[str] = []

    def spy(p: str | Path) -> None:
        synced.append(Path(p).name)
        fsync_path(p)

    monkeypatch.setattr(dir_store, "fsync_path", spy)
    again = Recording(store)
    done = upload(again, path, SNAP[0])

    put = {key.rsplit("/", 1)[1] for key in again.keys["put chunks"]}
    assert done.chunks_verified == 3 and done.chunks_known == 3 and done.chunks_put == count - 3
    assert put == set(done.manifest.chunk_ids()) - set(whole) and {emptied.name, cut.name} <= put
    # The whole ones are the first try's files, read and synced, never written again.
    assert {f.name: f.stat().st_ino for f in first[2:]} == whole
    assert set(whole) <= set(synced) and {f.parent.name for f in first[2:]} <= set(synced)
    restore_snapshot(store, done.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


def test_another_upload_verifies_the_whole_chunks_of_an_upload_in_flight(store: DirStore, tmp_path: Path) -> None:
    """A clone's upload while the first upload is unfinished (its process died, not yet run again)
    finds the first one's chunks younger than its marker: it reads them back, finds them whole and
    sends none of them again (its commit syncs them), only the one the first upload did not put."""
    path = tmp_path / "vol.raw"
    data = make_volume(path, 2 * MiB)
    count = 2 * MiB // CHUNK_SIZE
    crash_after(store, path, SNAP[0], count - 1, power_cut=False)

    clone = upload(store, path, SNAP[1], volume=VOL_B, clock=later(2 * CLOCK_SKEW_S))

    assert clone.chunks_put == 1 and clone.chunks_verified == clone.chunks_known == count - 1
    restore_snapshot(store, clone.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


def test_another_upload_does_not_trust_chunks_put_since_an_upload_in_flight_began(store: DirStore,
                                                                                  tmp_path: Path) -> None:
    """Another volume with the same bytes (a clone) is uploaded while the first upload is unfinished
    (crashed, not yet run again, a power cut emptied its chunks): the chunks the first one put are
    younger than its marker, so they are read back, even once older than the clocks' skew, and put
    again as they are not whole."""
    path = tmp_path / "vol.raw"
    data = make_volume(path, 2 * MiB)
    crash_after(store, path, SNAP[0], 2)

    clone = upload(store, path, SNAP[1], volume=VOL_B, clock=later(2 * CLOCK_SKEW_S))

    assert clone.chunks_known == 0 and clone.chunks_put == 2 * MiB // CHUNK_SIZE
    restore_snapshot(store, clone.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


def test_a_try_run_again_keeps_its_first_start_so_others_still_distrust_the_first_tries_chunks(
        store: DirStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 2 * MiB)
    crash_after(store, path, SNAP[0], 2)
    first = load_marker(store, SNAP[0])
    assert first is not None
    again = Recording(store)
    again.fail_put_after = 0  # the second try dies at its first put, two minutes later
    with pytest.raises(OSError, match="simulated crash"):
        upload(again, path, SNAP[0], clock=later(2 * CLOCK_SKEW_S))
    second = load_marker(store, SNAP[0])
    assert second is not None and second.started_at == first.started_at

    clone = upload(store, path, SNAP[1], volume=VOL_B, clock=later(2 * CLOCK_SKEW_S))

    assert clone.chunks_known == 0 and clone.chunks_put == 2 * MiB // CHUNK_SIZE


def test_a_committed_chunk_older_than_every_upload_in_flight_is_trusted(store: DirStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 2 * MiB)
    upload(store, path, SNAP[0])
    recording = Recording(store)

    soon = upload(recording, path, SNAP[1], volume=VOL_B)  # within the clocks' skew: read back and checked
    a_minute_later(store)
    later = upload(recording, path, SNAP[2], volume=VOL_B)

    count = 2 * MiB // CHUNK_SIZE
    assert soon.chunks_put == 0 and soon.chunks_verified == count
    assert later.chunks_put == 0 and later.chunks_known == count and later.chunks_verified == 0


def test_an_abandoned_upload_holds_the_horizon_until_a_collection_past_the_grace(store: DirStore,
                                                                               tmp_path: Path) -> None:
    """Deleting the snapshot of an unfinished upload leaves its marker abandoned (no claims), so what
    that upload may have left unsynced is still not trusted; a collection that begins past the grace
    after the abandonment sweeps those chunks and then deletes the marker."""
    path = tmp_path / "vol.raw"
    data = make_volume(path, 2 * MiB)
    crash_after(store, path, SNAP[0], 2)
    delete_snapshot(store, SNAP[0])
    marker = load_marker(store, SNAP[0])
    assert marker is not None and marker.abandoned_at is not None and not marker.claims

    clone = upload(store, path, SNAP[1], volume=VOL_B, clock=later(2 * CLOCK_SKEW_S))
    assert clone.chunks_known == 0 and clone.chunks_put == 2 * MiB // CHUNK_SIZE
    restore_snapshot(store, clone.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data

    young = collect_garbage(store, grace_s=HOUR)
    assert young.abandoned_markers_deleted == 0 and SNAP[0] not in young.stale_uploads
    assert load_marker(store, SNAP[0]) == marker
    past = collect_garbage(store, grace_s=HOUR, clock=later(HOUR + 2 * CLOCK_SKEW_S))
    assert past.abandoned_markers_deleted == 1 and load_marker(store, SNAP[0]) is None
    assert past.chunks_deleted == 0  # every chunk is the clone's, put again: listed by its manifest


def test_deleting_a_finished_snapshot_leaves_no_marker(store: DirStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 1 * MiB)
    upload(store, path, SNAP[0])
    delete_snapshot(store, SNAP[0])
    delete_snapshot(store, SNAP[0])  # idempotent
    assert not list(store.list("uploads/")) and not list(store.list("manifests/"))
