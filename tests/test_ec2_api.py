"""The EC2 Query API driven by unmodified clients: boto3 and the AWS CLI against a real ``vbs up``.

One ``vbs up`` (controller, storage agent, host agent ``host-1``) and one booted test guest serve the
whole module; the guest is a VBS instance, so AttachVolume puts a real virtio disk into it. Every
action of docs/ec2-api.md is called through botocore's own serializer and parser, errors are
checked by their EC2 code and HTTP status, and the AWS CLI runs as a subprocess with
``--endpoint-url`` and the credentials file ``vbs up`` wrote.
"""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore import UNSIGNED, xform_name
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from tests.conftest import DATABASES, Vbs, VbsUp, database_flags, wait_until
from vbs.controller.ec2.actions import HANDLERS
from vbs.errors import VbsError
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest

REGION = "us-east-1"
ZONE = "us-east-1a"
GIB = 1 << 30
NAMESPACE = "http://ec2.amazonaws.com/doc/2016-11-15/"
UNKNOWN_VOLUME = "vol-0123456789abcdef0"
UNKNOWN_SNAPSHOT = "snap-0123456789abcdef0"
UNKNOWN_INSTANCE = "i-0123456789abcdef0"
FAST = {"Delay": 0.25, "MaxAttempts": 240}  # boto3 waiters poll every 15 s by default
PAGE_VOLUMES = 250

Ec2Client = Any  # boto3's generated client class has no importable name

# The whole module runs twice: metadata in SQLite, then in PostgreSQL.
pytestmark = pytest.mark.parametrize("metadata_db", DATABASES, indirect=True, scope="module")


class Ec2Env:
    """The module's VBS install, its guest (a VBS instance) and clients for it."""

    def __init__(self, vbs: Vbs, guest: TestGuest, tmp: Path) -> None:
        self.vbs, self.guest, self.tmp = vbs, guest, tmp
        self.ec2: Ec2Client = client(vbs.endpoint, vbs.key.access_key_id, vbs.key.secret_access_key)
        self.instance_id = ""
        self.aws_config = tmp / "aws-config"
        self.aws_config.write_text(f"[default]\nregion = {REGION}\noutput = json\n")

    def cli_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_SHARED_CREDENTIALS_FILE=str(self.vbs.data_dir / "credentials"),
                   AWS_CONFIG_FILE=str(self.aws_config), AWS_EC2_METADATA_DISABLED="true", AWS_PAGER="")
        return env

    def aws(self, *args: str, check: bool = True, endpoint_flag: bool = True) -> Any:
        """``aws ec2 ARGS --endpoint-url …``: the parsed JSON output, or the process when ``check`` is False.

        Without ``endpoint_flag`` the endpoint comes from ``AWS_ENDPOINT_URL_EC2`` instead.
        """
        aws = Path(sys.executable).with_name("aws")
        env = self.cli_env()
        argv = [sys.executable, str(aws), "ec2", *args]
        if endpoint_flag:
            argv += ["--endpoint-url", self.vbs.endpoint]
        else:
            env["AWS_ENDPOINT_URL_EC2"] = self.vbs.endpoint
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        if not check:
            return proc
        assert proc.returncode == 0, f"aws ec2 {' '.join(args)}: {proc.stderr}"
        return json.loads(proc.stdout) if proc.stdout.strip() else None

    # -- small helpers ------------------------------------------------------------------------------

    def new_volume(self, size: int = 1, wait: bool = True, **params: Any) -> str:
        vol_id = str(self.ec2.create_volume(Size=size, AvailabilityZone=ZONE, **params)["VolumeId"])
        if wait:
            self.ec2.get_waiter("volume_available").wait(VolumeIds=[vol_id], WaiterConfig=FAST)
        return vol_id

    def volume(self, vol_id: str) -> dict[str, Any]:
        return self.ec2.describe_volumes(VolumeIds=[vol_id])["Volumes"][0]  # type: ignore[no-any-return]

    def attachment_state(self, vol_id: str) -> str | None:
        atts = self.volume(vol_id)["Attachments"]
        return atts[0]["State"] if atts else None

    def wait_attached(self, vol_id: str) -> str:
        """Wait for the attachment to be ``attached`` and the guest to see the disk; its device name there."""
        wait_until(lambda: self.attachment_state(vol_id) == "attached", 60, what=f"{vol_id} attached")
        return self.guest.wait_for_disk(virtio_serial(vol_id), 30)

    def detach_quietly(self, vol_id: str) -> None:
        """Teardown: detach ``vol_id`` if it is still attached, and wait until it is available."""
        try:
            if self.attachment_state(vol_id) in ("attaching", "attached", "busy"):
                wait_until(lambda: self.attachment_state(vol_id) != "attaching", 60, what="attach finished")
                self.ec2.detach_volume(VolumeId=vol_id, Force=True)
            self.ec2.get_waiter("volume_available").wait(VolumeIds=[vol_id], WaiterConfig=FAST)
            self.guest.wait_disk_gone(virtio_serial(vol_id), 30)
        except (ClientError, AssertionError, VbsError):
            pass

    def ids(self, **params: Any) -> set[str]:
        return {v["VolumeId"] for v in self.ec2.describe_volumes(**params)["Volumes"]}


def client(endpoint: str, key_id: str, secret: str, **config: Any) -> Ec2Client:
    # No retries: a retried 5xx would hide what the server answered first.
    cfg = Config(retries={"max_attempts": 0}, **config)
    return boto3.session.Session(aws_access_key_id=key_id, aws_secret_access_key=secret,
                                 region_name=REGION).client("ec2", endpoint_url=endpoint, config=cfg)


def error(call: Callable[..., Any], **params: Any) -> tuple[int, str]:
    """(HTTP status, EC2 error code) of a call that must fail."""
    with pytest.raises(ClientError) as info:
        call(**params)
    answer = info.value.response
    return answer["ResponseMetadata"]["HTTPStatusCode"], answer["Error"]["Code"]


