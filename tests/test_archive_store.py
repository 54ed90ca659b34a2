"""A separate archive store against a real ``vbs up`` (a dir snapshot store and a dir archive store): archiving
moves a snapshot's manifest into the archive store, and the standard store's garbage collection then frees
the chunks no other snapshot uses; a temporary or permanent restore copies it back, and a volume made from
it reads bit-exact; the end of a temporary restore drops the standard copy again; deleting an archived
snapshot deletes it from the archive store, whose own collection then frees its chunks. And an archive store
in a RADOS Gateway bucket."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.ceph_cluster import RadosGatewayForTests
from tests.conftest import Vbs, VbsUp, wait_until
from vbs.snapshot_store import DirStore, collect_garbage, find_manifest
from vbs.snapshot_store.contract import SnapshotStore
from vbs.snapshot_store.format import chunk_key, manifest_key
from vbs.snapshot_store.s3 import S3Store

pytestmark = pytest.mark.integration

MIB = 1 << 20
CHUNK = 512 * 1024


@dataclass
class Rig:
    vbs: Vbs
    standard: DirStore
    archive: SnapshotStore


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp: Path = tmp_path_factory.mktemp("archive-store")
    standard, archive = tmp / "snapshots", tmp / "archive"
    # Housekeeping (the end of temporary restores) every 2 s rather than every minute.
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--snapshot-store", f"dir:{standard}",
                                                   "--archive-store", f"dir:{archive}"],
               env={"VBS_CONTROLLER_RECYCLE_BIN_DAY_S": "20"})
    try:
        yield Rig(up.start(), DirStore(standard), DirStore(archive))
    finally:
        up.stop()


def volume_with_data(vbs: Vbs, data: bytes) -> str:
    vol = str(vbs.create_volume(size_gib=1)["volume_id"])
    vbs.wait_volume(vol, "available")
    with open(vbs.pool / "volumes" / f"{vol}.raw", "r+b") as f:
        f.write(data)
    return vol


def snapshot(vbs: Vbs, vol: str) -> str:
    snap = str(vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"])
    vbs.wait_snapshot(snap, "completed", timeout=120)
    return snap


def tier(vbs: Vbs, snap: str) -> dict[str, Any]:
    return dict(vbs.cli("describe-snapshot-tier-status", snap)["tiers"][0])


def wait_status(vbs: Vbs, snap: str, status: str) -> dict[str, Any]:
    wait_until(lambda: tier(vbs, snap)["last_status"] in (status, status.replace("completed", "failed")), 120,
               what=status)
    shown = tier(vbs, snap)
    assert shown["last_status"] == status, shown
    return shown


def digest_of_volume_from(vbs: Vbs, snap: str, length: int) -> str:
    vol = vbs.create_volume(snapshot_id=snap)["volume_id"]
    vbs.wait_volume(vol, "available", timeout=120)
    with open(vbs.pool / "volumes" / f"{vol}.raw", "rb") as f:
        return hashlib.sha256(f.read(length)).hexdigest()


def chunks_of(store: SnapshotStore, snap: str) -> set[str]:
    manifest = find_manifest(store, snap)
    assert manifest is not None, f"{store.describe()} has no manifest of {snap}"
    return manifest.chunk_ids()


def archived(rig: Rig, snap: str) -> None:
    assert rig.vbs.cli("archive-snapshot", snap)["snapshot_id"] == snap
    shown = wait_status(rig.vbs, snap, "archival-completed")
    assert shown["storage_tier"] == "archive" and shown["last_progress"] == 100


def test_archiving_moves_the_manifest_and_gc_frees_only_the_unshared_chunks(rig: Rig) -> None:
    vbs = rig.vbs
    data = os.urandom(4 * MIB)
    vol = volume_with_data(vbs, data)
    first = snapshot(vbs, vol)
    with open(vbs.pool / "volumes" / f"{vol}.raw", "r+b") as f:
        f.write(os.urandom(CHUNK))  # the second snapshot differs from the first in its first chunk
    second = snapshot(vbs, vol)
    mine, shared = chunks_of(rig.standard, first), chunks_of(rig.standard, second)
    unshared = mine - shared
    assert len(mine) == 8 and len(unshared) == 1

    archived(rig, first)
    assert not rig.standard.has(manifest_key(first)) and rig.archive.has(manifest_key(first))
    assert chunks_of(rig.archive, first) == mine
    assert all(rig.archive.has(chunk_key(c)) for c in mine)

    # vbs check finds each snapshot where it lives: the second in the snapshot store, the first in the archive.
    checked = vbs.cli("check", "--deep")
    assert checked["clean"], checked
    by_store = {s["store"]: s for s in checked["stores"]}
    assert by_store[rig.archive.describe()]["archive"] and by_store[rig.archive.describe()]["snapshots"] == 1
    assert by_store[rig.archive.describe()]["chunks_checked"] == len(mine)
    assert by_store[rig.standard.describe()]["snapshots"] == 1

    report = collect_garbage(rig.standard, grace_s=0)  # the agents' own collection, run now
    assert report.chunks_deleted >= 1
    assert not any(rig.standard.has(chunk_key(c)) for c in unshared)
    assert all(rig.standard.has(chunk_key(c)) for c in shared)  # the second snapshot's stay
    assert collect_garbage(rig.archive, grace_s=0).chunks_deleted == 0  # the archive's manifest claims them
    r = vbs.http.post("/v1/volumes", json={"snapshot_id": first})
    assert r.status_code == 409 and r.json()["error"]["code"] == "IncorrectState"
    r = vbs.http.post("/v1/snapshot-copies", json={"source_snapshot_id": first})  # nor a copy: restore first
    assert r.status_code == 409 and "archive store" in r.json()["error"]["message"]

    # A temporary restore copies it back before it is usable; the volume made from it is the data.
    assert vbs.cli("restore-snapshot-tier", first, "--days", "2")["restore_days"] == 2
    shown = wait_status(vbs, first, "temporary-restore-completed")
    assert shown["storage_tier"] == "standard" and shown["restore_expires_at"]
    assert rig.standard.has(manifest_key(first)) and rig.archive.has(manifest_key(first))
    assert digest_of_volume_from(vbs, first, 4 * MIB) == hashlib.sha256(data).hexdigest()

    # Two days on (the restore's end moved into the past): archived again, the standard copy dropped.
    with sqlite3.connect(vbs.data_dir / "vbs.db") as db:
        db.execute("UPDATE snapshot_tiers SET restore_expires_at = ? WHERE snapshot_id = ?",
                   ((datetime.now(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:%S.%f"), first))
    wait_until(lambda: not rig.standard.has(manifest_key(first)), 60, what="the standard copy dropped")
    shown = wait_status(vbs, first, "archival-completed")
    assert shown["storage_tier"] == "archive" and not shown.get("restore_expires_at")
    assert rig.archive.has(manifest_key(first))

    # A permanent restore: back in the standard store, out of the archive; its volume is the data again.
    vbs.cli("restore-snapshot-tier", first, "--permanent")
    shown = wait_status(vbs, first, "permanent-restore-completed")
    assert shown["storage_tier"] == "standard" and not shown.get("restore_expires_at")
    assert rig.standard.has(manifest_key(first)) and not rig.archive.has(manifest_key(first))
    assert digest_of_volume_from(vbs, first, 4 * MIB) == hashlib.sha256(data).hexdigest()
    collect_garbage(rig.archive, grace_s=0)
    assert not any(rig.archive.has(chunk_key(c)) for c in mine)


def test_deleting_an_archived_snapshot_deletes_it_from_the_archive_store(rig: Rig) -> None:
    vbs = rig.vbs
    vol = volume_with_data(vbs, os.urandom(2 * MIB))
    snap = snapshot(vbs, vol)
    mine = chunks_of(rig.standard, snap)
    archived(rig, snap)
    assert rig.archive.has(manifest_key(snap))
    assert vbs.http.delete(f"/v1/snapshots/{snap}").status_code in (200, 202, 204)

    def gone() -> bool:  # one read: the snapshot may go between two
        r = vbs.http.get(f"/v1/snapshots/{snap}")
        return r.status_code == 404 or (r.status_code == 200 and r.json()["status"] == "deleted")

    wait_until(gone, 60, what="deleted")
    assert not rig.archive.has(manifest_key(snap)) and not rig.standard.has(manifest_key(snap))
    collect_garbage(rig.archive, grace_s=0)
    assert not any(rig.archive.has(chunk_key(c)) for c in mine)



@pytest.fixture(scope="module")
def rig_radosgw(tmp_path_factory: pytest.TempPathFactory, radosgw: RadosGatewayForTests) -> Iterator[Rig]:
    """``vbs up`` with a dir snapshot store and an archive store in a bucket of the session's RADOS Gateway."""
    tmp: Path = tmp_path_factory.mktemp("archive-radosgw")
    radosgw.gateway.create_bucket("vbs-archive", radosgw.credentials)
    standard = tmp / "snapshots"
    up = VbsUp(tmp / "var", tmp / "up.log", extra=[
        "--snapshot-store", f"dir:{standard}", "--archive-store", "s3://vbs-archive/cold",
        "--archive-s3-endpoint", radosgw.endpoint, "--archive-s3-credentials-file", str(radosgw.credentials)])
    archive = S3Store.from_config({"endpoint_url": radosgw.endpoint, "bucket": "vbs-archive", "prefix": "cold",
                                   "region": "us-east-1", "credentials_file": str(radosgw.credentials)},
                                  default_dir=tmp)
    try:
        yield Rig(up.start(), DirStore(standard), archive)
    finally:
        up.stop()


def test_an_s3_archive_store_holds_the_archived_snapshot_and_gives_it_back(rig_radosgw: Rig) -> None:
    rig, vbs = rig_radosgw, rig_radosgw.vbs
    data = os.urandom(3 * MIB)
    snap = snapshot(vbs, volume_with_data(vbs, data))
    mine = chunks_of(rig.standard, snap)
    archived(rig, snap)
    assert not rig.standard.has(manifest_key(snap)) and chunks_of(rig.archive, snap) == mine
    assert all(rig.archive.has(chunk_key(c)) for c in mine)
    vbs.cli("restore-snapshot-tier", snap, "--permanent")
    wait_status(vbs, snap, "permanent-restore-completed")
    assert rig.standard.has(manifest_key(snap)) and not rig.archive.has(manifest_key(snap))
    assert digest_of_volume_from(vbs, snap, 3 * MIB) == hashlib.sha256(data).hexdigest()
