"""Several controllers on one database: operation leases, adoption, fencing (docs/architecture.md §6).

Engines with in-memory steps on a real database (SQLite, and PostgreSQL in the integration tier);
the agent side of fencing with a real ``FenceBook`` and the real HTTP client.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from tests.conftest import UNIT_DATABASES, fresh_database, wait_until
from vbs.controller.cluster import SingletonLease
from vbs.controller.db import Database, Operation, OperationStep
from vbs.controller.workflows import Params, Step, StepContext, Workflow, WorkflowEngine
from vbs.errors import InvalidParameter, LeaseLost, StaleFence
from vbs.net.web import ApiClient
from vbs.trust import fencing

pytestmark = pytest.mark.unit

VOLUME = "vol-0123456789abcdef0"


class Noted(Params):
    notes: list[str] = []


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database(request.param, request, tmp_path)


def operation(db: Database, op_id: str) -> Operation:
    with db.session() as s:
        op = s.get(Operation, op_id)
        assert op is not None
        return op


def steps(db: Database, op_id: str) -> list[str]:
    with db.session() as s:
        return list(s.scalars(select(OperationStep.state).where(OperationStep.operation_id == op_id)
                              .order_by(OperationStep.position)))


def test_an_expired_operation_is_adopted_with_a_higher_fence_and_its_old_owner_is_fenced_off(db: Database) -> None:
    """Controller A hangs inside a step past its lease; B adopts the operation and rolls it back; when
    A wakes up it writes nothing more: the operation stays as B left it."""
    paused, wake = threading.Event(), threading.Event()
    calls: list[str] = []

    def make(owner: str) -> Workflow[Noted]:
        def create(ctx: StepContext[Noted]) -> None:
            calls.append(f"{owner}:do:create")
            if owner == "a":
                paused.set()
                wake.wait(30)

        def undo(ctx: StepContext[Noted]) -> None:
            calls.append(f"{owner}:undo:create")

        return Workflow("w", Noted, "rollback", (Step("create", create, undo), Step("finish", lambda c: None)))

    a = WorkflowEngine(db, [make("a")], None, owner="a", lease_s=1)  # type: ignore[arg-type]
    b = WorkflowEngine(db, [make("b")], None, owner="b", lease_s=1)  # type: ignore[arg-type]
    try:
        with db.session() as s:
            op_id = a.begin(s, a.workflows["w"], VOLUME, Noted())
        first = operation(db, op_id)
        assert first.owner == "a" and first.fence > 0 and first.lease_until is not None
        a.submit(op_id)
        assert paused.wait(10)
        assert b.adopt() == [], "a live lease is never taken"
        time.sleep(1.3)  # A's lease (1 s, never renewed: A hangs) expires by the DB's clock
        assert b.adopt() == [op_id]
        wait_until(lambda: operation(db, op_id).status == "rolled-back", 10, what="B rolls back")
        taken = operation(db, op_id)
        assert taken.owner == "b" and taken.fence > first.fence
        wake.set()
        time.sleep(0.5)  # A's step returns and tries to record it
        after = operation(db, op_id)
        assert (after.status, after.owner, after.fence, after.updated_at) == (
            "rolled-back", "b", taken.fence, taken.updated_at)
        assert steps(db, op_id) == ["undone", "pending"]
        assert calls == ["a:do:create", "b:undo:create"], "A neither goes on nor undoes anything"
    finally:
        wake.set()
        a.stop()
        b.stop()


def test_renewal_keeps_an_operation_from_being_adopted(db: Database) -> None:
    gate = threading.Event()
    # Four renewals a second apart span more than the 3 s lease; a renewal late by up to 2 s (a
    # loaded machine) still comes before the lease ends.
    a = WorkflowEngine(db, [Workflow("w", Noted, "forward", (Step("slow", lambda c: gate.wait(30)),))],
                       None, owner="a", lease_s=3)  # type: ignore[arg-type]
    b = WorkflowEngine(db, [Workflow("w", Noted, "forward", (Step("slow", lambda c: None),))],
                       None, owner="b", lease_s=3)  # type: ignore[arg-type]
    try:
        with db.session() as s:
            op_id = a.begin(s, a.workflows["w"], VOLUME, Noted())
        a.submit(op_id)
        for _ in range(4):
            time.sleep(1.0)
            assert a.renew() == 1
            assert b.adopt() == []
        gate.set()
        wait_until(lambda: operation(db, op_id).status == "succeeded", 10)
        assert operation(db, op_id).owner == "a"
    finally:
        gate.set()
        a.stop()
        b.stop()


def test_a_write_by_a_controller_that_lost_the_operation_raises_lease_lost(db: Database) -> None:
    a = WorkflowEngine(db, [Workflow("w", Noted, "forward", (Step("s", lambda c: None),))], None,  # type: ignore[arg-type]
                       owner="a", lease_s=1)
    with db.session() as s:
        op_id = a.begin(s, a.workflows["w"], VOLUME, Noted())
    op = operation(db, op_id)
    ctx = a._context(a.workflows["w"], op)
    with db.session() as s:
        s.execute(Operation.__table__.update().where(Operation.id == op_id).values(owner="b", fence=op.fence + 1))
    with pytest.raises(LeaseLost):
        a.records.set_step(ctx, 0, "started")
    assert steps(db, op_id) == ["pending"], "nothing of the write is left"
    a.stop()


def test_a_singleton_loop_runs_on_one_controller_and_moves_when_its_lease_lapses(db: Database) -> None:
    a = SingletonLease(db, "reconciler", "a", ttl_s=1)
    b = SingletonLease(db, "reconciler", "b", ttl_s=1)
    assert a.hold() and not b.hold()
    assert a.hold(), "the holder renews"
    time.sleep(1.2)
    assert b.hold() and not a.hold()


def test_fences_grow_across_operations(db: Database) -> None:
    with db.session() as s:
        fences = [db.next_fence(s) for _ in range(3)]
    with db.session() as s:
        fences.append(db.next_fence(s))
    assert fences == sorted(fences) and len(set(fences)) == 4


# -- the agent's side --------------------------------------------------------------------------------------


def test_an_agent_refuses_a_lower_fence_for_a_resource_and_remembers_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "fences.json"
    book = fencing.FenceBook(path)
    book.admit(f"{VOLUME} 5")
    book.admit(f"{VOLUME} 5")  # the same run calls again
    book.admit("snap-0123456789abcdef0 2")  # another resource has its own
    with pytest.raises(StaleFence):
        book.admit(f"{VOLUME} 4")
    book.admit(f"{VOLUME} 9")
    assert path.stat().st_mode & 0o777 == 0o600
    again = fencing.FenceBook(path)
    with pytest.raises(StaleFence):
        again.admit(f"{VOLUME} 8")
    again.admit(f"{VOLUME} 9")
    for bad in ("", "vol-x 1", f"{VOLUME} -1", f"{VOLUME} 1 2", f"{VOLUME} 99999999999999999999", "../etc 1"):
        with pytest.raises(InvalidParameter):
            again.admit(bad)


def fence_recording_client(seen: list[str | None]) -> ApiClient:
    """An agent client whose agent answers every call with 200 and records the fence header it carried."""

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get(fencing.FENCE_HEADER))
        return httpx.Response(200, json={})

    client = ApiClient("http://agent.invalid", "token")
    client._http = httpx.Client(base_url="http://agent.invalid", transport=httpx.MockTransport(answer))
    return client


def test_agent_calls_carry_the_fence_of_the_run_that_makes_them() -> None:
    seen: list[str | None] = []
    client = fence_recording_client(seen)
    client.call("GET", "/v1/inventory")
    with fencing.fenced(VOLUME, 42):
        client.call("PUT", f"/v1/pools/default/volumes/{VOLUME}")
    client.call("GET", "/v1/inventory")
    assert seen == [None, f"{VOLUME} 42", None]


def test_a_controller_never_adopts_its_own_running_operation(db: Database) -> None:
    """Its own lease lapsed (renewal stalled): the loop renews it, it does not adopt it (a second run
    of it in this process would be dropped as a duplicate, and the operation left to no one)."""
    gate = threading.Event()
    a = WorkflowEngine(db, [Workflow("w", Noted, "forward", (Step("slow", lambda c: gate.wait(30)),))],
                       None, owner="a", lease_s=1)  # type: ignore[arg-type]
    try:
        with db.session() as s:
            op_id = a.begin(s, a.workflows["w"], VOLUME, Noted())
        a.submit(op_id)
        time.sleep(1.3)
        assert a.adopt() == []
        assert a.renew() == 1
        gate.set()
        wait_until(lambda: operation(db, op_id).status == "succeeded", 10)
    finally:
        gate.set()
        a.stop()


def test_the_fence_book_appends_and_compacts_without_forgetting(tmp_path: Path) -> None:
    path = tmp_path / "fences.json"
    book = fencing.FenceBook(path)
    resources = [f"vol-{i:017x}" for i in range(50)]
    for round_ in range(1, 60):  # 2,950 new highest fences: the log is compacted along the way
        for r in resources:
            book.admit(f"{r} {round_}")
    assert len(path.read_text().splitlines()) < 2 * len(resources) + 1000 + 1
    again = fencing.FenceBook(path)
    for r in resources:
        with pytest.raises(StaleFence):
            again.admit(f"{r} 58")
        again.admit(f"{r} 59")
    with path.open("a") as f:
        f.write("garbage line\n")
    fencing.FenceBook(path).admit(f"{resources[0]} 59")  # unreadable lines are skipped


def test_no_agent_call_is_sent_under_a_fence_whose_lease_the_controller_may_have_lost() -> None:
    sent: list[str | None] = []
    client = fence_recording_client(sent)
    held = [True]
    with fencing.fenced(VOLUME, 7, lambda: held[0]):
        client.call("PUT", f"/v1/pools/default/volumes/{VOLUME}")
        held[0] = False
        with pytest.raises(LeaseLost, match="could not renew its leases"):
            client.call("PUT", f"/v1/pools/default/volumes/{VOLUME}")
    assert sent == [f"{VOLUME} 7"]


def test_a_run_stopped_while_the_leases_could_not_be_renewed_carries_on_once_they_are(
        db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut from the database, a controller stops acting on its operations once its leases may have lapsed
    (its agent calls are not sent); renewed again and still their owner, it carries them on itself."""
    calls: list[str] = []

    def call(ctx: StepContext[Noted]) -> None:
        fencing.current()  # what every agent call of the step asks first
        calls.append(ctx.resource_id)

    engine = WorkflowEngine(db, [Workflow("w", Noted, "forward", (Step("call", call),))], None,  # type: ignore[arg-type]
                            owner="a", lease_s=1.5)
    renew = engine.leases.renew
    try:
        engine.start()

        def cut_off() -> int:
            raise OSError("the database is unreachable")
        monkeypatch.setattr(engine.leases, "renew", cut_off)
        wait_until(lambda: not engine.leases.held(), 10)
        with db.session() as s:
            op_id = engine.begin(s, engine.workflows["w"], VOLUME, Noted())
        engine.submit(op_id)
        time.sleep(1.5)  # the run stopped before its call; the retry loop does not resume it yet
        assert calls == [] and operation(db, op_id).status == "running"
        monkeypatch.setattr(engine.leases, "renew", renew)
        wait_until(lambda: operation(db, op_id).status == "succeeded", 20)
        assert calls == [VOLUME]
    finally:
        engine.stop()