def tags_of(item: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags", [])}


def tag_spec(resource_type: str, **tags: str) -> list[dict[str, Any]]:
    return [{"ResourceType": resource_type, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]


def flt(**filters: str | list[str]) -> list[dict[str, Any]]:
    """EC2 Filters from keywords: ``tag_X`` is ``tag:X`` (but ``tag_key`` is ``tag-key``), ``__`` is ``.``
    and ``_`` is ``-`` (``attachment__instance_id`` is ``attachment.instance-id``)."""
    out = []
    for name, values in filters.items():
        if name.startswith("tag_") and name != "tag_key":
            real = "tag:" + name[4:]
        else:
            real = name.replace("__", ".").replace("_", "-")
        out.append({"Name": real, "Values": [values] if isinstance(values, str) else values})
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, metadata_db: str, request: pytest.FixtureRequest
        ) -> Iterator[Ec2Env]:
    tmp = tmp_path_factory.mktemp("ec2-api")
    image = build_guest()
    up = VbsUp(tmp / "var", tmp / "up.log", extra=database_flags(metadata_db, request))
    guest = TestGuest("vm1", tmp / "guests", image, tmp / "var" / "vms")
    try:
        guest.start()  # boots while vbs up starts; host-1 finds its QMP socket in <data-dir>/vms
        vbs = up.start()
        guest.wait_ready(120)
        e = Ec2Env(vbs, guest, tmp)

        def find_instance() -> str | None:
            for res in e.ec2.describe_instances()["Reservations"]:
                for inst in res["Instances"]:
                    if tags_of(inst).get("Name") == "vm1" and inst["State"]["Name"] == "running":
                        return str(inst["InstanceId"])
            return None

        e.instance_id = wait_until(find_instance, 60, what="instance vm1")
        yield e
    finally:
        guest.stop()
        up.stop()


@pytest.fixture(scope="module")
def page_volumes(env: Ec2Env) -> set[str]:
    """250 volumes tagged batch=page (for pagination), created once for the module."""

    def make(_: int) -> str:
        return str(env.ec2.create_volume(Size=1, AvailabilityZone=ZONE,
                                         TagSpecifications=tag_spec("volume", batch="page"))["VolumeId"])

    with ThreadPoolExecutor(8) as pool:
        made = set(pool.map(make, range(PAGE_VOLUMES)))
    env.ec2.get_waiter("volume_available").wait(Filters=flt(tag_batch="page"), WaiterConfig=FAST)
    return made


# -- protocol: XML, errors, auth ----------------------------------------------------------------------


def signed_post(e: Ec2Env, body: str, secret: str | None = None) -> httpx.Response:
    """A form POST signed with SigV4 by botocore's signer (for what boto3 cannot send: unknown actions)."""
    req = AWSRequest(method="POST", url=e.vbs.endpoint + "/", data=body,
                     headers={"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"})
    SigV4Auth(Credentials(e.vbs.key.access_key_id, secret or e.vbs.key.secret_access_key), "ec2",
              REGION).add_auth(req)
    prepared = req.prepare()
    return httpx.post(e.vbs.endpoint + "/", content=prepared.body, headers=dict(prepared.headers), timeout=30)


def test_answers_are_ec2_xml_in_the_2016_11_15_namespace(env: Ec2Env) -> None:
    r = signed_post(env, "Action=DescribeAvailabilityZones&Version=2016-11-15")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/xml")
    assert f'<DescribeAvailabilityZonesResponse xmlns="{NAMESPACE}">' in r.text
    assert "<requestId>" in r.text and f"<zoneName>{ZONE}</zoneName>" in r.text

    r = signed_post(env, f"Action=DeleteVolume&Version=2016-11-15&VolumeId={UNKNOWN_VOLUME}")
    assert r.status_code == 400
    body = r.text
    assert "<Response><Errors><Error><Code>InvalidVolume.NotFound</Code><Message>" in body
    assert "</Message></Error></Errors><RequestID>" in body and body.rstrip().endswith("</RequestID></Response>")


def test_an_unknown_action_is_invalid_action(env: Ec2Env) -> None:
    r = signed_post(env, "Action=RunInstances&Version=2016-11-15&ImageId=ami-12345678&MinCount=1&MaxCount=1")
    assert r.status_code == 400
    assert "<Code>InvalidAction</Code>" in r.text
    r = signed_post(env, "Action=NoSuchThing&Version=2016-11-15")
    assert r.status_code == 400 and "<Code>InvalidAction</Code>" in r.text


def test_unsigned_and_wrongly_signed_requests_get_auth_failure(env: Ec2Env) -> None:
    ep, key = env.vbs.endpoint, env.vbs.key
    unsigned = client(ep, "x", "y", signature_version=UNSIGNED)
    assert error(unsigned.describe_volumes) == (401, "AuthFailure")
    wrong_secret = client(ep, key.access_key_id, key.secret_access_key[::-1])
    assert error(wrong_secret.describe_volumes) == (401, "AuthFailure")
    assert error(wrong_secret.create_volume, Size=1, AvailabilityZone=ZONE) == (401, "AuthFailure")
    unknown_key = client(ep, "AKIAIOSFODNN7EXAMPLE", key.secret_access_key)
    assert error(unknown_key.describe_availability_zones) == (401, "AuthFailure")

    r = httpx.post(ep + "/", data={"Action": "DescribeVolumes", "Version": "2016-11-15"}, timeout=30)
    assert r.status_code == 401 and "<Code>AuthFailure</Code>" in r.text
    r = signed_post(env, "Action=DescribeVolumes&Version=2016-11-15", secret="not-the-secret")
    assert r.status_code == 401 and "<Code>AuthFailure</Code>" in r.text

    proc = subprocess.run([sys.executable, str(Path(sys.executable).with_name("aws")), "--no-sign-request", "ec2",
                           "describe-volumes", "--endpoint-url", ep], env=env.cli_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "(AuthFailure)" in proc.stderr, proc.stderr


def test_the_credentials_file_vbs_up_wrote_works_with_a_boto3_profile(env: Ec2Env,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    creds = configparser.ConfigParser()
    creds.read(env.vbs.data_dir / "credentials")
    assert creds["default"]["aws_access_key_id"] == env.vbs.key.access_key_id
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(env.vbs.data_dir / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(env.aws_config))
    ec2 = boto3.session.Session(profile_name="default").client("ec2", endpoint_url=env.vbs.endpoint)
    assert ec2.meta.region_name == REGION
    assert [z["ZoneName"] for z in ec2.describe_availability_zones()["AvailabilityZones"]] == [ZONE]


# -- zones and instances ------------------------------------------------------------------------------


def test_describe_availability_zones(env: Ec2Env) -> None:
    zones = env.ec2.describe_availability_zones()["AvailabilityZones"]
    assert len(zones) == 1
    assert zones[0]["ZoneName"] == ZONE and zones[0]["RegionName"] == REGION and zones[0]["State"] == "available"
    assert env.ec2.describe_availability_zones(ZoneNames=[ZONE])["AvailabilityZones"] == zones
    assert error(env.ec2.describe_availability_zones, DryRun=True) == (412, "DryRunOperation")


def test_describe_volume_status_says_io_reaches_a_volume(env: Ec2Env) -> None:
    vol = env.new_volume()
    found = env.ec2.describe_volume_status(VolumeIds=[vol])["VolumeStatuses"]
    assert [(s["VolumeId"], s["AvailabilityZone"]) for s in found] == [(vol, ZONE)]
    assert found[0]["VolumeStatus"] == {"Status": "ok", "Details": [{"Name": "io-enabled", "Status": "passed"},
                                                                    {"Name": "io-performance",
                                                                     "Status": "not-applicable"}]}
    mine = env.ec2.describe_volume_status(VolumeIds=[vol], Filters=flt(volume_status__status="ok"))
    assert [s["VolumeId"] for s in mine["VolumeStatuses"]] == [vol]
    impaired = env.ec2.describe_volume_status(VolumeIds=[vol], Filters=flt(volume_status__status="impaired"))
    assert impaired["VolumeStatuses"] == []
    assert error(env.ec2.describe_volume_status, Filters=flt(create_time="x")) == (400, "InvalidParameterValue")
    assert error(env.ec2.describe_volume_status, DryRun=True) == (412, "DryRunOperation")


def test_describe_availability_zones_applies_its_filters(env: Ec2Env) -> None:
    """DescribeAvailabilityZonesRequest.Filters in botocore's model documents zone-name, region-name and state
    (among others); a filter that does not match leaves the zone out."""
    zones = env.ec2.describe_availability_zones
    assert [z["ZoneName"] for z in zones(Filters=flt(zone_name=ZONE, state="available",
                                                     region_name=REGION))["AvailabilityZones"]] == [ZONE]
    assert zones(Filters=flt(zone_name="us-east-1z"))["AvailabilityZones"] == []
    assert zones(Filters=flt(region_name="eu-west-1"))["AvailabilityZones"] == []


def test_describe_instances_lists_the_guest(env: Ec2Env) -> None:
    found = env.ec2.describe_instances(InstanceIds=[env.instance_id])["Reservations"]
    assert len(found) == 1 and len(found[0]["Instances"]) == 1
    inst = found[0]["Instances"][0]
    assert inst["InstanceId"] == env.instance_id
    assert inst["State"] == {"Code": 16, "Name": "running"}
    assert inst["Placement"]["AvailabilityZone"] == ZONE
    assert tags_of(inst)["vbs:host"] == "host-1" and tags_of(inst)["vbs:vm-id"] == "vm1"
    by_filter = env.ec2.describe_instances(Filters=flt(instance_id=env.instance_id,
                                                       instance_state_name="running"))["Reservations"]
    assert [i["InstanceId"] for r in by_filter for i in r["Instances"]] == [env.instance_id]
    assert env.ec2.describe_instances(Filters=flt(instance_state_name="stopped"))["Reservations"] == []
    assert error(env.ec2.describe_instances, InstanceIds=[UNKNOWN_INSTANCE]) == (400, "InvalidInstanceID.NotFound")


def test_describe_instances_applies_tag_filters(env: Ec2Env) -> None:
    """DescribeInstancesRequest.Filters in botocore's model documents ``tag:<key>`` and ``tag-key``; an instance
    whose tags do not match is left out (VBS instances carry Name, vbs:host and vbs:vm-id tags)."""
    def found(**filters: str) -> list[str]:
        res = env.ec2.describe_instances(Filters=flt(**filters))["Reservations"]
        return [i["InstanceId"] for r in res for i in r["Instances"]]

    assert env.instance_id in found(tag_Name="vm1")
    assert found(tag_Name="no-such-vm") == []
    assert found(tag_key="no-such-key") == []


# -- CreateVolume ---------------------------------------------------------------------------------------


def test_create_volume_accepts_and_echoes_its_parameters(env: Ec2Env) -> None:
    made = env.ec2.create_volume(Size=10, AvailabilityZone=ZONE, VolumeType="gp3", Iops=4000, Throughput=250,
                                 TagSpecifications=tag_spec("volume", Name="data", team="db"))
    assert made["State"] == "creating" and made["VolumeId"].startswith("vol-")
    assert (made["Size"], made["AvailabilityZone"], made["VolumeType"]) == (10, ZONE, "gp3")
    assert (made["Iops"], made["Throughput"], made["MultiAttachEnabled"], made["Encrypted"]) == (4000, 250, False,
                                                                                               False)
    assert tags_of(made) == {"Name": "data", "team": "db"}
    env.ec2.get_waiter("volume_available").wait(VolumeIds=[made["VolumeId"]], WaiterConfig=FAST)
    desc = env.volume(made["VolumeId"])
    for key in ("VolumeId", "Size", "AvailabilityZone", "VolumeType", "Iops", "Throughput", "MultiAttachEnabled",
                "CreateTime"):
        assert desc[key] == made[key], key
    assert desc["State"] == "available" and desc["Attachments"] == [] and tags_of(desc) == tags_of(made)

    multi = env.ec2.create_volume(Size=4, AvailabilityZone=ZONE, VolumeType="io2", Iops=1000,
                                  MultiAttachEnabled=True)
    assert (multi["VolumeType"], multi["Iops"], multi["MultiAttachEnabled"]) == ("io2", 1000, True)
    default = env.ec2.create_volume(Size=1, AvailabilityZone=ZONE)
    assert default["VolumeType"] == "gp2"  # EC2's documented default
    env.ec2.get_waiter("volume_available").wait(VolumeIds=[multi["VolumeId"], default["VolumeId"]],
                                                WaiterConfig=FAST)


def test_an_unknown_availability_zone_is_refused(env: Ec2Env) -> None:
    spec = tag_spec("volume", probe="bad-zone")
    assert error(env.ec2.create_volume, Size=1, AvailabilityZone="us-east-1z",
                 TagSpecifications=spec) == (400, "InvalidParameterValue")
    assert error(env.ec2.create_volume, Size=1, AvailabilityZone="eu-west-1a",
                 TagSpecifications=spec) == (400, "InvalidParameterValue")
    assert env.ids(Filters=flt(tag_probe="bad-zone")) == set()
    assert env.ids(Filters=flt(availability_zone="us-east-1z")) == set()


def test_client_token_makes_create_volume_idempotent(env: Ec2Env) -> None:
    token = f"tok-{time.time_ns()}"
    first = env.ec2.create_volume(Size=1, AvailabilityZone=ZONE, ClientToken=token)
    again = env.ec2.create_volume(Size=1, AvailabilityZone=ZONE, ClientToken=token)
    assert again["VolumeId"] == first["VolumeId"]
    assert error(env.ec2.create_volume, Size=2, AvailabilityZone=ZONE,
                 ClientToken=token) == (400, "IdempotentParameterMismatch")
    assert error(env.ec2.create_volume, Size=1, AvailabilityZone=ZONE, VolumeType="gp3",
                 ClientToken=token) == (400, "IdempotentParameterMismatch")
    other = env.ec2.create_volume(Size=1, AvailabilityZone=ZONE, ClientToken=token + "-2")
    assert other["VolumeId"] != first["VolumeId"]
    env.ec2.get_waiter("volume_available").wait(VolumeIds=[first["VolumeId"], other["VolumeId"]],
                                                WaiterConfig=FAST)
    assert env.ec2.create_volume(Size=1, AvailabilityZone=ZONE, ClientToken=token)["VolumeId"] == first["VolumeId"]


def test_invalid_parameters_are_refused(env: Ec2Env) -> None:
    ec2 = env.ec2
    assert error(ec2.create_volume, Size=0, AvailabilityZone=ZONE) == (400, "InvalidParameterValue")
    assert error(ec2.create_volume, Size=16385, AvailabilityZone=ZONE) == (400, "InvalidParameterValue")
    assert error(ec2.create_volume, Size=1, AvailabilityZone=ZONE, VolumeType="ssd") == (400, "InvalidParameterValue")
    assert error(ec2.create_volume, AvailabilityZone=ZONE) == (400, "MissingParameter")
    assert error(ec2.create_volume, Size=1, AvailabilityZone=ZONE,
                 TagSpecifications=tag_spec("volume", **{"aws:reserved": "x"})) == (400, "InvalidParameterValue")
    assert error(ec2.describe_volumes, MaxResults=4) == (400, "InvalidParameterValue")
    assert error(ec2.describe_volumes, MaxResults=5, NextToken="not-a-token") == (400, "InvalidParameterValue")
    assert error(ec2.describe_volumes, VolumeIds=[UNKNOWN_VOLUME],
                 MaxResults=5) == (400, "InvalidParameterCombination")
    assert error(ec2.describe_volumes, Filters=flt(no_such_filter="x")) == (400, "InvalidParameterValue")
    assert error(ec2.describe_tags, MaxResults=4) == (400, "InvalidParameterValue")


# -- ids that do not exist ------------------------------------------------------------------------------


def test_unknown_and_malformed_ids(env: Ec2Env) -> None:
    ec2, inst = env.ec2, env.instance_id
    vol = env.new_volume()
    cases: list[tuple[Callable[..., Any], dict[str, Any], str]] = [
        (ec2.describe_volumes, {"VolumeIds": [UNKNOWN_VOLUME]}, "InvalidVolume.NotFound"),
        (ec2.describe_volumes, {"VolumeIds": [vol, UNKNOWN_VOLUME]}, "InvalidVolume.NotFound"),
        (ec2.delete_volume, {"VolumeId": UNKNOWN_VOLUME}, "InvalidVolume.NotFound"),
        (ec2.delete_volume, {"VolumeId": "vol-123"}, "InvalidVolumeID.Malformed"),
        (ec2.delete_volume, {"VolumeId": "volume-1"}, "InvalidVolumeID.Malformed"),
        (ec2.describe_volumes, {"VolumeIds": [vol, "vol-zz"]}, "InvalidVolumeID.Malformed"),
        (ec2.attach_volume, {"VolumeId": UNKNOWN_VOLUME, "InstanceId": inst, "Device": "/dev/sdz"},
         "InvalidVolume.NotFound"),
        (ec2.detach_volume, {"VolumeId": UNKNOWN_VOLUME}, "InvalidVolume.NotFound"),
        (ec2.modify_volume, {"VolumeId": UNKNOWN_VOLUME, "Size": 2}, "InvalidVolume.NotFound"),
        (ec2.create_snapshot, {"VolumeId": UNKNOWN_VOLUME}, "InvalidVolume.NotFound"),
        (ec2.create_tags, {"Resources": [UNKNOWN_VOLUME], "Tags": [{"Key": "a", "Value": "b"}]},
         "InvalidVolume.NotFound"),
        (ec2.delete_snapshot, {"SnapshotId": UNKNOWN_SNAPSHOT}, "InvalidSnapshot.NotFound"),
        (ec2.delete_snapshot, {"SnapshotId": "snap-1"}, "InvalidSnapshotID.Malformed"),
        (ec2.describe_snapshots, {"SnapshotIds": ["snapshot-1"]}, "InvalidSnapshotID.Malformed"),
        (ec2.create_volume, {"SnapshotId": "snap-", "AvailabilityZone": ZONE}, "InvalidSnapshotID.Malformed"),
        (ec2.create_volume, {"SnapshotId": UNKNOWN_SNAPSHOT, "AvailabilityZone": ZONE}, "InvalidSnapshot.NotFound"),
        (ec2.create_tags, {"Resources": [UNKNOWN_SNAPSHOT], "Tags": [{"Key": "a", "Value": "b"}]},
         "InvalidSnapshot.NotFound"),
        (ec2.attach_volume, {"VolumeId": vol, "InstanceId": UNKNOWN_INSTANCE, "Device": "/dev/sdz"},
         "InvalidInstanceID.NotFound"),
        (ec2.describe_instances, {"InstanceIds": [UNKNOWN_INSTANCE]}, "InvalidInstanceID.NotFound"),
        (ec2.describe_instances, {"InstanceIds": ["i-x"]}, "InvalidInstanceID.Malformed"),
        (ec2.create_snapshots, {"InstanceSpecification": {"InstanceId": "instance-1"}}, "InvalidInstanceID.Malformed"),
    ]
    for call, params, code in cases:
        assert error(call, **params) == (400, code), (call.__name__, params)
    assert env.volume(vol)["State"] == "available"


def test_describe_snapshots_with_an_unknown_or_deleted_id_is_an_error(env: Ec2Env) -> None:
    """botocore's DescribeSnapshots documentation: "If you specify an invalid snapshot ID, an error is returned."

    EC2 answers InvalidSnapshot.NotFound (HTTP 400), the code DeleteSnapshot uses here too.
    """
    assert error(env.ec2.describe_snapshots, SnapshotIds=[UNKNOWN_SNAPSHOT]) == (400, "InvalidSnapshot.NotFound")
    vol = env.new_volume()
    snap = env.ec2.create_snapshot(VolumeId=vol)["SnapshotId"]
    env.ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig=FAST)
    env.ec2.delete_snapshot(SnapshotId=snap)
    wait_until(lambda: env.ec2.describe_snapshots(Filters=flt(snapshot_id=snap))["Snapshots"] == [], 30,
               what="snapshot gone")
    assert error(env.ec2.describe_snapshots, SnapshotIds=[snap]) == (400, "InvalidSnapshot.NotFound")


# -- state rules -----------------------------------------------------------------------------------------


def test_detaching_a_volume_that_is_not_attached_is_incorrect_state(env: Ec2Env) -> None:
    vol = env.new_volume()
    assert error(env.ec2.detach_volume, VolumeId=vol) == (400, "IncorrectState")
    assert error(env.ec2.detach_volume, VolumeId=vol, InstanceId=env.instance_id) == (400, "IncorrectState")
    assert env.volume(vol)["State"] == "available"


def test_a_deleted_volume_is_gone_but_for_the_history_filter(env: Ec2Env) -> None:
    vol = env.new_volume(TagSpecifications=tag_spec("volume", probe="deleted"))
    answer = env.ec2.delete_volume(VolumeId=vol)
    assert answer["ResponseMetadata"]["HTTPStatusCode"] == 200
    env.ec2.get_waiter("volume_deleted").wait(VolumeIds=[vol], WaiterConfig=FAST)
    # As on EC2: deleting shows for a while, then nothing, by id or in a listing ...
    assert error(env.ec2.describe_volumes, VolumeIds=[vol]) == (400, "InvalidVolume.NotFound")
    assert vol not in env.ids() and vol not in env.ids(Filters=flt(status="available"))
    # ... and the history for operators behind an explicit filter.
    assert vol in env.ids(Filters=flt(status="deleted"))
    shown = env.ec2.describe_volumes(VolumeIds=[vol], Filters=flt(status="deleted"))["Volumes"]
    assert [v["State"] for v in shown] == ["deleted"]
    # Gone for every action that would use it; its tags go with it.
    ec2 = env.ec2
    assert error(ec2.delete_volume, VolumeId=vol) == (400, "InvalidVolume.NotFound")
    assert error(ec2.attach_volume, VolumeId=vol, InstanceId=env.instance_id,
                 Device="/dev/sdy") == (400, "InvalidVolume.NotFound")
    assert error(ec2.create_snapshot, VolumeId=vol) == (400, "InvalidVolume.NotFound")
    assert error(ec2.modify_volume, VolumeId=vol, Size=2) == (400, "InvalidVolume.NotFound")
    assert error(ec2.create_tags, Resources=[vol], Tags=[{"Key": "a", "Value": "b"}]) == (400,
                                                                                         "InvalidVolume.NotFound")
    assert ec2.describe_tags(Filters=flt(resource_id=vol))["Tags"] == []
    assert not (env.vbs.pool / "volumes" / f"{vol}.raw").exists()


def test_dry_run_answers_dry_run_operation_and_changes_nothing(env: Ec2Env) -> None:
    ec2 = env.ec2
    vol = env.new_volume(TagSpecifications=tag_spec("volume", keep="me"))
    snap = ec2.create_snapshot(VolumeId=vol)["SnapshotId"]
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig=FAST)
    dry = [
        (ec2.create_volume, {"Size": 1, "AvailabilityZone": ZONE, "TagSpecifications": tag_spec("volume", dry="1")}),
        (ec2.delete_volume, {"VolumeId": vol}),
        (ec2.describe_volumes, {}),
        (ec2.attach_volume, {"VolumeId": vol, "InstanceId": env.instance_id, "Device": "/dev/sdx"}),
        (ec2.modify_volume, {"VolumeId": vol, "Size": 5}),
        (ec2.describe_volumes_modifications, {"VolumeIds": [vol]}),
        (ec2.create_snapshot, {"VolumeId": vol}),
        (ec2.delete_snapshot, {"SnapshotId": snap}),
        (ec2.describe_snapshots, {}),
        (ec2.create_tags, {"Resources": [vol], "Tags": [{"Key": "dry", "Value": "1"}]}),
        (ec2.delete_tags, {"Resources": [vol]}),
        (ec2.describe_tags, {}),
        (ec2.describe_instances, {}),
        (ec2.describe_availability_zones, {}),
        (ec2.describe_volume_status, {"VolumeIds": [vol]}),
        (ec2.describe_volume_attribute, {"VolumeId": vol, "Attribute": "autoEnableIO"}),
        (ec2.detach_volume, {"VolumeId": vol}),
        (ec2.copy_snapshot, {"SourceSnapshotId": snap, "SourceRegion": REGION}),
        (ec2.create_snapshots, {"InstanceSpecification": {"InstanceId": env.instance_id}}),
        (ec2.describe_snapshot_attribute, {"SnapshotId": snap, "Attribute": "createVolumePermission"}),
        (ec2.modify_snapshot_attribute, {"SnapshotId": snap, "Attribute": "createVolumePermission",
                                         "OperationType": "add", "UserIds": ["123456789012"]}),
        (ec2.reset_snapshot_attribute, {"SnapshotId": snap, "Attribute": "createVolumePermission"}),
        (ec2.lock_snapshot, {"SnapshotId": snap, "LockMode": "governance", "LockDuration": 1}),
        (ec2.unlock_snapshot, {"SnapshotId": snap}),
        (ec2.describe_locked_snapshots, {}),
        (ec2.modify_snapshot_tier, {"SnapshotId": snap, "StorageTier": "archive"}),
        (ec2.restore_snapshot_tier, {"SnapshotId": snap, "PermanentRestore": True}),
        (ec2.describe_snapshot_tier_status, {}),
        (ec2.list_snapshots_in_recycle_bin, {}),
        (ec2.restore_snapshot_from_recycle_bin, {"SnapshotId": snap}),
        (ec2.list_volumes_in_recycle_bin, {}),
        (ec2.restore_volume_from_recycle_bin, {"VolumeId": vol}),
    ]
    # Every action VBS answers takes DryRun as EC2 does (botocore's model gives each of them the parameter).
    assert {call.__name__ for call, _ in dry} == {xform_name(action) for action in HANDLERS}
    for call, params in dry:
        assert error(call, DryRun=True, **params) == (412, "DryRunOperation"), call.__name__
    after = env.volume(vol)
    assert (after["State"], after["Size"], after["Attachments"], tags_of(after)) == ("available", 1, [],
                                                                                     {"keep": "me"})
    assert env.ids(Filters=flt(tag_dry="1")) == set()
    assert [s["SnapshotId"] for s in ec2.describe_snapshots(Filters=flt(volume_id=vol))["Snapshots"]] == [snap]
    assert ec2.describe_volumes_modifications(VolumeIds=[vol])["VolumesModifications"] == []
    assert ec2.describe_locked_snapshots(SnapshotIds=[snap])["Snapshots"] == []
    assert ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]["StorageTier"] == "standard"
    assert ec2.describe_snapshot_attribute(SnapshotId=snap, Attribute="createVolumePermission"
                                           )["CreateVolumePermissions"] == []


