"""Snapshot workflows: create (rolls back if interrupted) and delete (rolls forward)."""

from __future__ import annotations

from sqlalchemy import select

from vbs.controller.db import Snapshot
from vbs.controller.states import SnapshotState
from vbs.controller.transitions import transition
from vbs.controller.workflows.engine import Step, StepContext, Workflow
from vbs.controller.workflows.storage import progress_reporter, storage_agent, until_ready


def snapshot_on_storage(ctx: StepContext) -> None:
    p = ctx.params
    agent = storage_agent(ctx)
    until_ready(lambda: agent.ensure_snapshot(p["pool"], ctx.resource_id, p["volume_id"]),
                progress_reporter(ctx, Snapshot, SnapshotState.PENDING))


def remove_from_storage(ctx: StepContext) -> None:
    storage_agent(ctx).remove_snapshot(ctx.params["pool"], ctx.resource_id)


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


def is_completed(ctx: StepContext) -> bool:
    with ctx.services.db.read() as s:
        return s.scalar(select(Snapshot.status).where(Snapshot.id == ctx.resource_id)) != SnapshotState.PENDING


CREATE_SNAPSHOT = Workflow(
    kind="create-snapshot",
    resume="rollback",
    steps=(Step("storage-snapshot", snapshot_on_storage, undo=remove_from_storage),
           Step("mark-completed", mark_completed)),
    on_rollback=mark_error,
    finished=is_completed,
)

DELETE_SNAPSHOT = Workflow(
    kind="delete-snapshot",
    resume="forward",
    steps=(Step("storage-delete", remove_from_storage), Step("mark-deleted", mark_deleted)),
)
