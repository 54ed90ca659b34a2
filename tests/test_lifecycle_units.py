"""The pieces of Data Lifecycle Manager without a service: due times of interval and cron schedules
(vbs.controller.lifecycle.schedule), which snapshots a RetainRule and an ArchiveRule retire
(lifecycle.retention), the checks of a policy document (lifecycle.document), and the scheduler's claims
on a real metadata DB: two controllers claiming the same due time make one run, a missed due time is
recorded as skipped, and a running run is taken over only from a controller that is gone (lifecycle.runs)."""

from __future__ import annotations

import threading
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from sqlalchemy import select

from tests.conftest import UNIT_DATABASES, fresh_database
from vbs.controller.db import ControllerRecord, Database, LifecyclePolicy, PolicyRun
from vbs.controller.lifecycle import document
from vbs.controller.lifecycle.errors import InvalidRequest
from vbs.controller.lifecycle.retention import Kept, older_than, retire
from vbs.controller.lifecycle.runs import MISSED, LifecycleScheduler, purge
from vbs.controller.lifecycle.schedule import CronError, cadence_of

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 30, 10, 17, 30, tzinfo=UTC)  # a Monday
DEC1 = datetime(2026, 12, 1, tzinfo=UTC)


def at(hh: int, mm: int, day: int = 30) -> datetime:
    return datetime(2026, 11, day, hh, mm, tzinfo=UTC)


# -- schedules -------------------------------------------------------------------------------------------


def test_interval_schedules_are_due_from_their_time_of_day() -> None:
    every12 = cadence_of({"Interval": 12, "IntervalUnit": "HOURS", "Times": ["09:30"]})
    assert every12.last_due(T0) == at(9, 30)
    assert every12.due_between(T0, T0 + timedelta(days=1), 10) == [at(21, 30), DEC1.replace(hour=9, minute=30)]
    daily = cadence_of({"Interval": 24, "IntervalUnit": "HOURS"})
    assert daily.last_due(T0) == at(0, 0)
    minutes = cadence_of({"Interval": 15, "IntervalUnit": "MINUTES"})
    assert minutes.last_due(T0) == at(10, 15)
    assert minutes.due_between(at(10, 15), at(11, 0), 2) == [at(10, 30), at(10, 45)]


@pytest.mark.parametrize(("expression", "last", "following"), [
    ("cron(0 9 ? * MON-FRI *)", at(9, 0), [DEC1.replace(hour=9)]),
    ("cron(0/20 8-10 ? * 2 *)", at(10, 0), [at(10, 20), at(10, 40)]),  # 2 = Monday, AWS counts Sunday as 1
    ("cron(30 2 1,15 * ? *)", at(2, 30, 15), [DEC1.replace(hour=2, minute=30)]),
    ("cron(0 12 ? JAN SUN 2027)", None, [datetime(2027, 1, 3, 12, 0, tzinfo=UTC)]),
])
def test_cron_schedules_follow_aws_six_fields(expression: str, last: datetime | None,
                                              following: list[datetime]) -> None:
    cadence = cadence_of({"CronExpression": expression})
    assert cadence.last_due(T0) == last
    assert cadence.due_between(T0, T0 + timedelta(days=400), len(following)) == following


@pytest.mark.parametrize("expression", [
    "cron(0 9 * * MON *)", "cron(0 9 ? * 2#1 *)", "cron(0 9 L * ? *)", "cron(0 24 ? * * *)", "cron(0 9 ? * *)",
    "cron(5-1 9 ? * * *)", "rate(1 hour)xxxxxxxx",
])
def test_cron_expressions_vbs_does_not_take_are_refused(expression: str) -> None:
    with pytest.raises(CronError):
        cadence_of({"CronExpression": expression})


# -- retention -------------------------------------------------------------------------------------------


