"""Snapshot workflows: create (rolls back if interrupted) and delete (rolls forward)."""

from __future__ import annotations

from sqlalchemy import update

from vbs.controller.db import Snapshot
from vbs.controller.db.tables import utcnow
from vbs.controller.states import SnapshotState
from vbs.controller.transitions import transition
from vbs.controller.workflows.engine import Step, StepContext, Workflow
from vbs.controller.workflows.waiting import until_ready


def _agent(ctx: StepContext):  # type: ignore[no-untyped-def]
    return ctx.services.agents.storage(ctx.params["node"])


def _set_progress(ctx: StepContext, progress: int) -> None:
    with ctx.services.db.session() as s:
        s.execute(update(Snapshot).where(Snapshot.id == ctx.resource_id, Snapshot.status == SnapshotState.PENDING)
                  .values(progress=progress, updated_at=utcnow()))


def snapshot_on_storage(ctx: StepContext) -> None:
    p = ctx.params
    agent = _agent(ctx)
    until_ready(lambda: agent.ensure_snapshot(p["pool"], ctx.resource_id, p["volume_id"]),
                lambda pct: _set_progress(ctx, pct))


def remove_from_storage(ctx: StepContext) -> None:
    _agent(ctx).remove_snapshot(ctx.params["pool"], ctx.resource_id)


def mark_completed(ctx: StepContext) -> None:
    with ctx.services.db.session() as s:
        transition(s, Snapshot, ctx.resource_id, [SnapshotState.PENDING], SnapshotState.COMPLETED, progress=100)


def mark_error(ctx: StepContext, reason: str) -> None:
    with ctx.services.db.session() as s:
        transition(s, Snapshot, ctx.resource_id, [SnapshotState.PENDING], SnapshotState.ERROR,
                   status_reason=f"snapshot failed and was rolled back: {reason}"[:2000])


def mark_deleted(ctx: StepContext) -> None:
    with ctx.services.db.session() as s:
        transition(s, Snapshot, ctx.resource_id, [SnapshotState.DELETING], SnapshotState.DELETED)


CREATE_SNAPSHOT = Workflow(
    kind="create-snapshot",
    resume="rollback",
    steps=(Step("storage-snapshot", snapshot_on_storage, undo=remove_from_storage),
           Step("mark-completed", mark_completed)),
    on_rollback=mark_error,
)

DELETE_SNAPSHOT = Workflow(
    kind="delete-snapshot",
    resume="forward",
    steps=(Step("storage-delete", remove_from_storage), Step("mark-deleted", mark_deleted)),
)
