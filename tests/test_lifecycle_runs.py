"""Lifecycle policies' runs with real processes (docs/lifecycle-policies.md, docs/scale-out.md):

* An instance policy takes a crash-consistent, multi-volume set of the tagged instance's volumes (the
  create-snapshots workflow: the VM paused while its volumes are fixed at one instant), without the volumes
  its ExcludeDataVolumeTags name, each snapshot tagged with the instance's id ($(instance-id)).
* Retention with an ArchiveRule: snapshots beyond the standard count are archived (the archive tier's
  workflow), archived ones beyond the archive count deleted through the ordinary delete path, and a locked
  one is kept, the run saying so in its error.
* Two controllers on PostgreSQL: controller A SIGKILLs itself in the middle of a run, after snapshotting its
  first target (``VBS_CRASH_AT=lifecycle-run:snapshot:done``); controller B takes the run over once A is gone
  and snapshots only the target A had not; every snapshot the policy made is recorded by exactly one run,
  and every due time from the first to the last has one row (run, or skipped with why).
* A policy deleted through ``dlm`` while its run is held after its first target: the run stops there, the
  snapshot it began completes and stays, nothing is left running or pending.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from tests.conftest import Vbs, VbsUp, node_token, vbs_up_with_guest, wait_until
from tests.test_controller_failover import Pair, pair  # noqa: F401  (the two controllers' fixture)
from tests.test_lifecycle_policies import POLICY_TAG, ROLE, details, every_minute, runs
from vbs.controller.db import Database, Operation, PolicyRun, Snapshot, Tag
from vbs.ids import virtio_serial

pytestmark = pytest.mark.integration

FAST_POLL = {"VBS_CONTROLLER_LIFECYCLE_POLL_S": "1"}


@pytest.fixture
def guest_install(tmp_path: Path) -> Iterator[tuple[Vbs, Any]]:
    with vbs_up_with_guest(tmp_path, env=FAST_POLL) as (vbs, _up, guest):
        yield vbs, guest


def attached_volume(vbs: Vbs, guest: Any, device: str, tags: dict[str, str]) -> str:
    vol = str(vbs.create_volume(size_gib=1, tags=tags)["volume_id"])
    vbs.wait_volume(vol, "available")
    r = vbs.http.post(f"/v1/volumes/{vol}/attach", json={"instance_id": vbs.instance("vm1"), "device": device})
    assert r.status_code == 200, r.text
    guest.wait_for_disk(virtio_serial(vol), 60)
    return vol


def test_an_instance_policy_takes_a_crash_consistent_set_of_its_volumes(guest_install: tuple[Vbs, Any]) -> None:
    vbs, guest = guest_install
    instance = vbs.instance("vm1")
    [name] = [i["name"] for i in vbs.http.get("/v1/instances").json()["instances"] if i["instance_id"] == instance]
    kept = [attached_volume(vbs, guest, dev, {"app": "db"}) for dev in ("vdb", "vdc")]
    skipped = attached_volume(vbs, guest, "vdd", {"scratch": "yes"})
    dlm, ec2 = vbs.aws("dlm"), vbs.ec2()
    pid = dlm.create_lifecycle_policy(
        ExecutionRoleArn=ROLE, Description="instance sets", State="ENABLED",
        PolicyDetails=details("INSTANCE", {"Key": "Name", "Value": name}, every_minute(
            "sets", retain=2, CopyTags=True, VariableTags=[{"Key": "instance", "Value": "$(instance-id)"}]),
            Parameters={"ExcludeDataVolumeTags": [{"Key": "scratch", "Value": "yes"}]}))["PolicyId"]
    [run] = wait_until(lambda: [r for r in runs(vbs, pid) if r["status"] == "succeeded"][:1], 240, interval=2,
                       what="the first run")
    dlm.update_lifecycle_policy(PolicyId=pid, State="DISABLED")
    assert list(run["snapshots"]) == [instance]
    snaps = run["snapshots"][instance]
    assert len(snaps) == 2
    for snap in snaps:
        vbs.wait_snapshot(snap, "completed", timeout=180)
    shown = ec2.describe_snapshots(SnapshotIds=snaps)["Snapshots"]
    assert sorted(s["VolumeId"] for s in shown) == sorted(kept) and skipped not in {s["VolumeId"] for s in shown}
    assert len({s["StartTime"] for s in shown}) == 1, "one instant for the whole set"
    for s in shown:
        tags = {t["Key"]: t["Value"] for t in s["Tags"]}
        assert tags == {"app": "db", "instance": instance, POLICY_TAG: pid,
                        "aws:dlm:lifecycle-schedule-name": "sets"}, tags
    assert guest.qmp("query-status")["status"] == "running", "the VM runs again after its set"


@dataclass
class Install:
    up: VbsUp
    vbs: Vbs


@pytest.fixture(scope="module")
def fast_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    """One ``vbs up`` (SQLite) for the module's volume policies, each targeting its own tag; its step holds
    reachable (VBS_TEST_HOOKS=1)."""
    tmp = tmp_path_factory.mktemp("lifecycle-runs")
    up = VbsUp(tmp / "var", tmp / "up.log", env={**FAST_POLL, "VBS_TEST_HOOKS": "1"})
    try:
        yield Install(up, up.start())
    finally:
        up.stop()


def test_retention_archives_beyond_the_count_and_keeps_a_locked_snapshot(fast_install: Install) -> None:
    vbs = fast_install.vbs
    vbs.create_volume(size_gib=1, tags={"tiered": "yes"})
    dlm = vbs.aws("dlm")
    pid = dlm.create_lifecycle_policy(
        ExecutionRoleArn=ROLE, Description="archive", State="ENABLED",
        PolicyDetails=details("VOLUME", {"Key": "tiered", "Value": "yes"}, every_minute(
            "tiered", retain=1, ArchiveRule={"RetainRule": {"RetentionArchiveTier": {"Count": 1}}})))["PolicyId"]
    [first] = wait_until(lambda: [r for r in runs(vbs, pid) if r["status"] == "succeeded"][:1], 150, interval=2,
                         what="the first run")
    [oldest] = [x for ids in first["snapshots"].values() for x in ids]
    vbs.wait_snapshot(oldest, "completed", timeout=120)
    r = vbs.http.put(f"/v1/snapshots/{oldest}/lock", json={"mode": "governance", "duration_days": 1})
    assert r.status_code == 200, r.text
    wait_until(lambda: len([r for r in runs(vbs, pid) if r["status"] == "succeeded"]) >= 3, 300, interval=2,
               what="three runs")
    dlm.update_lifecycle_policy(PolicyId=pid, State="DISABLED")
    wait_until(lambda: all(r["status"] != "running" for r in runs(vbs, pid)), 120, what="the last run ended")
    done = sorted(runs(vbs, pid), key=lambda r: r["due_at"])
    made = [x for r in done for ids in r["snapshots"].values() for x in ids]
    assert len(made) == len(done) >= 3 and made[0] == oldest

    def tier(snap: str) -> tuple[str, str]:
        shown = vbs.snapshot(snap)
        return shown["status"], shown["storage_tier"]

    # The newest in the standard tier, the one before it archived, the locked oldest kept (archived), the rest gone.
    expected = {made[-1]: ("completed", "standard"), made[-2]: ("completed", "archive"),
                oldest: ("completed", "archive"), **{x: ("deleted", "standard") for x in made[1:-2]}}
    wait_until(lambda: {x: tier(x) for x in made} == expected, 120, interval=1, what=f"{expected}")
    assert all(oldest in (r["error"] or "") and "locked" in (r["error"] or "") for r in done[2:]), done
    assert oldest in done[1]["retired"] and made[-2] in done[-1]["retired"]


def test_a_run_whose_controller_dies_is_taken_over_and_nothing_is_taken_twice(pair: Pair) -> None:  # noqa: F811
    b = pair.b
    ec2, dlm = b.ec2(), b.aws("dlm")
    vols = sorted(ec2.create_volume(Size=1, AvailabilityZone="us-east-1a", TagSpecifications=[{
        "ResourceType": "volume", "Tags": [{"Key": "backup", "Value": "yes"}]}])["VolumeId"] for _ in range(2))
    pid = dlm.create_lifecycle_policy(ExecutionRoleArn=ROLE, Description="takeover", State="ENABLED",
                                      PolicyDetails=details("VOLUME", {"Key": "backup", "Value": "yes"},
                                                            every_minute(retain=50)))["PolicyId"]
    # A polls every second, B every ten: A takes a due run first, snapshots the first volume and dies.
    pair.start_a(VBS_CRASH_AT="lifecycle-run:snapshot:done", **FAST_POLL)
    assert pair.a is not None
    wait_until(lambda: pair.a is not None and pair.a.poll() is not None, 300, interval=1, what="controller A's crash")
    assert pair.a.returncode == -signal.SIGKILL
    pair.a = None  # reaped: nothing of it is left to stop
    log = pair.svc.tmp / "controller-b.log"
    found = wait_until(lambda: re.search(r"lifecycle run (run-[0-9a-f]{17}) taken over from controller ctl-a",
                                         log.read_text(errors="replace")), 120, interval=1, what="B's takeover")
    taken = found.group(1)
    wait_until(lambda: next(r for r in runs(b, pid) if r["run_id"] == taken)["status"] != "running", 120,
               what="the taken-over run ended")
    dlm.update_lifecycle_policy(PolicyId=pid, State="DISABLED")
    wait_until(lambda: all(r["status"] != "running" for r in runs(b, pid)), 120, what="every run ended")
    done = sorted(runs(b, pid), key=lambda r: r["due_at"])
    run = next(r for r in done if r["run_id"] == taken)
    assert run["controller"] == "ctl-b" and run["status"] == "succeeded", run
    assert sorted(run["snapshots"]) == vols and all(len(v) == 1 for v in run["snapshots"].values()), run
    # Every snapshot the policy ever made is one run's, once; each run snapshotted each volume once.
    with pair.db.read() as s:
        made = set(s.scalars(select(Snapshot.id).where(Snapshot.id.in_(
            select(Tag.resource_id).where(Tag.key == POLICY_TAG, Tag.value == pid)))))
        rows = list(s.scalars(select(PolicyRun).where(PolicyRun.policy_id == pid).order_by(PolicyRun.due_at)))
        recorded = [x for r in rows for ids in (r.targets or {}).values() for x in ids]
        dues = [r.due_at for r in rows]
    assert sorted(recorded) == sorted(made), "a snapshot made but not recorded, or recorded twice"
    assert all(sorted(r["snapshots"]) == vols for r in done if r["status"] == "succeeded"), done
    assert all(y - x == timedelta(minutes=1) for x, y in zip(dues, dues[1:], strict=False)), dues
    assert all(r["status"] in ("succeeded", "skipped") for r in done), done
    assert all(r["error"] for r in done if r["status"] == "skipped")


def test_a_policy_deleted_in_the_middle_of_its_run_stops_it_and_keeps_what_it_made(
        fast_install: Install) -> None:
    """The run is held (a step hold, VBS_TEST_HOOKS=1) after it began its first target's snapshot, that
    snapshot itself held before its storage call; the policy is deleted through ``dlm``; then both go on. The
    run stops at once: its second target gets no snapshot, no run row is left (they go with the policy), the
    controller says why; the snapshot it began completes and stays, tagged as the policy's, as AWS keeps a
    deleted policy's snapshots; nothing is left pending or unfinished (docs/lifecycle-policies.md, "Runs")."""
    up, vbs = fast_install.up, fast_install.vbs
    ec2, dlm = vbs.ec2(), vbs.aws("dlm")
    first, second = sorted(ec2.create_volume(Size=1, AvailabilityZone="us-east-1a", TagSpecifications=[{
        "ResourceType": "volume", "Tags": [{"Key": "midrun", "Value": "yes"}]}])["VolumeId"] for _ in range(2))
    internal = {"authorization": f"Bearer {node_token(vbs.data_dir, 'storage', 'storage-1')}"}
    holds = [{"kind": "lifecycle-run", "step": "next-target"}, {"kind": "create-snapshot", "step": "storage-snapshot"}]
    for hook in holds:
        assert vbs.http.post("/internal/v1/test/hold-step", json=hook, headers=internal).status_code == 200
    try:
        pid = dlm.create_lifecycle_policy(ExecutionRoleArn=ROLE, Description="deleted mid-run", State="ENABLED",
                                          PolicyDetails=details("VOLUME", {"Key": "midrun", "Value": "yes"},
                                                                every_minute("mid-run", retain=5)))["PolicyId"]
        for hook in holds:  # the run after its first target, that target's snapshot before its storage call
            wait_until(lambda h=hook: vbs.http.post("/internal/v1/test/held-step", json=h, headers=internal)
                       .json()["held"], 150, interval=1, what=f"{hook} held")
        [running] = runs(vbs, pid)
        assert running["status"] == "running" and list(running["snapshots"]) == [first], running
        [made] = running["snapshots"][first]
        assert vbs.snapshot(made)["status"] == "pending"
        dlm.delete_lifecycle_policy(PolicyId=pid)
        assert vbs.http.get(f"/v1/lifecycle-policies/{pid}/runs").status_code == 404
    finally:
        for hook in holds:
            vbs.http.post("/internal/v1/test/release-step", json=hook, headers=internal)
    found = wait_until(lambda: re.search(rf"lifecycle run {running['run_id']} (.*)", up.log_path.read_text(
        errors="replace")), 60, interval=1, what="the run's end")
    assert found.group(1) == "stopped: its policy was deleted"
    vbs.wait_snapshot(made, "completed", timeout=120)
    [shown] = ec2.describe_snapshots(SnapshotIds=[made])["Snapshots"]
    assert shown["VolumeId"] == first and {"Key": POLICY_TAG, "Value": pid} in shown["Tags"]
    assert ec2.describe_snapshots(OwnerIds=["self"], Filters=[{"Name": "volume-id", "Values": [second]}])[
        "Snapshots"] == [], "the run went on after its policy was deleted"
    db = Database.for_data_dir(vbs.data_dir)
    try:
        with db.read() as s:
            assert list(s.scalars(select(PolicyRun.id).where(PolicyRun.policy_id == pid))) == []
            assert list(s.scalars(select(PolicyRun.id).where(PolicyRun.status == "running"))) == []
            made_by_policy = list(s.scalars(select(Snapshot.id).where(Snapshot.id.in_(
                select(Tag.resource_id).where(Tag.key == POLICY_TAG, Tag.value == pid)))))
            unfinished = list(s.scalars(select(Operation.id).where(Operation.resource_id == made,
                                                                   Operation.status != "succeeded")))
    finally:
        db.dispose()
    assert made_by_policy == [made] and unfinished == []
    ec2.delete_snapshot(SnapshotId=made)  # the module's install goes on without it
