"""The snapshot store end to end, against each driver (a directory, an S3 bucket on moto's server and
on a RADOS Gateway): volumes go in as chunks and a manifest and come back byte for byte; only new
chunks are sent; one tenant never shares a chunk with another; a missing or corrupt chunk fails
loudly by name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.snapshot_stores import (
    ACME,
    KEY,
    SNAP,
    MiB,
    Recording,
    a_minute_later,
    make_volume,
    moto_endpoint,
    store,
    syncs_per_batch,
)
from vbs.errors import ChunkCorrupt, ChunkMissing, IncorrectState, SnapshotDataError
from vbs.snapshot_store import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    BlockRange,
    SnapshotStore,
    check_store,
    delete_snapshot,
    load_manifest,
    restore_snapshot,
    snapshot_ids,
    upload_snapshot,
)
from vbs.snapshot_store.format import chunk_key, encode_chunk
from vbs.snapshot_store.upload import UploadResult

pytestmark = pytest.mark.unit

__all__ = ["moto_endpoint", "store"]  # fixtures, used by name

GLOBEX = KEY.tenant_key("globex")
VOL_A, VOL_B = "vol-0000000000000000a", "vol-0000000000000000b"


def upload(store: SnapshotStore, path: Path, snap: str, *, volume: str = VOL_A, tenant: str = "acme",
           key: bytes = ACME, **kwargs: Any) -> UploadResult:
    return upload_snapshot(store, path, path.stat().st_size, snapshot_id=snap, volume_id=volume, tenant=tenant,
                           tenant_key=key, gc_poll_s=0.05, **kwargs)


def stored_chunks(store: SnapshotStore) -> set[str]:
    return {info.key for info in store.list("chunks/")}


def test_a_volume_round_trips_with_zero_regions_and_a_short_last_chunk(store: SnapshotStore, tmp_path: Path) -> None:
    size = 5 * CHUNK_SIZE + 3 * 512  # not a whole number of chunks, nor of blocks
    zeros = ((0, CHUNK_SIZE), (2 * CHUNK_SIZE + 4096, 2 * CHUNK_SIZE))  # chunk 0 and chunk 3 all zeros
    data = make_volume(tmp_path / "vol.raw", size, zero_ranges=zeros)
    progress: list[tuple[int, int]] = []

    done = upload(store, tmp_path / "vol.raw", SNAP[0], progress=lambda d, t: progress.append((d, t)))

    manifest = done.manifest
    assert manifest.chunk_count == 6 and sorted(manifest.chunks) == [1, 2, 4, 5]
    assert done.chunks_zero == 2 and done.chunks_put == 4
    assert len(stored_chunks(store)) == 4  # zero chunks are not stored
    assert progress[-1] == (size, size) and all(a <= b for (a, _), (b, _) in zip(progress, progress[1:], strict=False))
    assert load_manifest(store, SNAP[0]) == manifest
    assert snapshot_ids(store) == [SNAP[0]]
    assert not list(store.list("uploads/"))  # the marker is gone once the manifest is written

    restored = tmp_path / "restored.raw"
    result = restore_snapshot(store, manifest, restored, tenant_key=ACME)
    assert restored.read_bytes() == data
    assert result.chunks_written == 4 and result.chunks_zero == 2


def test_a_restore_onto_a_new_file_leaves_zero_chunks_as_holes(store: SnapshotStore, tmp_path: Path) -> None:
    size = 64 * MiB
    make_volume(tmp_path / "vol.raw", size, zero_ranges=((MiB, size - MiB),))
    manifest = upload(store, tmp_path / "vol.raw", SNAP[0]).manifest

    restore_snapshot(store, manifest, tmp_path / "restored.raw", tenant_key=ACME)

    restored = tmp_path / "restored.raw"
    assert restored.stat().st_size == size
    assert restored.stat().st_blocks * 512 <= 2 * MiB


def test_a_restore_onto_a_used_target_writes_its_zero_chunks(store: SnapshotStore, tmp_path: Path) -> None:
    data = make_volume(tmp_path / "vol.raw", 4 * MiB, zero_ranges=((MiB, 2 * MiB),))
    manifest = upload(store, tmp_path / "vol.raw", SNAP[0]).manifest
    target = tmp_path / "old.raw"
    target.write_bytes(b"\xff" * 4 * MiB)

    restore_snapshot(store, manifest, target, tenant_key=ACME)

    assert target.read_bytes() == data


def test_a_second_snapshot_of_an_unchanged_volume_puts_no_chunk(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "vol.raw", 6 * MiB)
    first = upload(store, tmp_path / "vol.raw", SNAP[0])
    recording = Recording(store)

    second = upload(recording, tmp_path / "vol.raw", SNAP[1], previous=first.manifest)

    assert second.chunks_put == 0 and recording.count("put") == 0
    assert recording.count("has") == 0  # every id was the previous manifest's: not even asked for
    assert second.manifest.chunks == first.manifest.chunks
    assert second.manifest.parent_snapshot_id == SNAP[0]


def test_volumes_of_one_tenant_share_chunks(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "a.raw", 4 * MiB, seed=7)
    make_volume(tmp_path / "b.raw", 4 * MiB, seed=7)
    first = upload(store, tmp_path / "a.raw", SNAP[0], volume=VOL_A)
    a_minute_later(store)
    recording = Recording(store)

    second = upload(recording, tmp_path / "b.raw", SNAP[1], volume=VOL_B)

    assert second.chunks_put == 0 and second.chunks_known == 4 * MiB // CHUNK_SIZE and recording.count("put") == 0
    assert second.manifest.chunks == first.manifest.chunks


def test_the_same_bytes_of_two_tenants_are_two_sets_of_chunks(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "a.raw", 4 * MiB, seed=7)
    make_volume(tmp_path / "b.raw", 4 * MiB, seed=7)
    acme = upload(store, tmp_path / "a.raw", SNAP[0], volume=VOL_A, tenant="acme", key=ACME)
    recording = Recording(store)

    globex = upload(recording, tmp_path / "b.raw", SNAP[1], volume=VOL_B, tenant="globex", key=GLOBEX)

    assert not acme.manifest.chunk_ids() & globex.manifest.chunk_ids()
    # Globex's upload took as long and sent as much as if acme's data were not there: nothing to observe.
    per_volume = 4 * MiB // CHUNK_SIZE
    assert globex.chunks_put == per_volume and recording.count("put") == per_volume
    assert len(stored_chunks(store)) == 2 * per_volume


def test_an_incremental_upload_reads_and_puts_only_the_changed_chunks(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    data = bytearray(make_volume(path, 16 * MiB))
    first = upload(store, path, SNAP[0])
    # Two writes: one 4 KiB in chunk 3, one across the end of chunk 9 into chunk 10.
    changes = [(3 * CHUNK_SIZE + 8192, 4096), (10 * CHUNK_SIZE - 100, 200)]
    with open(path, "r+b") as f:
        for offset, length in changes:
            f.seek(offset)
            f.write(os.urandom(length))
    data = bytearray(path.read_bytes())
    changed = [BlockRange(offset // BLOCK_SIZE, 1 + (offset + length - 1) // BLOCK_SIZE - offset // BLOCK_SIZE)
               for offset, length in changes]
    recording = Recording(store)

    second = upload(recording, path, SNAP[1], previous=first.manifest, changed_blocks=changed)

    assert second.chunks_read == 3 and second.chunks_unread == 16 * MiB // CHUNK_SIZE - 3
    assert second.chunks_put == 3 and recording.count("put") == 3
    assert second.bytes_read == 3 * CHUNK_SIZE
    restore_snapshot(store, second.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data
    restore_snapshot(store, first.manifest, tmp_path / "r0.raw", tenant_key=ACME)
    assert (tmp_path / "r0.raw").read_bytes() != data


def test_without_a_change_list_every_chunk_is_read_and_only_changed_ones_are_put(store: SnapshotStore,
                                                                                  tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 8 * MiB)
    first = upload(store, path, SNAP[0])
    with open(path, "r+b") as f:
        f.seek(5 * MiB + 1)
        f.write(b"changed")
    recording = Recording(store)

    second = upload(recording, path, SNAP[1], previous=first.manifest)

    assert second.chunks_read == 8 * MiB // CHUNK_SIZE and second.chunks_put == 1 and recording.count("put") == 1
    assert recording.count("has") == 1  # only the chunk whose id the previous manifest lacks


def test_a_grown_volume_reads_its_new_tail_whatever_the_change_list_says(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 3 * CHUNK_SIZE + 512 * 3)
    first = upload(store, path, SNAP[0])
    with open(path, "ab") as f:
        f.write(os.urandom(2 * CHUNK_SIZE))
    data = path.read_bytes()

    second = upload(store, path, SNAP[1], previous=first.manifest, changed_blocks=[])

    assert second.chunks_read == 3 and second.chunks_unread == 3  # chunk 3 (was short), 4 and 5
    restore_snapshot(store, second.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


# Manifests record their chunk size: those written before chunks became one 512 KiB block hold 1 MiB chunks.
OLD_CHUNK_SIZE = 2 * BLOCK_SIZE


def test_a_manifest_of_1_mib_chunks_still_restores(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    size = 5 * OLD_CHUNK_SIZE + 3 * 512  # a short last chunk, and chunk 2 all zeros
    data = make_volume(path, size, zero_ranges=((2 * OLD_CHUNK_SIZE, OLD_CHUNK_SIZE),))
    old = upload(store, path, SNAP[0], chunk_size=OLD_CHUNK_SIZE).manifest
    assert old.chunk_size == OLD_CHUNK_SIZE != CHUNK_SIZE and sorted(old.chunks) == [0, 1, 3, 4, 5]

    manifest = load_manifest(store, SNAP[0])
    result = restore_snapshot(store, manifest, tmp_path / "r.raw", tenant_key=ACME)

    assert manifest == old and (tmp_path / "r.raw").read_bytes() == data
    assert result.chunks_written == 5 and result.chunks_zero == 1
    assert check_store(store, deep=True, tenant_keys=KEY.tenant_key).ok


def test_an_incremental_upload_after_a_1_mib_chunk_parent_reads_everything_and_restores(store: SnapshotStore,
                                                                                      tmp_path: Path) -> None:
    """The parent's chunks are of another size: its ids prove nothing about this upload's chunks, so
    every chunk is read (the change list is not trusted against it) and put; both snapshots restore."""
    path = tmp_path / "vol.raw"
    before = make_volume(path, 8 * MiB)
    parent = upload(store, path, SNAP[0], chunk_size=OLD_CHUNK_SIZE).manifest
    with open(path, "r+b") as f:
        f.seek(5 * MiB + 1)
        f.write(b"changed")
    after = path.read_bytes()
    changed = [BlockRange((5 * MiB + 1) // BLOCK_SIZE, 1)]

    child = upload(store, path, SNAP[1], previous=parent, changed_blocks=changed)

    count = 8 * MiB // CHUNK_SIZE
    assert child.manifest.chunk_size == CHUNK_SIZE and child.manifest.parent_snapshot_id == SNAP[0]
    assert child.chunks_read == count and child.chunks_unread == 0 and child.chunks_put == count
    restore_snapshot(store, child.manifest, tmp_path / "child.raw", tenant_key=ACME)
    assert (tmp_path / "child.raw").read_bytes() == after
    restore_snapshot(store, load_manifest(store, SNAP[0]), tmp_path / "parent.raw", tenant_key=ACME)
    assert (tmp_path / "parent.raw").read_bytes() == before
    # The next upload, against the 512 KiB-chunk child, is incremental again.
    grandchild = upload(store, path, SNAP[2], previous=child.manifest, changed_blocks=[])
    assert grandchild.chunks_read == 0 and grandchild.chunks_put == 0
    assert grandchild.manifest.chunks == child.manifest.chunks


def test_a_crashed_upload_run_again_puts_nothing_already_stored(store: SnapshotStore, tmp_path: Path) -> None:
    """Run again, an upload sends nothing the store holds: on S3 a PUT is durable; on a ``dir`` store
    the crashed try's chunks may not be synced (its batch never committed), so each is read back,
    found whole and synced by this try's commit instead (docs/snapshots.md, "Durability")."""
    path = tmp_path / "vol.raw"
    data = make_volume(path, 12 * MiB)
    count = 12 * MiB // CHUNK_SIZE
    crashing = Recording(store)
    crashing.fail_put_after = 5

    with pytest.raises(OSError, match="simulated crash"):
        upload(crashing, path, SNAP[0], parallel=1)
    stored = stored_chunks(store)
    assert len(stored) == 5 and not list(store.list("manifests/"))
    assert [i.key for i in store.list("uploads/")] == [f"uploads/{SNAP[0]}"]  # the marker says it is unfinished

    again = Recording(store)
    done = upload(again, path, SNAP[0])

    assert again.count("put") == count - 5 and done.chunks_put == count - 5 and done.chunks_known == 5
    assert not set(again.keys["put chunks"]) & stored
    assert done.chunks_verified == (5 if syncs_per_batch(store) else 0)
    restore_snapshot(store, done.manifest, tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data


def test_an_upload_whose_manifest_exists_is_answered_without_reading(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 2 * MiB)
    first = upload(store, path, SNAP[0])
    recording = Recording(store)

    again = upload(recording, path, SNAP[0])

    assert again.already_stored and again.manifest == first.manifest and recording.count("put", "manifests") == 0
    with pytest.raises(IncorrectState):
        upload(store, path, SNAP[0], volume=VOL_B)


def test_uploads_keep_at_least_eight_puts_in_flight(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 16 * MiB)
    holding = Recording(store)
    holding.hold_puts_until = 8  # each put waits until eight are under way (or ten seconds)

    upload(holding, path, SNAP[0], parallel=8)

    assert holding.max_in_flight == 8


def test_a_missing_chunk_fails_the_restore_naming_chunk_and_snapshot(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "vol.raw", 4 * MiB)
    manifest = upload(store, tmp_path / "vol.raw", SNAP[0]).manifest
    lost = manifest.chunks[2]
    store.delete(chunk_key(lost))

    with pytest.raises(ChunkMissing) as caught:
        restore_snapshot(store, manifest, tmp_path / "r.raw", tenant_key=ACME)

    assert lost in caught.value.message and SNAP[0] in caught.value.message and "index 2" in caught.value.message
    assert caught.value.fields == {"snapshot_id": SNAP[0], "chunk_id": lost, "chunk_index": 2}


@pytest.mark.parametrize("damage", ["flipped byte", "another chunk's bytes", "truncated"])
def test_a_corrupt_chunk_fails_the_restore_naming_chunk_and_snapshot(store: SnapshotStore, tmp_path: Path,
                                                                     damage: str) -> None:
    make_volume(tmp_path / "vol.raw", 4 * MiB)
    manifest = upload(store, tmp_path / "vol.raw", SNAP[0]).manifest
    bad = manifest.chunks[1]
    blob = bytearray(store.get(chunk_key(bad)))
    if damage == "flipped byte":
        blob[len(blob) // 2] ^= 0x01
    elif damage == "another chunk's bytes":
        blob = bytearray(encode_chunk(os.urandom(CHUNK_SIZE)))  # a well-formed chunk, of other bytes
    else:
        del blob[100:]
    store.put(chunk_key(bad), bytes(blob))

    with pytest.raises(ChunkCorrupt) as caught:
        restore_snapshot(store, manifest, tmp_path / "r.raw", tenant_key=ACME)

    assert bad in caught.value.message and SNAP[0] in caught.value.message
    assert caught.value.fields["chunk_index"] == 1


def test_a_restore_with_another_tenants_key_is_refused_before_any_write(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "vol.raw", 2 * MiB)
    manifest = upload(store, tmp_path / "vol.raw", SNAP[0]).manifest

    with pytest.raises(SnapshotDataError, match="key"):
        restore_snapshot(store, manifest, tmp_path / "r.raw", tenant_key=GLOBEX)
    assert not (tmp_path / "r.raw").exists()


def test_check_finds_missing_chunks_and_deep_check_finds_corrupt_ones(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "a.raw", 4 * MiB, seed=1)
    make_volume(tmp_path / "b.raw", 4 * MiB, seed=2)
    a = upload(store, tmp_path / "a.raw", SNAP[0]).manifest
    b = upload(store, tmp_path / "b.raw", SNAP[1], volume=VOL_B, tenant="globex", key=GLOBEX).manifest
    assert check_store(store).ok and check_store(store, deep=True, tenant_keys=KEY.tenant_key).ok

    store.delete(chunk_key(a.chunks[0]))
    blob = bytearray(store.get(chunk_key(b.chunks[3])))
    blob[-20] ^= 0xFF
    store.put(chunk_key(b.chunks[3]), bytes(blob))

    shallow = check_store(store)
    assert [(p.snapshot_id, p.kind, p.chunk_index) for p in shallow.problems] == [(SNAP[0], "missing", 0)]
    deep = check_store(store, deep=True, tenant_keys=KEY.tenant_key)
    assert [(p.snapshot_id, p.kind, p.chunk_index) for p in deep.problems] == \
        [(SNAP[0], "missing", 0), (SNAP[1], "corrupt", 3)]
    assert deep.chunks_checked == 2 * (4 * MiB // CHUNK_SIZE) and deep.snapshots == 2
    assert check_store(store, snapshots=[SNAP[1]]).ok


def test_check_reports_a_damaged_manifest(store: SnapshotStore, tmp_path: Path) -> None:
    make_volume(tmp_path / "a.raw", MiB)
    upload(store, tmp_path / "a.raw", SNAP[0])
    store.put(f"manifests/{SNAP[0]}", b"VBSM garbage")

    report = check_store(store)

    assert [(p.snapshot_id, p.kind) for p in report.problems] == [(SNAP[0], "manifest")]


def test_deleting_a_snapshot_touches_no_other(store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "vol.raw"
    make_volume(path, 4 * MiB)
    first = upload(store, path, SNAP[0])
    with open(path, "r+b") as f:
        f.write(b"new first chunk")
    data = path.read_bytes()
    second = upload(store, path, SNAP[1], previous=first.manifest)

    delete_snapshot(store, SNAP[0])

    assert snapshot_ids(store) == [SNAP[1]]
    restore_snapshot(store, load_manifest(store, SNAP[1]), tmp_path / "r.raw", tenant_key=ACME)
    assert (tmp_path / "r.raw").read_bytes() == data
    assert second.manifest.parent_snapshot_id == SNAP[0]  # a parent is history, not a dependency
