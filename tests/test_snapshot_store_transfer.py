"""Copying a snapshot from one store into another (the archive store and back): only the chunks the target
lacks are sent, each checked against its id; a corrupt one fails the copy before any manifest is written; a
copy run again is done at once; a collection of the target beside the copy takes none of its chunks; and
once the source forgets the snapshot, the source's collection frees the chunks no other manifest lists.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.snapshot_stores import ACME, KEY, SNAP, VOL, make_volume
from vbs.errors import IncorrectState, NotFound, SnapshotDataError
from vbs.snapshot_store import (
    CHUNK_SIZE,
    DirStore,
    collect_garbage,
    delete_snapshot,
    find_manifest,
    gc_runs,
    restore_snapshot,
    upload_snapshot,
)
from vbs.snapshot_store.format import chunk_key, manifest_key, marker_key
from vbs.snapshot_store.transfer import copy_snapshot

pytestmark = pytest.mark.unit

HOUR = 3600.0


def stored(store: DirStore, path: Path, snap: str, seed: int, chunks: int = 4) -> None:
    make_volume(path, chunks * CHUNK_SIZE, seed=seed)
    upload_snapshot(store, path, path.stat().st_size, snapshot_id=snap, volume_id=VOL, tenant="acme",
                    tenant_key=ACME)


def chunk_keys(store: DirStore) -> set[str]:
    return {info.key for info in store.list("chunks/")}


@pytest.fixture
def stores(tmp_path: Path) -> tuple[DirStore, DirStore]:
    return DirStore(tmp_path / "standard"), DirStore(tmp_path / "archive")


def test_a_copy_makes_the_target_hold_the_snapshot_whole(stores: tuple[DirStore, DirStore], tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    seen: list[tuple[int, int]] = []
    done = copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME, progress=lambda d, t: seen.append((d, t)))
    manifest = find_manifest(archive, SNAP[0])
    assert manifest == find_manifest(standard, SNAP[0]) and manifest is not None
    assert done.chunks == done.chunks_put == len(manifest.chunk_ids()) > 0 and not done.already
    assert seen[-1] == (done.chunks, done.chunks) and seen[0] == (0, done.chunks)
    assert chunk_keys(archive) == {chunk_key(c) for c in manifest.chunk_ids()}
    assert not archive.has(marker_key(SNAP[0]))
    restore_snapshot(archive, manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == (tmp_path / "a.raw").read_bytes()


def test_only_the_chunks_the_target_lacks_are_sent(stores: tuple[DirStore, DirStore], tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    with open(tmp_path / "a.raw", "r+b") as f:  # the second snapshot differs in its first chunk only
        f.write(b"\x07" * CHUNK_SIZE)
    upload_snapshot(standard, tmp_path / "a.raw", 4 * CHUNK_SIZE, snapshot_id=SNAP[1], volume_id=VOL,
                    tenant="acme", tenant_key=ACME)
    assert copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME).chunks_put == 4
    second = copy_snapshot(standard, archive, SNAP[1], tenant_key=ACME)
    assert (second.chunks, second.chunks_put) == (4, 1)


def test_a_copy_made_already_is_done_at_once(stores: tuple[DirStore, DirStore], tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME)
    delete_snapshot(standard, SNAP[0])  # the move's second half: the source forgets it
    again = copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME)
    assert again.already and again.chunks_put == 0


def test_a_copy_that_stopped_halfway_sends_only_the_rest(stores: tuple[DirStore, DirStore], tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    manifest = find_manifest(standard, SNAP[0])
    assert manifest is not None
    [first, *_] = sorted(manifest.chunk_ids())
    archive.put(chunk_key(first), standard.get(chunk_key(first)))  # what a crashed run had put
    assert copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME).chunks_put == 3


def test_a_corrupt_chunk_fails_the_copy_naming_it_and_writes_no_manifest(stores: tuple[DirStore, DirStore],
                                                                          tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    manifest = find_manifest(standard, SNAP[0])
    assert manifest is not None
    bad = sorted(manifest.chunk_ids())[1]
    standard.put(chunk_key(bad), standard.get(chunk_key(sorted(manifest.chunk_ids())[0])))
    with pytest.raises(SnapshotDataError, match=bad):
        copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME)
    assert not archive.has(manifest_key(SNAP[0])) and not archive.has(chunk_key(bad))


def test_a_missing_chunk_fails_the_copy_naming_it(stores: tuple[DirStore, DirStore], tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    manifest = find_manifest(standard, SNAP[0])
    assert manifest is not None
    gone = sorted(manifest.chunk_ids())[2]
    standard.delete(chunk_key(gone))
    with pytest.raises(SnapshotDataError, match=f"{gone} of {SNAP[0]} is missing"):
        copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME)
    assert not archive.has(manifest_key(SNAP[0]))


def test_another_tenant_key_is_refused(stores: tuple[DirStore, DirStore], tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    with pytest.raises(IncorrectState, match="another key"):
        copy_snapshot(standard, archive, SNAP[0], tenant_key=KEY.tenant_key("other"))
    with pytest.raises(NotFound):
        copy_snapshot(standard, archive, SNAP[1], tenant_key=ACME)


def test_a_collection_of_the_target_beside_the_copy_takes_none_of_its_chunks(
        stores: tuple[DirStore, DirStore], tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    manifest = find_manifest(standard, SNAP[0])
    assert manifest is not None
    # Chunks the archive held unclaimed from long ago, swept by a collection that ran while the copy put
    # the rest: the copy sees the run and puts them back before its manifest.
    for cid in manifest.chunk_ids():
        archive.put(chunk_key(cid), standard.get(chunk_key(cid)))
    swept: list[bool] = []

    def progress(done: int, total: int) -> None:
        if done == total and not swept:
            collect_garbage(archive, grace_s=HOUR, clock=lambda: time.time() + 2 * HOUR)
            swept.append(True)

    result = copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME, progress=progress, gc_poll_s=0.01)
    assert swept and result.chunks_restored == 0  # its marker claimed every chunk: the run kept them
    assert chunk_keys(archive) == {chunk_key(c) for c in manifest.chunk_ids()}
    assert gc_runs.runs_seen(archive).started


def test_once_the_source_forgets_it_its_collection_frees_only_the_unshared_chunks(
        stores: tuple[DirStore, DirStore], tmp_path: Path) -> None:
    standard, archive = stores
    stored(standard, tmp_path / "a.raw", SNAP[0], seed=1)
    with open(tmp_path / "a.raw", "r+b") as f:
        f.write(b"\x07" * CHUNK_SIZE)
    upload_snapshot(standard, tmp_path / "a.raw", 4 * CHUNK_SIZE, snapshot_id=SNAP[1], volume_id=VOL,
                    tenant="acme", tenant_key=ACME)
    first, second = find_manifest(standard, SNAP[0]), find_manifest(standard, SNAP[1])
    assert first is not None and second is not None
    copy_snapshot(standard, archive, SNAP[0], tenant_key=ACME)
    delete_snapshot(standard, SNAP[0])
    report = collect_garbage(standard, grace_s=HOUR, clock=lambda: time.time() + 2 * HOUR)
    assert report.chunks_deleted == len(first.chunk_ids() - second.chunk_ids()) == 1
    assert chunk_keys(standard) == {chunk_key(c) for c in second.chunk_ids()}
    back = copy_snapshot(archive, standard, SNAP[0], tenant_key=ACME)  # a restore sends back only that one
    assert back.chunks_put == 1
    restore_snapshot(standard, first, tmp_path / "r.raw", tenant_key=ACME)
    make_volume(tmp_path / "orig.raw", 4 * CHUNK_SIZE, seed=1)
    assert (tmp_path / "r.raw").read_bytes() == (tmp_path / "orig.raw").read_bytes()
