"""The workflow engine: each operation is a row with ordered steps, each step ``do`` and ``undo``.

A step is recorded ``started`` before its agent call and ``done`` after it, each in its own commit.
The last step of a workflow is a DB-only record (``Step(..., ends=True)``): it runs in the
transaction that ends the operation, and so do the endings (``on_rollback``, ``on_give_up``,
``gives_up``), so nobody sees a resource in its final state while its operation still runs (a
delete right after a create found the volume ``available`` and was refused as busy). That
transaction also records the closing step and the step before it done, with no commit of their own
for "started" or "done": a crash before it finds the step before ``started``, not ``done``, and a
roll-back undoes it all the same while a roll-forward repeats its (idempotent) call.
On failure the engine undoes the started and done steps in reverse and lets the workflow restore
its resource. When the controller starts it resumes every unfinished operation: workflows that
``resume="rollback"`` (create, attach) undo what they did, those that ``resume="forward"`` (delete,
detach, modify) carry on. Agent calls are idempotent, so repeating a step after a crash is safe.

Nothing retries forever. A step (or an undo) that keeps failing is retried with back-off for
``give_up_after_s``; then a roll-forward operation ends ``failed`` (its workflow puts the resource
in a stable state and says why, or skips a step it may skip), and an undo is abandoned (the
reconciler removes what it leaves once its target answers again) and the roll-back goes on.

Each workflow has a typed ``Params`` model, stored in the operation row. Params never hold a
secret: what a step learns that is secret (a connection) stays in ``StepContext.memo``, in memory
only, and a later step that needs it after a restart asks the agent again.

Several controllers share one database: each operation has an ``owner``, a ``lease_until`` and a
``fence``; ``leases.py`` renews and adopts them. Every write for an operation is conditional on owner
and fence (``LeaseLost`` when another controller took it: the run stops at once, writing nothing), and
every agent call carries the fence (``vbs.trust.fencing``), so a controller paused past its lease
cannot undo the new owner's work. Crash points, injected failures and holds for tests: ``faults.py``.
The engine begins, schedules and adopts operations; ``runner.py`` carries each run's steps forward or back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from pydantic import ValidationError
from sqlalchemy import bindparam, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Database, Operation, plain
from vbs.controller.db.session import DatabaseFull
from vbs.controller.db.states import UNFINISHED_OPERATION, OperationState
from vbs.controller.db.tables import utcnow
from vbs.controller.rest.after_answer import after_answer
from vbs.controller.services import Services
from vbs.controller.workflows.definition import P, StepContext, Workflow
from vbs.controller.workflows.faults import FaultHooks
from vbs.controller.workflows.leases import OperationLeases
from vbs.controller.workflows.records import OPERATIONS, STEPS, OperationRecords
from vbs.controller.workflows.runner import StepRunner
from vbs.errors import DriverError, IncorrectState, LeaseLost
from vbs.trust import fencing

__all__ = ["WorkflowEngine", "OperationStamp"]

log = logging.getLogger(__name__)

EXCLUSIVE_ATTEMPTS = 5  # inserts of an exclusive operation whose slot another one was just leaving


class OperationStamp(NamedTuple):
    """The database's time and a fence, taken for an operation before it is recorded (``stamp``)."""

    now: datetime
    fence: int


class OperationRecord(NamedTuple):
    """What a run reads of its operation's row."""

    id: str
    kind: str
    resource_id: str
    status: str
    error: str | None
    params: dict[str, Any]
    fence: int
    owner: str | None
    created_at: datetime


_RUN_QUERY = select(*(OPERATIONS.c[name] for name in OperationRecord._fields)).where(
    OPERATIONS.c.id == bindparam("op_id"))
_STEPS_QUERY = select(STEPS.c.position, STEPS.c.state).where(STEPS.c.operation_id == bindparam("op_id"))


