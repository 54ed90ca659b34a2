"""The create-volume workflow (rolls back if interrupted): the storage node makes the volume (empty, or
from a snapshot: a clone of its pool's copy, or hydrated from the snapshot store; with progress), then it
is marked available.
"""

from __future__ import annotations

from vbs.controller.db import Volume
from vbs.controller.db.states import VolumeState
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows import stored
from vbs.controller.workflows.definition import Step, StepContext
from vbs.controller.workflows.steps import StorageParams


class CreateVolumeParams(StorageParams):
    size_gib: int
    snapshot_id: str | None = None
    # A LUKS container (its size is the payload's). With ``format_key`` the pool writes it under the volume's
    # data key (fetched at the step, never kept in these params): a new container, or the snapshot
    # re-encrypted as it is copied (opened with the data key ``source_key_id``, or plain); without, it is a
    # clone of an encrypted snapshot.
    encrypted: bool = False
    format_key: bool = False
    source_key_id: str | None = None


def create_on_storage(ctx: StepContext[CreateVolumeParams]) -> None:
    p = ctx.params
    agent = shared.storage_agent(ctx)
    luks = shared.data_key(ctx, ctx.resource_id) if p.format_key else None
    source_luks = shared.key_passphrase(ctx, p.source_key_id)
    report = shared.progress_reporter(ctx, Volume, VolumeState.CREATING)
    if p.snapshot_id is not None:
        # A clone of the snapshot's pool copy where the volume is made beside it, else hydrated from the
        # snapshot store, every chunk checked (a missing or corrupt one fails it, naming the chunk).
        stored.fill_from_snapshot(ctx, p.node, p.pool, ctx.resource_id, p.size_gib, p.snapshot_id, report,
                                  encrypted=p.encrypted, luks=luks, source_luks=source_luks)
        return
    shared.until_ready(lambda: agent.ensure_volume(p.pool, ctx.resource_id, p.size_gib, None,
                                                   encrypted=p.encrypted, luks=luks, source_luks=source_luks),
                       report, unreachable_s=shared.patience(ctx))


def remove_from_storage(ctx: StepContext[StorageParams]) -> None:
    shared.storage_agent(ctx).remove_volume(ctx.params.pool, ctx.resource_id)


CREATE_VOLUME = shared.creation(
    "create-volume", CreateVolumeParams,
    (Step("storage-create", create_on_storage, undo=remove_from_storage),),
    Volume, "creation failed and was rolled back", exclusive=True)