# -- DescribeVolumes filters and pagination --------------------------------------------------------------


def test_describe_volumes_filters(env: Ec2Env) -> None:
    ec2, run = env.ec2, f"r{time.time_ns()}"
    small = env.new_volume(2, TagSpecifications=tag_spec("volume", run=run, team="db", Name="small"))
    big = env.new_volume(3, TagSpecifications=tag_spec("volume", run=run, team="web", empty=""))
    snap = ec2.create_snapshot(VolumeId=small)["SnapshotId"]
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig=FAST)
    clone = env.new_volume(2, SnapshotId=snap, TagSpecifications=tag_spec("volume", run=run))
    mine = flt(tag_run=run)

    assert env.ids(Filters=mine) == {small, big, clone}
    assert env.ids(Filters=mine + flt(status="available")) == {small, big, clone}
    assert env.ids(Filters=mine + flt(status=["in-use", "creating"])) == set()
    assert env.ids(Filters=mine + flt(size="2")) == {small, clone}
    assert env.ids(Filters=mine + flt(size=["3", "99"])) == {big}
    assert env.ids(Filters=flt(snapshot_id=snap)) == {clone}
    assert env.volume(clone)["SnapshotId"] == snap and env.volume(small)["SnapshotId"] == ""
    assert env.ids(Filters=flt(volume_id=[small, big])) == {small, big}
    assert env.ids(Filters=flt(tag_team="db")) >= {small} and big not in env.ids(Filters=flt(tag_team="db"))
    assert env.ids(Filters=mine + flt(tag_team=["db", "web"])) == {small, big}
    assert env.ids(Filters=mine + flt(tag_empty="")) == {big}
    assert env.ids(Filters=mine + flt(tag_key="team")) == {small, big}
    assert env.ids(Filters=mine + flt(tag_key=["Name", "empty"])) == {small, big}
    assert env.ids(Filters=mine + flt(tag_team="db", size="3")) == set()  # filters are ANDed
    assert env.ids(Filters=mine + flt(availability_zone=ZONE)) == {small, big, clone}
    assert env.ids(Filters=mine + flt(volume_type="gp2")) == {small, big, clone}
    assert env.ids(Filters=mine + flt(multi_attach_enabled="false")) == {small, big, clone}
    # Not attached: no attachment.* filter matches (they are exercised on an attached volume below).
    assert env.ids(Filters=mine + flt(attachment__instance_id=env.instance_id)) == set()
    assert env.ids(Filters=mine + flt(attachment__status="attached")) == set()
    assert env.ids(Filters=mine + flt(attachment__device="/dev/sdf")) == set()
    # Ids and filters together: the ids that match.
    assert env.ids(VolumeIds=[small, big], Filters=flt(size="2")) == {small}


