"""What the tier workflows share about a separate archive store (docs/snapshot-tiers.md): which store a
snapshot is archived to, which storage agent reaches it, and the moves between it and the snapshot store,
with their progress in the snapshot's tier row. The agents copy; the controller records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import update

from vbs.controller.db import Node, Snapshot, SnapshotTier
from vbs.controller.fleet.nodes import pool_of
from vbs.controller.services import Services
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows.definition import StepContext
from vbs.controller.workflows.stored import archive_agent, the_store_key
from vbs.errors import IncorrectState

__all__ = ["archive_store_of", "move_to_archive", "restore_from_archive"]


def archive_store_of(services: Services, snap: Snapshot) -> str | None:
    """The archive store the snapshot's pool reports (None: it has none: archiving keeps it in the store)."""
    with services.db.read() as s:
        info = pool_of(s.get(Node, (snap.storage_node, "storage")), snap.pool)
    return None if info is None else info.archive_store


def _tier_progress(ctx: StepContext[Any], while_status: str) -> Callable[[int], None]:
    """Mirror a move's progress into the tier row while its last operation is ``while_status``."""
    def report(progress: int) -> None:
        with ctx.services.db.session() as s:
            s.execute(update(SnapshotTier).where(
                SnapshotTier.snapshot_id == ctx.resource_id, SnapshotTier.last_status == while_status,
                SnapshotTier.last_progress < progress).values(last_progress=min(progress, 99)))
    return report


def _snapshot(ctx: StepContext[Any]) -> tuple[Snapshot, SnapshotTier | None]:
    with ctx.services.db.read() as s:
        snap = s.get(Snapshot, ctx.resource_id)
        row = s.get(SnapshotTier, ctx.resource_id)
    if snap is None:
        raise IncorrectState(f"The snapshot '{ctx.resource_id}' is gone.")
    return snap, row


def move_to_archive(ctx: StepContext[Any]) -> None:
    """The snapshot moves into the archive store (its row names that store before the agent is asked, so a
    delete meanwhile deletes it there too, and a failure leaves it to a restore), with its progress; nothing
    to do without an archive store."""
    snap, row = _snapshot(ctx)
    archive = row.archive_store if row is not None and row.archive_store else archive_store_of(ctx.services, snap)
    if archive is None:
        return
    agent = archive_agent(ctx.services, snap, archive)
    with ctx.services.db.session() as s:
        s.execute(update(SnapshotTier).where(SnapshotTier.snapshot_id == snap.id).values(archive_store=archive))
    key = the_store_key(ctx)
    shared.until_ready(lambda: agent.archive_stored(snap.id, snap.tenant, key),
                       _tier_progress(ctx, "archival-in-progress"), unreachable_s=shared.patience(ctx))


def restore_from_archive(ctx: StepContext[Any], *, permanent: bool, status: str) -> None:
    """The snapshot is copied back into the snapshot store (``permanent``: then leaves the archive store),
    with its progress while its tier row's last operation is ``status``."""
    snap, row = _snapshot(ctx)
    if row is None or row.archive_store is None:
        return
    agent = archive_agent(ctx.services, snap, row.archive_store)
    key = the_store_key(ctx)
    shared.until_ready(lambda: agent.restore_archived(snap.id, snap.tenant, key, permanent=permanent),
                       _tier_progress(ctx, status), unreachable_s=shared.patience(ctx))
