"""The Recycle Bin against a real ``vbs up`` whose Recycle Bin "day" lasts two seconds
(``recycle_bin_day_s``), driven by boto3's own ``rbin`` and ``ec2`` clients, the REST routes and the CLI:
retention rules (made, listed a page at a time, changed, tagged, locked, unlocked after their delay,
deleted), and deletes they match: the snapshot and the volume vanish from every describe and use, are
listed in the bin, are restored and used again; those whose retention ends are really deleted (their store
manifest and pool file gone, on disk)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.conftest import Vbs, VbsUp, wait_until
from vbs.snapshot_store import DirStore
from vbs.snapshot_store.manifests import find_manifest

pytestmark = pytest.mark.integration

DAY_S = 2  # one Recycle Bin "day" of this install
MIB = 1 << 20


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    tmp: Path = tmp_path_factory.mktemp("rbin")
    up = VbsUp(tmp / "var", tmp / "up.log", env={"VBS_CONTROLLER_RECYCLE_BIN_DAY_S": str(DAY_S)})
    try:
        yield up.start()
    finally:
        up.stop()


def rbin_client(vbs: Vbs) -> Any:
    return boto3.client("rbin", endpoint_url=vbs.endpoint, region_name="us-east-1",
                        aws_access_key_id=vbs.key.access_key_id, aws_secret_access_key=vbs.key.secret_access_key,
                        config=Config(retries={"max_attempts": 1}))


def error(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, str | None]:
    return str(exc.value.response["Error"]["Code"]), exc.value.response.get("Reason")


def days(n: int) -> dict[str, Any]:
    return {"RetentionPeriodValue": n, "RetentionPeriodUnit": "DAYS"}


def test_rules_are_made_listed_changed_tagged_and_refused_as_aws_refuses(vbs: Vbs) -> None:
    rbin = rbin_client(vbs)
    made = rbin.create_rule(ResourceType="EBS_SNAPSHOT", RetentionPeriod=days(10), Description="team snapshots",
                            ResourceTags=[{"ResourceTagKey": "team", "ResourceTagValue": "db"}],
                            Tags=[{"Key": "owner", "Value": "ops"}])
    rule_id = made["Identifier"]
    assert len(rule_id) == 11 and rule_id.isalnum() and made["Status"] == "available"
    assert made["RuleArn"] == f"arn:aws:rbin:us-east-1:000000000000:rule/{rule_id}"
    assert made["LockState"] == "unlocked" and made["Tags"] == [{"Key": "owner", "Value": "ops"}]
    got = rbin.get_rule(Identifier=rule_id)
    assert got["RetentionPeriod"] == days(10) and got["ResourceTags"] == [
        {"ResourceTagKey": "team", "ResourceTagValue": "db"}] and got["Description"] == "team snapshots"
    second = rbin.create_rule(ResourceType="EBS_SNAPSHOT", RetentionPeriod=days(1))["Identifier"]
    # Listed a page at a time with boto3's own paginator; the other type's rules are not listed.
    pages = list(rbin.get_paginator("list_rules").paginate(ResourceType="EBS_SNAPSHOT",
                                                           PaginationConfig={"PageSize": 1}))
    assert [r["Identifier"] for p in pages for r in p["Rules"]] == sorted([rule_id, second]) and len(pages) == 2
    assert rbin.list_rules(ResourceType="EBS_VOLUME")["Rules"] == []
    assert [r["Identifier"] for r in rbin.list_rules(
        ResourceType="EBS_SNAPSHOT", ResourceTags=[{"ResourceTagKey": "team", "ResourceTagValue": "db"}])["Rules"]
            ] == [rule_id]
    changed = rbin.update_rule(Identifier=rule_id, RetentionPeriod=days(20), Description="longer")
    assert changed["RetentionPeriod"] == days(20) and changed["Description"] == "longer"
    # The rule's own tags.
    arn = made["RuleArn"]
    rbin.tag_resource(ResourceArn=arn, Tags=[{"Key": "cost", "Value": "42"}])
    rbin.untag_resource(ResourceArn=arn, TagKeys=["owner"])
    assert rbin.list_tags_for_resource(ResourceArn=arn)["Tags"] == [{"Key": "cost", "Value": "42"}]
    # Refusals, each with AWS's code and reason, nothing made or changed.
    with pytest.raises(ClientError) as exc:
        rbin.create_rule(ResourceType="EC2_IMAGE", RetentionPeriod=days(1))
    assert error(exc) == ("ValidationException", "INVALID_PARAMETER_VALUE")
    assert "no machine images" in str(exc.value)
    with pytest.raises(ClientError) as exc:  # exclusions belong to region-level rules
        rbin.create_rule(ResourceType="EBS_VOLUME", RetentionPeriod=days(1),
                         ResourceTags=[{"ResourceTagKey": "a"}], ExcludeResourceTags=[{"ResourceTagKey": "b"}])
    assert error(exc)[0] == "ValidationException"
    with pytest.raises(ClientError) as exc:
        rbin.create_rule(ResourceType="EBS_VOLUME", RetentionPeriod=days(3651))
    assert error(exc)[0] == "ValidationException"
    with pytest.raises(ClientError) as exc:
        rbin.update_rule(Identifier=rule_id, ResourceType="EBS_VOLUME")
    assert error(exc)[0] == "ValidationException"
    with pytest.raises(ClientError) as exc:
        rbin.get_rule(Identifier="a" * 11)
    assert error(exc) == ("ResourceNotFoundException", "RULE_NOT_FOUND")
    with pytest.raises(ClientError) as exc:
        rbin.get_rule(Identifier="bad!")
    assert error(exc)[0] == "ValidationException"
    with pytest.raises(ClientError) as exc:
        rbin.list_rules(ResourceType="EBS_SNAPSHOT", NextToken="not-a-token")
    assert error(exc) == ("ValidationException", "INVALID_PAGE_TOKEN")
    assert rbin.list_rules(ResourceType="EBS_VOLUME")["Rules"] == []
    # A client that signs for another region is refused.
    other_region = boto3.client("rbin", endpoint_url=vbs.endpoint, region_name="us-east-2",
                              aws_access_key_id=vbs.key.access_key_id,
                              aws_secret_access_key=vbs.key.secret_access_key,
                              config=Config(retries={"max_attempts": 1}))
    with pytest.raises(ClientError) as exc:
        other_region.get_rule(Identifier=rule_id)
    assert error(exc)[0] == "AccessDeniedException"
    rbin.delete_rule(Identifier=second)
    rbin.delete_rule(Identifier=rule_id)
    assert rbin.list_rules(ResourceType="EBS_SNAPSHOT")["Rules"] == []


def test_a_locked_rule_is_deleted_by_nobody_until_its_unlock_delay_has_passed(vbs: Vbs) -> None:
    rbin = rbin_client(vbs)
    tagged = rbin.create_rule(ResourceType="EBS_VOLUME", RetentionPeriod=days(1),
                              ResourceTags=[{"ResourceTagKey": "x"}])["Identifier"]
    with pytest.raises(ClientError) as exc:  # only region-level rules lock
        rbin.lock_rule(Identifier=tagged, LockConfiguration={"UnlockDelay": {"UnlockDelayValue": 7,
                                                                             "UnlockDelayUnit": "DAYS"}})
    assert error(exc)[0] == "ValidationException"
    rbin.delete_rule(Identifier=tagged)
    rule = rbin.create_rule(ResourceType="EBS_VOLUME", RetentionPeriod=days(1),
                            ExcludeResourceTags=[{"ResourceTagKey": "rbin-test", "ResourceTagValue": "any"}],
                            LockConfiguration={"UnlockDelay": {"UnlockDelayValue": 7, "UnlockDelayUnit": "DAYS"}})
    rule_id = rule["Identifier"]
    assert rule["LockState"] == "locked" and rule["LockConfiguration"]["UnlockDelay"]["UnlockDelayValue"] == 7
    for refused in (lambda: rbin.delete_rule(Identifier=rule_id),
                    lambda: rbin.update_rule(Identifier=rule_id, RetentionPeriod=days(2)),
                    lambda: rbin.lock_rule(Identifier=rule_id, LockConfiguration={
                        "UnlockDelay": {"UnlockDelayValue": 8, "UnlockDelayUnit": "DAYS"}})):
        with pytest.raises(ClientError) as exc:
            refused()
        assert error(exc) == ("ConflictException", "INVALID_RULE_STATE")
    assert rbin.update_rule(Identifier=rule_id, Description="kept")["Description"] == "kept"
    assert [r["LockState"] for r in rbin.list_rules(ResourceType="EBS_VOLUME", LockState="locked")["Rules"]] == [
        "locked"]
    unlocking = rbin.unlock_rule(Identifier=rule_id)
    assert unlocking["LockState"] == "pending_unlock"
    assert (unlocking["LockEndTime"] - rbin.get_rule(Identifier=rule_id)["LockEndTime"]).total_seconds() == 0
    with pytest.raises(ClientError) as exc:  # still locked during its unlock delay
        rbin.delete_rule(Identifier=rule_id)
    assert error(exc)[0] == "ConflictException"
    wait_until(lambda: rbin.get_rule(Identifier=rule_id)["LockState"] == "unlocked", timeout=7 * DAY_S + 60,
               interval=1, what="the unlock delay's end")
    rbin.delete_rule(Identifier=rule_id)
    assert rbin.list_rules(ResourceType="EBS_VOLUME")["Rules"] == []


def _volume_with_data(vbs: Vbs, tags: dict[str, str]) -> tuple[str, str]:
    vol = vbs.create_volume(size_gib=1, tags=tags)["volume_id"]
    vbs.wait_volume(vol, "available")
    data = os.urandom(4 * MIB)
    with open(vbs.pool / "volumes" / f"{vol}.raw", "r+b") as f:
        f.write(data)
    return str(vol), hashlib.sha256(data).hexdigest()


def _snapshot(vbs: Vbs, vol: str, tags: dict[str, str]) -> str:
    r = vbs.http.post("/v1/snapshots", json={"volume_id": vol, "tags": tags})
    assert r.status_code == 200, r.text
    snap = r.json()["snapshot_id"]
    vbs.wait_snapshot(snap, "completed", timeout=120)
    return str(snap)


def _not_found(call: Any) -> str:
    with pytest.raises(ClientError) as exc:
        call()
    return error(exc)[0]


def test_deletes_a_rule_matches_go_to_the_bin_come_back_or_are_freed_when_retention_ends(vbs: Vbs) -> None:
    rbin, ec2 = rbin_client(vbs), vbs.ec2()
    made = [rbin.create_rule(ResourceType="EBS_SNAPSHOT", RetentionPeriod=days(300),
                             ResourceTags=[{"ResourceTagKey": "bin", "ResourceTagValue": "long"}]),
            rbin.create_rule(ResourceType="EBS_SNAPSHOT", RetentionPeriod=days(15),
                             ResourceTags=[{"ResourceTagKey": "bin", "ResourceTagValue": "short"}]),
            rbin.create_rule(ResourceType="EBS_VOLUME", RetentionPeriod=days(300),  # every volume but …
                             ExcludeResourceTags=[{"ResourceTagKey": "bin", "ResourceTagValue": "short"},
                                                  {"ResourceTagKey": "bin", "ResourceTagValue": "none"}]),
            rbin.create_rule(ResourceType="EBS_VOLUME", RetentionPeriod=days(15),
                             ResourceTags=[{"ResourceTagKey": "bin", "ResourceTagValue": "short"}])]
    kept_vol, kept_digest = _volume_with_data(vbs, {"bin": "long"})
    gone_vol, _ = _volume_with_data(vbs, {"bin": "short"})
    plain_vol, _ = _volume_with_data(vbs, {"bin": "none"})
    kept_snap = _snapshot(vbs, kept_vol, {"bin": "long", "Name": "keep me"})
    gone_snap = _snapshot(vbs, gone_vol, {"bin": "short"})
    plain_snap = _snapshot(vbs, plain_vol, {})
    locked_snap = _snapshot(vbs, plain_vol, {"bin": "long"})
    manifests = vbs.data_dir / "snapshots" / "manifests"
    assert (manifests / gone_snap).is_file()

    # -- a locked snapshot is refused deletion before any rule is asked ----------------------------------------
    ec2.lock_snapshot(SnapshotId=locked_snap, LockMode="governance", LockDuration=1)
    assert _not_found(lambda: ec2.delete_snapshot(SnapshotId=locked_snap)) == "SnapshotLocked"
    ec2.unlock_snapshot(SnapshotId=locked_snap)

    # -- the deletes: those a rule matches go to the bin, the others are deleted ---------------------------------
    with pytest.raises(ClientError) as exc:
        ec2.delete_snapshot(SnapshotId=kept_snap, DryRun=True)
    assert error(exc)[0] == "DryRunOperation"
    for snap in (kept_snap, gone_snap, plain_snap):
        ec2.delete_snapshot(SnapshotId=snap)
    # A snapshot in the bin stays the parent the next upload of its volume is incremental against.
    child = _snapshot(vbs, kept_vol, {})
    manifest = find_manifest(DirStore(vbs.data_dir / "snapshots"), child)
    assert manifest is not None and manifest.parent_snapshot_id == kept_snap
    r = vbs.http.delete(f"/v1/volumes/{kept_vol}")  # REST and EC2 alike
    assert r.status_code == 200 and r.json()["status"] == "recoverable", r.text
    ec2.delete_volume(VolumeId=gone_vol)
    ec2.delete_volume(VolumeId=plain_vol)
    wait_until(lambda: not (vbs.pool / "volumes" / f"{plain_vol}.raw").exists()
               and not (manifests / plain_snap).exists(), timeout=120, what="the unmatched deletes")

    # -- hidden from every describe and every use ---------------------------------------------------------------
    for snap in (kept_snap, gone_snap):
        assert _not_found(lambda s=snap: ec2.describe_snapshots(SnapshotIds=[s])) == "InvalidSnapshot.NotFound"
        assert vbs.http.get(f"/v1/snapshots/{snap}").status_code == 404
        assert _not_found(lambda s=snap: ec2.create_volume(SnapshotId=s, AvailabilityZone="us-east-1a")
                          ) == "InvalidSnapshot.NotFound"
        assert _not_found(lambda s=snap: ec2.create_tags(Resources=[s], Tags=[{"Key": "k", "Value": "v"}])
                          ) == "InvalidSnapshot.NotFound"
    for vol in (kept_vol, gone_vol):
        assert _not_found(lambda v=vol: ec2.describe_volumes(VolumeIds=[v])) == "InvalidVolume.NotFound"
        assert _not_found(lambda v=vol: ec2.create_snapshot(VolumeId=v)) == "InvalidVolume.NotFound"
        assert _not_found(lambda v=vol: ec2.delete_volume(VolumeId=v)) == "InvalidVolume.NotFound"
    listed = {s["SnapshotId"] for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]}
    assert not listed & {kept_snap, gone_snap}
    shown = {v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]}
    shown |= {v["VolumeId"] for v in ec2.describe_volumes(Filters=[{"Name": "status", "Values": ["deleted"]}])[
        "Volumes"]}
    assert not shown & {kept_vol, gone_vol}
    tagged = {t["ResourceId"] for t in ec2.describe_tags(Filters=[{"Name": "key", "Values": ["bin"]}])["Tags"]}
    assert not tagged & {kept_snap, gone_snap, kept_vol, gone_vol}

    # -- listed in the bin, with AWS's fields and pages -----------------------------------------------------------
    with pytest.raises(ClientError) as exc:
        ec2.list_snapshots_in_recycle_bin(DryRun=True)
    assert error(exc)[0] == "DryRunOperation"
    in_bin = {s["SnapshotId"]: s for s in ec2.list_snapshots_in_recycle_bin()["Snapshots"]}
    assert set(in_bin) == {kept_snap, gone_snap}
    assert in_bin[kept_snap]["VolumeId"] == kept_vol
    kept_for = in_bin[kept_snap]["RecycleBinExitTime"] - in_bin[kept_snap]["RecycleBinEnterTime"]
    assert kept_for.total_seconds() == 300 * DAY_S  # the longest matching rule's retention
    gone_for = in_bin[gone_snap]["RecycleBinExitTime"] - in_bin[gone_snap]["RecycleBinEnterTime"]
    assert gone_for.total_seconds() == 15 * DAY_S
    assert [s["SnapshotId"] for s in ec2.list_snapshots_in_recycle_bin(SnapshotIds=[gone_snap])["Snapshots"]] == [
        gone_snap]
    vols = {v["VolumeId"]: v for v in ec2.list_volumes_in_recycle_bin()["Volumes"]}
    assert set(vols) == {kept_vol, gone_vol}
    assert vols[kept_vol]["Size"] == 1 and vols[kept_vol]["State"] == "recoverable"
    paged = list(ec2.get_paginator("list_snapshots_in_recycle_bin").paginate(PaginationConfig={"PageSize": 5}))
    assert {s["SnapshotId"] for p in paged for s in p["Snapshots"]} == {kept_snap, gone_snap}
    # Another tenant sees none of it: not the bin, not the rules.
    key = vbs.http.post("/v1/keys", json={"tenant": "bob", "role": "user"}).json()
    bob = vbs.ec2(key["access_key_id"], key["secret_access_key"])
    bob_rbin = boto3.client("rbin", endpoint_url=vbs.endpoint, region_name="us-east-1",
                            aws_access_key_id=key["access_key_id"], aws_secret_access_key=key["secret_access_key"],
                            config=Config(retries={"max_attempts": 1}))
    assert bob.list_snapshots_in_recycle_bin()["Snapshots"] == [] and bob.list_volumes_in_recycle_bin()["Volumes"] == []
    assert _not_found(lambda: bob.restore_snapshot_from_recycle_bin(SnapshotId=kept_snap)) == "InvalidSnapshot.NotFound"
    assert _not_found(lambda: bob_rbin.get_rule(Identifier=made[0]["Identifier"])) == "ResourceNotFoundException"
    assert bob_rbin.list_rules(ResourceType="EBS_VOLUME")["Rules"] == []
    # The data stays while they are in the bin, and the reconciler finds no orphan in it.
    assert (manifests / gone_snap).is_file() and (vbs.pool / "volumes" / f"{gone_vol}.raw").is_file()
    r = vbs.http.get("/v1/admin/check")
    assert r.status_code == 200, r.text
    assert not {f["resource_id"] for f in r.json()["findings"]} & {kept_snap, gone_snap, kept_vol, gone_vol}

    # -- restored: back as they were, tags and all, and used again -----------------------------------------------
    restored = ec2.restore_snapshot_from_recycle_bin(SnapshotId=kept_snap)
    assert restored["SnapshotId"] == kept_snap and restored["State"] == "completed" and restored["VolumeSize"] == 1
    [snap] = ec2.describe_snapshots(SnapshotIds=[kept_snap])["Snapshots"]
    assert {t["Key"]: t["Value"] for t in snap["Tags"]} == {"bin": "long", "Name": "keep me"}
    assert ec2.restore_volume_from_recycle_bin(VolumeId=kept_vol)["Return"] is True
    [vol] = ec2.describe_volumes(VolumeIds=[kept_vol])["Volumes"]
    assert vol["State"] == "available" and {"Key": "bin", "Value": "long"} in vol["Tags"]
    made_vol = ec2.create_volume(SnapshotId=kept_snap, AvailabilityZone="us-east-1a")["VolumeId"]
    vbs.wait_volume(made_vol, "available", timeout=120)
    with open(vbs.pool / "volumes" / f"{made_vol}.raw", "rb") as f:
        assert hashlib.sha256(f.read(4 * MIB)).hexdigest() == kept_digest
    with open(vbs.pool / "volumes" / f"{kept_vol}.raw", "rb") as f:
        assert hashlib.sha256(f.read(4 * MIB)).hexdigest() == kept_digest
    again = _snapshot(vbs, kept_vol, {})  # the restored volume is used again
    assert _not_found(lambda: ec2.restore_snapshot_from_recycle_bin(SnapshotId=kept_snap)
                      ) == "InvalidSnapshot.NotFound"  # no longer in the bin

    # -- retention ends: the real delete frees the data -----------------------------------------------------------
    wait_until(lambda: not (manifests / gone_snap).exists() and not (vbs.pool / "volumes" / f"{gone_vol}.raw").exists(),
               timeout=15 * DAY_S + 180, interval=1, what="the end of the short retention")
    assert ec2.list_snapshots_in_recycle_bin()["Snapshots"] == []
    assert ec2.list_volumes_in_recycle_bin()["Volumes"] == []
    wait_until(lambda: vbs.http.get(f"/v1/volumes/{gone_vol}").json().get("status") == "deleted", timeout=60,
               what="the volume's row deleted")
    assert _not_found(lambda: ec2.restore_volume_from_recycle_bin(VolumeId=gone_vol)) == "InvalidVolume.NotFound"
    assert vbs.http.get(f"/v1/snapshots/{gone_snap}").status_code == 404
    for rule in made:
        rbin.delete_rule(Identifier=rule["Identifier"])
    for snap_id in (again, child, kept_snap, locked_snap):
        ec2.delete_snapshot(SnapshotId=snap_id)  # no rule left: really deleted
    wait_until(lambda: not (manifests / kept_snap).exists(), timeout=120, what="the restored snapshot deleted")


def test_the_cli_and_the_rest_routes_drive_the_same_rules_and_bin(vbs: Vbs) -> None:
    rule = vbs.cli("create-rule", "--resource-type", "EBS_SNAPSHOT", "--retention-days", "300",
                   "--resource-tag", "cli=yes", "--description", "from the CLI", "--tag", "owner=me")
    assert rule["resource_tags"] == [{"key": "cli", "value": "yes"}] and rule["tags"] == {"owner": "me"}
    vol_rule = vbs.cli("create-rule", "--resource-type", "EBS_VOLUME", "--retention-days", "300",
                       "--resource-tag", "cli")  # the key, whatever its value
    assert [r["rule_id"] for r in vbs.cli("list-rules", "--resource-type", "EBS_SNAPSHOT")["rules"]] == [
        rule["rule_id"]]
    assert vbs.cli("update-rule", rule["rule_id"], "--description", "changed")["description"] == "changed"
    assert vbs.cli("get-rule", rule["rule_id"])["retention_days"] == 300
    assert vbs.cli("tag-rule", rule["rule_id"], "--tag", "cost=1") == {"tags": {"owner": "me", "cost": "1"}}
    assert vbs.cli("untag-rule", rule["rule_id"], "--key", "owner") == {"tags": {"cost": "1"}}
    refused = vbs.cli("lock-rule", rule["rule_id"], "--unlock-delay-days", "7", check=False)
    assert refused.returncode != 0 and "region-level" in refused.stderr
    r = vbs.http.post("/v1/recycle-bin/rules", json={"resource_type": "EC2_IMAGE", "retention_days": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "ValidationException", r.text
    r = vbs.http.post("/v1/recycle-bin/rules", json={"resource_type": "EBS_VOLUME", "retention_days": 0})
    assert r.status_code in (400, 422), r.text
    assert vbs.http.get("/v1/recycle-bin/rules/zzzzzzzzzzz").status_code == 404

    vol = vbs.create_volume(size_gib=1, tags={"cli": "anything"})["volume_id"]
    vbs.wait_volume(vol, "available")
    snap = _snapshot(vbs, vol, {"cli": "yes"})
    assert vbs.cli("delete-snapshot", snap, "--wait")["status"] == "recoverable"  # in the bin: no wait
    assert vbs.cli("delete-volume", vol, "--wait")["status"] == "recoverable"
    assert [s["snapshot_id"] for s in vbs.cli("list-snapshots-in-recycle-bin")["snapshots"]] == [snap]
    [in_bin] = vbs.cli("list-volumes-in-recycle-bin", vol)["volumes"]
    assert in_bin["volume_id"] == vol and in_bin["size_gib"] == 1
    assert vbs.http.get(f"/v1/volumes/{vol}").status_code == 404
    assert vbs.cli("restore-snapshot-from-recycle-bin", snap) == {"resource_id": snap, "status": "completed"}
    assert vbs.cli("restore-volume-from-recycle-bin", vol)["status"] == "available"
    assert vbs.snapshot(snap)["status"] == "completed" and vbs.volume(vol)["tags"] == {"cli": "anything"}
    r = vbs.http.post(f"/v1/recycle-bin/volumes/{vol}/restore")
    assert r.status_code == 404, r.text  # not in the bin any more

    # A locked rule through the CLI: refused deletion until its unlock delay has passed.
    locked = vbs.cli("create-rule", "--resource-type", "EBS_SNAPSHOT", "--retention-days", "1", "--exclude-tag",
                     "cli=no", "--lock-unlock-delay-days", "7")
    assert locked["lock_state"] == "locked"
    assert vbs.cli("delete-rule", locked["rule_id"], check=False).returncode != 0
    assert vbs.cli("unlock-rule", locked["rule_id"])["lock_state"] == "pending_unlock"
    wait_until(lambda: vbs.cli("get-rule", locked["rule_id"])["lock_state"] == "unlocked",
               timeout=7 * DAY_S + 60, interval=1, what="the unlock delay's end")
    for rule_id in (locked["rule_id"], rule["rule_id"], vol_rule["rule_id"]):
        vbs.cli("delete-rule", rule_id)
    assert vbs.cli("list-rules", "--resource-type", "EBS_SNAPSHOT")["rules"] == []