def test_documented_encrypted_filter_is_accepted(env: Ec2Env) -> None:
    """``encrypted`` is a documented filter of DescribeVolumes and DescribeSnapshots (botocore's model,
    DescribeVolumesRequest.Filters / DescribeSnapshotsRequest.Filters: "encrypted - Indicates whether the
    volume [snapshot] is encrypted (true | false)"); VBS volumes are never encrypted."""
    vol = env.new_volume(TagSpecifications=tag_spec("volume", probe="encrypted"))
    snap = env.ec2.create_snapshot(VolumeId=vol)["SnapshotId"]
    env.ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig=FAST)
    assert env.ids(Filters=flt(tag_probe="encrypted", encrypted="false")) == {vol}
    assert env.ids(Filters=flt(tag_probe="encrypted", encrypted="true")) == set()
    snaps = env.ec2.describe_snapshots(Filters=flt(volume_id=vol, encrypted="false"))["Snapshots"]
    assert [s["SnapshotId"] for s in snaps] == [snap]


def test_paginating_250_volumes_with_boto3(env: Ec2Env, page_volumes: set[str]) -> None:
    paginator = env.ec2.get_paginator("describe_volumes")
    pages = list(paginator.paginate(Filters=flt(tag_batch="page"), PaginationConfig={"PageSize": 100}))
    assert [len(p["Volumes"]) for p in pages] == [100, 100, 50]
    assert all(p.get("NextToken") for p in pages[:-1]) and not pages[-1].get("NextToken")
    seen = [v["VolumeId"] for p in pages for v in p["Volumes"]]
    assert len(seen) == len(set(seen)) == PAGE_VOLUMES and set(seen) == page_volumes

    # By hand: NextToken carries on where the last page ended, with the same filters.
    seen, token, calls = [], None, 0
    while True:
        kwargs: dict[str, Any] = {"Filters": flt(tag_batch="page"), "MaxResults": 60}
        if token:
            kwargs["NextToken"] = token
        page = env.ec2.describe_volumes(**kwargs)
        calls += 1
        seen += [v["VolumeId"] for v in page["Volumes"]]
        token = page.get("NextToken")
        if not token:
            break
    assert calls == 5 and len(seen) == len(set(seen)) == PAGE_VOLUMES

    # MaxResults above EC2's 500 is capped, not refused; without MaxResults everything comes at once.
    assert len(env.ec2.describe_volumes(Filters=flt(tag_batch="page"), MaxResults=1000)["Volumes"]) == PAGE_VOLUMES
    assert len(env.ec2.describe_volumes(Filters=flt(tag_batch="page"))["Volumes"]) == PAGE_VOLUMES
    assert env.ec2.describe_volumes(Filters=flt(tag_batch="page"), MaxResults=5)["NextToken"]

    # DescribeTags pages too (one batch=page tag per volume).
    tag_pages = list(env.ec2.get_paginator("describe_tags").paginate(
        Filters=flt(key="batch", value="page"), PaginationConfig={"PageSize": 100}))
    assert [len(p["Tags"]) for p in tag_pages] == [100, 100, 50]
    assert {t["ResourceId"] for p in tag_pages for t in p["Tags"]} == page_volumes


