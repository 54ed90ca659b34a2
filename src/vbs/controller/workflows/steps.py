"""What the workflows share: parameters that name a storage node, waiting for an agent's work with
progress, and the DB steps that mark a resource's outcome."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import SecretStr
from sqlalchemy import select, update

from vbs.controller.auth import encryption
from vbs.controller.db import Snapshot, Volume
from vbs.controller.db.states import SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.db.transitions import Stateful, transition
from vbs.controller.fleet.agents import StorageAgent
from vbs.controller.workflows.definition import Params, Step, StepContext, Workflow
from vbs.errors import AgentUnavailable, DriverError, RetryLater
from vbs.wire.storage import ItemStatus

__all__ = ["StorageParams", "storage_agent", "patience", "until_ready", "waiting", "progress_reporter", "mark",
           "mark_failed", "has_left", "creation", "deletion"]

# Short copies finish between two polls: start polling fast, back off to the steady interval.
FIRST_POLL_S = 0.02
POLL_INTERVAL_S = 0.25
UNREACHABLE_LIMIT_S = 120.0

T = TypeVar("T")
P = TypeVar("P", bound=Params)
S = TypeVar("S", bound=ItemStatus)


class StorageParams(Params):
    """The storage node and pool the operation's resource lives on."""

    node: str
    pool: str


def storage_agent(ctx: StepContext[Any]) -> StorageAgent:
    return ctx.services.agents.storage(ctx.params.node)


def data_key(ctx: StepContext[Any], volume_id: str) -> SecretStr | None:
    """The LUKS passphrase of an encrypted volume (None: not encrypted), opened now for one agent call."""
    with ctx.services.db.read() as s:
        vol = s.get(Volume, volume_id)
        if vol is None or vol.key_id is None:
            return None
        return encryption.passphrase(s, ctx.services.master_key, vol.key_id)


def key_passphrase(ctx: StepContext[Any], key_id: str | None) -> SecretStr | None:
    """The passphrase of data key ``key_id`` (None for None), opened now for one agent call."""
    if key_id is None:
        return None
    with ctx.services.db.read() as s:
        return encryption.passphrase(s, ctx.services.master_key, key_id)


def patience(ctx: StepContext[Any]) -> float:
    """How long a step waits for an agent that does not answer: no longer than retries would last."""
    return min(UNREACHABLE_LIMIT_S, ctx.services.cfg.give_up_after_s)


def waiting(call: Callable[[], T], *, limit_s: float) -> T:
    """``call()``, repeated while the agent answers ``RetryLater`` (something it depends on is still
    in progress), for ``limit_s`` at most; then the last ``RetryLater`` is the step's failure."""
    deadline = time.monotonic() + limit_s
    delay = FIRST_POLL_S
    while True:
        try:
            return call()
        except RetryLater:
            if time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(1.0, delay * 2)


def until_ready(ensure: Callable[[], S], on_progress: Callable[[int], None], *,
                unreachable_s: float = UNREACHABLE_LIMIT_S) -> S:
    """Repeat the idempotent ``ensure`` call until the item is ready.

    Polling with ``ensure`` rather than a read keeps the work going if the agent restarted midway
    (it restarts what may be restarted). An agent unreachable for ``unreachable_s`` fails the step;
    one that answers ``error`` fails it with the agent's reason.
    """
    last_progress = -1
    unreachable_since: float | None = None
    delay = FIRST_POLL_S
    while True:
        try:
            status = ensure()
            unreachable_since = None
        except AgentUnavailable as exc:
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since > unreachable_s:
                # Not "unreachable": earlier calls of this loop may have started work on the agent.
                raise AgentUnavailable(exc.message) from exc
            time.sleep(1.0)
            continue
        if status.state == "ready":
            return status
        if status.state == "error":
            raise DriverError(status.error or "the agent reported an error")
        if status.progress != last_progress:
            on_progress(status.progress)
            last_progress = status.progress
        time.sleep(delay)
        delay = min(POLL_INTERVAL_S, delay * 2)


