"""EBS parity found by code written for AWS, through boto3 against a real ``vbs up``: volume-type rules and
the figures describe reports, TagSpecifications without tags refused rather than ignored, Multi-Attach
changed by ModifyVolume, DescribeVolumeAttribute, the snapshots' start-time filter, CopySnapshot, and
snapshots shared between tenants (createVolumePermission)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError

from tests.conftest import Vbs, running_vbs_up, wait_until

ZONE = "us-east-1a"
MIB = 1 << 20
FAST = {"Delay": 0.2, "MaxAttempts": 300}


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    with running_vbs_up(tmp_path_factory.mktemp("parity")) as vbs:
        yield vbs


@pytest.fixture(scope="module")
def ec2(vbs: Vbs) -> Any:
    return vbs.ec2()


@pytest.fixture(scope="module")
def bob(vbs: Vbs) -> Any:
    """A user key of another tenant."""
    key = vbs.http.post("/v1/keys", json={"tenant": "bob", "role": "user"}).json()
    return vbs.ec2(key["access_key_id"], key["secret_access_key"])


def error(call: Callable[..., Any], **params: Any) -> str:
    with pytest.raises(ClientError) as info:
        call(**params)
    return str(info.value.response["Error"]["Code"])


def volume_count(ec2: Any) -> int:
    return sum(len(page["Volumes"]) for page in ec2.get_paginator("describe_volumes").paginate())


def new_volume(ec2: Any, **params: Any) -> dict[str, Any]:
    made: dict[str, Any] = ec2.create_volume(AvailabilityZone=ZONE, **({"Size": 1} | params))
    ec2.get_waiter("volume_available").wait(VolumeIds=[made["VolumeId"]], WaiterConfig=FAST)
    return made


def new_snapshot(ec2: Any, vol_id: str) -> str:
    snap = str(ec2.create_snapshot(VolumeId=vol_id)["SnapshotId"])
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig=FAST)
    return snap


def test_volume_type_rules_refuse_what_ec2_refuses_and_change_nothing(ec2: Any) -> None:
    before = volume_count(ec2)
    refused = [
        ({"Size": 1, "VolumeType": "gp2", "Throughput": 200}, "InvalidParameterCombination"),
        ({"Size": 1, "Throughput": 200}, "InvalidParameterCombination"),  # the default type is gp2
        ({"Size": 10, "VolumeType": "gp3", "MultiAttachEnabled": True}, "InvalidParameterCombination"),
        ({"Size": 10, "VolumeType": "io1"}, "MissingParameter"),
        ({"Size": 10, "VolumeType": "io1", "Iops": 1000}, "InvalidParameterValue"),  # 50 IOPS per GiB at most
        ({"Size": 1, "VolumeType": "gp2", "Iops": 300}, "InvalidParameterCombination"),
        ({"Size": 1, "TagSpecifications": [{"ResourceType": "volume", "Tags": []}]}, "InvalidParameterValue"),
        ({"Size": 1, "KmsKeyId": "alias/aws/ebs"}, "InvalidParameterDependency"),  # KmsKeyId needs Encrypted
    ]
    for params, code in refused:
        assert error(ec2.create_volume, AvailabilityZone=ZONE, **params) == code, params
    assert volume_count(ec2) == before


def test_describe_reports_each_types_nominal_figures(ec2: Any) -> None:
    small, big = new_volume(ec2), new_volume(ec2, Size=100)
    gp3 = new_volume(ec2, VolumeType="gp3")
    io2 = new_volume(ec2, Size=4, VolumeType="io2", Iops=400, MultiAttachEnabled=True)
    found = {v["VolumeId"]: v for v in ec2.describe_volumes(
        VolumeIds=[small["VolumeId"], big["VolumeId"], gp3["VolumeId"], io2["VolumeId"]])["Volumes"]}
    assert small["VolumeType"] == "gp2" and found[small["VolumeId"]]["Iops"] == 100  # 3 per GiB, at least 100
    assert found[big["VolumeId"]]["Iops"] == 300 and "Throughput" not in found[big["VolumeId"]]
    assert (found[gp3["VolumeId"]]["Iops"], found[gp3["VolumeId"]]["Throughput"]) == (3000, 125)
    assert (found[io2["VolumeId"]]["Iops"], found[io2["VolumeId"]]["MultiAttachEnabled"]) == (400, True)


def test_modify_volume_turns_multi_attach_on_and_off_where_ec2_allows_it(ec2: Any) -> None:
    io2 = new_volume(ec2, Size=4, VolumeType="io2", Iops=400)["VolumeId"]
    gp3 = new_volume(ec2, Size=4, VolumeType="gp3")["VolumeId"]
    mod = ec2.modify_volume(VolumeId=io2, MultiAttachEnabled=True)["VolumeModification"]
    assert mod["ModificationState"] == "completed"
    assert ec2.describe_volumes(VolumeIds=[io2])["Volumes"][0]["MultiAttachEnabled"] is True
    ec2.modify_volume(VolumeId=io2, MultiAttachEnabled=False)
    assert ec2.describe_volumes(VolumeIds=[io2])["Volumes"][0]["MultiAttachEnabled"] is False
    assert error(ec2.modify_volume, VolumeId=gp3, MultiAttachEnabled=True) == "InvalidParameterCombination"
    assert error(ec2.modify_volume, VolumeId=gp3, VolumeType="io2") == "MissingParameter"  # io2 needs its IOPS
    # gp3 -> gp2 drops what gp2 does not take
    ec2.modify_volume(VolumeId=gp3, VolumeType="gp2")
    wait_until(lambda: ec2.describe_volumes_modifications(VolumeIds=[gp3])["VolumesModifications"][0][
        "ModificationState"] in ("optimizing", "completed"), 60, what="modification done")
    shown = ec2.describe_volumes(VolumeIds=[gp3])["Volumes"][0]
    assert (shown["VolumeType"], shown["Iops"], shown.get("Throughput")) == ("gp2", 100, None)  # 3 x 4 GiB < 100


def test_describe_volume_attribute(ec2: Any) -> None:
    vol = new_volume(ec2)["VolumeId"]
    assert ec2.describe_volume_attribute(VolumeId=vol, Attribute="autoEnableIO")["AutoEnableIO"] == {"Value": False}
    assert ec2.describe_volume_attribute(VolumeId=vol, Attribute="productCodes")["ProductCodes"] == []
    assert error(ec2.describe_volume_attribute, VolumeId=vol, Attribute="size") == "InvalidParameterValue"
    assert error(ec2.describe_volume_attribute, VolumeId="vol-0123456789abcdef0",
                 Attribute="autoEnableIO") == "InvalidVolume.NotFound"


def test_the_start_time_filter_on_snapshots(ec2: Any) -> None:
    snap = new_snapshot(ec2, new_volume(ec2)["VolumeId"])
    started = ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]["StartTime"]

    def found(value: str) -> bool:
        return snap in {s["SnapshotId"] for s in ec2.describe_snapshots(
            OwnerIds=["self"], Filters=[{"Name": "start-time", "Values": [value]}])["Snapshots"]}

    exact = started.strftime("%Y-%m-%dT%H:%M:%S.") + f"{started.microsecond // 1000:03d}Z"
    assert found(exact) and found(started.strftime("%Y-%m-%dT%H:%M:*")) and found(started.strftime("%Y-%m-*"))
    assert not found((started - timedelta(days=1)).strftime("%Y-%m-%dT*"))
    assert error(ec2.describe_snapshots, Filters=[{"Name": "start-time", "Values": ["yesterday"]}]) \
        == "InvalidParameterValue"


def write_pattern(vbs: Vbs, vol_id: str, seed: bytes) -> bytes:
    """Fill the first MiB of an available volume's pool file; what was written."""
    data = (seed * (MIB // len(seed) + 1))[:MIB]
    fd = os.open(vbs.pool / "volumes" / f"{vol_id}.raw", os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return data


def first_mib(vbs: Vbs, vol_id: str) -> bytes:
    with open(vbs.pool / "volumes" / f"{vol_id}.raw", "rb") as f:
        return f.read(MIB)


def test_copy_snapshot_holds_the_sources_data_and_outlives_it(vbs: Vbs, ec2: Any) -> None:
    vol = new_volume(ec2)["VolumeId"]
    data = write_pattern(vbs, vol, b"copy-snapshot source ")
    source = new_snapshot(ec2, vol)
    write_pattern(vbs, vol, b"written after the snapshot ")
    copy = ec2.copy_snapshot(SourceSnapshotId=source, SourceRegion="us-east-1", Description="the copy",
                             TagSpecifications=[{"ResourceType": "snapshot", "Tags": [{"Key": "k", "Value": "v"}]}])
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[copy["SnapshotId"]], WaiterConfig=FAST)
    shown = ec2.describe_snapshots(SnapshotIds=[copy["SnapshotId"]])["Snapshots"][0]
    assert (shown["Description"], shown["Tags"], shown["VolumeSize"]) == ("the copy", [{"Key": "k", "Value": "v"}], 1)
    ec2.delete_snapshot(SnapshotId=source)
    restored = new_volume(ec2, SnapshotId=copy["SnapshotId"])["VolumeId"]
    assert first_mib(vbs, restored) == data
    assert error(ec2.copy_snapshot, SourceSnapshotId=copy["SnapshotId"], SourceRegion="eu-west-1") \
        == "InvalidParameterValue"
    assert error(ec2.copy_snapshot, SourceSnapshotId="snap-0123456789abcdef0",
                 SourceRegion="us-east-1") == "InvalidSnapshot.NotFound"


def test_a_snapshot_shared_with_another_tenant(vbs: Vbs, ec2: Any, bob: Any) -> None:
    vol = new_volume(ec2)["VolumeId"]
    data = write_pattern(vbs, vol, b"shared with bob ")
    snap = new_snapshot(ec2, vol)
    # Not shared: bob neither sees nor uses it.
    assert snap not in {s["SnapshotId"] for s in bob.describe_snapshots()["Snapshots"]}
    assert error(bob.create_volume, AvailabilityZone=ZONE, SnapshotId=snap) == "InvalidSnapshot.NotFound"
    assert ec2.describe_snapshot_attribute(SnapshotId=snap, Attribute="createVolumePermission")[
        "CreateVolumePermissions"] == []

    ec2.modify_snapshot_attribute(SnapshotId=snap, Attribute="createVolumePermission",
                                  CreateVolumePermission={"Add": [{"UserId": "bob"}]})
    assert ec2.describe_snapshot_attribute(SnapshotId=snap, Attribute="createVolumePermission")[
        "CreateVolumePermissions"] == [{"UserId": "bob"}]
    seen = {s["SnapshotId"]: s for s in bob.describe_snapshots()["Snapshots"]}
    assert seen[snap]["OwnerId"] == "000000000000"
    assert snap not in {s["SnapshotId"] for s in bob.describe_snapshots(OwnerIds=["self"])["Snapshots"]}
    mine = new_volume(bob, SnapshotId=snap)["VolumeId"]
    assert first_mib(vbs, mine) == data
    copy = bob.copy_snapshot(SourceSnapshotId=snap, SourceRegion="us-east-1")["SnapshotId"]
    bob.get_waiter("snapshot_completed").wait(SnapshotIds=[copy], WaiterConfig=FAST)
    assert bob.describe_snapshots(SnapshotIds=[copy])["Snapshots"][0]["OwnerId"] == "bob"
    # Using is all bob may do with it.
    assert error(bob.delete_snapshot, SnapshotId=snap) == "InvalidSnapshot.NotFound"
    assert error(bob.modify_snapshot_attribute, SnapshotId=snap, Attribute="createVolumePermission",
                 OperationType="add", UserIds=["mallory"]) == "InvalidSnapshot.NotFound"
    assert error(bob.describe_snapshot_attribute, SnapshotId=snap,
                 Attribute="createVolumePermission") == "InvalidSnapshot.NotFound"

    # The older form (OperationType with UserId), the group all, and a reset.
    ec2.modify_snapshot_attribute(SnapshotId=snap, Attribute="createVolumePermission", OperationType="remove",
                                  UserIds=["bob"])
    assert error(bob.create_volume, AvailabilityZone=ZONE, SnapshotId=snap) == "InvalidSnapshot.NotFound"
    ec2.modify_snapshot_attribute(SnapshotId=snap, Attribute="createVolumePermission",
                                  CreateVolumePermission={"Add": [{"Group": "all"}]})
    new_volume(bob, SnapshotId=snap)
    ec2.reset_snapshot_attribute(SnapshotId=snap, Attribute="createVolumePermission")
    assert error(bob.create_volume, AvailabilityZone=ZONE, SnapshotId=snap) == "InvalidSnapshot.NotFound"
    assert error(ec2.modify_snapshot_attribute, SnapshotId=snap, Attribute="createVolumePermission",
                 OperationType="add", UserIds=["Not A Tenant"]) == "InvalidParameterValue"


def test_a_grantee_sees_neither_the_owners_tags_nor_its_volume(vbs: Vbs, ec2: Any) -> None:
    """As on AWS: tags stay their owner's, a shared snapshot does not name the owner's volume to the
    tenant it is shared with, and a copy shows vol-ffffffff (AWS's volume of every copied snapshot)."""
    key = vbs.http.post("/v1/keys", json={"tenant": "carol", "role": "user"}).json()
    carol = vbs.ec2(key["access_key_id"], key["secret_access_key"])
    carol_rest = httpx.Client(base_url=vbs.endpoint, timeout=30,
                              headers={"authorization": f"Bearer {key['access_key_id']}:{key['secret_access_key']}"})
    vol = new_volume(ec2)["VolumeId"]
    snap = new_snapshot(ec2, vol)
    ec2.create_tags(Resources=[snap], Tags=[{"Key": "secret", "Value": "owner-only"}])
    ec2.modify_snapshot_attribute(SnapshotId=snap, Attribute="createVolumePermission",
                                  CreateVolumePermission={"Add": [{"UserId": "carol"}]})
    # The attack: the grantee reads the shared snapshot, by EC2 and REST, and looks for the owner's tags.
    seen = carol.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]
    assert "Tags" not in seen or seen["Tags"] == []
    assert seen["VolumeId"] == "vol-ffffffff"
    listed = {s["SnapshotId"]: s for s in carol.describe_snapshots()["Snapshots"]}
    assert listed[snap].get("Tags", []) == [] and listed[snap]["VolumeId"] == "vol-ffffffff"
    got = carol_rest.get(f"/v1/snapshots/{snap}").json()
    assert got["tags"] == {} and got["volume_id"] == "vol-ffffffff"
    assert all(s["tags"] == {} and s["volume_id"] != vol for s in carol_rest.get("/v1/snapshots?shared=true").json()
               .get("snapshots", []))
    # Filters cannot test the owner's tags or volume either.
    assert carol.describe_snapshots(Filters=[{"Name": "tag:secret", "Values": ["owner-only"]}])["Snapshots"] == []
    assert carol.describe_snapshots(Filters=[{"Name": "volume-id", "Values": [vol]}])["Snapshots"] == []
    assert carol.describe_tags(Filters=[{"Name": "resource-id", "Values": [snap]}])["Tags"] == []
    # A copy the grantee makes does not keep the owner's volume.
    copy = carol.copy_snapshot(SourceSnapshotId=snap, SourceRegion="us-east-1")["SnapshotId"]
    carol.get_waiter("snapshot_completed").wait(SnapshotIds=[copy], WaiterConfig=FAST)
    assert carol.describe_snapshots(SnapshotIds=[copy])["Snapshots"][0]["VolumeId"] == "vol-ffffffff"
    assert carol_rest.get(f"/v1/snapshots/{copy}").json()["volume_id"] == "vol-ffffffff"
    # The owner still sees its own snapshot whole.
    mine = ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]
    assert mine["VolumeId"] == vol and mine["Tags"] == [{"Key": "secret", "Value": "owner-only"}]
    assert [s["SnapshotId"] for s in ec2.describe_snapshots(
        Filters=[{"Name": "volume-id", "Values": [vol]}])["Snapshots"]] == [snap]
    carol_rest.close()