def test_paginating_250_volumes_with_the_aws_cli(env: Ec2Env, page_volumes: set[str]) -> None:
    query = ["--filters", "Name=tag:batch,Values=page"]
    everything = env.aws("describe-volumes", *query, "--page-size", "100")
    assert {v["VolumeId"] for v in everything["Volumes"]} == page_volumes

    first = env.aws("describe-volumes", *query, "--page-size", "50", "--max-items", "120")
    assert len(first["Volumes"]) == 120 and first["NextToken"]
    rest = env.aws("describe-volumes", *query, "--page-size", "50", "--max-items", "200",
                   "--starting-token", first["NextToken"])
    assert len(rest["Volumes"]) == PAGE_VOLUMES - 120 and "NextToken" not in rest
    both = [v["VolumeId"] for v in first["Volumes"] + rest["Volumes"]]
    assert len(both) == len(set(both)) and set(both) == page_volumes

    # --no-paginate: one call with the server's page size (no MaxResults: all of them).
    one = env.aws("describe-volumes", *query, "--no-paginate")
    assert len(one["Volumes"]) == PAGE_VOLUMES


# -- snapshots -----------------------------------------------------------------------------------------


def test_snapshot_lifecycle_and_filters(env: Ec2Env) -> None:
    ec2 = env.ec2
    vol = env.new_volume(2)
    made = ec2.create_snapshot(VolumeId=vol, Description="nightly backup",
                               TagSpecifications=tag_spec("snapshot", kind="nightly"))
    snap = made["SnapshotId"]
    assert snap.startswith("snap-") and made["VolumeId"] == vol and made["VolumeSize"] == 2
    assert made["State"] in ("pending", "completed") and made["Description"] == "nightly backup"
    assert tags_of(made) == {"kind": "nightly"}
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig=FAST)
    desc = ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]
    assert (desc["State"], desc["Progress"], desc["VolumeSize"], desc["Encrypted"]) == ("completed", "100%", 2, False)
    assert desc["OwnerId"] and desc["StartTime"] == made["StartTime"]

    def snap_ids(**params: Any) -> set[str]:
        return {s["SnapshotId"] for s in ec2.describe_snapshots(**params)["Snapshots"]}

    assert snap_ids(Filters=flt(volume_id=vol)) == {snap}
    assert snap_ids(Filters=flt(snapshot_id=snap, status="completed")) == {snap}
    assert snap_ids(Filters=flt(snapshot_id=snap, status="pending")) == set()
    assert snap_ids(Filters=flt(volume_id=vol, description="nightly backup")) == {snap}
    assert snap_ids(Filters=flt(volume_id=vol, progress="100%")) == {snap}
    assert snap_ids(Filters=flt(volume_id=vol, volume_size="2")) == {snap}
    assert snap_ids(Filters=flt(volume_id=vol, tag_kind="nightly")) == {snap}
    assert snap_ids(Filters=flt(volume_id=vol, tag_key="kind")) == {snap}
    assert snap_ids(Filters=flt(volume_id=vol, tag_kind="weekly")) == set()
    assert snap_ids(OwnerIds=["self"], Filters=flt(volume_id=vol)) == {snap}
    assert error(ec2.create_snapshot, VolumeId=vol,
                 TagSpecifications=tag_spec("volume", a="b")) == (400, "InvalidParameterValue")

    # A volume from the snapshot: its size by default, never smaller.
    clone = ec2.create_volume(SnapshotId=snap, AvailabilityZone=ZONE)
    assert clone["SnapshotId"] == snap and clone["Size"] == 2
    assert error(ec2.create_volume, SnapshotId=snap, Size=1, AvailabilityZone=ZONE) == (400, "InvalidParameterValue")
    bigger = ec2.create_volume(SnapshotId=snap, Size=3, AvailabilityZone=ZONE)
    assert bigger["Size"] == 3
    ec2.get_waiter("volume_available").wait(VolumeIds=[clone["VolumeId"], bigger["VolumeId"]], WaiterConfig=FAST)

    # Delete: gone from listings; a second delete does not find it.
    assert ec2.delete_snapshot(SnapshotId=snap)["ResponseMetadata"]["HTTPStatusCode"] == 200
    wait_until(lambda: snap not in snap_ids(Filters=flt(volume_id=vol)), 30, what="snapshot deleted")
    assert error(ec2.delete_snapshot, SnapshotId=snap) == (400, "InvalidSnapshot.NotFound")
    assert error(ec2.create_volume, SnapshotId=snap, AvailabilityZone=ZONE) == (400, "InvalidSnapshot.NotFound")