def progress_reporter(ctx: StepContext[Any], table: type[Volume] | type[Snapshot],
                      while_in: str, row_id: str | None = None) -> Callable[[int], None]:
    """Mirror a copy's progress into the resource row (or the row ``row_id``: one of several an
    operation makes), while the row is still ``while_in``. Progress never goes back, though its phases
    (a hypervisor's copy, then giving space back) count anew."""
    item = row_id or ctx.resource_id

    def report(progress: int) -> None:
        with ctx.services.db.session() as s:
            s.execute(update(table).where(table.id == item, table.status == while_in,
                                          table.progress < progress)
                      .values(progress=progress, updated_at=utcnow()))

    return report


def mark(table: Stateful, to_state: str, **values: Any) -> Callable[[StepContext[Any]], None]:
    """A step that moves the operation's resource to ``to_state`` (as the state table allows)."""

    def step(ctx: StepContext[Any]) -> None:
        with ctx.session() as s:
            transition(s, table, ctx.resource_id, to_state, already_ok=True,
                       **{k: v() if callable(v) else v for k, v in values.items()})

    return step


def mark_failed(table: Stateful, to_state: str, what: str) -> Callable[[StepContext[Any], str], None]:
    """An ending that moves the resource to ``to_state`` with the reason (``what`` and why); a
    resource already there (the ending ran before a crash) is left as it is."""

    def ending(ctx: StepContext[Any], reason: str) -> None:
        with ctx.session() as s:
            transition(s, table, ctx.resource_id, to_state, already_ok=True, status_reason=f"{what}: {reason}"[:2000])

    return ending


def has_left(table: type[Volume] | type[Snapshot], state: str) -> Callable[[StepContext[Any]], bool]:
    """Whether the resource is no longer ``state`` (its workflow's last step ran)."""

    def check(ctx: StepContext[Any]) -> bool:
        with ctx.services.db.read() as s:
            return s.scalar(select(table.status).where(table.id == ctx.resource_id)) != state

    return check


def creation(kind: str, params: type[P], steps: tuple[Step[P], ...], table: type[Volume] | type[Snapshot],
             failed: str, *, exclusive: bool = False, forward_from: str | None = None,
             on_give_up: Callable[[StepContext[P], str], None] | None = None,
             gives_up: Callable[[StepContext[P], Exception], bool] | None = None) -> Workflow[P]:
    """Make a volume or snapshot (rolls back if interrupted): ``steps``, then it is marked available
    (completed). Rolled back, it ends ``error``, the reason after ``failed``; resumed after its last step
    ran, it is finished. From step ``forward_from`` on (a snapshot's upload into the store: the pool's
    copy is made, the upload resumes) it rolls forward instead, and ``on_give_up`` ends it when retries
    are exhausted, or ``gives_up`` at once on a failure that no retry can mend (it ends it itself)."""
    making: str
    error: str
    if table is Volume:
        made = Step("mark-available", mark(Volume, VolumeState.AVAILABLE, progress=100, status_reason=None),
                    ends=True)
        making, error = VolumeState.CREATING, VolumeState.ERROR
    else:
        made = Step("mark-completed", mark(Snapshot, SnapshotState.COMPLETED, progress=100), ends=True)
        making, error = SnapshotState.PENDING, SnapshotState.ERROR
    return Workflow(kind=kind, exclusive=exclusive, params=params, resume="rollback", steps=(*steps, made),
                    on_rollback=mark_failed(table, error, failed), finished=has_left(table, making),
                    forward_from=forward_from, on_give_up=on_give_up, gives_up=gives_up)


def deletion(kind: str, table: type[Volume] | type[Snapshot], remove: Callable[[StepContext[Any]], None], *,
             exclusive: bool, **deleted_values: Any) -> Workflow[StorageParams]:
    """Delete a volume or snapshot (rolls forward): from its storage node, then from the DB. A node
    that stays unreachable leaves it ``error``, which may be deleted again."""
    return Workflow(
        kind=kind,
        exclusive=exclusive,
        params=StorageParams,
        resume="forward",
        steps=(Step("storage-delete", remove),
               Step("mark-deleted", mark(table, "deleted", **deleted_values), ends=True)),
        on_give_up=mark_failed(table, "error", "deletion could not finish (delete it again)"),
    )
