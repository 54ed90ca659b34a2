"""Encrypted volumes for real: a ``vbs up`` whose file pool makes LUKS containers and whose QEMU guest
opens them. What the guest writes is found nowhere in the pool file; snapshots and their clones stay
encrypted and readable; the key survives a master-key rotation; the EC2 API reports Encrypted and
KmsKeyId and refuses what it cannot do; the data key is in no log, operation row or process argv."""

from __future__ import annotations

import base64
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from tests.conftest import VBS, GuestOfVbsUp, Vbs, VbsUp, vbs_up_with_guest
from vbs.controller.auth.keys import MasterKey
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest
from vbs.storage.luks import LUKS_MAGIC, header_bytes

GIB = 1 << 30
MIB = 1 << 20
SEED = "vbs-plaintext-that-must-not-leak"
FAST = {"Delay": 0.2, "MaxAttempts": 300}


class Env(GuestOfVbsUp):
    def __init__(self, vbs: Vbs, up: VbsUp, guest: TestGuest) -> None:
        self.vbs, self.up, self.guest = vbs, up, guest
        self.ec2 = vbs.ec2()

    def pool_file(self, vol: str) -> Path:
        return self.vbs.pool / "volumes" / f"{vol}.raw"

    def passphrases(self) -> list[str]:
        """Every data key, opened as the controller does (the test reads its data dir)."""
        master = MasterKey(self.vbs.data_dir / "master.key")
        with sqlite3.connect(self.vbs.data_dir / "vbs.db") as db:
            rows = db.execute("SELECT id, sealed_key FROM volume_keys").fetchall()
        opened = [master.open(sealed, key_id) for key_id, sealed in rows]
        assert all(opened)
        return [o for o in opened if o]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with vbs_up_with_guest(tmp_path_factory.mktemp("encryption")) as (vbs, up, guest):
        yield Env(vbs, up, guest)


def contains(path: Path, needle: bytes, limit: int = 64 * MIB) -> bool:
    with open(path, "rb") as f:
        data = f.read(limit)
    return needle in data


