"""The archive tier against a real ``vbs up``, driven by boto3's own EC2 client (ModifySnapshotTier,
RestoreSnapshotTier, DescribeSnapshotTierStatus, DescribeSnapshots' StorageTier), the REST routes and the
CLI: an archived snapshot makes no volume until it is restored (AWS's refusal), a temporary restore ends
back in the archive tier, and a volume made from a restored snapshot holds its data."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from tests.conftest import Vbs, VbsUp, wait_until

pytestmark = pytest.mark.integration

MIB = 1 << 20


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    tmp: Path = tmp_path_factory.mktemp("tiers")
    up = VbsUp(tmp / "var", tmp / "up.log")
    try:
        yield up.start()
    finally:
        up.stop()


def snapshot_with_data(vbs: Vbs) -> tuple[str, str]:
    """A completed snapshot of a volume holding 4 MiB of random data; the data's sha256."""
    vol = vbs.create_volume(size_gib=1)["volume_id"]
    vbs.wait_volume(vol, "available")
    data = os.urandom(4 * MIB)
    with open(vbs.pool / "volumes" / f"{vol}.raw", "r+b") as f:
        f.write(data)
    snap = vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
    vbs.wait_snapshot(snap, "completed", timeout=120)
    return str(snap), hashlib.sha256(data).hexdigest()


def tier(ec2: Any, snap: str) -> dict[str, Any]:
    [found] = [t for t in ec2.describe_snapshot_tier_status(
        Filters=[{"Name": "snapshot-id", "Values": [snap]}])["SnapshotTierStatuses"]]
    return dict(found)


def volume_digest(vbs: Vbs, snap: str) -> str:
    vol = vbs.create_volume(snapshot_id=snap)["volume_id"]
    vbs.wait_volume(vol, "available", timeout=120)
    with open(vbs.pool / "volumes" / f"{vol}.raw", "rb") as f:
        return hashlib.sha256(f.read(4 * MIB)).hexdigest()


def test_an_archived_snapshot_makes_volumes_again_once_restored(vbs: Vbs) -> None:
    ec2 = vbs.ec2()
    snap, digest = snapshot_with_data(vbs)
    assert tier(ec2, snap)["StorageTier"] == "standard"
    with pytest.raises(ClientError) as exc:
        ec2.modify_snapshot_tier(SnapshotId=snap, StorageTier="archive", DryRun=True)
    assert exc.value.response["Error"]["Code"] == "DryRunOperation"
    started = ec2.modify_snapshot_tier(SnapshotId=snap, StorageTier="archive")
    assert started["SnapshotId"] == snap and started["TieringStartTime"]
    wait_until(lambda: tier(ec2, snap)["LastTieringOperationStatus"] == "archival-completed", 60,
               what="archived")
    shown = tier(ec2, snap)
    assert shown["StorageTier"] == "archive" and shown["ArchivalCompleteTime"] and shown["LastTieringProgress"] == 100
    assert ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]["StorageTier"] == "archive"
    assert vbs.snapshot(snap)["data_location"] == "store"  # only the store holds it

    with pytest.raises(ClientError) as exc:  # no volume from an archived snapshot
        ec2.create_volume(SnapshotId=snap, AvailabilityZone="vbs-1a")
    assert exc.value.response["Error"]["Code"] == "IncorrectState"
    assert "archive" in exc.value.response["Error"]["Message"]
    with pytest.raises(ClientError) as exc:  # nor archived twice
        ec2.modify_snapshot_tier(SnapshotId=snap, StorageTier="archive")
    assert exc.value.response["Error"]["Code"] == "IncorrectState"

    restored = ec2.restore_snapshot_tier(SnapshotId=snap, TemporaryRestoreDays=1)
    assert restored["RestoreDuration"] == 1 and restored["IsPermanentRestore"] is False
    shown = tier(ec2, snap)
    assert (shown["StorageTier"], shown["LastTieringOperationStatus"]) == ("standard",
                                                                           "temporary-restore-completed")
    assert shown["RestoreExpiryTime"]
    assert ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]["RestoreExpiryTime"] == shown["RestoreExpiryTime"]
    assert volume_digest(vbs, snap) == digest

    assert ec2.restore_snapshot_tier(SnapshotId=snap, PermanentRestore=True)["IsPermanentRestore"] is True
    shown = tier(ec2, snap)
    assert shown["StorageTier"] == "standard" and "RestoreExpiryTime" not in shown
    with pytest.raises(ClientError) as exc:  # not archived any more
        ec2.restore_snapshot_tier(SnapshotId=snap, PermanentRestore=True)
    assert exc.value.response["Error"]["Code"] == "IncorrectState"
    with pytest.raises(ClientError) as exc:  # one of the two
        ec2.restore_snapshot_tier(SnapshotId=snap)
    assert exc.value.response["Error"]["Code"] == "InvalidParameterValue"


def test_a_temporary_restore_ends_back_in_the_archive_tier(vbs: Vbs) -> None:
    snap, _ = snapshot_with_data(vbs)
    assert vbs.cli("archive-snapshot", snap)["snapshot_id"] == snap
    wait_until(lambda: vbs.cli("describe-snapshot-tier-status", snap)["tiers"][0]["storage_tier"] == "archive", 60,
               what="archived")
    assert vbs.cli("restore-snapshot-tier", snap, "--days", "2")["restore_days"] == 2
    # Two days on (the restore's end moved into the past in the metadata DB, as SQLite stores times).
    with sqlite3.connect(vbs.data_dir / "vbs.db") as db:
        db.execute("UPDATE snapshot_tiers SET restore_expires_at = ? WHERE snapshot_id = ?",
                   ((datetime.now(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:%S.%f"), snap))
    assert vbs.cli("describe-snapshot-tier-status", snap)["tiers"][0]["storage_tier"] == "archive"
    r = vbs.http.post("/v1/volumes", json={"snapshot_id": snap})
    assert r.status_code == 409 and r.json()["error"]["code"] == "IncorrectState"
