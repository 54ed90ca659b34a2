"""The workflow engine: each operation is a row with ordered steps, each step ``do`` and ``undo``.

A step is recorded ``started`` before its agent call and ``done`` after it, each in its own commit.
On failure the engine undoes the started and done steps in reverse and lets the workflow restore
its resource. When the controller starts it resumes every unfinished operation: workflows that
``resume="rollback"`` (create, attach) undo what they did, those that ``resume="forward"`` (delete,
detach) carry on. Agent calls are idempotent, so repeating a step after a crash is safe.

Test hooks: ``VBS_CRASH_AT=<kind>:<step>:<started|done>`` makes the process SIGKILL itself at that
point, to prove recovery; ``inject_failure(kind, step, when)`` (reachable over the internal API
only when the controller runs with ``VBS_TEST_HOOKS=1``) makes one step fail before or after its
call, to prove rollback.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Database, Operation, OperationStep
from vbs.controller.db.tables import utcnow
from vbs.controller.states import OperationState
from vbs.errors import AgentUnreachable, DriverError

log = logging.getLogger(__name__)

MAX_RETRY_DELAY_S = 60.0


@dataclass
class StepContext:
    """What a step sees: its operation, the workflow's parameters (persisted) and the services."""

    operation_id: str
    resource_id: str
    params: dict[str, Any]
    services: Any


StepFn = Callable[[StepContext], None]


@dataclass(frozen=True)
class Step:
    name: str
    do: StepFn
    undo: StepFn | None = None


@dataclass(frozen=True)
class Workflow:
    kind: str
    resume: Literal["rollback", "forward"]
    steps: tuple[Step, ...]
    on_rollback: Callable[[StepContext, str], None] | None = None
    # For roll-forward workflows: a failure this accepts as final stops the operation (no retry).
    gives_up: Callable[[StepContext, Exception], bool] | None = None
    # For roll-back workflows: whether the resource already reached its final state (the last step,
    # a DB transition, ran but the controller died before recording it): then resuming finishes.
    finished: Callable[[StepContext], bool] | None = None
    step_index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_index", {s.name: i for i, s in enumerate(self.steps)})


def _crash_point() -> tuple[str, str, str] | None:
    spec = os.environ.get("VBS_CRASH_AT", "")
    parts = spec.split(":")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


