"""One run of an operation's steps, forward or back, as the engine's module docstring says
(engine.py): each step recorded ``started`` before its call and ``done`` after it, the closing step in
the transaction that ends the operation, a failure retried, given up on, or undone in reverse."""

from __future__ import annotations

import logging
from typing import Any

from vbs.controller.db.session import DatabaseFull
from vbs.controller.db.states import OperationState
from vbs.controller.workflows.definition import StepContext, Workflow
from vbs.controller.workflows.faults import FaultHooks
from vbs.controller.workflows.records import OperationRecords
from vbs.errors import AgentUnreachable, LeaseLost, StaleFence

__all__ = ["StepRunner"]

log = logging.getLogger("vbs.controller.workflows.engine")  # the engine's records keep its name


def _stop_if_fenced_off(exc: Exception) -> None:
    """An agent refused this run's fence, or a write found the operation taken: stop the run here (no
    undo, no retry, no record: the operation's new owner has it). The same for a full metadata disk:
    nothing could be recorded, so the run is not a step's failure; the engine runs it again later."""
    if isinstance(exc, LeaseLost | DatabaseFull):
        raise exc
    if isinstance(exc, StaleFence):
        raise LeaseLost(f"an agent refused the fence of this run: {exc.message}") from exc


def _message(exc: Exception) -> str:
    return str(getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")


class StepRunner:
    """Carries an operation's steps forward or back for the engine, recording each (``records``) and
    stopping where the tests' ``faults`` say."""

    def __init__(self, records: OperationRecords, faults: FaultHooks) -> None:
        self.records = records
        self.faults = faults

    def resume(self, workflow: Workflow[Any], ctx: StepContext[Any], status: str, error: str | None,
               steps: dict[int, str], resuming: bool) -> None:
        """Run the operation on from where its rows (``status``, ``error``, the ``steps``' states) say it is;
        ``resuming``: adopted, left unfinished by a restart or by a controller whose lease expired."""
        if workflow.resume == "rollback" and (resuming or status == OperationState.ROLLING_BACK) \
                and self._committed(workflow, ctx):
            if status == OperationState.ROLLING_BACK:
                log.warning("operation %s: past its point of no return; going forward instead of rolling back",
                            ctx.operation_id)
                self.records.set_op(ctx, status=OperationState.RUNNING, failing_since=None)
            self._forward(workflow, ctx, steps)
        elif status == OperationState.ROLLING_BACK:
            self._rollback(workflow, ctx, steps, error or "rolled back")
        elif resuming and workflow.rolls_back_after(steps) and (
                all(steps.get(pos) in ("done", "skipped") for pos in range(len(workflow.steps)))
                or (workflow.finished is not None and workflow.finished(ctx))):
            # Everything was done; only the operation's own record was missing. Undoing it now would
            # destroy a finished volume or attachment.
            self.records.finish(ctx, OperationState.SUCCEEDED)
        elif resuming and workflow.rolls_back_after(steps):
            reason = "interrupted: its controller restarted, or lost its lease to another"
            self.records.set_op(ctx, status=OperationState.ROLLING_BACK, error=reason, failing_since=None)
            self._rollback(workflow, ctx, steps, reason)
        else:
            self._forward(workflow, ctx, steps)

    def _forward(self, workflow: Workflow[Any], ctx: StepContext[Any], steps: dict[int, str]) -> None:
        # Steps done whose record waits for the closing step's transaction (see below).
        unrecorded: list[int] = []
        for pos, step in enumerate(workflow.steps):
            if steps.get(pos) in ("done", "skipped"):
                continue
            if not (step.ends and workflow.rolls_back_at(pos) == workflow.rolls_back_at(max(pos - 1, 0))):
                # A closing step writes only in the transaction that ends the operation, so a crash
                # before that commit finds it pending or started alike: its own "started" commit (a
                # fifth of a create's) is left out, unless reaching it is what decides the direction.
                self.records.set_step(ctx, pos, "started")
            self.faults.maybe_crash(workflow.kind, step.name, "started")
            try:
                self.faults.before_call(workflow.kind, step.name)
                if step.ends:
                    with self.records.ending(ctx, OperationState.SUCCEEDED, done=(*unrecorded, pos)):
                        step.do(ctx)
                        self.faults.maybe_fail(workflow.kind, step.name, "after")
                    self.faults.maybe_crash(workflow.kind, step.name, "done")
                    return
                step.do(ctx)
                self.faults.maybe_fail(workflow.kind, step.name, "after")
            except Exception as exc:
                _stop_if_fenced_off(exc)
                message = _message(exc)
                log.warning("operation %s (%s) step %s failed: %s", ctx.operation_id, workflow.kind, step.name,
                            message)
                if not hasattr(exc, "code"):
                    log.exception("unexpected error in step %s", step.name)
                if workflow.rolls_back_at(pos) and not self._committed(workflow, ctx):
                    # A call that never reached its agent changed nothing there: no undo is owed for it.
                    steps[pos] = "pending" if isinstance(exc, AgentUnreachable) else "started"
                    self.records.set_step(ctx, pos, steps[pos], error=message)
                    self.records.set_op(ctx, status=OperationState.ROLLING_BACK, error=message,
                                 failing_since=None)
                    self._rollback(workflow, ctx, steps, message)
                    return
                self.records.set_step(ctx, pos, "started", error=message)
                if workflow.gives_up is not None:
                    with self.records.ending(ctx, OperationState.FAILED, message) as ending:
                        ending.cancelled = not workflow.gives_up(ctx, exc)
                    if not ending.cancelled:
                        return
                if not self.records.exhausted(ctx):
                    self.records.retry_later(ctx, message)
                    return
                if step.skippable is not None and step.skippable(ctx):
                    log.warning("operation %s: giving up on step %s, which may be skipped: %s", ctx.operation_id,
                                step.name, message)
                    self.records.set_step(ctx, pos, "skipped", error=message)
                    self.records.set_op(ctx, failing_since=None)
                    continue
                reason = (f"gave up after {self.records.give_up_after.total_seconds():g}s of failures at "
                          f"{step.name}: {message}")
                with self.records.ending(ctx, OperationState.FAILED, reason):
                    if workflow.on_give_up is not None:
                        workflow.on_give_up(ctx, reason)
                return
            steps[pos] = "done"
            if pos + 1 < len(workflow.steps) and workflow.steps[pos + 1].ends:
                # The step before a closing step is recorded done in the transaction that ends the
                # operation: one commit fewer per create, snapshot or attach. A restart before that
                # commit finds it started instead of done, which resumes the same way (roll-back
                # undoes both; roll-forward repeats the call, and agent calls are idempotent).
                unrecorded.append(pos)
            else:
                self.records.set_step(ctx, pos, "done", succeeded=True)
            self.faults.maybe_crash(workflow.kind, step.name, "done")
        self.records.finish(ctx, OperationState.SUCCEEDED)

    def _rollback(self, workflow: Workflow[Any], ctx: StepContext[Any], steps: dict[int, str], reason: str) -> None:
        for pos in sorted(steps, reverse=True):
            if steps[pos] not in ("started", "done"):
                continue
            step = workflow.steps[pos]
            if step.undo is not None:
                try:
                    step.undo(ctx)
                except Exception as exc:
                    _stop_if_fenced_off(exc)
                    message = _message(exc)
                    if not self.records.exhausted(ctx):
                        log.warning("operation %s: undo of %s failed (will retry): %s", ctx.operation_id,
                                    step.name, message)
                        self.records.retry_later(ctx, reason)
                        return
                    # Its target stays unreachable: leave what it holds to the reconciler (an orphan
                    # export or disk is removed once it answers again) and undo the rest.
                    log.error("operation %s: abandoning the undo of %s: %s", ctx.operation_id, step.name, message)
                    steps[pos] = "abandoned"
                    self.records.set_step(ctx, pos, "abandoned", error=message)
                    self.records.set_op(ctx, failing_since=None)
                    continue
            steps[pos] = "undone"
            # The error stays: why the step failed (a tool's own words) is what an operator reads.
            self.records.set_step(ctx, pos, "undone", succeeded=True, keep_error=True)
        abandoned = [workflow.steps[p].name for p, state in steps.items() if state == "abandoned"]
        ending = (self.records.ending(ctx, OperationState.FAILED, f"{reason}; rolled back, but could not undo "
                                                              f"{', '.join(abandoned)} (left to reconciliation)")
                  if abandoned else self.records.ending(ctx, OperationState.ROLLED_BACK))
        with ending:
            if workflow.on_rollback is not None:
                workflow.on_rollback(ctx, reason)

    @staticmethod
    def _committed(workflow: Workflow[Any], ctx: StepContext[Any]) -> bool:
        """Whether a roll-back workflow is past its point of no return (then it goes forward); a
        failure to tell counts as not (its undo steps refuse to cross that point themselves)."""
        if workflow.committed is None:
            return False
        try:
            return workflow.committed(ctx)
        except Exception as exc:
            _stop_if_fenced_off(exc)
            log.warning("operation %s: could not tell whether it is past its point of no return: %s",
                        ctx.operation_id, _message(exc))
            return False
