"""An operation's rows as a run writes them: its steps' states, its params, its retries and its ending,
each write conditional on this controller still owning the operation with the run's fence (``LeaseLost``
otherwise: another controller took it over).

The engine's own writes, made for every step of every operation, are plain statements built once per set
of columns (``vbs.controller.db.plain``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any, cast

from sqlalchemy import Table, Update, bindparam, delete, select
from sqlalchemy.orm import Session

from vbs.controller.db import Database, Operation, OperationStep, plain
from vbs.controller.db.states import UNFINISHED_OPERATION, OperationState
from vbs.controller.db.tables import utcnow
from vbs.controller.rest.completion import OperationEnds
from vbs.controller.workflows.definition import StepContext
from vbs.errors import LeaseLost

log = logging.getLogger(__name__)

__all__ = ["OperationRecords", "OPERATIONS", "STEPS"]

MAX_RETRY_DELAY_S = 60.0
# The tables the engine's own bookkeeping reads and writes with Core statements (see _op_update).
OPERATIONS = cast(Table, Operation.__table__)
STEPS = cast(Table, OperationStep.__table__)


@dataclass
class _Ending:
    cancelled: bool = False


def _ended_values(status: OperationState, error: str | None) -> dict[str, Any]:
    values: dict[str, Any] = {"status": status, "next_attempt_at": None, "failing_since": None,
                              "updated_at": utcnow()}
    if error is not None:
        values["error"] = error[:4000]
    return values


# The engine's own writes, made for every step of every operation, are plain statements built once per
# set of columns (vbs.controller.db.plain): neither a statement built per write nor the ORM's bulk path
# (together about a fifth of a create's workflow CPU before).
@cache
def _op_update(columns: frozenset[str]) -> Update:
    """UPDATE operations SET ``columns`` WHERE it is still the run's (id, owner, fence)."""
    c = OPERATIONS.c
    return plain.update_of(OPERATIONS, columns, c.id == bindparam("w_id"), c.owner == bindparam("w_owner"),
                           c.fence == bindparam("w_fence"))


@cache
def _steps_update(columns: frozenset[str], several: bool) -> Update:
    """UPDATE operation_steps SET ``columns`` WHERE operation_id = ``w_id`` AND position = ``w_pos``
    (``several``: position IN the list ``w_pos``)."""
    c = STEPS.c
    position = c.position.in_(bindparam("w_pos", expanding=True)) if several else c.position == bindparam("w_pos")
    return plain.update_of(STEPS, columns, c.operation_id == bindparam("w_id"), position)


