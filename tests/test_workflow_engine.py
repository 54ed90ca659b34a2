"""The workflow engine on a real SQLite DB with in-memory steps: order, rollback, retry, resume."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from tests.conftest import UNIT_DATABASES, fresh_database, wait_until
from vbs.controller.db import Database, Operation, OperationStep
from vbs.controller.workflows import Params, Step, StepContext, Workflow, WorkflowEngine
from vbs.errors import AgentUnavailable, DriverError, IncorrectState

pytestmark = pytest.mark.unit

VOLUME = "vol-0123456789abcdef0"


class Seen(Params):
    seen: list[str] = []


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: set[str] = set()
        self.lock = threading.Lock()
        self.rolled_back: list[str] = []

    def step(self, name: str) -> Step:
        def do(ctx: StepContext) -> None:
            with self.lock:
                self.calls.append(f"do:{name}")
            if name in self.fail:
                raise DriverError(f"{name} failed")
            ctx.params.seen.append(name)

        def undo(ctx: StepContext) -> None:
            with self.lock:
                self.calls.append(f"undo:{name}")

        return Step(name, do, undo)

    def workflow(self, kind: str, resume: str, names: list[str], **extra: Any) -> Workflow[Seen]:
        return Workflow(kind, Seen, resume, tuple(self.step(n) for n in names),  # type: ignore[arg-type]
                        on_rollback=lambda ctx, reason: self.rolled_back.append(reason), **extra)


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    """The metadata DB, SQLite and (integration tier) PostgreSQL."""
    return fresh_database(request.param, request, tmp_path)


def start_op(engine: WorkflowEngine, db: Database, kind: str, resource: str = VOLUME) -> str:
    with db.session() as s:
        op_id = engine.begin(s, engine.workflows[kind], resource, Seen())
    return op_id


def restart_with(db: Database, wf: Workflow[Seen], op_id: str, states: dict[int, str], outcome: str, what: str
                 ) -> None:
    """As if the controller died with the operation's steps recorded as ``states`` (position -> state;
    the others pending): a new engine takes it up, and stops once the operation is ``outcome``."""
    with db.session() as s:
        for st in s.scalars(select(OperationStep).where(OperationStep.operation_id == op_id)):
            st.state = states.get(st.position, "pending")
    restarted = WorkflowEngine(db, [wf], None)
    restarted.start()
    wait_until(lambda: op_status(db, op_id) == outcome, 10, what=what)
    restarted.stop()


def run_op(engine: WorkflowEngine, db: Database, outcome: str, timeout: float, what: str) -> str:
    """An operation of kind "w" begun and submitted on the started ``engine``, which stops once the
    operation is ``outcome``: its id."""
    engine.start()
    op_id = start_op(engine, db, "w")
    engine.submit(op_id)
    wait_until(lambda: op_status(db, op_id) == outcome, timeout, what=what)
    engine.stop()
    return op_id


def op_status(db: Database, op_id: str) -> str:
    with db.session() as s:
        return s.get(Operation, op_id).status  # type: ignore[union-attr]


def step_states(db: Database, op_id: str) -> list[str]:
    with db.session() as s:
        return list(s.scalars(select(OperationStep.state).where(OperationStep.operation_id == op_id)
                              .order_by(OperationStep.position)))


def test_steps_run_in_order_and_are_recorded_done(db: Database) -> None:
    rec = Recorder()
    engine = WorkflowEngine(db, [rec.workflow("w", "rollback", ["a", "b", "c"])], None)
    op_id = start_op(engine, db, "w")
    engine.run_now(op_id)
    assert rec.calls == ["do:a", "do:b", "do:c"]
    assert op_status(db, op_id) == "succeeded"
    assert step_states(db, op_id) == ["done", "done", "done"]
    with db.session() as s:
        assert s.get(Operation, op_id).params == {"seen": ["a", "b", "c"]}  # type: ignore[union-attr]


def test_a_failed_step_undoes_it_and_every_earlier_step_in_reverse(db: Database) -> None:
    rec = Recorder()
    rec.fail = {"c"}
    engine = WorkflowEngine(db, [rec.workflow("w", "rollback", ["a", "b", "c", "d"])], None)
    op_id = start_op(engine, db, "w")
    engine.run_now(op_id)
    assert rec.calls == ["do:a", "do:b", "do:c", "undo:c", "undo:b", "undo:a"]
    assert op_status(db, op_id) == "rolled-back"
    assert step_states(db, op_id) == ["undone", "undone", "undone", "pending"]
    assert rec.rolled_back == ["c failed"]


def test_an_interrupted_rollback_workflow_is_undone_at_restart(db: Database) -> None:
    rec = Recorder()
    wf = rec.workflow("w", "rollback", ["a", "b", "c"])
    op_id = start_op(WorkflowEngine(db, [wf], None), db, "w")
    # As if the controller died right after recording "b" started.
    restart_with(db, wf, op_id, {0: "done", 1: "started"}, "rolled-back", "rollback")
    assert rec.calls == ["undo:b", "undo:a"]
    assert "restart" in rec.rolled_back[0]


def test_an_interrupted_forward_workflow_finishes_at_restart(db: Database) -> None:
    rec = Recorder()
    wf = rec.workflow("w", "forward", ["a", "b", "c"])
    op_id = start_op(WorkflowEngine(db, [wf], None), db, "w")
    restart_with(db, wf, op_id, {0: "done", 1: "started"}, "succeeded", "roll forward")
    assert rec.calls == ["do:b", "do:c"], "the started step is repeated (idempotent), the done one is not"


def test_a_forward_workflow_retries_until_its_agent_answers(db: Database) -> None:
    attempts: list[float] = []

    def flaky(ctx: StepContext[Seen]) -> None:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise AgentUnavailable("agent down")

    wf = Workflow("w", Seen, "forward", (Step("flaky", flaky),))
    engine = WorkflowEngine(db, [wf], None, retry_interval=0.1)
    op_id = run_op(engine, db, "succeeded", 20, "retries")
    assert len(attempts) == 3
    with db.session() as s:
        assert s.get(Operation, op_id).attempts == 2  # type: ignore[union-attr]


def test_an_operation_runs_once_even_if_submitted_twice(db: Database) -> None:
    gate = threading.Event()
    runs: list[int] = []

    def slow(ctx: StepContext[Seen]) -> None:
        runs.append(1)
        gate.wait(5)

    engine = WorkflowEngine(db, [Workflow("w", Seen, "rollback", (Step("slow", slow),))], None)  # type: ignore[arg-type]
    op_id = start_op(engine, db, "w")
    engine.submit(op_id)
    wait_until(lambda: runs, 5)
    engine.submit(op_id)
    time.sleep(0.2)
    gate.set()
    wait_until(lambda: op_status(db, op_id) == "succeeded", 5)
    engine.stop()
    assert runs == [1]


def test_finished_operations_are_not_run_again(db: Database) -> None:
    rec = Recorder()
    engine = WorkflowEngine(db, [rec.workflow("w", "rollback", ["a"])], None)
    op_id = start_op(engine, db, "w")
    engine.run_now(op_id)
    engine.run_now(op_id)
    assert rec.calls == ["do:a"]


def test_begin_is_part_of_the_callers_transaction(db: Database) -> None:
    rec = Recorder()
    engine = WorkflowEngine(db, [rec.workflow("w", "rollback", ["a"])], None)
    with pytest.raises(RuntimeError), db.session() as s:
        engine.begin(s, engine.workflows["w"], VOLUME, Seen())
        raise RuntimeError("the caller's transaction fails")
    with db.session() as s:
        assert s.scalars(select(Operation)).all() == []




def test_a_rollback_workflow_whose_steps_all_finished_is_not_undone_at_restart(db: Database) -> None:
    rec = Recorder()
    wf = rec.workflow("w", "rollback", ["a", "b"])
    op_id = start_op(WorkflowEngine(db, [wf], None), db, "w")
    # The controller died after recording the last step done, before the operation's own record.
    restart_with(db, wf, op_id, {0: "done", 1: "done"}, "succeeded", "finished")
    assert rec.calls == [] and rec.rolled_back == []


def test_a_rollback_workflow_whose_resource_is_final_finishes_at_restart(db: Database) -> None:
    rec = Recorder()
    wf = rec.workflow("w", "rollback", ["a", "b"], finished=lambda ctx: True)
    op_id = start_op(WorkflowEngine(db, [wf], None), db, "w")
    # The last step (a DB transition) ran, but the controller died before recording it done.
    restart_with(db, wf, op_id, {0: "done", 1: "started"}, "succeeded", "finished")
    assert rec.calls == []


# -- nothing retries forever ---------------------------------------------------------------------


def test_a_forward_step_that_keeps_failing_ends_failed_with_its_reason(db: Database) -> None:
    ended: list[str] = []

    def down(ctx: StepContext[Seen]) -> None:
        raise AgentUnavailable("storage node gone")

    wf = Workflow("w", Seen, "forward", (Step("down", down),), on_give_up=lambda ctx, why: ended.append(why))
    engine = WorkflowEngine(db, [wf], None, retry_interval=0.05, give_up_after=0.5)  # type: ignore[arg-type]
    op_id = run_op(engine, db, "failed", 20, "give up")
    with db.session() as s:
        op = s.get(Operation, op_id)
        assert op is not None and op.next_attempt_at is None and op.failing_since is None
        assert op.error is not None and "gave up" in op.error and "storage node gone" in op.error
    assert len(ended) == 1 and "storage node gone" in ended[0]


def test_a_skippable_step_is_left_out_once_its_retries_are_exhausted(db: Database) -> None:
    rec = Recorder()

    def down(ctx: StepContext[Seen]) -> None:
        raise AgentUnavailable("host gone")

    wf = Workflow("w", Seen, "forward", (Step("host", down, skippable=lambda ctx: True), rec.step("storage")))
    engine = WorkflowEngine(db, [wf], None, retry_interval=0.05, give_up_after=0.3)  # type: ignore[arg-type]
    op_id = run_op(engine, db, "succeeded", 20, "skip")
    assert step_states(db, op_id) == ["skipped", "done"]
    assert rec.calls == ["do:storage"]


def test_an_undo_that_keeps_failing_is_abandoned_and_the_rest_is_undone(db: Database) -> None:
    rec = Recorder()
    rec.fail = {"c"}

    def undo_unreachable(ctx: StepContext[Seen]) -> None:
        raise AgentUnavailable("host gone")

    wf = Workflow("w", Seen, "rollback",
                  (rec.step("a"), Step("b", lambda ctx: None, undo=undo_unreachable), rec.step("c")),
                  on_rollback=lambda ctx, reason: rec.rolled_back.append(reason))
    engine = WorkflowEngine(db, [wf], None, retry_interval=0.05, give_up_after=0.3)  # type: ignore[arg-type]
    op_id = run_op(engine, db, "failed", 20, "rollback to end")
    assert step_states(db, op_id) == ["undone", "abandoned", "undone"]
    assert rec.calls.count("undo:a") == 1 and rec.rolled_back == ["c failed"]
    with db.session() as s:
        error = s.get(Operation, op_id).error  # type: ignore[union-attr]
    assert error is not None and "could not undo b" in error


# -- operations that exclude each other ------------------------------------------------------------


def test_one_unfinished_exclusive_operation_per_resource(db: Database) -> None:
    rec = Recorder()
    engine = WorkflowEngine(db, [rec.workflow("delete-volume", "forward", ["a"], exclusive=True),  # type: ignore[arg-type]
                                 rec.workflow("modify-volume", "forward", ["a"], exclusive=True),
                                 rec.workflow("create-snapshot", "rollback", ["a"])], None)
    first = start_op(engine, db, "modify-volume")
    with pytest.raises(IncorrectState, match=f"modify-volume in progress \\({first}\\)"):
        start_op(engine, db, "delete-volume")
    with pytest.raises(IncorrectState):
        start_op(engine, db, "modify-volume")
    # Another resource, and kinds that may overlap, are not held up.
    start_op(engine, db, "delete-volume", resource="vol-0123456789abcdef1")
    start_op(engine, db, "create-snapshot")
    start_op(engine, db, "create-snapshot")
    engine.run_now(first)
    assert op_status(db, start_op(engine, db, "delete-volume")) == "running"


def test_the_unique_index_itself_refuses_a_second_exclusive_operation(db: Database) -> None:
    from sqlalchemy.exc import IntegrityError

    from vbs.controller.db.tables import utcnow

    def row(op_id: str) -> Operation:
        now = utcnow()
        return Operation(id=op_id, kind="delete-volume", resource_id=VOLUME, status="running", exclusive=True,
                         params={}, attempts=0, created_at=now, updated_at=now)

    with db.session() as s:
        s.add(row("op-00000000000000001"))
    with pytest.raises(IntegrityError), db.session() as s:
        s.add(row("op-00000000000000002"))


# -- parameters, memo, holds, purge ------------------------------------------------------------------


def test_params_are_typed_and_the_memo_is_never_persisted(db: Database) -> None:
    class Attach(Params):
        host: str

    seen: list[str] = []

    def export(ctx: StepContext[Attach]) -> None:
        ctx.memo["connection"] = "chap-secret-s3cr3t"

    def plug(ctx: StepContext[Attach]) -> None:
        seen.append(f"{ctx.params.host}:{ctx.memo['connection']}")

    wf = Workflow("attach-volume", Attach, "rollback", (Step("export", export), Step("plug", plug)))
    engine = WorkflowEngine(db, [wf], None)  # type: ignore[arg-type]
    with db.session() as s:
        op_id = engine.begin(s, wf, VOLUME, Attach(host="host-1"))
        with pytest.raises(TypeError):
            engine.begin(s, wf, VOLUME, Seen())  # type: ignore[arg-type]
    engine.run_now(op_id)
    assert seen == ["host-1:chap-secret-s3cr3t"]
    with db.session() as s:
        op = s.get(Operation, op_id)
        assert op is not None and op.params == {"host": "host-1"}
        assert "s3cr3t" not in repr(op.params) and "s3cr3t" not in (op.error or "")


def test_a_held_step_waits_until_released(db: Database) -> None:
    rec = Recorder()
    engine = WorkflowEngine(db, [rec.workflow("w", "forward", ["a", "b"])], None)
    engine.faults.hold("w", "b")
    op_id = start_op(engine, db, "w")
    engine.submit(op_id)
    wait_until(lambda: engine.faults.held("w", "b"), 10, what="hold reached")
    assert rec.calls == ["do:a"] and op_status(db, op_id) == "running"
    engine.faults.release("w", "b")
    wait_until(lambda: op_status(db, op_id) == "succeeded", 10, what="released")
    engine.stop()
    assert rec.calls == ["do:a", "do:b"]


def test_finished_operations_are_purged_with_their_steps_after_the_retention(db: Database) -> None:
    rec = Recorder()
    engine = WorkflowEngine(db, [rec.workflow("w", "forward", ["a"])], None)
    done, running = start_op(engine, db, "w"), start_op(engine, db, "w", resource="vol-0123456789abcdef1")
    engine.run_now(done)
    assert engine.purge(3600) == 0
    assert engine.purge(0) == 1
    with db.session() as s:
        assert s.get(Operation, done) is None and s.get(Operation, running) is not None
        assert s.scalars(select(OperationStep).where(OperationStep.operation_id == done)).all() == []


# -- endings: the resource's final state and the operation's end in one transaction ----------------


def _record_in_ending(db: Database, seen: list[tuple[str, str]]) -> Any:
    """A closing step that writes through ctx.session() and, from another connection, looks at
    whether its operation already ended (it must not have: both commit together)."""

    def record(ctx: StepContext) -> None:
        with ctx.session() as s:
            s.add(OperationStep(operation_id=ctx.operation_id, position=99, name="marker", state="done",
                                updated_at=s.get(Operation, ctx.operation_id).updated_at))  # type: ignore[union-attr]
        with db.read() as other:
            seen.append(("during", other.scalar(select(Operation.status).where(
                Operation.id == ctx.operation_id)) or ""))

    return record


def test_a_closing_step_commits_with_the_end_of_its_operation(db: Database) -> None:
    seen: list[tuple[str, str]] = []
    rec = Recorder()
    wf = Workflow("w", Seen, "rollback", (rec.step("a"), Step("mark", _record_in_ending(db, seen), ends=True)))
    engine = WorkflowEngine(db, [wf], None)  # type: ignore[arg-type]
    op_id = start_op(engine, db, "w")
    engine.run_now(op_id)
    assert seen == [("during", "running")]  # the marker was not visible yet, nor the end
    assert op_status(db, op_id) == "succeeded"
    assert step_states(db, op_id) == ["done", "done", "done"]  # a, mark, and the marker row


def test_the_step_before_a_closing_step_is_recorded_done_with_the_end_in_two_commits_in_all(db: Database) -> None:
    """A create's shape (one agent step, one closing step): "a" started, then one transaction that records
    "a" and the closing step done and ends the operation. Seen from another connection during the closing
    step, "a" is still "started": a crash there resumes as from any started step."""
    during: list[list[str]] = []
    commits: list[int] = []

    def closing(ctx: StepContext) -> None:
        mine = len(commits)
        during.append(step_states(db, ctx.operation_id))
        del commits[mine:]  # this look's own transaction is not the engine's

    rec = Recorder()
    wf = Workflow("w", Seen, "rollback", (rec.step("a"), Step("mark", closing, ends=True)))
    engine = WorkflowEngine(db, [wf], None)  # type: ignore[arg-type]
    op_id = start_op(engine, db, "w")
    listen = (db.engine, "commit", lambda conn: commits.append(1))
    event.listen(*listen)
    try:
        engine.run_now(op_id)
    finally:
        event.remove(*listen)
    assert during == [["started", "pending"]]
    assert step_states(db, op_id) == ["done", "done"] and op_status(db, op_id) == "succeeded"
    assert len(commits) == 3, "the read that loads the operation, 'a' started, the ending"


def test_a_closing_step_that_fails_leaves_neither_its_writes_nor_an_ended_operation(db: Database) -> None:
    seen: list[tuple[str, str]] = []
    rec = Recorder()
    wf = Workflow("w", Seen, "rollback", (rec.step("a"), Step("mark", _record_in_ending(db, seen), ends=True)),
                  on_rollback=lambda ctx, reason: rec.rolled_back.append(reason))
    engine = WorkflowEngine(db, [wf], None)  # type: ignore[arg-type]
    engine.faults.inject_failure("w", "mark", "after")
    op_id = start_op(engine, db, "w")
    engine.run_now(op_id)
    assert op_status(db, op_id) == "rolled-back"
    assert step_states(db, op_id) == ["undone", "undone"]  # no marker row: the closing write rolled back
    assert rec.calls == ["do:a", "undo:a"]


def test_only_the_last_step_may_end_an_operation() -> None:
    with pytest.raises(ValueError, match="only the last step"):
        Workflow("w", Seen, "forward", (Step("a", lambda ctx: None, ends=True), Step("b", lambda ctx: None)))


# -- a point of no return (forward_from): roll back before it, forward from it ----------------------------


def test_a_failure_before_the_point_of_no_return_rolls_back(db: Database) -> None:
    rec = Recorder()
    rec.fail = {"b"}
    engine = WorkflowEngine(db, [rec.workflow("w", "rollback", ["a", "b", "pivot", "c"], forward_from="pivot")],
                            None)
    op_id = start_op(engine, db, "w")
    engine.run_now(op_id)
    assert rec.calls == ["do:a", "do:b", "undo:b", "undo:a"]
    assert op_status(db, op_id) == "rolled-back"


def test_a_failure_from_the_point_of_no_return_is_retried_not_undone(db: Database) -> None:
    rec = Recorder()
    rec.fail = {"c"}
    engine = WorkflowEngine(db, [rec.workflow("w", "rollback", ["a", "pivot", "c"], forward_from="pivot")], None,
                            retry_interval=0.05)
    op_id = start_op(engine, db, "w")
    engine.run_now(op_id)
    assert rec.calls == ["do:a", "do:pivot", "do:c"]
    assert op_status(db, op_id) == "running", "waiting for its retry, nothing undone"
    rec.fail = set()
    engine.start()
    wait_until(lambda: op_status(db, op_id) == "succeeded", 10, what="the retry")
    engine.stop()
    assert "undo:pivot" not in rec.calls and rec.calls[-1] == "do:c"


@pytest.mark.parametrize(("states", "outcome", "calls"), [
    ({0: "done", 1: "started"}, "rolled-back", ["undo:b", "undo:a"]),
    ({0: "done", 1: "done", 2: "started"}, "succeeded", ["do:pivot", "do:c"]),
    ({0: "done", 1: "done", 2: "done"}, "succeeded", ["do:c"]),
])
def test_a_restart_rolls_back_before_the_point_of_no_return_and_forward_from_it(
        db: Database, states: dict[int, str], outcome: str, calls: list[str]) -> None:
    rec = Recorder()
    wf = rec.workflow("w", "rollback", ["a", "b", "pivot", "c"], forward_from="pivot")
    op_id = start_op(WorkflowEngine(db, [wf], None), db, "w")
    restart_with(db, wf, op_id, states, outcome, outcome)
    assert rec.calls == calls


def test_a_point_of_no_return_must_name_a_step() -> None:
    with pytest.raises(ValueError, match="forward_from names no step"):
        Recorder().workflow("w", "rollback", ["a"], forward_from="nope")
