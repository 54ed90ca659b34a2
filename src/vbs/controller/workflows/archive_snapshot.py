"""The archive-snapshot workflow (rolls forward): ModifySnapshotTier to ``archive``, and the end of a
temporary restore. The snapshot already lives, whole, in the snapshot store (its manifest lists every chunk
it needs: docs/snapshot-tiers.md); archiving drops its pool's fast copy (a reflink or RBD pool keeps one),
moves it into the separate archive store if there is one (``archived.move_to_archive``: copied, then
its manifest leaves the snapshot store), then records the tier. A storage node that stays unreachable leaves
it ``archival-failed`` in the standard tier, with the reason.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from vbs.controller.db import Snapshot, SnapshotTier
from vbs.controller.db.tables import utcnow
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows.archived import move_to_archive
from vbs.controller.workflows.definition import Step, StepContext, Workflow
from vbs.controller.workflows.steps import StorageParams

__all__ = ["ARCHIVE_SNAPSHOT"]


def drop_pool_copy(ctx: StepContext[StorageParams]) -> None:
    """The pool gives its copy up; the snapshot is then found in the store only (``pool_copy`` false)."""
    with ctx.services.db.read() as s:
        in_pool = s.scalar(select(Snapshot.pool_copy).where(Snapshot.id == ctx.resource_id))
    if in_pool:
        shared.storage_agent(ctx).remove_snapshot(ctx.params.pool, ctx.resource_id)
        with ctx.session() as s:
            s.execute(update(Snapshot).where(Snapshot.id == ctx.resource_id)
                      .values(pool_copy=False, updated_at=utcnow()))


def archive_copy(ctx: StepContext[StorageParams]) -> None:
    move_to_archive(ctx)


def mark_archived(ctx: StepContext[StorageParams]) -> None:
    with ctx.session() as s:
        s.execute(update(SnapshotTier).where(SnapshotTier.snapshot_id == ctx.resource_id).values(
            tier="archive", last_status="archival-completed", last_progress=100, last_detail=None,
            archived_at=utcnow(), restore_expires_at=None))


def archival_failed(ctx: StepContext[Any], reason: str) -> None:
    """The snapshot stays standard, unless its move into an archive store was under way: the snapshot store
    may have lost its manifest already, so it is held as archived (a restore finds it in either store)."""
    with ctx.session() as s:
        row = s.get(SnapshotTier, ctx.resource_id)
        moving = row is not None and row.archive_store is not None
        if moving:
            reason += " (it may have moved into the archive store in part: restore it to use it)"
        s.execute(update(SnapshotTier).where(SnapshotTier.snapshot_id == ctx.resource_id).values(
            tier="archive" if moving else "standard", last_status="archival-failed", last_detail=reason[:2000]))


ARCHIVE_SNAPSHOT = Workflow(
    kind="archive-snapshot",
    exclusive=True,
    params=StorageParams,
    resume="forward",
    steps=(Step("pool-drop", drop_pool_copy), Step("archive-copy", archive_copy),
           Step("mark-archived", mark_archived, ends=True)),
    on_give_up=archival_failed,
)
