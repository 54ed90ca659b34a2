"""The EBS direct APIs, driven by boto3's own ``ebs`` client against a real ``vbs up`` whose QEMU guest
(TCG) writes and reads the volumes.

- a snapshot written block by block (PutSnapshotBlock) is an ordinary snapshot: listed, read back block
  by block, described by EC2, and a volume made from it holds exactly those blocks in a guest;
- a backup tool's flow: a guest writes, snapshot; it changes some blocks (and writes one again with the
  same bytes), snapshot; ListChangedBlocks names exactly the changed ones; the second image is rebuilt
  from the first plus those blocks, bit-exact; written back as a child snapshot, it restores the same;
- an encrypted snapshot (Encrypted, KmsKeyArn) takes plaintext blocks and answers them as plaintext; its
  child shares its key; a volume made from it is a LUKS container under that key whose guest reads the
  blocks as they were put; an encrypted volume's snapshot (a LUKS container) is read as plaintext too;
- what AWS refuses is refused with AWS's error and reason, and changes nothing.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.conftest import GuestOfVbsUp, Vbs, VbsUp, vbs_up_with_guest, wait_until
from vbs.rigs.testguest import TestGuest

BLOCK = 512 * 1024
GIB = 1 << 30
BLOCKS_PER_GIB = GIB // BLOCK
DIRECT_VOLUME = "vol-" + "f" * 17


def sha(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def linear(checksums: list[str]) -> str:
    """CompleteSnapshot's LINEAR aggregate: SHA-256 of the blocks' SHA-256 digests in block order."""
    return sha(b"".join(base64.b64decode(c) for c in checksums))


class Env(GuestOfVbsUp):
    def __init__(self, vbs: Vbs, up: VbsUp, guest: TestGuest) -> None:
        self.vbs, self.up, self.guest = vbs, up, guest
        self.ebs = ebs_client(vbs, vbs.key.access_key_id, vbs.key.secret_access_key)

    def guest_block(self, dev: str, index: int) -> str:
        """sha256 (hex) of block ``index`` of ``dev`` as the guest reads it from the device."""
        out = self.guest.check(f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/{dev} bs=512K skip={index} count=1 "
                               "2>/dev/null | sha256sum", timeout=60)
        return out.split()[0]

    def snapshot(self, vol: str) -> str:
        snap = self.vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
        self.vbs.wait_snapshot(snap, "completed", timeout=300)
        return str(snap)

    def volume_from(self, snap: str) -> str:
        vol = self.vbs.create_volume(snapshot_id=snap)["volume_id"]
        self.vbs.wait_volume(vol, "available", timeout=300)
        return str(vol)


def ebs_client(vbs: Vbs, key_id: str, secret: str) -> Any:
    return boto3.client("ebs", endpoint_url=vbs.endpoint, region_name="us-east-1", aws_access_key_id=key_id,
                        aws_secret_access_key=secret, config=Config(retries={"max_attempts": 1}))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    limits = {"VBS_CONTROLLER_EBS_PENDING_SNAPSHOTS_MAX": "4"}
    with vbs_up_with_guest(tmp_path_factory.mktemp("ebs-direct"), env=limits) as (vbs, up, guest):
        yield Env(vbs, up, guest)


def put(ebs: Any, snap: str, index: int, data: bytes, **extra: Any) -> dict[str, Any]:
    return ebs.put_snapshot_block(SnapshotId=snap, BlockIndex=index, BlockData=data, DataLength=len(data),
                                  Checksum=sha(data), ChecksumAlgorithm="SHA256", **extra)


def all_pages(call: Any, key: str, **kw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while True:
        page = call(**kw)
        out += page[key]
        if not page.get("NextToken"):
            return out
        kw["NextToken"] = page["NextToken"]


def read_block(ebs: Any, snap: str, index: int, token: str) -> bytes:
    got = ebs.get_snapshot_block(SnapshotId=snap, BlockIndex=index, BlockToken=token)
    data = got["BlockData"].read()
    assert got["DataLength"] == len(data) == BLOCK and got["ChecksumAlgorithm"] == "SHA256"
    assert got["Checksum"] == sha(data)
    return bytes(data)


def test_blocks_put_one_by_one_make_a_snapshot_that_a_guest_reads(env: Env) -> None:
    ebs = env.ebs
    started = ebs.start_snapshot(VolumeSize=1, Description="written block by block", Timeout=60,
                                 Tags=[{"Key": "made-by", "Value": "backup-tool"}])
    snap = started["SnapshotId"]
    assert (started["Status"], started["VolumeSize"], started["BlockSize"]) == ("pending", 1, BLOCK)
    blocks = {0: os.urandom(BLOCK), 3: os.urandom(BLOCK), BLOCKS_PER_GIB - 1: os.urandom(BLOCK), 10: bytes(BLOCK)}
    for index, data in blocks.items():
        answer = put(ebs, snap, index, data, Progress=50)
        assert answer["Checksum"] == sha(data)
    blocks[3] = os.urandom(BLOCK)  # a block written again: the last write counts
    put(ebs, snap, 3, blocks[3])
    assert env.vbs.snapshot(snap)["status"] == "pending"
    done = ebs.complete_snapshot(SnapshotId=snap, ChangedBlocksCount=4, ChecksumAlgorithm="SHA256",
                                 ChecksumAggregationMethod="LINEAR",
                                 Checksum=linear([sha(blocks[i]) for i in sorted(blocks)]))
    assert done["Status"] == "completed"

    shown = env.vbs.ec2().describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]
    assert (shown["State"], shown["VolumeId"], shown["VolumeSize"]) == ("completed", DIRECT_VOLUME, 1)
    assert {"Key": "made-by", "Value": "backup-tool"} in shown["Tags"]

    listed = all_pages(ebs.list_snapshot_blocks, "Blocks", SnapshotId=snap, MaxResults=100)
    assert [b["BlockIndex"] for b in listed] == [0, 3, BLOCKS_PER_GIB - 1]  # the zero block is not listed
    for b in listed:
        assert read_block(ebs, snap, b["BlockIndex"], b["BlockToken"]) == blocks[b["BlockIndex"]]

    vol = env.volume_from(snap)
    dev = env.attach(vol)
    try:
        for index, data in blocks.items():
            assert env.guest_block(dev, index) == hashlib.sha256(data).hexdigest(), index
        assert env.guest_block(dev, 7) == hashlib.sha256(bytes(BLOCK)).hexdigest()
    finally:
        env.detach(vol)


def test_a_backup_tool_rebuilds_the_second_snapshot_from_the_first_and_the_changed_blocks(
        env: Env, tmp_path: Path) -> None:
    ebs, guest = env.ebs, env.guest
    vol = env.vbs.create_volume(size_gib=1)["volume_id"]
    env.vbs.wait_volume(vol, "available")
    dev = env.attach(vol)
    guest.write_pattern(dev, "first-image", 4)  # blocks 0-7
    env.detach(vol)
    first = env.snapshot(vol)

    dev = env.attach(vol)
    # Blocks 1 and 500 change; block 3 is written again with the bytes it holds (not a change).
    guest.check(f"head -c 524288 /dev/urandom | dd of=/dev/{dev} bs=512K seek=1 conv=fsync,notrunc 2>/dev/null")
    guest.check(f"head -c 524288 /dev/urandom | dd of=/dev/{dev} bs=512K seek=500 conv=fsync,notrunc 2>/dev/null")
    guest.check(f"dd if=/dev/{dev} bs=512K skip=3 count=1 2>/dev/null > /run/b3; "
                f"dd if=/run/b3 of=/dev/{dev} bs=512K seek=3 conv=fsync,notrunc 2>/dev/null")
    env.detach(vol)
    second = env.snapshot(vol)

    changed = all_pages(ebs.list_changed_blocks, "ChangedBlocks", FirstSnapshotId=first, SecondSnapshotId=second)
    assert [c["BlockIndex"] for c in changed] == [1, 500]
    assert "FirstBlockToken" in changed[0] and "FirstBlockToken" not in changed[1]  # block 500 was zeros

    # Rebuild: every block of the first snapshot, then the changed blocks of the second over them.
    rebuilt = tmp_path / "rebuilt.raw"
    with open(rebuilt, "wb") as f:
        f.truncate(GIB)
        for b in all_pages(ebs.list_snapshot_blocks, "Blocks", SnapshotId=first):
            f.seek(b["BlockIndex"] * BLOCK)
            f.write(read_block(ebs, first, b["BlockIndex"], b["BlockToken"]))
        for c in changed:
            f.seek(c["BlockIndex"] * BLOCK)
            f.write(read_block(ebs, second, c["BlockIndex"], c["SecondBlockToken"]))
    assert file_digest(rebuilt) == file_digest(env.vbs.snapshot_data(second))

    # Written back as a child of the first: only the changed blocks go up.
    child = ebs.start_snapshot(VolumeSize=1, ParentSnapshotId=first)["SnapshotId"]
    with open(rebuilt, "rb") as f:
        for c in changed:
            f.seek(c["BlockIndex"] * BLOCK)
            put(ebs, child, c["BlockIndex"], f.read(BLOCK))
    assert ebs.complete_snapshot(SnapshotId=child, ChangedBlocksCount=2)["Status"] == "completed"
    again = all_pages(ebs.list_changed_blocks, "ChangedBlocks", FirstSnapshotId=first, SecondSnapshotId=child)
    assert [c["BlockIndex"] for c in again] == [1, 500]
    restored = env.volume_from(child)
    assert file_digest(env.vbs.pool / "volumes" / f"{restored}.raw") == file_digest(rebuilt)
    dev = env.attach(restored)
    try:
        with open(rebuilt, "rb") as f:
            for index in (0, 1, 3, 7, 500):
                f.seek(index * BLOCK)
                assert env.guest_block(dev, index) == hashlib.sha256(f.read(BLOCK)).hexdigest(), index
    finally:
        env.detach(restored)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def error(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, str | None]:
    return exc.value.response["Error"]["Code"], exc.value.response.get("Reason")


def test_what_aws_refuses_is_refused_with_its_error_and_changes_nothing(env: Env) -> None:
    ebs = env.ebs
    snap = ebs.start_snapshot(VolumeSize=1)["SnapshotId"]
    data = os.urandom(BLOCK)
    with pytest.raises(ClientError) as exc:  # a checksum of other data
        ebs.put_snapshot_block(SnapshotId=snap, BlockIndex=0, BlockData=data, DataLength=BLOCK,
                               Checksum=sha(b"other"), ChecksumAlgorithm="SHA256")
    assert error(exc) == ("ValidationException", "INVALID_BLOCK")
    with pytest.raises(ClientError) as exc:  # a block that is not 512 KiB
        put(ebs, snap, 0, data[:1000])
    assert error(exc) == ("ValidationException", "INVALID_BLOCK")
    with pytest.raises(ClientError) as exc:  # past the end of a 1 GiB volume
        put(ebs, snap, BLOCKS_PER_GIB, data)
    assert error(exc) == ("ValidationException", "INVALID_BLOCK")
    put(ebs, snap, 5, data)
    with pytest.raises(ClientError) as exc:  # a count other than the blocks written
        ebs.complete_snapshot(SnapshotId=snap, ChangedBlocksCount=2)
    assert error(exc)[0] == "ValidationException"
    with pytest.raises(ClientError) as exc:  # an aggregate checksum of other blocks
        ebs.complete_snapshot(SnapshotId=snap, ChangedBlocksCount=1, Checksum=linear([sha(b"x")]),
                              ChecksumAlgorithm="SHA256", ChecksumAggregationMethod="LINEAR")
    assert error(exc)[0] == "ValidationException"
    assert env.vbs.snapshot(snap)["status"] == "pending"  # refused completions leave it pending
    done = ebs.complete_snapshot(SnapshotId=snap, ChangedBlocksCount=1, Checksum=linear([sha(data)]),
                                 ChecksumAlgorithm="SHA256", ChecksumAggregationMethod="LINEAR")
    assert done["Status"] == "completed"
    with pytest.raises(ClientError) as exc:  # no block once completed
        put(ebs, snap, 6, data)
    assert error(exc)[0] == "ValidationException"

    [block] = ebs.list_snapshot_blocks(SnapshotId=snap)["Blocks"]
    assert read_block(ebs, snap, 5, block["BlockToken"]) == data
    other = ebs.start_snapshot(VolumeSize=1)["SnapshotId"]
    put(ebs, other, 5, data)
    ebs.complete_snapshot(SnapshotId=other, ChangedBlocksCount=1)
    raw = base64.b64decode(block["BlockToken"])
    forged = base64.b64encode(raw[:-1] + bytes([raw[-1] ^ 0xFF])).decode()  # its MAC's last byte changed
    for sid, index, token in ((other, 5, block["BlockToken"]), (snap, 6, block["BlockToken"]), (snap, 5, forged)):
        with pytest.raises(ClientError) as exc:  # a token of another snapshot, another block, or forged
            ebs.get_snapshot_block(SnapshotId=sid, BlockIndex=index, BlockToken=token)
        assert error(exc) == ("ValidationException", "INVALID_BLOCK_TOKEN")
    with pytest.raises(ClientError) as exc:  # two snapshots started without a parent: two lineages
        ebs.list_changed_blocks(FirstSnapshotId=snap, SecondSnapshotId=other)
    assert error(exc) == ("ValidationException", "UNRELATED_SNAPSHOTS")

    # A client token: the same request answers the same snapshot; another request with it is a conflict.
    a = ebs.start_snapshot(VolumeSize=2, ClientToken="backup-run-1")["SnapshotId"]
    assert ebs.start_snapshot(VolumeSize=2, ClientToken="backup-run-1")["SnapshotId"] == a
    with pytest.raises(ClientError) as exc:
        ebs.start_snapshot(VolumeSize=3, ClientToken="backup-run-1")
    assert error(exc)[0] == "ConflictException"
    # At most 4 pending at once here (VBS_CONTROLLER_EBS_PENDING_SNAPSHOTS_MAX).
    pending = [ebs.start_snapshot(VolumeSize=1)["SnapshotId"] for _ in range(3)]
    with pytest.raises(ClientError) as exc:
        ebs.start_snapshot(VolumeSize=1)
    assert error(exc)[0] == "ConcurrentLimitExceededException"
    for sid in [a, *pending]:
        ebs.complete_snapshot(SnapshotId=sid, ChangedBlocksCount=0)

    # Another tenant's key finds none of these snapshots; a bad signature is refused.
    made = env.vbs.cli("create-key", "--tenant", "ebs-other", "--role", "user")
    stranger = ebs_client(env.vbs, made["access_key_id"], made["secret_access_key"])
    with pytest.raises(ClientError) as exc:
        stranger.list_snapshot_blocks(SnapshotId=snap)
    assert error(exc) == ("ResourceNotFoundException", "SNAPSHOT_NOT_FOUND")
    with pytest.raises(ClientError) as exc:
        put(stranger, other, 7, data)
    assert error(exc)[0] == "ResourceNotFoundException"
    wrong = ebs_client(env.vbs, made["access_key_id"], made["secret_access_key"][::-1])
    with pytest.raises(ClientError) as exc:
        wrong.list_snapshot_blocks(SnapshotId=snap)
    assert error(exc)[0] == "AccessDeniedException"
    assert [b["BlockIndex"] for b in ebs.list_snapshot_blocks(SnapshotId=snap)["Blocks"]] == [5]


def test_a_snapshot_past_its_timeout_ends_in_error_and_takes_no_more_blocks(env: Env) -> None:
    ebs = env.ebs
    snap = ebs.start_snapshot(VolumeSize=1, Timeout=10)["SnapshotId"]
    put(ebs, snap, 0, os.urandom(BLOCK))
    # Eleven minutes on: the timeout moved into the past in the metadata DB (as SQLite stores times).
    past = (datetime.now(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:%S.%f")
    with sqlite3.connect(env.vbs.data_dir / "vbs.db") as db:
        db.execute("UPDATE direct_snapshots SET expires_at = ? WHERE snapshot_id = ?", (past, snap))
    with pytest.raises(ClientError) as exc:
        put(ebs, snap, 1, os.urandom(BLOCK))
    assert error(exc)[0] == "ValidationException"
    shown = env.vbs.snapshot(snap)
    assert shown["status"] == "error" and "Timeout" in shown["status_reason"]
    assert ebs.complete_snapshot(SnapshotId=snap, ChangedBlocksCount=1)["Status"] == "error"
    # An errored snapshot is deleted as any other.
    assert env.vbs.http.delete(f"/v1/snapshots/{snap}").status_code == 200
    wait_until(lambda: env.vbs.http.get(f"/v1/snapshots/{snap}").status_code == 404, 60, what="deleted")
    # A completed one too: its manifest leaves the store (its chunks go with the store's garbage collection).
    done = ebs.start_snapshot(VolumeSize=1)["SnapshotId"]
    put(ebs, done, 2, os.urandom(BLOCK))
    ebs.complete_snapshot(SnapshotId=done, ChangedBlocksCount=1)
    manifest = env.vbs.data_dir / "snapshots" / "manifests" / done
    assert manifest.exists()
    assert env.vbs.http.delete(f"/v1/snapshots/{done}").status_code == 200
    wait_until(lambda: not manifest.exists(), 60, what="manifest deleted")


KMS_ARN = "arn:aws:kms:us-east-1:000000000000:key/0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
MARK = b"vbs-direct-encrypted-plaintext!!" * (BLOCK // 32)


def holds(path: Path, needle: bytes, limit: int = 64 << 20) -> bool:
    with open(path, "rb") as f:
        return needle in f.read(limit)


def test_an_encrypted_snapshot_takes_plaintext_blocks_and_its_volumes_are_encrypted_under_its_key(env: Env) -> None:
    ebs, ec2 = env.ebs, env.vbs.ec2()
    started = ebs.start_snapshot(VolumeSize=1, Encrypted=True, KmsKeyArn=KMS_ARN)
    snap = started["SnapshotId"]
    assert (started["Status"], started["KmsKeyArn"]) == ("pending", KMS_ARN)
    blocks = {0: MARK, 2: os.urandom(BLOCK)}
    for index, data in blocks.items():
        put(ebs, snap, index, data)
    assert ebs.complete_snapshot(SnapshotId=snap, ChangedBlocksCount=2)["Status"] == "completed"
    shown = ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]
    assert (shown["State"], shown["Encrypted"], shown["KmsKeyId"]) == ("completed", True, KMS_ARN)
    listed = ebs.list_snapshot_blocks(SnapshotId=snap)["Blocks"]
    assert [b["BlockIndex"] for b in listed] == [0, 2]
    for b in listed:  # plaintext to its owner, as AWS answers
        assert read_block(ebs, snap, b["BlockIndex"], b["BlockToken"]) == blocks[b["BlockIndex"]]

    # A child is encrypted under its parent's key; only its own blocks differ.
    child = ebs.start_snapshot(VolumeSize=1, ParentSnapshotId=snap)
    assert child["KmsKeyArn"] == KMS_ARN
    blocks[5] = os.urandom(BLOCK)
    put(ebs, child["SnapshotId"], 5, blocks[5])
    assert ebs.complete_snapshot(SnapshotId=child["SnapshotId"], ChangedBlocksCount=1)["Status"] == "completed"
    changed = ebs.list_changed_blocks(FirstSnapshotId=snap, SecondSnapshotId=child["SnapshotId"])["ChangedBlocks"]
    assert [c["BlockIndex"] for c in changed] == [5]

    # EC2 CreateVolume: encrypted under the snapshot's key; the pool holds a LUKS container, the guest reads
    # the blocks as they were put.
    made = ec2.create_volume(AvailabilityZone="us-east-1a", SnapshotId=child["SnapshotId"])
    assert (made["Encrypted"], made["KmsKeyId"]) == (True, KMS_ARN)
    vol = made["VolumeId"]
    env.vbs.wait_volume(vol, "available", timeout=300)
    raw = env.vbs.pool / "volumes" / f"{vol}.raw"
    assert holds(raw, b"LUKS\xba\xbe", 6) and not holds(raw, MARK[:4096])
    dev = env.attach(vol)
    try:
        for index, data in (*blocks.items(), (7, bytes(BLOCK))):
            assert env.guest_block(dev, index) == hashlib.sha256(data).hexdigest(), index
    finally:
        env.detach(vol)

    # An encrypted volume's snapshot is its LUKS container: its blocks are answered as plaintext (the
    # controller decrypts them), a block beside a written one may be listed too (the container's blocks
    # straddle the volume's); it is no parent for blocks put as plaintext.
    luks_vol = env.vbs.create_volume(size_gib=1, encrypted=True)["volume_id"]
    env.vbs.wait_volume(luks_vol, "available")
    dev = env.attach(luks_vol)
    try:
        for index in (1, 3):
            env.guest.check(f"head -c 524288 /dev/urandom | dd of=/dev/{dev} bs=512K seek={index} "
                            "conv=fsync,notrunc 2>/dev/null")
        written = {index: env.guest_block(dev, index) for index in (1, 3)}
    finally:
        env.detach(luks_vol)
    first = env.snapshot(luks_vol)
    listed = {b["BlockIndex"]: b["BlockToken"] for b in ebs.list_snapshot_blocks(SnapshotId=first)["Blocks"]}
    assert {1, 3} <= set(listed) <= {0, 1, 2, 3, 4}
    for index, digest in written.items():
        assert hashlib.sha256(read_block(ebs, first, index, listed[index])).hexdigest() == digest
    dev = env.attach(luks_vol)
    try:
        env.guest.check(f"head -c 524288 /dev/urandom | dd of=/dev/{dev} bs=512K seek=3 conv=fsync,notrunc 2>/dev/null")
        written[3] = env.guest_block(dev, 3)
    finally:
        env.detach(luks_vol)
    second = env.snapshot(luks_vol)
    changed = ebs.list_changed_blocks(FirstSnapshotId=first, SecondSnapshotId=second)["ChangedBlocks"]
    assert 3 in {c["BlockIndex"] for c in changed} and 1 not in {c["BlockIndex"] for c in changed}
    [three] = [c for c in changed if c["BlockIndex"] == 3]
    assert hashlib.sha256(read_block(ebs, second, 3, three["SecondBlockToken"])).hexdigest() == written[3]
    with pytest.raises(ClientError) as exc:
        ebs.start_snapshot(VolumeSize=1, ParentSnapshotId=second)
    assert error(exc) == ("ValidationException", "INVALID_SNAPSHOT_ID")
    with pytest.raises(ClientError) as exc:  # another lineage
        ebs.list_changed_blocks(FirstSnapshotId=snap, SecondSnapshotId=second)
    assert error(exc) == ("ValidationException", "UNRELATED_SNAPSHOTS")

    # The default key; what AWS refuses, refused.
    default = ebs.start_snapshot(VolumeSize=1, Encrypted=True)
    assert default["KmsKeyArn"] == "arn:aws:kms:us-east-1:000000000000:alias/aws/ebs"
    assert ebs.complete_snapshot(SnapshotId=default["SnapshotId"], ChangedBlocksCount=0)["Status"] == "completed"
    assert ec2.describe_snapshots(SnapshotIds=[default["SnapshotId"]])["Snapshots"][0]["KmsKeyId"] == "alias/aws/ebs"
    for params, expected in (
            ({"Encrypted": True, "ParentSnapshotId": snap}, ("ValidationException", "INVALID_PARAMETER_VALUE")),
            ({"KmsKeyArn": KMS_ARN}, ("ValidationException", "INVALID_PARAMETER_VALUE")),
            ({"Encrypted": True, "KmsKeyArn": KMS_ARN.replace("000000000000", "111122223333")},
             ("AccessDeniedException", "DEPENDENCY_ACCESS_DENIED"))):
        with pytest.raises(ClientError) as exc:
            ebs.start_snapshot(VolumeSize=1, **params)
        assert error(exc) == expected, params
