"""Data Lifecycle Manager against a real ``vbs up``, driven by boto3's own ``dlm`` client (SigV4 for ``dlm``,
AWS's rest-json shapes and errors), the REST routes and the CLI (docs/lifecycle-policies.md).

The module runs on SQLite (one controller) and on PostgreSQL with two controllers (``postgresql-2``,
``vbs up --controllers 2``), both of which run the scheduler: a policy snapshotting a tagged volume every
minute and keeping three is left to run four times; then exactly its three newest snapshots remain, each
tagged as the policy says, every due time was run once (one run row, one snapshot), and none was skipped.
That test is four minutes of each install's worker asleep (the CPU goes to the other workers meanwhile).

The Recycle Bin's test with two controllers runs on the same install (its Recycle Bin "day" is BIN_DAY_S),
where both controllers run the housekeeping that ends retentions (docs/recycle-bin.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from sqlalchemy import select

from tests.conftest import Vbs, VbsUp, database_flags, wait_until

pytestmark = pytest.mark.integration
BOTH = pytest.mark.parametrize("metadata_db", ("sqlite", "postgresql-2"), indirect=True, scope="module")

ROLE = "arn:aws:iam::000000000000:role/AWSDataLifecycleManagerDefaultRole"
POLICY_TAG = "aws:dlm:lifecycle-policy-id"
SCHEDULE_TAG = "aws:dlm:lifecycle-schedule-name"
RUNS = 4
RETAIN = 3
BIN_DAY_S = 2  # one Recycle Bin "day" of these installs (the Recycle Bin test below)


@dataclass
class Install:
    vbs: Vbs
    endpoints: list[str]
    database_url: str | None  # PostgreSQL's; None on SQLite
    log: Path


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory, metadata_db: str, request: pytest.FixtureRequest
            ) -> Iterator[Install]:
    tmp = tmp_path_factory.mktemp("lifecycle")
    controllers = 2 if metadata_db == "postgresql-2" else 1
    flags = database_flags(metadata_db.removesuffix("-2"), request)
    if controllers == 2:
        flags += ["--controllers", "2"]
    up = VbsUp(tmp / "var", tmp / "up.log", extra=flags, ports=controllers,
               env={"VBS_CONTROLLER_LIFECYCLE_POLL_S": "1", "VBS_CONTROLLER_RECYCLE_BIN_DAY_S": str(BIN_DAY_S)})
    try:
        vbs = up.start(timeout=180)
        url = flags[flags.index("--database-url") + 1] if "--database-url" in flags else None
        yield Install(vbs, [f"http://127.0.0.1:{up.port + k}" for k in range(controllers)], url, up.log_path)
    finally:
        up.stop()


def details(resource: str, target: dict[str, str], *schedules: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"PolicyType": "EBS_SNAPSHOT_MANAGEMENT", "ResourceTypes": [resource], "TargetTags": [target],
            "Schedules": list(schedules), **more}


def every_minute(name: str = "every minute", retain: int = RETAIN, **more: Any) -> dict[str, Any]:
    return {"Name": name, "CreateRule": {"Interval": 1, "IntervalUnit": "MINUTES"}, "RetainRule": {"Count": retain},
            **more}


def policy_snapshots(ec2: Any, policy_id: str) -> dict[str, dict[str, str]]:
    """The live snapshots the policy made: id -> tags."""
    found = ec2.describe_snapshots(OwnerIds=["self"],
                                   Filters=[{"Name": f"tag:{POLICY_TAG}", "Values": [policy_id]}])["Snapshots"]
    return {s["SnapshotId"]: {t["Key"]: t["Value"] for t in s.get("Tags", [])} for s in found
            if s["State"] in ("pending", "completed")}


def runs(vbs: Vbs, policy_id: str) -> list[dict[str, Any]]:
    r = vbs.http.get(f"/v1/lifecycle-policies/{policy_id}/runs")
    assert r.status_code == 200, r.text
    return list(r.json()["runs"])


@BOTH
def test_a_one_minute_policy_keeps_the_three_newest_snapshots_of_each_run(install: Install) -> None:
    vbs = install.vbs
    ec2, dlm = vbs.ec2(), vbs.aws("dlm")
    vol = ec2.create_volume(Size=1, AvailabilityZone="us-east-1a", TagSpecifications=[{
        "ResourceType": "volume", "Tags": [{"Key": "backup", "Value": "minutely"}, {"Key": "team", "Value": "db"}]}])
    other = ec2.create_volume(Size=1, AvailabilityZone="us-east-1a")  # not targeted
    pid = dlm.create_lifecycle_policy(
        ExecutionRoleArn=ROLE, Description="every minute keep three", State="ENABLED", Tags={"owner": "tests"},
        PolicyDetails=details("VOLUME", {"Key": "backup", "Value": "minutely"}, every_minute(
            CopyTags=True, TagsToAdd=[{"Key": "made-by", "Value": "dlm"}])))["PolicyId"]
    assert pid.startswith("policy-")

    def succeeded() -> list[dict[str, Any]]:
        return [r for r in runs(vbs, pid) if r["status"] == "succeeded"]

    wait_until(lambda: len(succeeded()) >= RUNS, 60 * (RUNS + 3), interval=2, what=f"{RUNS} runs")
    dlm.update_lifecycle_policy(PolicyId=pid, State="DISABLED")  # no run starts after this
    wait_until(lambda: all(r["status"] != "running" for r in runs(vbs, pid)), 120, what="the last run ended")
    done = sorted(runs(vbs, pid), key=lambda r: r["due_at"])
    # Every due time once, one minute apart, none skipped, each run one snapshot of the targeted volume only.
    assert [r["status"] for r in done] == ["succeeded"] * len(done), done
    dues = [r["due_at"] for r in done]
    assert len(set(dues)) == len(dues)
    assert all(b - a == timedelta(minutes=1) for a, b in zip(
        [_when(d) for d in dues], [_when(d) for d in dues[1:]], strict=False)), dues
    made = [r["snapshots"] for r in done]
    assert all(list(m) == [vol["VolumeId"]] and len(m[vol["VolumeId"]]) == 1 for m in made), made
    ids = [m[vol["VolumeId"]][0] for m in made]
    assert len(set(ids)) == len(ids), "a run took a snapshot twice"
    assert other["VolumeId"] not in {x for m in made for x in m}
    # Exactly the three newest remain (older ones retired by the runs after them, through the ordinary delete).
    wait_until(lambda: set(policy_snapshots(ec2, pid)) == set(ids[-RETAIN:]), 120, interval=1,
               what="the three newest snapshots only")
    assert set(ids[:-RETAIN]) <= {x for r in done for x in r["retired"]}
    controllers = {c["controller_id"] for c in vbs.cli("describe-controllers")["controllers"]}
    assert len(controllers) == len(install.endpoints)
    assert {r["controller"] for r in done} <= controllers, (done, controllers)
    for tags in policy_snapshots(ec2, pid).values():
        assert tags == {"backup": "minutely", "team": "db", "made-by": "dlm", POLICY_TAG: pid,
                        SCHEDULE_TAG: "every minute"}, tags
    # Visible: AWS's StatusMessage, the REST policy's last run, the CLI.
    policy = dlm.get_lifecycle_policy(PolicyId=pid)["Policy"]
    assert policy["State"] == "DISABLED" and "succeeded" in policy["StatusMessage"]
    assert policy["Tags"] == {"owner": "tests"} and policy["PolicyArn"].endswith(f":policy/{pid}")
    assert vbs.cli("get-lifecycle-policy", pid)["last_run"]["run_id"] == done[-1]["run_id"]
    shown = vbs.cli("describe-policy-runs", pid)["runs"]
    assert [r["run_id"] for r in shown] == [r["run_id"] for r in reversed(done)]
    listed = dlm.get_lifecycle_policies(State="DISABLED", ResourceTypes=["VOLUME"])["Policies"]
    assert [p["PolicyId"] for p in listed] == [pid]
    dlm.delete_lifecycle_policy(PolicyId=pid)
    assert set(policy_snapshots(ec2, pid)) == set(ids[-RETAIN:]), "a deleted policy's snapshots stay"


def _when(text: str) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00"))


BAD_SCHEDULES = [
    (every_minute(FastRestoreRule={"Count": 1, "AvailabilityZones": ["us-east-1a"]}), "FastRestoreRule"),
    (every_minute(CrossRegionCopyRules=[{"TargetRegion": "eu-west-1", "Encrypted": False}]), "CrossRegionCopyRules"),
    (every_minute(ShareRules=[{"TargetAccounts": ["123456789012"]}]), "ShareRules"),
    ({"Name": "bad cron", "CreateRule": {"CronExpression": "cron(0 9 * * MON *)"}, "RetainRule": {"Count": 1}},
     "Day-of-month"),
    ({"Name": "bad cron", "CreateRule": {"CronExpression": "cron(61 9 ? * MON *)"}, "RetainRule": {"Count": 1}},
     "Minutes"),
    ({"Name": "odd hours", "CreateRule": {"Interval": 5, "IntervalUnit": "HOURS"}, "RetainRule": {"Count": 1}},
     "HOURS"),
    (every_minute(retain=0), "Count"),
    ({"Name": "both", "CreateRule": {"Interval": 1, "IntervalUnit": "MINUTES"},
      "RetainRule": {"Count": 2, "Interval": 1, "IntervalUnit": "DAYS"}}, "one of the two"),
]


@BOTH
@pytest.mark.parametrize(("schedule", "named"), BAD_SCHEDULES)
def test_what_vbs_does_not_do_is_refused_with_aws_errors_and_nothing_is_made(
        install: Install, schedule: dict[str, Any], named: str) -> None:
    dlm = install.vbs.aws("dlm")
    before = dlm.get_lifecycle_policies()["Policies"]
    with pytest.raises(ClientError) as exc:
        dlm.create_lifecycle_policy(ExecutionRoleArn=ROLE, Description="refused", State="ENABLED",
                                    PolicyDetails=details("VOLUME", {"Key": "a", "Value": "b"}, schedule))
    err = exc.value.response
    assert err["Error"]["Code"] == "InvalidRequestException" and named in err["Error"]["Message"], err["Error"]
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert dlm.get_lifecycle_policies()["Policies"] == before


@pytest.mark.parametrize("metadata_db", ("sqlite",), indirect=True, scope="module")
def test_a_cron_schedule_fires_at_its_times_and_age_retention_retires_what_is_older(install: Install) -> None:
    """A CronExpression schedule runs at exactly its two next times (minutes m and m+1 of this hour, UTC), and
    a RetainRule by age (one DAY) retires at the second run the first run's snapshot once it is older than
    that. A day cannot pass in a test: between the runs the test moves the first snapshot's start two days
    back in the metadata DB (the only change made behind the API), so the age rule, not a count, retires it."""
    from datetime import UTC, datetime

    from vbs.controller.db import Database, Snapshot

    vbs = install.vbs
    ec2, dlm = vbs.ec2(), vbs.aws("dlm")
    vol = ec2.create_volume(Size=1, AvailabilityZone="us-east-1a", TagSpecifications=[{
        "ResourceType": "volume", "Tags": [{"Key": "backup", "Value": "cron"}]}])["VolumeId"]
    first = (datetime.now(UTC) + timedelta(seconds=100)).replace(second=0, microsecond=0)
    if first.minute == 59:  # both times in one hour, so that one Hours value names them
        first += timedelta(minutes=1)
    cron = f"cron({first.minute},{first.minute + 1} {first.hour} * * ? *)"
    pid = dlm.create_lifecycle_policy(
        ExecutionRoleArn=ROLE, Description="cron and age", State="ENABLED",
        PolicyDetails=details("VOLUME", {"Key": "backup", "Value": "cron"}, {
            "Name": "cron", "CreateRule": {"CronExpression": cron},
            "RetainRule": {"Interval": 1, "IntervalUnit": "DAYS"}}))["PolicyId"]

    def succeeded() -> list[dict[str, Any]]:
        return sorted((r for r in runs(vbs, pid) if r["status"] == "succeeded"), key=lambda r: r["due_at"])

    [one] = wait_until(lambda: succeeded() or None, 300, interval=1, what="the first cron run")
    assert _when(one["due_at"]) == first, (one, cron)
    [older] = one["snapshots"][vol]
    vbs.wait_snapshot(older, "completed", timeout=120)
    db = Database.for_data_dir(vbs.data_dir)
    try:
        with db.session() as s:
            row = s.get(Snapshot, older)
            assert row is not None
            row.started_at = row.started_at - timedelta(days=2)
    finally:
        db.dispose()
    done = wait_until(lambda: succeeded() if len(succeeded()) >= 2 else None, 180, interval=1,
                      what="the second cron run")
    dlm.update_lifecycle_policy(PolicyId=pid, State="DISABLED")
    assert [_when(r["due_at"]) for r in done] == [first, first + timedelta(minutes=1)], done
    [newer] = done[1]["snapshots"][vol]
    assert done[1]["retired"] == [older], done[1]
    wait_until(lambda: set(policy_snapshots(ec2, pid)) == {newer}, 120, interval=1,
               what="the newer snapshot only")
    wait_until(lambda: vbs.http.get(f"/v1/snapshots/{older}").status_code == 404, 120, interval=1,
               what="the older snapshot deleted")
    with pytest.raises(ClientError) as exc:
        ec2.describe_snapshots(SnapshotIds=[older])
    assert exc.value.response["Error"]["Code"] == "InvalidSnapshot.NotFound"
    vbs.wait_snapshot(newer, "completed", timeout=120)
    dlm.delete_lifecycle_policy(PolicyId=pid)
    ec2.delete_snapshot(SnapshotId=newer)


@BOTH
def test_unsupported_policies_and_unknown_ones_answer_aws_errors(install: Install) -> None:
    vbs = install.vbs
    dlm = vbs.aws("dlm")
    target = {"Key": "a", "Value": "b"}
    refused: list[tuple[dict[str, Any], str]] = [
        ({"PolicyDetails": details("VOLUME", target, every_minute(), PolicyType="IMAGE_MANAGEMENT")},
         "IMAGE_MANAGEMENT"),
        ({"PolicyDetails": {"PolicyType": "EVENT_BASED_POLICY", "EventSource": {"Type": "MANAGED_CWE"}}},
         "Event-based"),
        ({"DefaultPolicy": "VOLUME", "CreateInterval": 1, "RetainInterval": 7}, "Default policies"),
        ({"PolicyDetails": details("VOLUME", target, every_minute(VariableTags=[
            {"Key": "instance", "Value": "$(instance-id)"}]))}, "VariableTags"),
        ({"PolicyDetails": details("VOLUME", target, every_minute()), "ExecutionRoleArn": "not-an-arn"},
         "ExecutionRoleArn"),
    ]
    for extra, named in refused:
        args = {"ExecutionRoleArn": ROLE, "Description": "refused", "State": "ENABLED", **extra}
        with pytest.raises(ClientError) as exc:
            dlm.create_lifecycle_policy(**args)
        assert exc.value.response["Error"]["Code"] == "InvalidRequestException", (named, exc.value.response)
        assert named in exc.value.response["Error"]["Message"], (named, exc.value.response["Error"])
    unknown = "policy-0123456789abcdef0"
    arn = f"arn:aws:dlm:us-east-1:000000000000:policy/{unknown}"
    calls: list[tuple[str, dict[str, Any]]] = [
        ("get_lifecycle_policy", {"PolicyId": unknown}),
        ("update_lifecycle_policy", {"PolicyId": unknown, "State": "DISABLED"}),
        ("delete_lifecycle_policy", {"PolicyId": unknown}), ("list_tags_for_resource", {"ResourceArn": arn})]
    for name, kwargs in calls:
        with pytest.raises(ClientError) as exc:
            getattr(dlm, name)(**kwargs)
        assert exc.value.response["Error"]["Code"] == "ResourceNotFoundException"
        assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    # A wrong secret is refused before anything is read.
    with pytest.raises(ClientError) as exc:
        vbs.aws("dlm", secret="x" * 40).get_lifecycle_policies()
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] in (401, 403)
    # A good policy, tagged and untagged through its ARN; an update with a bad document changes nothing.
    pid = dlm.create_lifecycle_policy(ExecutionRoleArn=ROLE, Description="daily", State="DISABLED",
                                      PolicyDetails=details("VOLUME", target, {
                                          "Name": "daily", "CreateRule": {"CronExpression": "cron(30 2 ? * * *)"},
                                          "RetainRule": {"Interval": 2, "IntervalUnit": "WEEKS"}}))["PolicyId"]
    arn = dlm.get_lifecycle_policy(PolicyId=pid)["Policy"]["PolicyArn"]
    dlm.tag_resource(ResourceArn=arn, Tags={"env": "test", "team": "storage"})
    dlm.untag_resource(ResourceArn=arn, TagKeys=["team"])
    assert dlm.list_tags_for_resource(ResourceArn=arn)["Tags"] == {"env": "test"}
    kept = dlm.get_lifecycle_policy(PolicyId=pid)["Policy"]
    with pytest.raises(ClientError) as exc:
        dlm.update_lifecycle_policy(PolicyId=pid, PolicyDetails=details("VOLUME", target, every_minute(
            ShareRules=[{"TargetAccounts": ["123456789012"]}])))
    assert exc.value.response["Error"]["Code"] == "InvalidRequestException"
    assert dlm.get_lifecycle_policy(PolicyId=pid)["Policy"] == kept
    assert vbs.http.get(f"/v1/lifecycle-policies/{pid}").json()["state"] == "DISABLED"
    dlm.delete_lifecycle_policy(PolicyId=pid)


@BOTH
def test_the_cli_makes_changes_and_deletes_a_policy_from_an_aws_policy_details_file(
        install: Install, tmp_path: Path) -> None:
    vbs = install.vbs
    doc = tmp_path / "details.json"
    doc.write_text(json.dumps(details("VOLUME", {"Key": "cli", "Value": "yes"}, {
        "Name": "twice a day", "CreateRule": {"Interval": 12, "IntervalUnit": "HOURS", "Times": ["03:00"]},
        "RetainRule": {"Count": 14}})))
    made = vbs.cli("create-lifecycle-policy", "--policy-details", str(doc), "--description", "from the cli",
                   "--state", "DISABLED", "--tag", "team=ops")
    pid = made["policy_id"]
    assert made["state"] == "DISABLED" and made["tags"] == {"team": "ops"} and made["last_run"] is None
    assert made["policy_details"]["Schedules"][0]["CreateRule"]["Times"] == ["03:00"]
    assert [p["policy_id"] for p in vbs.cli("get-lifecycle-policies", "--state", "DISABLED")["policies"]] == [pid]
    assert vbs.cli("update-lifecycle-policy", pid, "--description", "renamed")["description"] == "renamed"
    doc.write_text(json.dumps(details("VOLUME", {"Key": "cli", "Value": "yes"}, every_minute(
        FastRestoreRule={"Count": 1}))))
    refused = vbs.cli("update-lifecycle-policy", pid, "--policy-details", str(doc), check=False)
    assert refused.returncode != 0 and "FastRestoreRule" in refused.stderr
    assert vbs.cli("describe-policy-runs", pid)["runs"] == []
    assert vbs.cli("delete-lifecycle-policy", pid)["policy_id"] == pid
    gone = vbs.cli("get-lifecycle-policy", pid, check=False)
    assert gone.returncode != 0 and "does not exist" in gone.stderr


def _volume_with_data(vbs: Vbs, tag: str) -> str:
    vol = str(vbs.create_volume(size_gib=1, tags={"rbin2": tag})["volume_id"])
    vbs.wait_volume(vol, "available")
    with open(vbs.pool / "volumes" / f"{vol}.raw", "r+b") as f:
        f.write(b"d" * (4 << 20))
    return vol


def _snapshot_of(vbs: Vbs, vol: str, tag: str) -> str:
    r = vbs.http.post("/v1/snapshots", json={"volume_id": vol, "tags": {"rbin2": tag}})
    assert r.status_code == 200, r.text
    vbs.wait_snapshot(r.json()["snapshot_id"], "completed", timeout=120)
    return str(r.json()["snapshot_id"])


@pytest.mark.parametrize("metadata_db", ("postgresql-2",), indirect=True, scope="module")
def test_the_recycle_bin_works_through_either_controller_and_expires_once(install: Install) -> None:
    """The Recycle Bin (docs/recycle-bin.md) on PostgreSQL with two controllers, both running the
    housekeeping (this install's Recycle Bin "day" is BIN_DAY_S): rules made through one controller are the
    other's; deletes through either go to the bin, are listed and restored through either; a retention that
    ends frees the pool file and the store manifest through exactly one delete operation of each resource,
    started once although both controllers look for expired entries (the housekeeping lease, and the entry
    taken out of the bin in the transaction that begins the delete)."""
    from vbs.controller.db import Database, Operation, RecycleBinEntry

    first = install.vbs
    second = Vbs(install.endpoints[1], first.data_dir)
    rbin1, rbin2, ec2_1, ec2_2 = first.aws("rbin"), second.aws("rbin"), first.ec2(), second.ec2()
    rules = [rbin1.create_rule(ResourceType=kind, RetentionPeriod={"RetentionPeriodValue": n,
                                                                  "RetentionPeriodUnit": "DAYS"},
                               ResourceTags=[{"ResourceTagKey": "rbin2", "ResourceTagValue": tag}])["Identifier"]
             for kind in ("EBS_SNAPSHOT", "EBS_VOLUME") for tag, n in (("keep", 300), ("expire", 2))]
    assert [rbin2.get_rule(Identifier=r)["RetentionPeriod"]["RetentionPeriodValue"] for r in rules] == [
        300, 2, 300, 2]
    kept_vol, gone_vol = _volume_with_data(first, "keep"), _volume_with_data(second, "expire")
    kept_snap, gone_snap = _snapshot_of(first, kept_vol, "keep"), _snapshot_of(second, gone_vol, "expire")
    manifests = first.data_dir / "snapshots" / "manifests"
    gone_file = first.pool / "volumes" / f"{gone_vol}.raw"
    assert (manifests / gone_snap).is_file() and gone_file.is_file()
    # Into the bin through either controller: EC2 on the first, REST on the second (it answers the state).
    ec2_1.delete_snapshot(SnapshotId=kept_snap)
    ec2_1.delete_volume(VolumeId=kept_vol)
    for path in (f"/v1/snapshots/{gone_snap}", f"/v1/volumes/{gone_vol}"):
        r = second.http.delete(path)
        assert r.status_code == 200 and r.json()["status"] == "recoverable", r.text
    for ec2 in (ec2_1, ec2_2):
        assert kept_snap in {s["SnapshotId"] for s in ec2.list_snapshots_in_recycle_bin()["Snapshots"]}
        assert kept_vol in {v["VolumeId"] for v in ec2.list_volumes_in_recycle_bin()["Volumes"]}
        assert _code(lambda e=ec2: e.describe_snapshots(SnapshotIds=[kept_snap])) == "InvalidSnapshot.NotFound"
    # Restored through either.
    assert ec2_2.restore_snapshot_from_recycle_bin(SnapshotId=kept_snap)["State"] == "completed"
    assert ec2_1.restore_volume_from_recycle_bin(VolumeId=kept_vol)["Return"] is True
    assert ec2_1.describe_snapshots(SnapshotIds=[kept_snap])["Snapshots"][0]["State"] == "completed"
    assert ec2_2.describe_volumes(VolumeIds=[kept_vol])["Volumes"][0]["State"] == "available"
    # The short retention ends: the data is freed, once.
    wait_until(lambda: not (manifests / gone_snap).exists() and not gone_file.exists(), 2 * BIN_DAY_S + 180,
               interval=1, what="the end of the short retention")
    wait_until(lambda: second.http.get(f"/v1/volumes/{gone_vol}").json().get("status") == "deleted", 60,
               what="the volume's row deleted")
    assert first.http.get(f"/v1/snapshots/{gone_snap}").status_code == 404
    assert not (first.pool / "snapshots" / f"{gone_snap}.raw").exists()
    assert install.database_url is not None
    db = Database(install.database_url)
    try:
        with db.read() as s:
            ops = sorted((o.kind, o.resource_id, o.status) for o in s.scalars(select(Operation).where(
                Operation.resource_id.in_([gone_snap, gone_vol, kept_snap, kept_vol]),
                Operation.kind.in_(["delete-snapshot", "delete-volume"]))))
            left = list(s.scalars(select(RecycleBinEntry.resource_id)))
    finally:
        db.dispose()
    assert ops == sorted([("delete-snapshot", gone_snap, "succeeded"), ("delete-volume", gone_vol, "succeeded")])
    assert left == []
    log = install.log.read_text(errors="replace")
    for name in (f"snapshot {gone_snap}", f"volume {gone_vol}"):
        assert log.count(f"{name}: its Recycle Bin retention ended") == 1, name
    for rule in rules:
        rbin2.delete_rule(Identifier=rule)
    ec2_2.delete_snapshot(SnapshotId=kept_snap)  # no rule left: really deleted
    ec2_2.delete_volume(VolumeId=kept_vol)


def _code(call: Any) -> str:
    with pytest.raises(ClientError) as exc:
        call()
    return str(exc.value.response["Error"]["Code"])