class WorkflowEngine:
    def __init__(self, db: Database, workflows: list[Workflow], services: Any, *, threads: int = 16,
                 retry_interval: float = 2.0) -> None:
        self.db = db
        self.workflows = {w.kind: w for w in workflows}
        self.services = services
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="workflow")
        self._inflight: set[str] = set()
        self._lock = threading.Lock()
        self._crash_at = _crash_point()
        self._fail_at: set[tuple[str, str, str]] = set()
        self._retry_interval = retry_interval
        self._stop = threading.Event()
        self._retry_thread = threading.Thread(target=self._retry_loop, name="workflow-retry", daemon=True)

    # -- starting operations -------------------------------------------------------------------

    def begin(self, session: Session, kind: str, resource_id: str, params: dict[str, Any]) -> str:
        """Record a new operation inside the caller's transaction (atomic with the resource row)."""
        workflow = self.workflows[kind]
        op_id = ids.new_id("operation")
        now = utcnow()
        session.add(Operation(id=op_id, kind=kind, resource_id=resource_id, status=OperationState.RUNNING,
                              params=params, attempts=0, created_at=now, updated_at=now))
        session.flush()
        for pos, step in enumerate(workflow.steps):
            session.add(OperationStep(operation_id=op_id, position=pos, name=step.name, state="pending",
                                      updated_at=now))
        return op_id

    def submit(self, op_id: str, *, resuming: bool = False) -> None:
        """Run an operation in the background (after the transaction that began it committed)."""
        self._pool.submit(self._run_guarded, op_id, resuming)

    def run_now(self, op_id: str) -> None:
        """Run an operation in the caller's thread (for callers that wait for the outcome)."""
        self._run_guarded(op_id, False)

    def start(self) -> None:
        """Resume every operation left unfinished by a previous controller, then watch for retries."""
        with self.db.session() as s:
            pending = s.scalars(select(Operation.id).where(
                Operation.status.in_([OperationState.RUNNING, OperationState.ROLLING_BACK]))).all()
        for op_id in pending:
            log.info("resuming operation %s", op_id)
            self.submit(op_id, resuming=True)
        self._retry_thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- running -------------------------------------------------------------------------------

    def _run_guarded(self, op_id: str, resuming: bool) -> None:
        with self._lock:
            if op_id in self._inflight:
                return
            self._inflight.add(op_id)
        try:
            self._run(op_id, resuming)
        except Exception:
            # The DB is unreachable or a bug: leave the operation for the retry loop.
            log.exception("operation %s: engine error", op_id)
            self._schedule_retry(op_id, "engine error")
        finally:
            with self._lock:
                self._inflight.discard(op_id)

    def _run(self, op_id: str, resuming: bool) -> None:
        with self.db.session() as s:
            op = s.get(Operation, op_id)
            if op is None or op.status not in (OperationState.RUNNING, OperationState.ROLLING_BACK):
                return
            steps = {st.position: st.state for st in s.scalars(
                select(OperationStep).where(OperationStep.operation_id == op_id))}
            s.expunge(op)
        workflow = self.workflows[op.kind]
        ctx = StepContext(op.id, op.resource_id, dict(op.params), self.services)
        if op.status == OperationState.ROLLING_BACK:
            self._rollback(workflow, ctx, steps, op.error or "rolled back")
        elif resuming and workflow.resume == "rollback" and (
                all(steps.get(pos) == "done" for pos in range(len(workflow.steps)))
                or (workflow.finished is not None and workflow.finished(ctx))):
            # Everything was done; only the operation's own record was missing. Undoing it now would
            # destroy a finished volume or attachment.
            self._set_op(op_id, status=OperationState.SUCCEEDED, next_attempt_at=None)
        elif resuming and workflow.resume == "rollback":
            reason = "interrupted by a controller restart"
            self._set_op(op_id, status=OperationState.ROLLING_BACK, error=reason)
            self._rollback(workflow, ctx, steps, reason)
        else:
            self._forward(workflow, ctx, steps)

    def _forward(self, workflow: Workflow, ctx: StepContext, steps: dict[int, str]) -> None:
        for pos, step in enumerate(workflow.steps):
            if steps.get(pos) == "done":
                continue
            self._set_step(ctx, pos, "started")
            self._maybe_crash(workflow.kind, step.name, "started")
            try:
                self._maybe_fail(workflow.kind, step.name, "before")
                step.do(ctx)
                self._maybe_fail(workflow.kind, step.name, "after")
            except Exception as exc:
                message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                log.warning("operation %s (%s) step %s failed: %s", ctx.operation_id, workflow.kind,
                            step.name, message)
                if not hasattr(exc, "code"):
                    log.exception("unexpected error in step %s", step.name)
                if workflow.resume == "forward":
                    self._set_step(ctx, pos, "started", error=message)
                    if workflow.gives_up is not None and workflow.gives_up(ctx, exc):
                        self._set_op(ctx.operation_id, status=OperationState.FAILED, error=message,
                                     next_attempt_at=None)
                    else:
                        self._schedule_retry(ctx.operation_id, message)
                    return
                # A call that never reached its agent changed nothing there: no undo is owed for it.
                steps[pos] = "pending" if isinstance(exc, AgentUnreachable) else "started"
                self._set_step(ctx, pos, steps[pos], error=message)
                self._set_op(ctx.operation_id, status=OperationState.ROLLING_BACK, error=message)
                self._rollback(workflow, ctx, steps, message)
                return
            steps[pos] = "done"
            self._set_step(ctx, pos, "done")
            self._maybe_crash(workflow.kind, step.name, "done")
        self._set_op(ctx.operation_id, status=OperationState.SUCCEEDED, next_attempt_at=None)

    def _rollback(self, workflow: Workflow, ctx: StepContext, steps: dict[int, str], reason: str) -> None:
        for pos in sorted(steps, reverse=True):
            if steps[pos] not in ("started", "done"):
                continue
            step = workflow.steps[pos]
            if step.undo is not None:
                try:
                    step.undo(ctx)
                except Exception as exc:
                    message = getattr(exc, "message", None) or str(exc)
                    log.warning("operation %s: undo of %s failed (will retry): %s", ctx.operation_id,
                                step.name, message)
                    self._schedule_retry(ctx.operation_id, reason)
                    return
            self._set_step(ctx, pos, "undone")
        if workflow.on_rollback is not None:
            workflow.on_rollback(ctx, reason)
        self._set_op(ctx.operation_id, status=OperationState.ROLLED_BACK, next_attempt_at=None)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _set_step(self, ctx: StepContext, pos: int, state: str, error: str | None = None) -> None:
        with self.db.session() as s:
            s.execute(update(OperationStep)
                      .where(OperationStep.operation_id == ctx.operation_id, OperationStep.position == pos)
                      .values(state=state, error=error, updated_at=utcnow()))
            s.execute(update(Operation).where(Operation.id == ctx.operation_id)
                      .values(params=ctx.params, updated_at=utcnow()))

    def _set_op(self, op_id: str, **values: Any) -> None:
        with self.db.session() as s:
            s.execute(update(Operation).where(Operation.id == op_id).values(updated_at=utcnow(), **values))

    def _schedule_retry(self, op_id: str, error: str) -> None:
        with self.db.session() as s:
            op = s.get(Operation, op_id)
            if op is None:
                return
            delay = min(MAX_RETRY_DELAY_S, self._retry_interval * (2 ** min(op.attempts, 6)))
            op.attempts += 1
            op.error = error
            op.next_attempt_at = utcnow() + timedelta(seconds=delay)
            op.updated_at = utcnow()

    def _retry_loop(self) -> None:
        while not self._stop.wait(self._retry_interval / 2):
            try:
                with self.db.session() as s:
                    due = s.scalars(select(Operation.id).where(
                        Operation.status.in_([OperationState.RUNNING, OperationState.ROLLING_BACK]),
                        Operation.next_attempt_at.is_not(None),
                        Operation.next_attempt_at <= utcnow())).all()
                for op_id in due:
                    self.submit(op_id)
            except Exception:
                log.exception("workflow retry loop")

    def inject_failure(self, kind: str, step: str, when: Literal["before", "after"]) -> None:
        """Make the next run of ``step`` in ``kind`` fail (test hook)."""
        with self._lock:
            self._fail_at.add((kind, step, when))

    def _maybe_fail(self, kind: str, step: str, when: str) -> None:
        with self._lock:
            if (kind, step, when) not in self._fail_at:
                return
            self._fail_at.discard((kind, step, when))
        raise DriverError(f"injected failure {when} step {step}")

    def _maybe_crash(self, kind: str, step: str, moment: str) -> None:
        if self._crash_at == (kind, step, moment):
            log.warning("VBS_CRASH_AT reached (%s:%s:%s): killing the controller", kind, step, moment)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