# -- tags ------------------------------------------------------------------------------------------------


def test_tags_round_trip(env: Ec2Env) -> None:
    ec2 = env.ec2
    vol = env.new_volume(TagSpecifications=tag_spec("volume", Name="tagged"))
    snap = ec2.create_snapshot(VolumeId=vol)["SnapshotId"]
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig=FAST)

    def tags(rid: str) -> dict[str, str]:
        return {t["Key"]: t["Value"] for t in ec2.describe_tags(Filters=flt(resource_id=rid))["Tags"]}

    ec2.create_tags(Resources=[vol, snap], Tags=[{"Key": "env", "Value": "prod"}, {"Key": "flag"},
                                                 {"Key": "owner", "Value": "alice"}, {"Key": "blank", "Value": ""}])
    assert tags(vol) == {"Name": "tagged", "env": "prod", "flag": "", "owner": "alice", "blank": ""}
    assert tags(snap) == {"env": "prod", "flag": "", "owner": "alice", "blank": ""}
    assert tags_of(env.volume(vol)) == tags(vol)
    assert tags_of(ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]) == tags(snap)
    ec2.create_tags(Resources=[vol], Tags=[{"Key": "env", "Value": "staging"}])  # overwrites
    assert tags(vol)["env"] == "staging" and tags(snap)["env"] == "prod"

    # DescribeTags: every field, every filter.
    rows = ec2.describe_tags(Filters=flt(resource_id=[vol, snap], key="env"))["Tags"]
    assert sorted((t["ResourceId"], t["ResourceType"], t["Key"], t["Value"]) for t in rows) == sorted(
        [(vol, "volume", "env", "staging"), (snap, "snapshot", "env", "prod")])
    assert {t["ResourceId"] for t in ec2.describe_tags(Filters=flt(resource_id=[vol, snap],
                                                                   resource_type="snapshot"))["Tags"]} == {snap}
    assert {t["ResourceId"] for t in ec2.describe_tags(Filters=flt(resource_id=[vol, snap],
                                                                   value="staging"))["Tags"]} == {vol}
    assert {t["ResourceId"] for t in ec2.describe_tags(Filters=flt(key="owner", value="alice"))["Tags"]} >= {vol, snap}
    paged = list(ec2.get_paginator("describe_tags").paginate(Filters=flt(resource_id=[vol, snap]),
                                                             PaginationConfig={"PageSize": 5}))
    assert [len(p["Tags"]) for p in paged] == [5, 4]

    # DeleteTags: a key alone deletes whatever the value; a key with a value only if it matches;
    # an empty value only an empty value; no Tags at all deletes every tag.
    ec2.delete_tags(Resources=[vol], Tags=[{"Key": "owner", "Value": "bob"}])
    assert tags(vol)["owner"] == "alice"
    ec2.delete_tags(Resources=[vol], Tags=[{"Key": "owner", "Value": "alice"}, {"Key": "env"}])
    assert "owner" not in tags(vol) and "env" not in tags(vol)
    ec2.delete_tags(Resources=[vol], Tags=[{"Key": "Name", "Value": ""}, {"Key": "flag", "Value": ""}])
    assert tags(vol) == {"Name": "tagged", "blank": ""}
    ec2.delete_tags(Resources=[vol, snap], Tags=[{"Key": "blank"}])
    assert tags(vol) == {"Name": "tagged"} and "blank" not in tags(snap)
    ec2.delete_tags(Resources=[snap])
    assert tags(snap) == {} and tags(vol) == {"Name": "tagged"}
    assert env.ids(Filters=flt(tag_Name="tagged")) >= {vol}

    assert error(ec2.create_tags, Resources=[vol], Tags=[{"Key": "aws:x", "Value": "1"}]) == (400,
                                                                                             "InvalidParameterValue")
    assert error(ec2.delete_tags, Resources=[UNKNOWN_VOLUME]) == (400, "InvalidVolume.NotFound")
    assert error(ec2.describe_tags, Filters=flt(bogus="x")) == (400, "InvalidParameterValue")


# -- ModifyVolume --------------------------------------------------------------------------------------


def wait_modification(e: Ec2Env, vol: str, timeout: float = 60) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        mods = e.ec2.describe_volumes_modifications(VolumeIds=[vol])["VolumesModifications"]
        return mods[0] if mods and mods[0]["ModificationState"] not in ("modifying",) else None

    return wait_until(done, timeout, interval=0.25, what=f"modification of {vol}")  # type: ignore[no-any-return]


