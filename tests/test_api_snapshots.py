"""Snapshots and volumes from snapshots: the copy path on the ext4 root (asynchronous, with progress),
with the metadata in SQLite and in PostgreSQL."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DATABASES, Vbs, database_flags, node_token, wait_until

pytestmark = pytest.mark.parametrize("metadata_db", DATABASES, indirect=True, scope="module")

MIB = 1 << 20


def fill(path: Path, mib: int, seed: bytes) -> str:
    """Write ``mib`` MiB of a deterministic pattern at the start of ``path``; return its sha256."""
    block = hashlib.sha256(seed).digest() * (MIB // 32)
    h = hashlib.sha256()
    with path.open("r+b") as fh:
        for _ in range(mib):
            fh.write(block)
            h.update(block)
        fh.flush()
        os.fsync(fh.fileno())
    return h.hexdigest()


def digest(path: Path, mib: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for _ in range(mib):
            h.update(fh.read(MIB))
    return h.hexdigest()


def test_snapshot_copy_is_pending_with_rising_progress_then_completed(vbs_up: Vbs) -> None:
    vol = vbs_up.cli("create-volume", "--size", "4", "--wait")
    vol_path = vbs_up.pool / "volumes" / f"{vol['volume_id']}.raw"
    want = fill(vol_path, 1536, b"environment")
    snap = vbs_up.cli("create-snapshot", vol["volume_id"], "--comment", "env")
    assert snap["status"] == "pending"
    seen = [snap["progress"]]
    while (cur := vbs_up.snapshot(snap["snapshot_id"]))["status"] == "pending":
        seen.append(cur["progress"])
    assert cur["status"] == "completed" and cur["progress"] == 100
    assert seen == sorted(seen), "progress never goes back"
    # Completed means stored; on this copy pool the snapshot store is where it lives (issue 33).
    assert cur["data_location"] == "store"
    assert not (vbs_up.pool / "snapshots" / f"{snap['snapshot_id']}.raw").exists()
    # The snapshot is independent of later writes to its volume.
    fill(vol_path, 8, b"later")
    assert digest(vbs_up.snapshot_data(snap["snapshot_id"]), 1536) == want


def test_volume_from_snapshot_is_creating_then_available_with_the_data(vbs_up: Vbs) -> None:
    vol = vbs_up.cli("create-volume", "--size", "2", "--wait")
    want = fill(vbs_up.pool / "volumes" / f"{vol['volume_id']}.raw", 1024, b"software")
    snap = vbs_up.cli("create-snapshot", vol["volume_id"], "--wait")
    clone = vbs_up.create_volume(snapshot_id=snap["snapshot_id"], size_gib=3)
    assert clone["status"] == "creating" and clone["size_gib"] == 3
    done = vbs_up.wait_volume(clone["volume_id"], "available")
    assert done["progress"] == 100 and done["snapshot_id"] == snap["snapshot_id"]
    path = vbs_up.pool / "volumes" / f"{clone['volume_id']}.raw"
    assert path.stat().st_size == 3 << 30
    assert digest(path, 1024) == want


def test_deleting_a_snapshot_that_a_creating_volume_copies_is_refused(
        tmp_path: Path, metadata_db: str, request: pytest.FixtureRequest) -> None:
    from tests.conftest import VbsUp

    # The clone's copy is held before it starts (the controller's step hook), so the delete always
    # meets a volume still being made from the snapshot.
    up = VbsUp(tmp_path / "var", tmp_path / "up.log", extra=database_flags(metadata_db, request),
               env={"VBS_TEST_HOOKS": "1"})
    vbs = up.start()
    auth = {"authorization": "Bearer " + node_token(vbs.data_dir, "storage", "storage-1")}

    def hook(action: str) -> Any:
        r = vbs.http.post(f"/internal/v1/test/{action}-step", json={"kind": "create-volume",
                                                                   "step": "storage-create"},
                          headers=auth, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        vol = vbs.cli("create-volume", "--size", "1", "--wait")
        want = fill(vbs.pool / "volumes" / f"{vol['volume_id']}.raw", 8, b"copied")
        snap = vbs.cli("create-snapshot", vol["volume_id"], "--wait")
        hook("hold")
        clone = vbs.create_volume(snapshot_id=snap["snapshot_id"])
        wait_until(lambda: hook("held")["held"], what="the clone's copy held")
        assert vbs.volume(clone["volume_id"])["status"] == "creating"
        r = vbs.http.delete(f"/v1/snapshots/{snap['snapshot_id']}")
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "InvalidSnapshot.InUse"
        hook("release")
        vbs.wait_volume(clone["volume_id"], "available")
        assert digest(vbs.pool / "volumes" / f"{clone['volume_id']}.raw", 8) == want
        assert vbs.snapshot(snap["snapshot_id"])["status"] == "completed"
        r = vbs.http.delete(f"/v1/snapshots/{snap['snapshot_id']}")
        assert r.status_code == 200, r.text
        wait_until(lambda: vbs.http.get(f"/v1/snapshots/{snap['snapshot_id']}").status_code == 404,
                   what="snapshot gone")
    finally:
        up.stop()


def test_deleting_a_volume_keeps_its_snapshots_and_their_clones(vbs_up: Vbs) -> None:
    vol = vbs_up.cli("create-volume", "--size", "1", "--wait")
    want = fill(vbs_up.pool / "volumes" / f"{vol['volume_id']}.raw", 64, b"keep")
    snap = vbs_up.cli("create-snapshot", vol["volume_id"], "--wait")
    vbs_up.cli("delete-volume", vol["volume_id"], "--wait")
    assert vbs_up.snapshot(snap["snapshot_id"])["status"] == "completed"
    clone = vbs_up.cli("create-volume", "--snapshot", snap["snapshot_id"], "--wait")
    assert digest(vbs_up.pool / "volumes" / f"{clone['volume_id']}.raw", 64) == want
    # delete-snapshot --wait, as every delete: it answers once the snapshot is gone.
    deleted = vbs_up.cli("delete-snapshot", snap["snapshot_id"], "--wait")
    assert deleted["snapshot_id"] == snap["snapshot_id"] and deleted["status"] == "deleted"
    assert vbs_up.http.get(f"/v1/snapshots/{snap['snapshot_id']}").status_code == 404


def test_restart_finds_every_volume_and_snapshot_again(tmp_path: Path, metadata_db: str,
                                                      request: pytest.FixtureRequest) -> None:
    from tests.conftest import VbsUp

    flags = database_flags(metadata_db, request)
    up = VbsUp(tmp_path / "var", tmp_path / "up.log", extra=flags)
    vbs = up.start()
    try:
        vol = vbs.cli("create-volume", "--size", "1", "--comment", "persist", "--wait")
        snap = vbs.cli("create-snapshot", vol["volume_id"], "--wait")
    finally:
        up.stop()
    again = VbsUp(tmp_path / "var", tmp_path / "up2.log", extra=flags)
    again.port = up.port
    vbs = again.start()
    try:
        assert vbs.volume(vol["volume_id"])["comment"] == "persist"
        assert vbs.snapshot(snap["snapshot_id"])["status"] == "completed"
        clone = vbs.cli("create-volume", "--snapshot", snap["snapshot_id"], "--wait")
        assert clone["status"] == "available"
    finally:
        again.stop()