def kept(n: int, *, archived: Collection[int] = (), pending: Collection[int] = ()) -> list[Kept]:
    """Snapshots s0 (oldest) .. s{n-1} (newest), a day apart."""
    return [Kept(f"s{i}", T0 - timedelta(days=n - i), i not in pending, i in archived) for i in range(n)]


def test_retention_by_count_deletes_the_oldest_completed_ones() -> None:
    assert retire(kept(5), {"Count": 3}, None, T0) == ([], ["s1", "s0"])
    assert retire(kept(5, pending={0}), {"Count": 3}, None, T0) == ([], ["s1"])  # pending: next time
    assert retire(kept(2), {"Count": 3}, None, T0) == ([], [])


def test_retention_by_age_uses_calendar_units() -> None:
    assert retire(kept(10), {"Interval": 1, "IntervalUnit": "WEEKS"}, None, T0) == ([], ["s2", "s1", "s0"])
    assert older_than(datetime(2026, 3, 31, tzinfo=UTC), 1, "MONTHS") == datetime(2026, 2, 28, tzinfo=UTC)
    assert older_than(datetime(2028, 2, 29, tzinfo=UTC), 1, "YEARS") == datetime(2027, 2, 28, tzinfo=UTC)


def test_an_archive_rule_archives_beyond_the_count_and_deletes_beyond_the_archive_count() -> None:
    archive = {"RetainRule": {"RetentionArchiveTier": {"Count": 2}}}
    # s0, s1 archived already; s2, s3 fall out of the standard count of 2: archived, pushing s0, s1 out.
    assert retire(kept(6, archived={0, 1}), {"Count": 2}, archive, T0) == (["s3", "s2"], ["s1", "s0"])
    assert retire(kept(3), {"Count": 2}, archive, T0) == (["s0"], [])


# -- documents -------------------------------------------------------------------------------------------


def doc(schedule: dict[str, Any], resource: str = "VOLUME", **more: Any) -> dict[str, Any]:
    return {"ResourceTypes": [resource], "TargetTags": [{"Key": "backup", "Value": "yes"}], "Schedules": [schedule],
            **more}


def sched(**more: Any) -> dict[str, Any]:
    return {"Name": "s", "CreateRule": {"Interval": 1, "IntervalUnit": "MINUTES"}, "RetainRule": {"Count": 3},
            **more}


def test_a_document_is_stored_as_checked() -> None:
    stored = document.stored(document.parse(doc(sched(TagsToAdd=[{"Key": "k", "Value": "v"}]))))
    assert stored["PolicyType"] == "EBS_SNAPSHOT_MANAGEMENT" and stored["ResourceLocations"] == ["CLOUD"]
    assert stored["Schedules"][0]["TagsToAdd"] == [{"Key": "k", "Value": "v"}]
    inst = document.parse(doc(sched(VariableTags=[{"Key": "i", "Value": "$(instance-id)"}]), "INSTANCE",
                              Parameters={"ExcludeDataVolumeTags": [{"Key": "skip", "Value": "1"}]}))
    assert inst.ResourceTypes == ["INSTANCE"]