def test_modify_volume_grows_a_detached_volume(env: Ec2Env) -> None:
    ec2 = env.ec2
    vol = env.new_volume(1)
    path = env.vbs.pool / "volumes" / f"{vol}.raw"
    assert path.stat().st_size == GIB
    mod = ec2.modify_volume(VolumeId=vol, Size=3)["VolumeModification"]
    assert (mod["VolumeId"], mod["OriginalSize"], mod["TargetSize"]) == (vol, 1, 3)
    assert mod["ModificationState"] in ("modifying", "optimizing", "completed")
    done = wait_modification(env, vol)
    assert done["ModificationState"] == "completed", done
    assert (done["OriginalSize"], done["TargetSize"], done["Progress"]) == (1, 3, 100)
    assert done["StartTime"] <= done["EndTime"]
    assert path.stat().st_size == 3 * GIB
    after = env.volume(vol)
    assert (after["Size"], after["State"]) == (3, "available")

    found = ec2.describe_volumes_modifications(Filters=flt(volume_id=vol, modification_state="completed"))
    assert [m["VolumeId"] for m in found["VolumesModifications"]] == [vol]
    assert ec2.describe_volumes_modifications(
        Filters=flt(volume_id=vol, modification_state="failed"))["VolumesModifications"] == []
    assert error(ec2.modify_volume, VolumeId=vol, Size=2) == (400, "InvalidParameterValue")  # no shrinking
    assert path.stat().st_size == 3 * GIB


def test_describe_volumes_modifications_shows_the_latest_one_per_volume(env: Ec2Env) -> None:
    """botocore's DescribeVolumesModifications documentation: "Describes the most recent volume modification
    request for the specified EBS volumes." (Terraform's aws_ebs_volume asserts a single result per volume
    when it waits for a resize, so a second resize of the same volume must not show two.)"""
    vol = env.new_volume(1)
    env.ec2.modify_volume(VolumeId=vol, Size=2)
    assert wait_modification(env, vol)["ModificationState"] == "completed"
    env.ec2.modify_volume(VolumeId=vol, Size=3)
    wait_until(lambda: env.volume(vol)["Size"] == 3, 60, what="second resize")
    mods = env.ec2.describe_volumes_modifications(VolumeIds=[vol])["VolumesModifications"]
    assert [(m["OriginalSize"], m["TargetSize"], m["ModificationState"]) for m in mods] == [(2, 3, "completed")]


