"""The copy-snapshot workflow (rolls back if interrupted): a scratch volume made from the source (a clone of
its pool's copy, or restored from the snapshot store), snapshot as the copy, put into the store (rolling
forward from there), the scratch removed, the copy marked completed.
"""

from __future__ import annotations

from typing import Any

from vbs.controller.db import Snapshot
from vbs.controller.db.states import SnapshotState
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows import stored
from vbs.controller.workflows.create_snapshot import remove_snapshot, store_gave_up
from vbs.controller.workflows.definition import Step, StepContext
from vbs.controller.workflows.steps import StorageParams


class CopySnapshotParams(StorageParams):
    source_snapshot_id: str
    # The copy goes through a volume made from the source, which only this operation knows (the
    # reconciler leaves it alone while the operation is unfinished: ``scratch_ids``).
    scratch_volume_id: str
    size_gib: int
    # The copy is a LUKS container; with ``key_id`` re-encrypted as it is copied, under that data key (the
    # source opened with ``source_key_id``, or plain).
    encrypted: bool = False
    key_id: str | None = None
    source_key_id: str | None = None
    # The copy goes into the snapshot store after its pool's copy, which takes this share of its progress
    # (``stored.copy_share``); None: its pool puts none into a store.
    store_share: int | None = None


def _scratch_from_source(ctx: StepContext[CopySnapshotParams]) -> None:
    p = ctx.params
    report = shared.progress_reporter(ctx, Snapshot, SnapshotState.PENDING)
    luks, source_luks = shared.key_passphrase(ctx, p.key_id), shared.key_passphrase(ctx, p.source_key_id)
    share = 90 if p.store_share is None else max(p.store_share * 9 // 10, 0)
    stored.fill_from_snapshot(ctx, p.node, p.pool, p.scratch_volume_id, p.size_gib, p.source_snapshot_id,
                              stored.scaled(report, 0, share), encrypted=p.encrypted, luks=luks,
                              source_luks=source_luks)


def _remove_scratch(ctx: StepContext[CopySnapshotParams]) -> None:
    shared.storage_agent(ctx).remove_volume(ctx.params.pool, ctx.params.scratch_volume_id)


def snapshot_scratch(ctx: StepContext[Any]) -> None:
    """The storage node snapshots the operation's scratch volume (``params.pool``/``scratch_volume_id``) as
    the operation's snapshot: the copy's data, fixed."""
    p = ctx.params
    agent = shared.storage_agent(ctx)
    shared.until_ready(lambda: agent.ensure_snapshot(p.pool, ctx.resource_id, p.scratch_volume_id),
                       lambda progress: None, unreachable_s=shared.patience(ctx))


def store_copy(ctx: StepContext[Any]) -> None:
    """The copy goes into the store (the operation's ``node``/``pool``, ``store_share`` of its params)."""
    p = ctx.params
    if p.store_share is not None:
        stored.upload(ctx, p.node, p.pool, ctx.resource_id, p.store_share)


COPY_SNAPSHOT = shared.creation(
    "copy-snapshot", CopySnapshotParams,
    (Step("scratch-volume", _scratch_from_source, undo=_remove_scratch),
     Step("storage-snapshot", snapshot_scratch, undo=remove_snapshot),
     Step("store-upload", store_copy),
     Step("remove-scratch", _remove_scratch)),
    Snapshot, "snapshot copy failed and was rolled back", forward_from="store-upload",
    on_give_up=store_gave_up)


def scratch_ids(params: dict[str, Any]) -> list[str]:
    """What an unfinished operation made on a storage node besides its own resource."""
    scratch = params.get("scratch_volume_id")
    return [scratch] if isinstance(scratch, str) else []
