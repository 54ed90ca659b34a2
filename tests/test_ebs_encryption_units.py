"""StartSnapshot's encryption without a service (vbs.controller.ebs.encryption, docs/ebs-direct.md
"Encrypted snapshots"): which of Encrypted, KmsKeyArn and ParentSnapshotId go together, which KMS keys a
tenant may name, the data key a new snapshot gets (a new one, its parent's, or none), what StartSnapshot
answers as KmsKeyArn, and how a copy of a snapshot encrypted over plaintext blocks is encrypted
(vbs.controller.auth.encryption.key_for_copy, which EC2 CreateVolume and CopySnapshot use too)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import UNIT_DATABASES, fresh_database
from vbs.controller.auth import encryption
from vbs.controller.auth.keys import MasterKey
from vbs.controller.db import Snapshot, VolumeKey
from vbs.controller.ebs.api import _start_request
from vbs.controller.ebs.encryption import check_combination, kms_key_arn, snapshot_key, usable_kms_key
from vbs.controller.ebs.errors import AccessDenied, Validation
from vbs.controller.ebs.writes import StartRequest

pytestmark = pytest.mark.unit

PARENT = "snap-0123456789abcdef0"
ARN = "arn:aws:kms:us-east-1:000000000000:key/1234abcd-12ab-34cd-56ef-1234567890ab"


@pytest.mark.parametrize(("encrypted", "arn", "parent"), [
    (None, None, None), (False, None, None), (True, None, None), (True, ARN, None), (None, None, PARENT),
])
def test_what_aws_accepts(encrypted: bool | None, arn: str | None, parent: str | None) -> None:
    check_combination(encrypted, arn, parent)


@pytest.mark.parametrize(("encrypted", "arn", "parent", "said"), [
    (True, None, PARENT, "ParentSnapshotId and Encrypted"),
    (False, None, PARENT, "ParentSnapshotId and Encrypted"),
    (None, ARN, PARENT, "ParentSnapshotId and KmsKeyArn"),
    (None, ARN, None, "requires the parameter Encrypted"),
    (False, ARN, None, "requires the parameter Encrypted"),
    (True, "alias/aws/ebs", None, "Invalid KmsKeyArn"),
    (True, "arn:aws:kms:us-east-1:000000000000:alias/backups", None, "Invalid KmsKeyArn"),
    (True, ARN + " ", None, "Invalid KmsKeyArn"),
])
def test_what_aws_refuses_is_a_validation_exception(encrypted: bool | None, arn: str | None, parent: str | None,
                                                    said: str) -> None:
    with pytest.raises(Validation) as exc:
        check_combination(encrypted, arn, parent)
    assert said in exc.value.message and exc.value.reason == "INVALID_PARAMETER_VALUE"


def test_the_request_body_carries_encryption_and_a_plain_requests_digest_is_unchanged() -> None:
    plain = _start_request(json.dumps({"VolumeSize": 1, "ClientToken": "t"}).encode())
    assert (plain.encrypted, plain.kms_key_arn) == (None, None)
    before = StartRequest(volume_size_gib=1, parent_snapshot_id=None, tags={}, description="", client_token="t",
                          timeout_min=60)
    assert plain.digest() == before.digest()  # a client token used before an upgrade still answers
    asked = _start_request(json.dumps({"VolumeSize": 1, "Encrypted": True, "KmsKeyArn": ARN}).encode())
    assert (asked.encrypted, asked.kms_key_arn) == (True, ARN)
    assert asked.digest() != plain.digest()
    with pytest.raises(Validation):
        _start_request(json.dumps({"VolumeSize": 1, "Encrypted": True, "ParentSnapshotId": PARENT}).encode())
    with pytest.raises(Validation):  # an empty ARN is no ARN (botocore's model: at least 1 character)
        _start_request(json.dumps({"VolumeSize": 1, "Encrypted": True, "KmsKeyArn": ""}).encode())


def test_a_tenant_names_only_keys_of_its_own_account_in_this_region() -> None:
    assert usable_kms_key(ARN, "default", "us-east-1") == ARN
    own = "arn:aws:kms:us-east-1:acme:key/k1"
    check_combination(True, own, None)
    assert usable_kms_key(own, "acme", "us-east-1") == own
    for arn, tenant, region in ((ARN, "acme", "us-east-1"), (own, "default", "us-east-1"),
                                (ARN.replace("000000000000", "111122223333"), "default", "us-east-1"),
                                (ARN, "default", "eu-west-1")):
        with pytest.raises(AccessDenied) as exc:
            usable_kms_key(arn, tenant, region)
        assert exc.value.reason == "DEPENDENCY_ACCESS_DENIED" and exc.value.status == 403


@pytest.fixture(params=UNIT_DATABASES)
def svc(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    db = fresh_database(request.param, request, tmp_path / "db")
    return SimpleNamespace(db=db, cfg=SimpleNamespace(region="us-east-1"), master_key=MasterKey(tmp_path / "master"))


def parent(key_id: str | None, *, plain_data: bool) -> Snapshot:
    return Snapshot(id=PARENT, key_id=key_id, plain_data=plain_data)


def test_a_new_snapshot_gets_a_new_key_its_parents_or_none(svc: Any) -> None:
    with svc.db.session() as s:
        assert snapshot_key(s, svc, "default", encrypted=None, kms_key_arn=None, parent=None) is None
        assert snapshot_key(s, svc, "default", encrypted=False, kms_key_arn=None, parent=None) is None
        default = snapshot_key(s, svc, "default", encrypted=True, kms_key_arn=None, parent=None)
        named = snapshot_key(s, svc, "default", encrypted=True, kms_key_arn=ARN, parent=None)
        assert default is not None and named is not None and default != named
        s.flush()
        assert encryption.kms_key_ids(s, {default, named}) == {default: "alias/aws/ebs", named: ARN}
        assert kms_key_arn(s, svc, "default", default) == "arn:aws:kms:us-east-1:000000000000:alias/aws/ebs"
        assert kms_key_arn(s, svc, "default", named) == ARN
        # A child is encrypted as its parent: under the same key, or plain.
        assert snapshot_key(s, svc, "default", encrypted=None, kms_key_arn=None,
                            parent=parent(named, plain_data=True)) == named
        assert snapshot_key(s, svc, "default", encrypted=None, kms_key_arn=None,
                            parent=parent(None, plain_data=False)) is None
        with pytest.raises(Validation) as exc:  # an encrypted volume's snapshot is a LUKS container
            snapshot_key(s, svc, "default", encrypted=None, kms_key_arn=None, parent=parent(named, plain_data=False))
        assert exc.value.reason == "INVALID_SNAPSHOT_ID"
        with pytest.raises(AccessDenied):
            snapshot_key(s, svc, "acme", encrypted=True, kms_key_arn=ARN, parent=None)
        assert s.query(VolumeKey).count() == 2  # a refused start made no key


def test_a_copy_of_a_snapshot_encrypted_over_plaintext_is_encrypted_as_it_is_written(svc: Any) -> None:
    with svc.db.session() as s:
        key = encryption.new_key(s, svc.master_key, ARN)
        s.flush()
        copy = encryption.key_for_copy
        # Written through StartSnapshot: the copy (a volume, a snapshot copy) is encrypted under the same key,
        # or the one asked for, from plain data.
        assert copy(s, svc.master_key, key, encrypted=False, kms_key_id=None, source_plain=True) == (key, True, None)
        assert copy(s, svc.master_key, key, encrypted=True, kms_key_id=ARN, source_plain=True) == (key, True, None)
        other = copy(s, svc.master_key, key, encrypted=True, kms_key_id="alias/other", source_plain=True)
        assert other.key_id not in (None, key) and (other.rewrite, other.source_key_id) == (True, None)
        # A LUKS container: a clone keeps it; another key re-encrypts it, opened with the source's.
        assert copy(s, svc.master_key, key, encrypted=False, kms_key_id=None) == (key, False, None)
        again = copy(s, svc.master_key, key, encrypted=True, kms_key_id="alias/other")
        assert again.key_id not in (None, key) and (again.rewrite, again.source_key_id) == (True, key)
        # Plain: encrypted under a new key when asked, else plain.
        assert copy(s, svc.master_key, None, encrypted=False, kms_key_id=None) == (None, False, None)
        fresh = copy(s, svc.master_key, None, encrypted=True, kms_key_id=None)
        assert fresh.key_id is not None and (fresh.rewrite, fresh.source_key_id) == (True, None)


def test_a_block_of_an_encrypted_volumes_snapshot_is_made_of_the_two_container_blocks_it_spans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vbs.controller.ebs import luks_reads
    from vbs.qemu.luks1 import Header

    offset = 4040 * 512  # QEMU's payload offset: 3.9 blocks of 512 KiB into the container
    header = Header("sha256", offset, 64, b"", b"", 1, ())
    monkeypatch.setattr(luks_reads, "_head", lambda svc, snap, key: (header, b""))
    snap = Snapshot(id=PARENT, volume_size_gib=1, key_id="vk-1", plain_data=False)
    assert luks_reads.is_container(snap) and not luks_reads.is_container(Snapshot(key_id="vk-1", plain_data=True))
    # Container blocks 0-3 hold the header and block 0's head; the volume's block 1 lies in blocks 4 and 5.
    got = luks_reads.payload_blocks(Any, snap, {0: "h0", 1: "h1", 3: "c3", 5: "c5"}, Any)
    assert got == {0: "c3+0", 1: "0+c5", 2: "c5+0"}
    last = 2048 - 1  # the volume's last block ends in the container's last
    assert luks_reads.payload_blocks(Any, snap, {2051: "end"}, Any) == {last: "0+end"}