@pytest.mark.parametrize(("bad", "named"), [
    (doc(sched(), PolicyType="IMAGE_MANAGEMENT"), "IMAGE_MANAGEMENT"),
    (doc(sched(), CrossRegionCopyTargets=[{"TargetRegion": "eu-west-1"}]), "CrossRegionCopyTargets"),
    (doc(sched(DeprecateRule={"Count": 1})), "DeprecateRule"),
    (doc(sched(TagsToAdd=[{"Key": "aws:x", "Value": "v"}])), "aws:"),
    (doc(sched(VariableTags=[{"Key": "i", "Value": "$(volume-id)"}]), "INSTANCE"), "VariableTags"),
    (doc(sched(ArchiveRule={"RetainRule": {"RetentionArchiveTier": {"Count": 2}}}, RetainRule={
        "Interval": 1, "IntervalUnit": "DAYS"})), "ArchiveRule"),
    (doc(sched(CreateRule={"Interval": 7, "IntervalUnit": "MINUTES"})), "MINUTES"),
    (doc(sched(CreateRule={"Interval": 1, "IntervalUnit": "HOURS", "Times": ["25:00"]})), "Times"),
    (doc(sched(CreateRule={"Interval": 1, "IntervalUnit": "HOURS", "Scripts": []})), "Scripts"),
    (doc(sched(Unknown=1)), "Unknown"),
    (doc(sched(RetainRule={"Count": "3"})), "Count"),
    ({"ResourceTypes": ["VOLUME"], "Schedules": [sched()]}, "TargetTags"),
    ({**doc(sched()), "Schedules": [sched(), sched()]}, "unique"),
    ({**doc(sched()), "Schedules": [sched(Name=f"s{i}") for i in range(5)]}, "Schedules"),
    (None, "required"),
])
def test_documents_vbs_does_not_take_are_refused_naming_why(bad: Any, named: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        document.parse(bad)
    assert named in exc.value.message


# -- the scheduler's claims, on a real metadata DB -----------------------------------------------------


@pytest.fixture(params=UNIT_DATABASES)
def db(request: pytest.FixtureRequest, tmp_path: Any) -> Database:
    return fresh_database(request.param, request, tmp_path)


def scheduler(db: Database, owner: str) -> LifecycleScheduler:
    return LifecycleScheduler(cast(Any, SimpleNamespace(db=db)), owner, lease_s=15, poll_s=1)


def add_policy(db: Database, made: datetime) -> str:
    with db.session() as s:
        s.add(LifecyclePolicy(id="policy-0123456789abcdef0", tenant="default", description="t", state="ENABLED",
                              execution_role_arn="arn:aws:iam::000000000000:role/r", tags={}, created_at=made,
                              modified_at=made, schedules_from=made,
                              details=document.stored(document.parse(doc(HOURLY)))))
    return "policy-0123456789abcdef0"


# Due on every whole hour: a test's claims meet a new due time only if an hour turns while it runs.
HOURLY = sched(CreateRule={"Interval": 1, "IntervalUnit": "HOURS"})


def run_rows(db: Database) -> list[PolicyRun]:
    with db.read() as s:
        rows = list(s.scalars(select(PolicyRun).order_by(PolicyRun.due_at)))
        s.expunge_all()
    return rows


def test_two_controllers_claiming_one_due_time_make_one_run(db: Database) -> None:
    add_policy(db, datetime.now(UTC) - timedelta(minutes=61))
    claimed: dict[str, list[str]] = {}
    controllers = [scheduler(db, f"ctl-{k}") for k in range(4)]
    threads = [threading.Thread(target=lambda c=c: claimed.setdefault(c.owner, c._claim_due())) for c in controllers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rows = run_rows(db)
    running = [r for r in rows if r.status == "running"]
    assert len(running) == 1, [(r.status, r.due_at, r.controller) for r in rows]
    winners = [owner for owner, ids in claimed.items() if ids]
    assert winners == [running[0].controller] and claimed[winners[0]] == [running[0].id]
    assert [c._claim_due() for c in controllers] == [[], [], [], []], "nothing is claimed twice"


def test_missed_due_times_are_recorded_as_skipped_and_the_latest_is_run(db: Database) -> None:
    add_policy(db, datetime.now(UTC) - timedelta(hours=4, minutes=1))
    [run_id] = scheduler(db, "ctl-a")._claim_due()
    rows = run_rows(db)
    assert [r.status for r in rows][-1] == "running" and rows[-1].id == run_id
    skipped = rows[:-1]
    assert len(skipped) >= 3 and all(r.status == "skipped" and r.error == MISSED for r in skipped)
    dues = [r.due_at for r in rows]
    assert all(b - a == timedelta(hours=1) for a, b in zip(dues, dues[1:], strict=False))


def test_a_run_is_taken_over_only_from_a_controller_that_is_gone(db: Database) -> None:
    add_policy(db, datetime.now(UTC) - timedelta(minutes=61))
    [run_id] = scheduler(db, "ctl-a")._claim_due()
    with db.session() as s:
        now = db.clock(s)
        s.add(ControllerRecord(id="ctl-a", url="http://a", started_at=now, last_seen=now))
        s.add(ControllerRecord(id="ctl-b", url="http://b", started_at=now, last_seen=now))
    b = scheduler(db, "ctl-b")
    assert b._orphans() == [], "ctl-a is alive: its run stays its own"
    with db.session() as s:
        row = s.get(ControllerRecord, "ctl-a")
        assert row is not None
        row.last_seen = db.clock(s) - timedelta(seconds=60)
    assert b._orphans() == [run_id]
    assert [r.controller for r in run_rows(db) if r.status == "running"] == ["ctl-b"]
    assert scheduler(db, "ctl-c")._orphans() == [], "ctl-b is alive now"


def test_old_runs_are_forgotten_but_each_schedules_newest(db: Database) -> None:
    add_policy(db, datetime.now(UTC) - timedelta(hours=6, minutes=1))
    [run_id] = scheduler(db, "ctl-a")._claim_due()  # five or six skipped before it, then the latest, running
    skipped = len(run_rows(db)) - 1
    assert skipped >= 5
    assert purge(db, retention_s=0) == skipped, "finished ones go, but the newest of the schedule (running) stays"
    assert [r.id for r in run_rows(db)] == [run_id]
    with db.session() as s:
        row = s.get(PolicyRun, run_id)
        assert row is not None
        row.status = "succeeded"
    assert purge(db, retention_s=0) == 0, "the schedule's newest says up to where its due times were taken"
    assert scheduler(db, "ctl-b")._claim_due() == [], "and so nothing is taken again"


def test_a_run_whose_policy_was_deleted_retires_nothing(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a policy deletes its runs' rows (lifecycle.policies): a run still going finds its row gone
    before each retirement and stops (execute._LostRun), so a deleted policy's snapshots stay."""
    from vbs.controller.lifecycle import execute
    from vbs.controller.lifecycle.policies import delete_policy

    policy_id = add_policy(db, datetime.now(UTC) - timedelta(minutes=61))
    [run_id] = scheduler(db, "ctl-a")._claim_due()
    svc = cast(Any, SimpleNamespace(db=db))
    with db.read() as s:
        policy = s.get(LifecyclePolicy, policy_id)
        assert policy is not None
        s.expunge(policy)
    run = execute._Run(svc, "ctl-a", run_id, policy, policy.details["Schedules"][0], {}, datetime.now(UTC))
    deleted: list[str] = []
    monkeypatch.setattr(execute, "retire", lambda *_a: ([], ["snap-0123456789abcdef0"]))
    monkeypatch.setattr(execute, "delete_snapshot", lambda _svc, snap_id, _tenant: deleted.append(snap_id))
    assert execute._retention(run, ["vol-0123456789abcdef0"], datetime.now(UTC)) == (
        ["snap-0123456789abcdef0"], []), "held: it retires"
    other = execute._Run(svc, "ctl-b", run_id, policy, policy.details["Schedules"][0], {}, datetime.now(UTC))
    with pytest.raises(execute._LostRun) as lost:
        execute._retention(other, ["vol-0123456789abcdef0"], datetime.now(UTC))
    assert lost.value.why == execute.TAKEN_OVER
    delete_policy(svc, policy_id, "default")
    with pytest.raises(execute._LostRun) as lost:
        execute._retention(run, ["vol-0123456789abcdef0"], datetime.now(UTC))
    assert lost.value.why == execute.POLICY_DELETED
    assert deleted == ["snap-0123456789abcdef0"], "nothing retired once the policy was deleted"
    execute.execute(svc, "ctl-a", run_id)  # its row gone: nothing to do, no error
    assert run_rows(db) == []
