"""The workflow engine on a real SQLite DB with in-memory steps: order, rollback, retry, resume."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.conftest import wait_until
from vbs.controller.db import Database, Operation, OperationStep
from vbs.controller.workflows import Step, StepContext, Workflow, WorkflowEngine
from vbs.errors import AgentUnavailable, DriverError


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
            ctx.params.setdefault("seen", []).append(name)

        def undo(ctx: StepContext) -> None:
            with self.lock:
                self.calls.append(f"undo:{name}")

        return Step(name, do, undo)

    def workflow(self, kind: str, resume: str, names: list[str]) -> Workflow:
        return Workflow(kind, resume, tuple(self.step(n) for n in names),  # type: ignore[arg-type]
                        on_rollback=lambda ctx, reason: self.rolled_back.append(reason))


@pytest.fixture
def db(tmp_path: Path) -> Database:
    d = Database.for_data_dir(tmp_path)
    d.migrate()
    return d


def start_op(engine: WorkflowEngine, db: Database, kind: str) -> str:
    with db.session() as s:
        op_id = engine.begin(s, kind, "vol-0123456789abcdef0", {})
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
        assert s.get(Operation, op_id).params["seen"] == ["a", "b", "c"]  # type: ignore[union-attr]


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
    engine = WorkflowEngine(db, [wf], None)
    op_id = start_op(engine, db, "w")
    # As if the controller died right after recording "b" started.
    with db.session() as s:
        for st in s.scalars(select(OperationStep).where(OperationStep.operation_id == op_id)):
            st.state = {0: "done", 1: "started"}.get(st.position, "pending")
    restarted = WorkflowEngine(db, [wf], None)
    restarted.start()
    wait_until(lambda: op_status(db, op_id) == "rolled-back", 10, what="rollback")
    restarted.stop()
    assert rec.calls == ["undo:b", "undo:a"]
    assert "restart" in rec.rolled_back[0]


def test_an_interrupted_forward_workflow_finishes_at_restart(db: Database) -> None:
    rec = Recorder()
    wf = rec.workflow("w", "forward", ["a", "b", "c"])
    engine = WorkflowEngine(db, [wf], None)
    op_id = start_op(engine, db, "w")
    with db.session() as s:
        for st in s.scalars(select(OperationStep).where(OperationStep.operation_id == op_id)):
            st.state = {0: "done", 1: "started"}.get(st.position, "pending")
    restarted = WorkflowEngine(db, [wf], None)
    restarted.start()
    wait_until(lambda: op_status(db, op_id) == "succeeded", 10, what="roll forward")
    restarted.stop()
    assert rec.calls == ["do:b", "do:c"], "the started step is repeated (idempotent), the done one is not"


def test_a_forward_workflow_retries_until_its_agent_answers(db: Database) -> None:
    attempts: list[float] = []

    def flaky(ctx: StepContext) -> None:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise AgentUnavailable("agent down")

    wf = Workflow("w", "forward", (Step("flaky", flaky),))
    engine = WorkflowEngine(db, [wf], None, retry_interval=0.1)
    engine.start()
    op_id = start_op(engine, db, "w")
    engine.submit(op_id)
    wait_until(lambda: op_status(db, op_id) == "succeeded", 20, what="retries")
    engine.stop()
    assert len(attempts) == 3
    with db.session() as s:
        assert s.get(Operation, op_id).attempts == 2  # type: ignore[union-attr]


def test_an_operation_runs_once_even_if_submitted_twice(db: Database) -> None:
    gate = threading.Event()
    runs: list[int] = []

    def slow(ctx: StepContext) -> None:
        runs.append(1)
        gate.wait(5)

    engine = WorkflowEngine(db, [Workflow("w", "rollback", (Step("slow", slow),))], None)
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
        engine.begin(s, "w", "vol-0123456789abcdef0", {})
        raise RuntimeError("the caller's transaction fails")
    with db.session() as s:
        assert s.scalars(select(Operation)).all() == []




def test_a_rollback_workflow_whose_steps_all_finished_is_not_undone_at_restart(db: Database) -> None:
    rec = Recorder()
    wf = rec.workflow("w", "rollback", ["a", "b"])
    engine = WorkflowEngine(db, [wf], None)
    op_id = start_op(engine, db, "w")
    # The controller died after recording the last step done, before the operation's own record.
    with db.session() as s:
        for st in s.scalars(select(OperationStep).where(OperationStep.operation_id == op_id)):
            st.state = "done"
    restarted = WorkflowEngine(db, [wf], None)
    restarted.start()
    wait_until(lambda: op_status(db, op_id) == "succeeded", 10, what="finished")
    restarted.stop()
    assert rec.calls == [] and rec.rolled_back == []


def test_a_rollback_workflow_whose_resource_is_final_finishes_at_restart(db: Database) -> None:
    rec = Recorder()
    wf = Workflow("w", "rollback", (rec.step("a"), rec.step("b")), finished=lambda ctx: True)
    engine = WorkflowEngine(db, [wf], None)
    op_id = start_op(engine, db, "w")
    # The last step (a DB transition) ran, but the controller died before recording it done.
    with db.session() as s:
        for st in s.scalars(select(OperationStep).where(OperationStep.operation_id == op_id)):
            st.state = {0: "done", 1: "started"}[st.position]
    restarted = WorkflowEngine(db, [wf], None)
    restarted.start()
    wait_until(lambda: op_status(db, op_id) == "succeeded", 10, what="finished")
    restarted.stop()
    assert rec.calls == []
