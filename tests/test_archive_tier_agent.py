"""The storage agent's moves between its snapshot store and its archive store (``ArchiveTier``), on two dir
stores: a move is a job whose progress a repeated call reports, ends ``ready`` once only the target holds the
snapshot (or both, for a temporary restore), answers ``ready`` at once when run again, reports a corrupt
chunk as an error and leaves the source whole, and a delete stops a move and forgets the snapshot in the
archive store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests.snapshot_stores import ACME, SNAP, VOL, make_volume
from vbs.errors import DriverError
from vbs.snapshot_store import CHUNK_SIZE, DirStore, find_manifest, upload_snapshot
from vbs.snapshot_store.format import UploadMarker, chunk_key, manifest_key
from vbs.snapshot_store.manifests import load_marker, save_marker
from vbs.storage.archive_tier import ArchiveTier
from vbs.wire.storage import StoredStatus, TierMove

pytestmark = pytest.mark.unit

MOVE = TierMove(tenant="acme", store_key=SecretStr(bytes(range(32)).hex()))  # tests.snapshot_stores.KEY


class HeldStore(DirStore):
    """A dir store whose chunk reads wait until ``release`` is set (so a move is seen under way)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.reading = threading.Event()

    def get(self, key: str) -> bytes:
        if key.startswith("chunks/"):
            self.reading.set()
            assert self.release.wait(60)
        return super().get(key)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[ArchiveTier]:
    standard = HeldStore(tmp_path / "standard")
    standard.release.set()
    make_volume(tmp_path / "a.raw", 4 * CHUNK_SIZE, seed=3)
    upload_snapshot(standard, tmp_path / "a.raw", 4 * CHUNK_SIZE, snapshot_id=SNAP[0], volume_id=VOL,
                    tenant="acme", tenant_key=ACME)
    moves = ArchiveTier(standard, DirStore(tmp_path / "archive"))
    try:
        yield moves
    finally:
        moves.close()


def until_ended(call: Callable[[], StoredStatus]) -> StoredStatus:
    """The answer of ``call`` once the move is no longer under way."""
    for _ in range(10_000):
        answer = call()
        if answer.state != "copying":
            return answer
        time.sleep(0.01)
    raise AssertionError("the move did not end")


def test_an_archive_is_a_job_that_ends_with_only_the_archive_holding_it(tier: ArchiveTier) -> None:
    standard, archive = tier.store, tier.archive
    assert isinstance(standard, HeldStore) and archive is not None
    standard.release.clear()
    assert tier.archive_snapshot(SNAP[0], MOVE).state == "copying"
    assert standard.reading.wait(60)
    assert tier.archive_snapshot(SNAP[0], MOVE).state == "copying"  # under way: the same job answers
    standard.release.set()
    done = until_ended(lambda: tier.archive_snapshot(SNAP[0], MOVE))
    assert done.state == "ready" and done.progress == 100
    assert archive.has(manifest_key(SNAP[0])) and not standard.has(manifest_key(SNAP[0]))
    assert tier.archive_snapshot(SNAP[0], MOVE).state == "ready"  # run again: done at once


def test_a_temporary_restore_leaves_the_archive_copy_and_a_permanent_one_drops_it(tier: ArchiveTier) -> None:
    standard, archive = tier.store, tier.archive
    assert standard is not None and archive is not None
    until_ended(lambda: tier.archive_snapshot(SNAP[0], MOVE))
    assert until_ended(lambda: tier.restore(SNAP[0], MOVE)).state == "ready"
    assert standard.has(manifest_key(SNAP[0])) and archive.has(manifest_key(SNAP[0]))
    assert until_ended(lambda: tier.archive_snapshot(SNAP[0], MOVE)).state == "ready"  # the restore's end
    assert not standard.has(manifest_key(SNAP[0])) and archive.has(manifest_key(SNAP[0]))
    permanent = MOVE.model_copy(update={"permanent": True})
    assert until_ended(lambda: tier.restore(SNAP[0], permanent)).state == "ready"
    assert standard.has(manifest_key(SNAP[0])) and not archive.has(manifest_key(SNAP[0]))
    assert find_manifest(standard, SNAP[0]) is not None


def test_a_corrupt_chunk_ends_the_archive_in_error_and_the_source_keeps_it(tier: ArchiveTier) -> None:
    standard, archive = tier.store, tier.archive
    assert standard is not None and archive is not None
    manifest = find_manifest(standard, SNAP[0])
    assert manifest is not None
    first, second = sorted(manifest.chunk_ids())[:2]
    standard.put(chunk_key(second), standard.get(chunk_key(first)))
    failed = until_ended(lambda: tier.archive_snapshot(SNAP[0], MOVE))
    assert failed.state == "error" and failed.error is not None and second in failed.error
    assert standard.has(manifest_key(SNAP[0])) and not archive.has(manifest_key(SNAP[0]))


def test_a_delete_stops_a_move_and_forgets_the_snapshot_in_the_archive(tier: ArchiveTier) -> None:
    standard, archive = tier.store, tier.archive
    assert isinstance(standard, HeldStore) and archive is not None
    standard.release.clear()
    tier.archive_snapshot(SNAP[0], MOVE)
    assert standard.reading.wait(60)
    stopper = threading.Thread(target=tier.delete, args=(SNAP[0],))
    stopper.start()
    standard.release.set()
    stopper.join(60)
    assert not stopper.is_alive()
    assert not archive.has(manifest_key(SNAP[0]))


def test_an_agent_without_an_archive_store_refuses_moves(tmp_path: Path) -> None:
    moves = ArchiveTier(DirStore(tmp_path / "standard"), None)
    assert moves.location is None
    with pytest.raises(DriverError, match="no archive store"):
        moves.archive_snapshot(SNAP[0], MOVE)
    moves.delete(SNAP[0])  # nothing to forget


def test_a_permanent_restore_of_a_half_archived_snapshot_abandons_the_archive_copy(tier: ArchiveTier) -> None:
    """An archive that stopped partway (its marker in the archive store, the standard manifest still there):
    a permanent restore finds it whole in the snapshot store and leaves the marker abandoned, claiming
    nothing, so the archive store's collection frees what the copy had put."""
    standard, archive = tier.store, tier.archive
    assert standard is not None and archive is not None
    manifest = find_manifest(standard, SNAP[0])
    assert manifest is not None
    save_marker(archive, UploadMarker(SNAP[0], VOL, "acme", datetime.now(UTC), frozenset(manifest.chunk_ids())))
    permanent = MOVE.model_copy(update={"permanent": True})
    assert tier.restore(SNAP[0], permanent).state == "ready"
    marker = load_marker(archive, SNAP[0])
    assert marker is not None and marker.abandoned_at is not None and not marker.claims
    assert standard.has(manifest_key(SNAP[0]))
