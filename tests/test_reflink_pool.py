"""The reflink path: a pool on a real XFS (reflink=1) made on a loop device by the test."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Vbs, VbsUp, wait_until
from tests.test_api_snapshots import digest, fill
from vbs.snapshot_store import CHUNK_SIZE

MiB = 1 << 20

GIB = 1 << 30


@pytest.fixture
def vbs_xfs(xfs_dir: Path, tmp_path: Path) -> Iterator[Vbs]:
    # An 8 GiB loop filesystem holding two 16 GiB thin volumes: raise the overcommit ratio for it.
    up = VbsUp(xfs_dir / "var", tmp_path / "up.log", extra=["--overcommit-ratio", "16"])
    try:
        yield up.start()
    finally:
        up.stop()


def test_the_agent_detects_reflink(vbs_xfs: Vbs) -> None:
    pool = vbs_xfs.cli("describe-storage-nodes")["storage_nodes"][0]["pools"][0]
    assert pool["clone_method"] == "reflink"


def test_snapshot_and_clone_of_16_gib_are_instant_and_share_blocks(vbs_xfs: Vbs) -> None:
    vol = vbs_xfs.cli("create-volume", "--size", "16", "--wait")
    path = vbs_xfs.pool / "volumes" / f"{vol['volume_id']}.raw"
    want = fill(path, 256, b"reflink")
    free_before = os.statvfs(vbs_xfs.pool).f_bavail * os.statvfs(vbs_xfs.pool).f_frsize

    t0 = time.monotonic()
    snap = vbs_xfs.http.post("/v1/snapshots", json={"volume_id": vol["volume_id"]}).json()
    done = vbs_xfs.wait_snapshot(snap["snapshot_id"], "completed", timeout=10)
    snap_seconds = time.monotonic() - t0
    clone = vbs_xfs.create_volume(snapshot_id=snap["snapshot_id"])
    vbs_xfs.wait_volume(clone["volume_id"], "available", timeout=10)

    assert done["progress"] == 100
    # Stored, and the reflink kept as the fast tier the clone above came from (issue 33).
    assert done["data_location"] == "pool+store"
    assert (vbs_xfs.data_dir / "snapshots" / "manifests" / snap["snapshot_id"]).is_file()
    # Whatever the size, no data is copied: the pool barely changes (the 256 MiB written stay shared).
    free_after = os.statvfs(vbs_xfs.pool).f_bavail * os.statvfs(vbs_xfs.pool).f_frsize
    assert free_before - free_after < 64 << 20
    snap_path = vbs_xfs.pool / "snapshots" / f"{snap['snapshot_id']}.raw"
    clone_path = vbs_xfs.pool / "volumes" / f"{clone['volume_id']}.raw"
    assert snap_path.stat().st_size == clone_path.stat().st_size == 16 * GIB
    assert digest(snap_path, 256) == digest(clone_path, 256) == want
    # Writing to the source after the snapshot changes neither the snapshot nor the clone.
    fill(path, 4, b"after")
    assert digest(snap_path, 256) == digest(clone_path, 256) == want
    print(f"reflink snapshot of 16 GiB: {snap_seconds * 1000:.0f} ms through the API")


def test_a_stored_snapshot_whose_pool_copy_vanished_lives_on_in_the_store(vbs_xfs: Vbs) -> None:
    vol = vbs_xfs.cli("create-volume", "--size", "1", "--wait")["volume_id"]
    want = fill(vbs_xfs.pool / "volumes" / f"{vol}.raw", 8, b"kept")
    snap = vbs_xfs.cli("create-snapshot", vol)["snapshot_id"]
    assert vbs_xfs.wait_snapshot(snap, "completed", timeout=60)["data_location"] == "pool+store"

    (vbs_xfs.pool / "snapshots" / f"{snap}.raw").unlink()  # the fast tier lost; the store still has it

    # The reconciler's repair (a row changed in the last seconds is judged by a later pass) only records
    # that the pool copy is gone: the snapshot stays completed, restored from the store.
    def repaired() -> bool:
        report = vbs_xfs.cli("check", "--repair", "--now")
        return any(f["resource_id"] == snap and f["action"] == "repaired" for f in report["findings"])

    wait_until(repaired, 60, what="the missing pool copy repaired")
    kept = vbs_xfs.snapshot(snap)
    assert kept["status"] == "completed" and kept["data_location"] == "store", kept
    clone = vbs_xfs.cli("create-volume", "--snapshot", snap, "--wait")
    assert digest(vbs_xfs.pool / "volumes" / f"{clone['volume_id']}.raw", 8) == want


def test_a_second_snapshot_reads_only_the_chunk_its_reflink_does_not_share(vbs_xfs: Vbs, tmp_path: Path) -> None:
    # docs/snapshots.md "Incremental uploads": the controller names the previous stored snapshot, and the
    # agent reads only the extents the two snapshot files do not share.
    vol = vbs_xfs.cli("create-volume", "--size", "1", "--wait")["volume_id"]
    path = vbs_xfs.pool / "volumes" / f"{vol}.raw"
    fill(path, 8, b"first")  # 8 MiB of chunks, each MiB the same
    first = vbs_xfs.cli("create-snapshot", vol)["snapshot_id"]
    vbs_xfs.wait_snapshot(first, "completed", timeout=60)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, os.urandom(4096), 3 << 20)
        os.fsync(fd)
    finally:
        os.close(fd)
    second = vbs_xfs.cli("create-snapshot", vol)["snapshot_id"]
    vbs_xfs.wait_snapshot(second, "completed", timeout=60)
    stored = [line for line in (tmp_path / "up.log").read_text().splitlines() if f"snapshot {second} stored" in line]
    assert len(stored) == 1 and f": {8 * MiB // CHUNK_SIZE} chunks, 1 read, 1 new" in stored[0], stored
    assert digest(vbs_xfs.pool / "snapshots" / f"{second}.raw", 8) != digest(
        vbs_xfs.pool / "snapshots" / f"{first}.raw", 8)