class WorkflowEngine:
    def __init__(self, db: Database, workflows: Iterable[Workflow[Any]], services: Services, *, threads: int = 16,
                 retry_interval: float = 2.0, give_up_after: float = 600.0, owner: str = "controller",
                 lease_s: float = 15.0, on_end: Callable[[str, str, datetime | None], None] | None = None) -> None:
        """``on_end(kind, outcome, started_at)`` hears of every operation this engine ends."""
        self.db = db
        self.owner = owner
        self._lease = timedelta(seconds=lease_s)
        self.workflows: dict[str, Workflow[Any]] = {w.kind: w for w in workflows}
        self.services = services
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="workflow")
        self._inflight: set[str] = set()
        # Runs stopped without a record of when to try again (the DB was unreachable, or this controller
        # could not renew its leases): resumed by the retry loop once the leases are held again, if the
        # operation is still this controller's.
        self._stranded: set[str] = set()
        self._lock = threading.Lock()
        # Crash points, injected failures and holds (tests: vbs.controller.workflows.faults).
        self.faults = FaultHooks()
        self.records = OperationRecords(db, owner, retry_interval=retry_interval,
                                        give_up_after=timedelta(seconds=give_up_after), on_end=on_end)
        self._runner = StepRunner(self.records, self.faults)
        # Wakes the API requests that wait for an operation or its resource (GET ...?wait=N).
        self.ends = self.records.ends
        self._stop = threading.Event()
        self._retry_thread = threading.Thread(target=self._retry_loop, name="workflow-retry", daemon=True)
        self.leases = OperationLeases(db, owner, self._lease, resume=lambda op_id: self.submit(op_id, resuming=True))

    # -- starting operations -------------------------------------------------------------------

    def stamp(self, session: Session) -> OperationStamp:
        """The database's time and a fence for an operation that ``begin`` records later in this
        transaction. A create takes it before the locks it then holds until commit (the storage node
        rows, the tenant's quota): on PostgreSQL that is one round trip fewer inside them, and every
        other create of the service waits on them."""
        return OperationStamp(*self.db.clock_and_fence(session))

    def begin(self, session: Session, workflow: Workflow[P], resource_id: str, params: P, *,
              new_resource: bool = False, stamp: OperationStamp | None = None) -> str:
        """Record a new operation of ``workflow`` inside the caller's transaction (atomic with the resource
        row).

        An exclusive workflow on a resource that has an unfinished exclusive operation is refused by the
        DB's unique index: ``IncorrectState``. ``new_resource``: the caller's transaction made the
        resource (a create), so no other operation can hold it. ``stamp``: taken earlier in this
        transaction (``stamp()``); only for a new resource, which no older fence can concern.
        """
        kind = workflow.kind
        if self.workflows.get(kind) is not workflow:
            raise ValueError(f"{kind} is not a workflow this engine runs")
        if not isinstance(params, workflow.params):
            raise TypeError(f"{kind} takes {workflow.params.__name__}, not {type(params).__name__}")
        if stamp is not None and not new_resource:
            raise ValueError("an operation on an existing resource takes its fence when it is recorded")
        op_id = ids.new_id("operation")
        now = utcnow()
        db_now, fence = stamp if stamp is not None else self.db.clock_and_fence(session)
        lease_until = db_now + self._lease

        row = {"id": op_id, "kind": kind, "resource_id": resource_id, "status": str(OperationState.RUNNING),
               "exclusive": workflow.exclusive, "params": params.model_dump(mode="json"), "attempts": 0,
               "created_at": now, "updated_at": now, "owner": self.owner, "lease_until": lease_until, "fence": fence}
        if workflow.exclusive and not new_resource:
            self._insert_exclusive(session, lambda: Operation(**row), resource_id)
        else:
            # Nothing can refuse it: no savepoint (two more statements), and a plain INSERT. No other
            # transaction waits on these rows, so a create writes them before its resource's row (whose
            # insert other creates wait on until it commits: ``volumes._insert_volume``).
            plain.execute(session, insert(OPERATIONS), row)
        plain.execute(session, insert(STEPS), [
            {"operation_id": op_id, "position": pos, "name": step.name, "state": "pending", "error": None,
             "updated_at": now} for pos, step in enumerate(workflow.steps)])
        return op_id

    @staticmethod
    def _insert_exclusive(session: Session, operation: Callable[[], Operation], resource_id: str) -> None:
        """Insert an exclusive operation, or ``IncorrectState`` while its resource has another one."""
        for _attempt in range(EXCLUSIVE_ATTEMPTS):
            try:
                with session.begin_nested():
                    session.add(operation())
                    session.flush()
                return
            except IntegrityError:
                other = session.scalar(select(Operation).where(
                    Operation.resource_id == resource_id, Operation.exclusive.is_(True),
                    Operation.status.in_(UNFINISHED_OPERATION)))
                if other is not None:
                    raise IncorrectState(f"'{resource_id}' has {other.kind} in progress ({other.id}); "
                                         "try again when it is done.") from None
                # PostgreSQL: the operation that held the slot ended between our insert and this look-up
                # (at READ COMMITTED each statement sees the latest commits). The slot is free: try again.
                log.info("operation slot of %s freed meanwhile; retrying", resource_id)
        raise IncorrectState(f"'{resource_id}' is being changed by another operation; try again.")

    def submit(self, op_id: str, *, resuming: bool = False) -> None:
        """Run an operation in the background (after the transaction that began it committed); begun by
        an API request, it starts once the request's answer is sent (``vbs.controller.rest.after_answer``)."""
        after_answer(lambda: self._pool.submit(self._run_guarded, op_id, resuming))

    def run_now(self, op_id: str) -> None:
        """Run an operation in the caller's thread (for callers that wait for the outcome)."""
        self._run_guarded(op_id, False)

    def start(self) -> None:
        """Adopt what a previous controller left unfinished (on SQLite: everything, there is only one
        controller; on PostgreSQL: this controller's own earlier operations, those of no one, and
        those whose lease expired), then renew leases, adopt more as leases expire, and retry."""
        self.adopt(everything=self.db.dialect == "sqlite", own=True)
        self._retry_thread.start()
        self.leases.start(self._stop)

    def adopt(self, *, everything: bool = False, own: bool = False, limit: int = 100) -> list[str]:
        """Take over unfinished operations whose lease expired (or that have no owner) and resume them
        (``OperationLeases.adopt``)."""
        return self.leases.adopt(everything=everything, own=own, limit=limit)

    def renew(self) -> int:
        """Extend the lease of every unfinished operation this controller owns."""
        return self.leases.renew()

    def stop(self) -> None:
        self._stop.set()
        self.faults.release_all()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def purge(self, retention_s: float) -> int:
        """Forget finished operations (and their steps) older than ``retention_s``."""
        return self.records.purge(retention_s)

    # -- running -------------------------------------------------------------------------------

    def _run_guarded(self, op_id: str, resuming: bool) -> None:
        with self._lock:
            if op_id in self._inflight:
                return
            self._inflight.add(op_id)
        try:
            self._run(op_id, resuming)
        except LeaseLost as exc:
            log.warning("operation %s: %s; stopping here, its new owner carries on", op_id, exc.message)
            self._strand(op_id)  # if no other controller took it after all, this one carries on later
        except Exception as exc:
            # The DB is unreachable, its disk full, or a bug: leave the operation for the retry loop.
            if isinstance(exc, DatabaseFull):
                log.warning("operation %s: stopped, the metadata database's disk is full; will retry", op_id)
            else:
                log.exception("operation %s: engine error", op_id)
            try:
                self.records.retry_later(op_id, "engine error")
            except Exception:
                log.warning("operation %s: its next attempt could not be recorded; tried again once the "
                            "leases are renewed", op_id)
                self._strand(op_id)
        finally:
            with self._lock:
                self._inflight.discard(op_id)

    def _strand(self, op_id: str) -> None:
        with self._lock:
            self._stranded.add(op_id)

    def _resume_stranded(self) -> None:
        """Submit again the runs stopped without a record, once this controller holds its leases again
        (each run first reads whether its operation is still this controller's)."""
        if not self.leases.held():
            return
        with self._lock:
            stranded, self._stranded = self._stranded, set()
        for op_id in stranded:
            self.submit(op_id)

    def _context(self, workflow: Workflow[Any], op: OperationRecord) -> StepContext[Any]:
        try:
            params = workflow.params.model_validate(op.params)
        except ValidationError as exc:
            raise DriverError(f"operation {op.id}: unreadable parameters ({exc.error_count()} problems)") from exc
        ctx: StepContext[Any] = StepContext(op.id, op.resource_id, params, self.services, fence=op.fence,
                                            kind=op.kind, started_at=op.created_at)
        ctx.save = lambda: self.records.save_params(ctx)
        ctx.guard = lambda s: self.records.guard(s, ctx)
        return ctx

    def _run(self, op_id: str, resuming: bool) -> None:
        # A read (the run's writes are fenced: one that meets another owner or fence raises LeaseLost),
        # of the columns a run needs, as plain rows.
        with self.db.read() as s:
            c = s.connection()
            found = c.execute(_RUN_QUERY, {"op_id": op_id}).first()
            if found is None:
                return
            op = OperationRecord(*found)
            if op.status not in UNFINISHED_OPERATION or op.owner != self.owner:
                return
            steps: dict[int, str] = {pos: state for pos, state in c.execute(_STEPS_QUERY, {"op_id": op_id})}
        workflow = self.workflows[op.kind]
        ctx = self._context(workflow, op)
        with fencing.fenced(op.resource_id, op.fence, self.leases.held):
            self._runner.resume(workflow, ctx, op.status, op.error, steps, resuming)

    def _retry_loop(self) -> None:
        while not self._stop.wait(self.records.retry_interval / 2):
            self._resume_stranded()
            try:
                with self.db.session() as s:
                    due = s.scalars(select(Operation.id).where(
                        Operation.status.in_(UNFINISHED_OPERATION), Operation.owner == self.owner,
                        Operation.next_attempt_at.is_not(None),
                        Operation.next_attempt_at <= utcnow())).all()
                for op_id in due:
                    self.submit(op_id)
            except Exception:
                log.exception("workflow retry loop")
