"""Volume workflows: create (rolls back if interrupted) and delete (rolls forward)."""

from __future__ import annotations

from sqlalchemy import select

from vbs.controller.db import Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.states import VolumeState
from vbs.controller.transitions import transition
from vbs.controller.workflows.engine import Step, StepContext, Workflow
from vbs.controller.workflows.storage import progress_reporter, storage_agent, until_ready


def create_on_storage(ctx: StepContext) -> None:
    p = ctx.params
    agent = storage_agent(ctx)
    until_ready(lambda: agent.ensure_volume(p["pool"], ctx.resource_id, p["size_gib"], p.get("snapshot_id")),
                progress_reporter(ctx, Volume, VolumeState.CREATING))


def remove_from_storage(ctx: StepContext) -> None:
    storage_agent(ctx).remove_volume(ctx.params["pool"], ctx.resource_id)


def mark_available(ctx: StepContext) -> None:
    with ctx.services.db.session() as s:
        transition(s, Volume, ctx.resource_id, [VolumeState.CREATING], VolumeState.AVAILABLE, progress=100,
                   status_reason=None)


def mark_error(ctx: StepContext, reason: str) -> None:
    with ctx.services.db.session() as s:
        transition(s, Volume, ctx.resource_id, [VolumeState.CREATING], VolumeState.ERROR,
                   status_reason=f"creation failed and was rolled back: {reason}"[:2000])


def mark_deleted(ctx: StepContext) -> None:
    with ctx.services.db.session() as s:
        transition(s, Volume, ctx.resource_id, [VolumeState.DELETING], VolumeState.DELETED, deleted_at=utcnow())


def is_available(ctx: StepContext) -> bool:
    with ctx.services.db.read() as s:
        return s.scalar(select(Volume.status).where(Volume.id == ctx.resource_id)) != VolumeState.CREATING


CREATE_VOLUME = Workflow(
    kind="create-volume",
    resume="rollback",
    steps=(Step("storage-create", create_on_storage, undo=remove_from_storage),
           Step("mark-available", mark_available)),
    on_rollback=mark_error,
    finished=is_available,
)

DELETE_VOLUME = Workflow(
    kind="delete-volume",
    resume="forward",
    steps=(Step("storage-delete", remove_from_storage), Step("mark-deleted", mark_deleted)),
)
