"""The restore-snapshot-tier workflow (rolls forward): RestoreSnapshotTier of a snapshot held in a separate
archive store (docs/snapshot-tiers.md). The storage agent copies it back into the snapshot store (a
permanent restore then drops the archive's copy); only then is it recorded in the standard tier, usable:
``temporary-restore-in-progress`` (or ``permanent-``), then ``...-completed``. A snapshot archived in the
snapshot store itself is restored at once, without this workflow.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import update

from vbs.controller.db import SnapshotTier
from vbs.controller.db.tables import utcnow
from vbs.controller.workflows.archived import restore_from_archive
from vbs.controller.workflows.definition import Params, Step, StepContext, Workflow

__all__ = ["RESTORE_SNAPSHOT_TIER", "TierRestoreParams"]


class TierRestoreParams(Params):
    """For good, or for ``days``."""

    permanent: bool
    days: int | None = None


def _kind(params: TierRestoreParams) -> str:
    return "permanent" if params.permanent else "temporary"


def copy_back(ctx: StepContext[TierRestoreParams]) -> None:
    restore_from_archive(ctx, permanent=ctx.params.permanent, status=f"{_kind(ctx.params)}-restore-in-progress")


def mark_restored(ctx: StepContext[TierRestoreParams]) -> None:
    now = utcnow()
    values: dict[str, Any] = {"tier": "standard", "last_status": f"{_kind(ctx.params)}-restore-completed",
                              "last_progress": 100, "last_detail": None}
    if ctx.params.permanent:
        values.update(archive_store=None, archived_at=None, restore_expires_at=None)
    else:
        values["restore_expires_at"] = now + timedelta(days=ctx.params.days or 1)
    with ctx.session() as s:
        s.execute(update(SnapshotTier).where(SnapshotTier.snapshot_id == ctx.resource_id).values(**values))


def restore_failed(ctx: StepContext[Any], reason: str) -> None:
    kind = "permanent" if getattr(ctx.params, "permanent", False) else "temporary"
    with ctx.session() as s:
        s.execute(update(SnapshotTier).where(SnapshotTier.snapshot_id == ctx.resource_id).values(
            last_status=f"{kind}-restore-failed", last_detail=reason[:2000]))


RESTORE_SNAPSHOT_TIER = Workflow(
    kind="restore-snapshot-tier",
    exclusive=True,
    params=TierRestoreParams,
    resume="forward",
    steps=(Step("copy-back", copy_back), Step("mark-restored", mark_restored, ends=True)),
    on_give_up=restore_failed,
)