class OperationRecords:
    """The writes of one controller's runs (``owner``), and the end of each operation told to its waiters
    (``ends``) and to ``on_end(kind, outcome, started_at)``."""

    def __init__(self, db: Database, owner: str, *, retry_interval: float, give_up_after: timedelta,
                 on_end: Callable[[str, str, datetime | None], None] | None) -> None:
        self.db = db
        self.owner = owner
        self.retry_interval = retry_interval
        self.give_up_after = give_up_after
        self._on_end = on_end
        # Wakes the API requests that wait for an operation or its resource (GET ...?wait=N).
        self.ends = OperationEnds()

    def update_op(self, s: Session, ctx: StepContext[Any], **values: Any) -> None:
        """Write the operation row if it is still ours with the same fence, or raise ``LeaseLost`` if
        another controller took it over. What the transaction's ORM objects hold is flushed first
        (``plain.execute``): resource rows are written, and locked, before the operation's."""
        result = plain.execute(s, _op_update(frozenset(values)),
                               plain.bound(values, id=ctx.operation_id, owner=self.owner, fence=ctx.fence))
        if getattr(result, "rowcount", 0) != 1:
            raise LeaseLost(f"operation {ctx.operation_id} is no longer this controller's ({self.owner}, "
                            f"fence {ctx.fence})")

    def guard(self, s: Session, ctx: StepContext[Any]) -> None:
        # On PostgreSQL this also locks the row until the transaction ends: no adoption in between.
        # Call it after the transaction's other writes (lock order: resources, then operations).
        self.update_op(s, ctx, updated_at=utcnow())

    def set_step(self, ctx: StepContext[Any], pos: int, state: str, *, error: str | None = None,
                  succeeded: bool = False, keep_error: bool = False) -> None:
        with self.db.session() as s:
            values: dict[str, Any] = {"params": ctx.params.model_dump(mode="json"), "updated_at": utcnow()}
            if succeeded:
                values["failing_since"] = None  # the clock of give_up_after restarts at the next failure
            self.update_op(s, ctx, **values)
            step_values: dict[str, Any] = {"state": state, "updated_at": utcnow()}
            if not keep_error:
                step_values["error"] = error
            plain.execute(s, _steps_update(frozenset(step_values), False),
                          plain.bound(step_values, id=ctx.operation_id, pos=pos))

    def save_params(self, ctx: StepContext[Any]) -> None:
        self.set_op(ctx, params=ctx.params.model_dump(mode="json"))

    def set_op(self, ctx: StepContext[Any], **values: Any) -> None:
        with self.db.session() as s:
            self.update_op(s, ctx, updated_at=utcnow(), **values)

    def finish(self, ctx: StepContext[Any], status: OperationState, error: str | None = None) -> None:
        with self.db.session() as s:
            self.update_op(s, ctx, **_ended_values(status, error))
        self.ended(ctx, status)

    def ended(self, ctx: StepContext[Any], status: OperationState) -> None:
        """Tell the waiters and ``on_end`` of an ending, once its transaction committed."""
        self.ends.signal(ctx.operation_id, ctx.resource_id)
        if self._on_end is not None:
            try:
                self._on_end(ctx.kind, str(status), ctx.started_at)
            except Exception:
                log.exception("recording the end of operation %s", ctx.operation_id)

    @contextmanager
    def ending(self, ctx: StepContext[Any], status: OperationState, error: str | None = None, *,
                done: tuple[int, ...] = ()) -> Iterator[_Ending]:
        """One transaction for what the block writes through ``ctx.session()``, the steps at the
        positions ``done`` recorded done (the closing step, and the one before it) and the operation
        ended ``status`` — unless the block sets ``cancelled`` (then only its own writes commit)."""
        ending = _Ending()
        with self.db.session() as s:
            ctx.tx = s
            try:
                yield ending
            finally:
                ctx.tx = None
            # The operation row is written last, conditional on owner and fence (LeaseLost rolls the
            # whole transaction back): resource rows are locked before operation rows, as in the API.
            if ending.cancelled:
                self.guard(s, ctx)
                return
            if done:
                step_values = {"state": "done", "error": None, "updated_at": utcnow()}  # after the block's writes
                plain.execute(s, _steps_update(frozenset(step_values), True),
                              plain.bound(step_values, id=ctx.operation_id, pos=list(done)))
            self.update_op(s, ctx, params=ctx.params.model_dump(mode="json"), **_ended_values(status, error))
        self.ended(ctx, status)

    def exhausted(self, ctx: StepContext[Any]) -> bool:
        """Whether the operation's current failure has lasted ``give_up_after`` (starts its clock)."""
        now = utcnow()
        with self.db.session() as s:
            op = s.get(Operation, ctx.operation_id, with_for_update=True)  # read, then written: no lost update
            if op is None or op.owner != self.owner or op.fence != ctx.fence:
                raise LeaseLost(f"operation {ctx.operation_id} is no longer this controller's")
            since: datetime | None = op.failing_since
            if since is None:
                op.failing_since = now
                return False
            return now - since >= self.give_up_after

    def retry_later(self, ctx: StepContext[Any] | str, error: str) -> None:
        """Schedule the next attempt (``ctx``: of this run; an operation id: of whatever run of this
        controller's had it)."""
        op_id = ctx if isinstance(ctx, str) else ctx.operation_id
        with self.db.session() as s:
            op = s.get(Operation, op_id, with_for_update=True)
            if op is None or op.owner != self.owner or (not isinstance(ctx, str) and op.fence != ctx.fence):
                return
            delay = min(MAX_RETRY_DELAY_S, self.retry_interval * (2 ** min(op.attempts, 6)),
                        max(self.retry_interval, self.give_up_after.total_seconds() / 4))
            op.attempts += 1
            op.error = error[:4000]
            op.failing_since = op.failing_since or utcnow()
            op.next_attempt_at = utcnow() + timedelta(seconds=delay)
            op.updated_at = utcnow()

    def purge(self, retention_s: float) -> int:
        """Forget finished operations (and their steps) older than ``retention_s``."""
        cutoff = utcnow() - timedelta(seconds=retention_s)
        with self.db.session() as s:
            old = list(s.scalars(select(Operation.id).where(Operation.status.not_in(UNFINISHED_OPERATION),
                                                            Operation.updated_at < cutoff).limit(1000)))
            if old:
                s.execute(delete(OperationStep).where(OperationStep.operation_id.in_(old)))
                s.execute(delete(Operation).where(Operation.id.in_(old)))
        return len(old)