def test_the_guest_writes_plaintext_and_the_pool_holds_only_ciphertext(env: Env) -> None:
    vbs = env.vbs
    vol = vbs.create_volume(size_gib=1, encrypted=True)["volume_id"]
    shown = vbs.wait_volume(vol, "available")
    assert (shown["encrypted"], shown["kms_key_id"]) == (True, "alias/aws/ebs")
    raw = env.pool_file(vol)
    with open(raw, "rb") as f:
        assert f.read(len(LUKS_MAGIC)) == LUKS_MAGIC
    assert raw.stat().st_size == GIB + header_bytes(raw)  # the payload is the size; the header comes on top

    dev = env.attach(vol)
    assert env.guest.disk_size(virtio_serial(vol)) == GIB
    written = env.guest.write_pattern(dev, SEED, 8)
    assert env.guest.checksum(dev, 8) == written
    env.detach(vol)
    assert not contains(raw, SEED.encode()), "plaintext found in the pool file of an encrypted volume"

    # A snapshot and the volume made from it are copies of the container: encrypted, same key, same data.
    snap = vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
    assert vbs.wait_snapshot(snap, "completed")["encrypted"] is True
    clone = vbs.create_volume(snapshot_id=snap)["volume_id"]
    assert vbs.wait_volume(clone, "available")["encrypted"] is True
    assert not contains(env.pool_file(clone), SEED.encode())
    dev = env.attach(clone)
    assert env.guest.checksum(dev, 8) == written
    env.detach(clone)

    # Copied under another KMS key id: re-encrypted under a new data key, the same data.
    r = vbs.http.post("/v1/snapshot-copies", json={"source_snapshot_id": snap, "encrypted": True,
                                                    "kms_key_id": "alias/rekeyed"})
    assert r.status_code == 200, r.text
    rekeyed = vbs.wait_snapshot(r.json()["snapshot_id"], "completed", timeout=180)
    assert (rekeyed["encrypted"], rekeyed["kms_key_id"]) == (True, "alias/rekeyed")
    restored = vbs.create_volume(snapshot_id=rekeyed["snapshot_id"])["volume_id"]
    assert vbs.wait_volume(restored, "available", timeout=180)["kms_key_id"] == "alias/rekeyed"
    assert not contains(env.pool_file(restored), SEED.encode())
    with open(env.pool_file(restored), "rb") as a, open(raw, "rb") as b:
        assert a.read(MIB) != b.read(MIB), "a re-encrypted copy must not be the same ciphertext"
    dev = env.attach(restored)
    assert env.guest.checksum(dev, 8) == written
    env.detach(restored)

    # A new master key: every data key re-sealed, the running controller still opens them.
    before = set(env.passphrases())
    r = subprocess.run([*VBS, "rotate-keys", "--master-key", "--data-dir", str(vbs.data_dir)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "re-sealed" in r.stdout, r.stderr
    assert set(env.passphrases()) == before
    dev = env.attach(vol)
    assert env.guest.checksum(dev, 8) == written
    env.detach(vol)


def test_a_plain_snapshot_becomes_an_encrypted_volume(env: Env) -> None:
    vbs = env.vbs
    plain = vbs.create_volume(size_gib=1)["volume_id"]
    vbs.wait_volume(plain, "available")
    dev = env.attach(plain)
    written = env.guest.write_pattern(dev, "plain-then-encrypted", 4)
    env.detach(plain)
    snap = vbs.http.post("/v1/snapshots", json={"volume_id": plain}).json()["snapshot_id"]
    assert vbs.wait_snapshot(snap, "completed")["encrypted"] is False
    vol = vbs.create_volume(snapshot_id=snap, size_gib=2, encrypted=True)["volume_id"]
    shown = vbs.wait_volume(vol, "available", timeout=180)
    assert (shown["encrypted"], shown["size_gib"]) == (True, 2)
    assert not contains(env.pool_file(vol), b"plain-then-encrypted")
    dev = env.attach(vol)
    assert env.guest.disk_size(virtio_serial(vol)) == 2 * GIB
    assert env.guest.checksum(dev, 4) == written
    env.detach(vol)


def test_the_data_key_is_in_no_log_operation_row_or_argv(env: Env) -> None:
    vol = env.vbs.create_volume(size_gib=1, encrypted=True)["volume_id"]
    env.vbs.wait_volume(vol, "available")
    env.attach(vol)
    try:
        keys = env.passphrases()
        assert keys
        argvs = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argvs.append(Path(f"/proc/{pid}/cmdline").read_bytes())
            except OSError:
                continue
        with sqlite3.connect(env.vbs.data_dir / "vbs.db") as db:
            operations = repr(db.execute("SELECT * FROM operations").fetchall()
                              + db.execute("SELECT * FROM operation_steps").fetchall())
        logs = env.up.log_path.read_text(errors="replace")
        for key in keys:
            for form in (key, base64.b64decode(key).hex()):
                assert form not in logs and form not in operations
                assert not any(form.encode() in a for a in argvs)
    finally:
        env.detach(vol)


def ec2_code(call: Any, **params: Any) -> str:
    with pytest.raises(ClientError) as info:
        call(**params)
    return str(info.value.response["Error"]["Code"])


def test_ec2_reports_encryption_and_refuses_what_it_cannot_do(env: Env) -> None:
    ec2 = env.ec2
    vol = ec2.create_volume(AvailabilityZone="us-east-1a", Size=1, Encrypted=True, KmsKeyId="alias/team-db")
    assert (vol["Encrypted"], vol["KmsKeyId"]) == (True, "alias/team-db")
    plain = ec2.create_volume(AvailabilityZone="us-east-1a", Size=1)
    ec2.get_waiter("volume_available").wait(VolumeIds=[vol["VolumeId"], plain["VolumeId"]], WaiterConfig=FAST)
    encrypted_ids = {v["VolumeId"] for v in ec2.describe_volumes(
        Filters=[{"Name": "encrypted", "Values": ["true"]}])["Volumes"]}
    plain_ids = {v["VolumeId"] for v in ec2.describe_volumes(
        Filters=[{"Name": "encrypted", "Values": ["false"]}])["Volumes"]}
    assert vol["VolumeId"] in encrypted_ids and plain["VolumeId"] in plain_ids
    assert not encrypted_ids & plain_ids

    snap = ec2.create_snapshot(VolumeId=vol["VolumeId"])["SnapshotId"]
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig=FAST)
    shown = ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]
    assert (shown["Encrypted"], shown["KmsKeyId"]) == (True, "alias/team-db")
    copy = ec2.copy_snapshot(SourceSnapshotId=snap, SourceRegion="us-east-1", Encrypted=True,
                             KmsKeyId="alias/team-db")["SnapshotId"]
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[copy], WaiterConfig=FAST)
    assert ec2.describe_snapshots(SnapshotIds=[copy])["Snapshots"][0]["Encrypted"] is True
    restored = ec2.create_volume(AvailabilityZone="us-east-1a", SnapshotId=copy)
    assert (restored["Encrypted"], restored["KmsKeyId"]) == (True, "alias/team-db")
    assert snap in {s["SnapshotId"] for s in ec2.describe_snapshots(
        OwnerIds=["self"], Filters=[{"Name": "encrypted", "Values": ["true"]}])["Snapshots"]}

    plain_snap = ec2.create_snapshot(VolumeId=plain["VolumeId"])["SnapshotId"]
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[plain_snap], WaiterConfig=FAST)
    # The EBS way to encrypt what was not: copy it with Encrypted.
    encrypted_copy = ec2.copy_snapshot(SourceSnapshotId=plain_snap, SourceRegion="us-east-1",
                                       Encrypted=True)["SnapshotId"]
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[encrypted_copy], WaiterConfig=FAST)
    shown = ec2.describe_snapshots(SnapshotIds=[encrypted_copy])["Snapshots"][0]
    assert (shown["Encrypted"], shown["KmsKeyId"]) == (True, "alias/aws/ebs")
    refused = [
        (ec2.create_volume, {"AvailabilityZone": "us-east-1a", "Size": 1, "KmsKeyId": "alias/x"},
         "InvalidParameterDependency"),
        (ec2.create_volume, {"AvailabilityZone": "us-east-1a", "Size": 1, "Encrypted": True, "KmsKeyId": "bad key"},
         "InvalidParameterValue"),
    ]
    for call, params, code in refused:
        assert ec2_code(call, **params) == code, params