def test_modify_volume_grows_an_attached_volume_online(env: Ec2Env) -> None:
    ec2 = env.ec2
    vol = env.new_volume(1)
    ec2.attach_volume(VolumeId=vol, InstanceId=env.instance_id, Device="/dev/sdm")
    try:
        dev = env.wait_attached(vol)
        assert env.guest.check(f"cat /sys/block/{dev}/size").strip() == str(GIB // 512)
        ec2.modify_volume(VolumeId=vol, Size=2)
        done = wait_modification(env, vol)
        assert done["ModificationState"] == "completed", done
        assert (env.volume(vol)["Size"], env.volume(vol)["State"]) == (2, "in-use")
        assert (env.vbs.pool / "volumes" / f"{vol}.raw").stat().st_size == 2 * GIB
        wait_until(lambda: env.guest.check(f"cat /sys/block/{dev}/size").strip() == str(2 * GIB // 512), 30,
                   interval=0.5, what="the guest to see 2 GiB")
        # …and can use it: a write past the old end reads back.
        env.guest.check(f"yes grown | head -c 1048576 | dd of=/dev/{dev} bs=1M seek=1536 conv=fsync 2>/dev/null")
        out = env.guest.check(f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/{dev} bs=1M skip=1536 count=1 "
                              "2>/dev/null | head -c 6")
        assert out.startswith("grown"), out
    finally:
        env.detach_quietly(vol)


def test_modify_volume_during_an_attach_is_refused_then_reaches_the_guest_once_attached(env: Ec2Env) -> None:
    """Attach and modify exclude each other (docs/operations.md): a resize asked for while the attachment
    is still being made is IncorrectState, naming the attach; asked again once attached, the guest sees it."""
    ec2 = env.ec2
    vol = env.new_volume(1)
    ec2.attach_volume(VolumeId=vol, InstanceId=env.instance_id, Device="/dev/sdn")
    try:
        try:
            ec2.modify_volume(VolumeId=vol, Size=2)
            refused = False
        except ClientError as exc:
            assert exc.response["Error"]["Code"] == "IncorrectState", exc.response
            assert "attach-volume in progress" in exc.response["Error"]["Message"]
            refused = True
        dev = env.wait_attached(vol)
        if refused:  # the attach may have been done already when the modify came: then it ran
            ec2.modify_volume(VolumeId=vol, Size=2)
        assert wait_modification(env, vol)["ModificationState"] == "completed"
        assert env.volume(vol)["Size"] == 2
        wait_until(lambda: env.guest.check(f"cat /sys/block/{dev}/size").strip() == str(2 * GIB // 512), 30,
                   interval=0.5, what="the guest to see 2 GiB")
    finally:
        env.detach_quietly(vol)


# -- attach and detach with the guest -----------------------------------------------------------------------


def test_attach_detach_round_trip_with_a_real_guest(env: Ec2Env) -> None:
    ec2, inst = env.ec2, env.instance_id
    vol = env.new_volume(1)
    other = env.new_volume(1)
    serial = virtio_serial(vol)
    assert serial not in env.guest.disks()
    att = ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    try:
        assert (att["VolumeId"], att["InstanceId"], att["Device"]) == (vol, inst, "/dev/sdf")
        assert att["State"] in ("attaching", "attached")
        dev = env.wait_attached(vol)
        assert env.guest.disk_size(serial) == GIB
        desc = env.volume(vol)
        assert desc["State"] == "in-use"
        assert [(a["InstanceId"], a["Device"], a["State"]) for a in desc["Attachments"]] == [
            (inst, "/dev/sdf", "attached")]

        # The guest really has it: a write reads back.
        written = env.guest.write_pattern(dev, "ec2api", 1)
        assert env.guest.checksum(dev, 1) == written

        # DescribeInstances shows the block device mapping.
        found = ec2.describe_instances(InstanceIds=[inst])["Reservations"][0]["Instances"][0]
        assert [(m["DeviceName"], m["Ebs"]["VolumeId"], m["Ebs"]["Status"]) for m in
                found["BlockDeviceMappings"]] == [("/dev/sdf", vol, "attached")]

        # attachment.* filters.
        assert vol in env.ids(Filters=flt(attachment__instance_id=inst))
        assert vol in env.ids(Filters=flt(attachment__status="attached", attachment__device="/dev/sdf"))
        assert vol not in env.ids(Filters=flt(attachment__status=["attaching", "detaching"]))
        assert vol not in env.ids(Filters=flt(attachment__device="/dev/sdg"))
        assert vol in env.ids(Filters=flt(status="in-use", volume_id=vol))

        # What EC2 refuses while it is attached.
        assert error(ec2.delete_volume, VolumeId=vol) == (400, "VolumeInUse")
        assert error(ec2.attach_volume, VolumeId=vol, InstanceId=inst, Device="/dev/sdg") == (400, "VolumeInUse")
        assert error(ec2.attach_volume, VolumeId=other, InstanceId=inst,
                     Device="/dev/sdf") == (400, "InvalidParameterValue")  # device name taken
        assert env.volume(other)["State"] == "available"
        assert error(ec2.detach_volume, VolumeId=vol, InstanceId=inst, DryRun=True) == (412, "DryRunOperation")
        assert env.attachment_state(vol) == "attached"

        det = ec2.detach_volume(VolumeId=vol, InstanceId=inst)
        assert (det["VolumeId"], det["InstanceId"], det["Device"]) == (vol, inst, "/dev/sdf")
        assert det["State"] in ("detaching", "detached")
        ec2.get_waiter("volume_available").wait(VolumeIds=[vol], WaiterConfig=FAST)
        env.guest.wait_disk_gone(serial, 30)
        assert env.volume(vol)["Attachments"] == []
        found = ec2.describe_instances(InstanceIds=[inst])["Reservations"][0]["Instances"][0]
        assert vol not in [m["Ebs"]["VolumeId"] for m in found["BlockDeviceMappings"]]
        assert vol not in env.ids(Filters=flt(attachment__instance_id=inst))
    finally:
        env.detach_quietly(vol)

    # Available again: it attaches again (the data is still there) and then deletes.
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdh")
    try:
        dev = env.wait_attached(vol)
        assert env.guest.checksum(dev, 1) == written
        ec2.detach_volume(VolumeId=vol, Force=True)
        ec2.get_waiter("volume_available").wait(VolumeIds=[vol], WaiterConfig=FAST)
        env.guest.wait_disk_gone(serial, 30)
    finally:
        env.detach_quietly(vol)
    ec2.delete_volume(VolumeId=vol)
    ec2.get_waiter("volume_deleted").wait(VolumeIds=[vol], WaiterConfig=FAST)


def test_the_four_boto3_waiters_complete(env: Ec2Env) -> None:
    ec2 = env.ec2
    vol = ec2.create_volume(Size=1, AvailabilityZone=ZONE)["VolumeId"]
    ec2.get_waiter("volume_available").wait(VolumeIds=[vol], WaiterConfig={"Delay": 1, "MaxAttempts": 30})
    assert env.volume(vol)["State"] == "available"

    snap = ec2.create_snapshot(VolumeId=vol)["SnapshotId"]
    ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap], WaiterConfig={"Delay": 1, "MaxAttempts": 30})
    assert ec2.describe_snapshots(SnapshotIds=[snap])["Snapshots"][0]["State"] == "completed"

    ec2.attach_volume(VolumeId=vol, InstanceId=env.instance_id, Device="/dev/sdw")
    try:
        ec2.get_waiter("volume_in_use").wait(VolumeIds=[vol], WaiterConfig={"Delay": 1, "MaxAttempts": 30})
        assert env.volume(vol)["State"] == "in-use"
        env.wait_attached(vol)
        ec2.detach_volume(VolumeId=vol)
        ec2.get_waiter("volume_available").wait(VolumeIds=[vol], WaiterConfig={"Delay": 1, "MaxAttempts": 30})
    finally:
        env.detach_quietly(vol)

    ec2.delete_volume(VolumeId=vol)
    ec2.get_waiter("volume_deleted").wait(VolumeIds=[vol], WaiterConfig={"Delay": 1, "MaxAttempts": 30})
    # …also for an id that never existed (the waiter takes InvalidVolume.NotFound as success).
    ec2.get_waiter("volume_deleted").wait(VolumeIds=[UNKNOWN_VOLUME], WaiterConfig={"Delay": 1, "MaxAttempts": 2})


# -- the AWS CLI, action by action --------------------------------------------------------------------------


def test_the_aws_cli_drives_every_action(env: Ec2Env) -> None:
    aws = env.aws
    zones = aws("describe-availability-zones", endpoint_flag=False)["AvailabilityZones"]
    assert [z["ZoneName"] for z in zones] == [ZONE]

    made = aws("create-volume", "--size", "1", "--availability-zone", ZONE, "--volume-type", "gp3",
               "--tag-specifications", "ResourceType=volume,Tags=[{Key=Name,Value=cli},{Key=via,Value=aws}]")
    vol = made["VolumeId"]
    assert (made["Size"], made["AvailabilityZone"], made["VolumeType"]) == (1, ZONE, "gp3")
    env.ec2.get_waiter("volume_available").wait(VolumeIds=[vol], WaiterConfig=FAST)
    assert aws("wait", "volume-available", "--volume-ids", vol) is None
    listed = aws("describe-volumes", "--filters", "Name=tag:via,Values=aws", "Name=status,Values=available")
    assert [v["VolumeId"] for v in listed["Volumes"]] == [vol]

    assert aws("create-tags", "--resources", vol, "--tags", "Key=team,Value=db", "Key=flag") is None
    tags = aws("describe-tags", "--filters", f"Name=resource-id,Values={vol}")["Tags"]
    assert {t["Key"]: t["Value"] for t in tags} == {"Name": "cli", "via": "aws", "team": "db", "flag": ""}
    aws("delete-tags", "--resources", vol, "--tags", "Key=flag", "Key=team,Value=db")
    tags = aws("describe-tags", "--filters", f"Name=resource-id,Values={vol}", "Name=key,Values=team,flag")["Tags"]
    assert tags == []

    snap = aws("create-snapshot", "--volume-id", vol, "--description", "from the cli",
               "--tag-specifications", "ResourceType=snapshot,Tags=[{Key=via,Value=aws}]")
    env.ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[snap["SnapshotId"]], WaiterConfig=FAST)
    assert aws("wait", "snapshot-completed", "--snapshot-ids", snap["SnapshotId"]) is None
    snaps = aws("describe-snapshots", "--owner-ids", "self", "--filters", f"Name=volume-id,Values={vol}")
    assert [(s["SnapshotId"], s["State"], s["Progress"], s["Description"]) for s in snaps["Snapshots"]] == [
        (snap["SnapshotId"], "completed", "100%", "from the cli")]

    mod = aws("modify-volume", "--volume-id", vol, "--size", "2")["VolumeModification"]
    assert (mod["OriginalSize"], mod["TargetSize"]) == (1, 2)
    wait_modification(env, vol)
    mods = aws("describe-volumes-modifications", "--volume-ids", vol)["VolumesModifications"]
    assert [(m["ModificationState"], m["TargetSize"]) for m in mods] == [("completed", 2)]

    inst = aws("describe-instances", "--instance-ids", env.instance_id)["Reservations"][0]["Instances"][0]
    assert inst["State"]["Name"] == "running"
    att = aws("attach-volume", "--volume-id", vol, "--instance-id", env.instance_id, "--device", "/dev/sdk")
    try:
        assert (att["VolumeId"], att["Device"]) == (vol, "/dev/sdk")
        env.wait_attached(vol)
        assert aws("wait", "volume-in-use", "--volume-ids", vol) is None
        proc = aws("delete-volume", "--volume-id", vol, check=False)
        assert proc.returncode != 0 and "(VolumeInUse)" in proc.stderr, proc.stderr
        det = aws("detach-volume", "--volume-id", vol, "--instance-id", env.instance_id, "--force")
        assert det["State"] in ("detaching", "detached")
        env.ec2.get_waiter("volume_available").wait(VolumeIds=[vol], WaiterConfig=FAST)
        env.guest.wait_disk_gone(virtio_serial(vol), 30)
    finally:
        env.detach_quietly(vol)

    assert aws("delete-snapshot", "--snapshot-id", snap["SnapshotId"]) is None
    assert aws("delete-volume", "--volume-id", vol) is None
    env.ec2.get_waiter("volume_deleted").wait(VolumeIds=[vol], WaiterConfig=FAST)
    assert aws("describe-volumes", "--volume-ids", vol, "--filters", "Name=status,Values=deleted",
               "--query", "Volumes[0].State") == "deleted"

    # Errors come back as EC2 codes on stderr, with a failing exit status.
    for args, code in [
        (("describe-volumes", "--volume-ids", UNKNOWN_VOLUME), "InvalidVolume.NotFound"),
        (("delete-snapshot", "--snapshot-id", UNKNOWN_SNAPSHOT), "InvalidSnapshot.NotFound"),
        (("create-volume", "--size", "1", "--availability-zone", "us-east-1z"), "InvalidParameterValue"),
        (("create-volume", "--size", "1", "--availability-zone", ZONE, "--dry-run"), "DryRunOperation"),
        (("detach-volume", "--volume-id", UNKNOWN_VOLUME), "InvalidVolume.NotFound"),
    ]:
        proc = aws(*args, check=False)
        assert proc.returncode != 0 and f"({code})" in proc.stderr, (args, proc.stderr)
