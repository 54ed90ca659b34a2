"""The Recycle Bin without a service (vbs.controller.requests.recycle_bin_rules and .recycle_bin,
docs/recycle-bin.md): which rule keeps a delete and for how long (any of a rule's resource tags, a key alone
matching any value; a region-level rule but for its exclusions; the longest retention wins), a lock's
states, the refusals that change nothing, and the end of a retention, which starts a delete once however
often (and by however many controllers) it is looked for."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import UNIT_DATABASES, fresh_database
from vbs import ids
from vbs.controller.db import Database, RecycleBinEntry, RecycleBinRule, Snapshot
from vbs.controller.db.tables import utcnow
from vbs.controller.rbin.errors import RuleConflict, RuleInvalid, RuleNotFound
from vbs.controller.requests import recycle_bin as bin_req
from vbs.controller.requests import recycle_bin_rules as rules
from vbs.controller.workflows.faults import FaultHooks
from vbs.errors import NotFound

pytestmark = pytest.mark.unit


@pytest.fixture(params=UNIT_DATABASES)
def svc(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    db = fresh_database(request.param, request, tmp_path)
    return SimpleNamespace(db=db, cfg=SimpleNamespace(region="us-east-1", recycle_bin_day_s=86400),
                           engine=Engine())


class Engine:
    """What the bin asks of the workflow engine: operations begun (in the caller's transaction) and run."""

    def __init__(self) -> None:
        self.begun: list[tuple[str, str]] = []
        self.submitted: list[str] = []
        self.faults = FaultHooks()  # the expiry's crash point (VBS_CRASH_AT, unset here)
        self._lock = threading.Lock()

    def begin(self, session: Any, workflow: Any, resource_id: str, params: Any) -> str:
        with self._lock:
            self.begun.append((workflow.kind, resource_id))
            return f"op-{len(self.begun)}"

    def submit(self, op_id: str) -> None:
        with self._lock:
            self.submitted.append(op_id)


def kept(db: Database, tenant: str, kind: str, tags: dict[str, str]) -> int | None:
    with db.read() as s:
        return rules.retention_for(s, tenant, kind, tags)


def test_the_longest_retention_of_the_rules_that_match_keeps_a_delete(svc: Any) -> None:
    snap = "EBS_SNAPSHOT"
    rules.create_rule(svc, "acme", rules.RuleSpec(snap, 5, resource_tags=[("team", "db")]))
    rules.create_rule(svc, "acme", rules.RuleSpec(snap, 9, resource_tags=[("legal", None), ("x", "y")]))
    rules.create_rule(svc, "acme", rules.RuleSpec(snap, 3, exclude_tags=[("scratch", "yes")]))
    assert kept(svc.db, "acme", snap, {"team": "db"}) == 5  # its tag rule beats the region-level rule
    assert kept(svc.db, "acme", snap, {"legal": "anything", "team": "db"}) == 9  # a key alone: any value
    assert kept(svc.db, "acme", snap, {"team": "web"}) == 3  # the region-level rule
    assert kept(svc.db, "acme", snap, {"scratch": "yes"}) is None  # excluded, and no tag rule
    assert kept(svc.db, "acme", snap, {"scratch": "no"}) == 3
    assert kept(svc.db, "acme", "EBS_VOLUME", {"team": "db"}) is None  # rules are per resource type
    assert kept(svc.db, "other", snap, {"team": "db"}) is None  # and per tenant


def test_refusals_change_nothing(svc: Any) -> None:
    for spec in (rules.RuleSpec("EC2_IMAGE", 1), rules.RuleSpec("EBS_THING", 1),
                 rules.RuleSpec("EBS_VOLUME", 1, resource_tags=[("a", None)], exclude_tags=[("b", None)]),
                 rules.RuleSpec("EBS_VOLUME", 1, resource_tags=[("a", None)], unlock_delay_days=7),
                 rules.RuleSpec("EBS_VOLUME", 1, description="two\nlines"),
                 rules.RuleSpec("EBS_VOLUME", 1, tags={"aws:x": "y"}),
                 rules.RuleSpec("EBS_VOLUME", 1, tags={"bad<": "y"})):
        with pytest.raises(RuleInvalid):
            rules.create_rule(svc, "acme", spec)
    with svc.db.read() as s:
        assert s.query(RecycleBinRule).count() == 0
    with pytest.raises(RuleInvalid):
        rules.get_rule(svc, "acme", "short")
    with pytest.raises(RuleNotFound):
        rules.get_rule(svc, "acme", "A" * 11)
    with pytest.raises(RuleInvalid):
        rules.rule_of_arn(svc, "acme", "arn:aws:ec2:us-east-1:1:volume/x")
    with pytest.raises(RuleNotFound):  # another account's, or another region's: not this tenant's
        rules.rule_of_arn(svc, "acme", "arn:aws:rbin:us-east-1:000000000000:rule/" + "A" * 11)
    assert rules.rule_of_arn(svc, "acme", "arn:aws:rbin:us-east-1:acme:rule/" + "A" * 11) == "A" * 11


def test_a_locked_rule_waits_out_its_unlock_delay(svc: Any) -> None:
    made = rules.create_rule(svc, "acme", rules.RuleSpec("EBS_VOLUME", 4, unlock_delay_days=7))
    assert made.lock_state == "locked" and made.unlock_delay_days == 7
    with pytest.raises(RuleConflict):
        rules.update_rule(svc, "acme", made.rule_id, rules.RuleChange(retention_days=1))
    with pytest.raises(RuleConflict):
        rules.update_rule(svc, "acme", made.rule_id, rules.RuleChange(exclude_tags=[("a", None)]))
    assert rules.update_rule(svc, "acme", made.rule_id, rules.RuleChange(description="d")).description == "d"
    unlocking = rules.unlock_rule(svc, "acme", made.rule_id)
    assert unlocking.lock_state == "pending_unlock" and unlocking.lock_end_time is not None
    assert unlocking.lock_end_time - utcnow() > timedelta(days=6)
    with pytest.raises(RuleConflict):
        rules.delete_rule(svc, "acme", made.rule_id)
    with svc.db.session() as s:  # the delay ends
        s.get(RecycleBinRule, made.rule_id).lock_end_at = utcnow() - timedelta(seconds=1)  # type: ignore[union-attr]
    assert rules.get_rule(svc, "acme", made.rule_id).lock_state == "unlocked"
    assert rules.list_rules(svc, "acme", "EBS_VOLUME", in_lock_state="unlocked")[0][0].rule_id == made.rule_id
    rules.delete_rule(svc, "acme", made.rule_id)
    assert rules.list_rules(svc, "acme", "EBS_VOLUME") == ([], None)


def test_rules_are_listed_a_page_at_a_time(svc: Any) -> None:
    made = sorted(rules.create_rule(svc, "acme", rules.RuleSpec("EBS_SNAPSHOT", 1)).rule_id for _ in range(5))
    seen: list[str] = []
    token = None
    while True:
        page, token = rules.list_rules(svc, "acme", "EBS_SNAPSHOT", max_results=2, next_token=token)
        seen += [r.rule_id for r in page]
        if token is None:
            break
    assert seen == made
    with pytest.raises(RuleInvalid):
        rules.list_rules(svc, "acme", "EBS_SNAPSHOT", next_token="../etc")


def in_bin(db: Database, *, ends_in: timedelta) -> str:
    """A snapshot in the bin whose retention ends ``ends_in`` from now."""
    sid, now = ids.new_id("snapshot"), utcnow()
    with db.session() as s:
        s.add(Snapshot(id=sid, volume_id=ids.new_id("volume"), volume_size_gib=1, comment="", storage_node="n",
                       pool="p", status="recoverable", progress=100, started_at=now, updated_at=now, tenant="acme"))
        s.add(RecycleBinEntry(resource_id=sid, resource_type=bin_req.SNAPSHOT, tenant="acme", former_status="completed",
                              entered_at=now, exits_at=now + ends_in))
    return sid


def test_a_retention_end_starts_one_delete_however_many_look_for_it(svc: Any) -> None:
    due, kept = in_bin(svc.db, ends_in=-timedelta(seconds=1)), in_bin(svc.db, ends_in=timedelta(days=1))
    with pytest.raises(NotFound):  # past its end: gone for its user before any housekeeping ran
        bin_req.restore(svc, "acme", bin_req.SNAPSHOT, due)
    assert [s.snapshot_id for s in bin_req.list_snapshots(svc, "acme", [])[0]] == [kept]
    started: list[int] = []
    passes = [threading.Thread(target=lambda: started.append(bin_req.expire(svc))) for _ in range(4)]
    for p in passes:
        p.start()
    for p in passes:
        p.join()
    assert sorted(started) == [0, 0, 0, 1] and svc.engine.begun == [("delete-snapshot", due)]
    assert bin_req.expire(svc) == 0
    with svc.db.read() as s:
        assert s.get(Snapshot, due).status == "deleting"  # type: ignore[union-attr]
        assert s.get(RecycleBinEntry, due) is None and s.get(RecycleBinEntry, kept) is not None
    assert bin_req.restore(svc, "acme", bin_req.SNAPSHOT, kept) == "completed"
    with pytest.raises(NotFound):  # another tenant's bin, or out of it already
        bin_req.restore(svc, "acme", bin_req.SNAPSHOT, kept)
    with svc.db.read() as s:
        assert s.get(Snapshot, kept).status == "completed"  # type: ignore[union-attr]
