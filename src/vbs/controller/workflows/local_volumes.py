"""Workflows of local volumes (semi-shared storage, after OpenNebula): volumes in a hypervisor node's own
local pool, made and removed by its host agent, attached there with no network hop.

- create: the host makes the volume; from a snapshot, the storage node clones the snapshot into a
  scratch volume, exports it read-only to that host, and the host copies it in (progress in the
  volume's row); the scratch volume goes. Rolls back.
- attach / detach: the host opens the volume by pool and volume id (``LocalConnection``); no storage
  node is involved. A detach of a non-persistent volume removes it (an instance store), rolling forward.
- create-snapshot: the copy goes back to shared storage: the storage node makes a scratch volume and
  exports it to the host, the host copies the volume into it (its hypervisor at one instant while a
  VM has it, else ``qemu-img convert``), the storage node snapshots the scratch volume, puts the snapshot
  into the snapshot store (rolling forward from there) and drops the scratch volume.
- delete: the host removes it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from vbs import ids
from vbs.controller.db import Attachment, Node, Snapshot, Volume
from vbs.controller.db.states import AttachmentState, SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.db.transitions import transition
from vbs.controller.fleet.agents import HostAgent
from vbs.controller.fleet.nodes import host_identity
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows import stored
from vbs.controller.workflows.attach_volume import (
    AttachParams,
    attach_rolled_back,
    is_attached,
    mark_attached,
    unplug_forcibly,
)
from vbs.controller.workflows.copy_snapshot import snapshot_scratch, store_copy
from vbs.controller.workflows.create_snapshot import remove_snapshot, store_gave_up
from vbs.controller.workflows.definition import Params, Step, StepContext, Workflow
from vbs.controller.workflows.detach_volume import DetachParams, detaching, mark_detached
from vbs.controller.workflows.steps import StorageParams
from vbs.errors import NotFound
from vbs.wire.connection import HostIdentity, LocalConnection


class CreateLocalVolumeParams(Params):
    host: str
    pool: str  # the host's local pool
    size_gib: int
    # From a snapshot: where it lives, and the scratch volume made from it there (the reconciler
    # leaves it alone while the operation is unfinished: ``scratch_ids``).
    snapshot_id: str | None = None
    snapshot_node: str | None = None
    snapshot_pool: str | None = None
    scratch_volume_id: str | None = None


class SnapshotLocalParams(StorageParams):
    """``node``/``pool``: the shared storage the snapshot lands on (and from there in the snapshot store,
    its pool's copy taking ``store_share`` of its progress; None: no store)."""

    volume_id: str
    host: str
    local_pool: str
    size_gib: int
    scratch_volume_id: str
    store_share: int | None = None


def _host(ctx: StepContext[Any], name: str) -> HostAgent:
    return ctx.services.agents.host(name)


def _identity(ctx: StepContext[Any], host: str) -> HostIdentity:
    with ctx.services.db.read() as s:
        node = s.get(Node, (host, "host"))
    if node is None:
        raise NotFound(f"host {host} is not known", code="InvalidHost.NotFound")
    return host_identity(node)


# -- create ------------------------------------------------------------------------------------------------

def _scratch_from_snapshot(ctx: StepContext[CreateLocalVolumeParams]) -> None:
    p = ctx.params
    if p.snapshot_id is None or p.snapshot_node is None or p.snapshot_pool is None or p.scratch_volume_id is None:
        return
    # A clone of the snapshot's pool copy, or (a copy pool keeps none) restored from the snapshot store.
    stored.fill_from_snapshot(ctx, p.snapshot_node, p.snapshot_pool, p.scratch_volume_id, p.size_gib, p.snapshot_id,
                              lambda progress: None)


def _remove_scratch_of_snapshot(ctx: StepContext[CreateLocalVolumeParams]) -> None:
    p = ctx.params
    if p.snapshot_node is not None and p.snapshot_pool is not None and p.scratch_volume_id is not None:
        agent = ctx.services.agents.storage(p.snapshot_node)
        agent.remove_connection(p.snapshot_pool, p.scratch_volume_id, p.host)
        agent.remove_volume(p.snapshot_pool, p.scratch_volume_id)


def _create_on_host(ctx: StepContext[CreateLocalVolumeParams]) -> None:
    p = ctx.params
    host = _host(ctx, p.host)
    shared.until_ready(lambda: host.ensure_local_volume(p.pool, ctx.resource_id, p.size_gib), lambda progress: None,
                       unreachable_s=shared.patience(ctx))


def _remove_from_host(ctx: StepContext[CreateLocalVolumeParams]) -> None:
    _host(ctx, ctx.params.host).remove_local_volume(ctx.params.pool, ctx.resource_id)


def _fill_from_snapshot(ctx: StepContext[CreateLocalVolumeParams]) -> None:
    """The host copies the snapshot's data in, through the storage node's read-only export of the scratch volume."""
    p = ctx.params
    if p.snapshot_node is None or p.snapshot_pool is None or p.scratch_volume_id is None:
        return
    agent = ctx.services.agents.storage(p.snapshot_node)
    host = _host(ctx, p.host)
    source = shared.waiting(lambda: agent.connection_for(p.snapshot_pool or "", p.scratch_volume_id or "",
                                                         _identity(ctx, p.host), True),
                            limit_s=ctx.services.cfg.give_up_after_s).connection
    shared.until_ready(lambda: host.fill_local_volume(p.pool, ctx.resource_id, source),
                       shared.progress_reporter(ctx, Volume, VolumeState.CREATING), unreachable_s=shared.patience(ctx))
    host.forget_fill(p.pool, ctx.resource_id)
    agent.remove_connection(p.snapshot_pool, p.scratch_volume_id, p.host)


def _cancel_fill(ctx: StepContext[CreateLocalVolumeParams]) -> None:
    _host(ctx, ctx.params.host).forget_fill(ctx.params.pool, ctx.resource_id)


CREATE_LOCAL_VOLUME = shared.creation(
    "create-local-volume", CreateLocalVolumeParams,
    (Step("scratch-from-snapshot", _scratch_from_snapshot, undo=_remove_scratch_of_snapshot),
     Step("host-create", _create_on_host, undo=_remove_from_host),
     Step("host-fill", _fill_from_snapshot, undo=_cancel_fill),
     Step("remove-scratch", _remove_scratch_of_snapshot)),
    Volume, "creation failed and was rolled back")


# -- delete --------------------------------------------------------------------------------------------------

def _remove_local(ctx: StepContext[StorageParams]) -> None:
    """``node`` is the host of a local volume, ``pool`` its local pool."""
    _host(ctx, ctx.params.node).remove_local_volume(ctx.params.pool, ctx.resource_id)


DELETE_LOCAL_VOLUME = shared.deletion("delete-local-volume", Volume, _remove_local, exclusive=False,
                                      deleted_at=utcnow)


# -- attach and detach -------------------------------------------------------------------------------------

def _plug_local(ctx: StepContext[AttachParams]) -> None:
    p = ctx.params
    _host(ctx, p.host).attach(p.vm_id, p.serial, LocalConnection(pool=p.pool, volume_id=ctx.resource_id),
                              read_only=p.read_only, qos=p.limits.qos if p.limits is not None else p.qos)


ATTACH_LOCAL_VOLUME = Workflow(
    kind="attach-local-volume",
    params=AttachParams,
    resume="rollback",
    steps=(Step("host-attach", _plug_local, undo=unplug_forcibly),
           Step("mark-attached", mark_attached, ends=True)),
    on_rollback=attach_rolled_back,
    finished=is_attached,
)


def _discard_non_persistent(ctx: StepContext[DetachParams]) -> None:
    if not ctx.params.persistent:
        _host(ctx, ctx.params.host).remove_local_volume(ctx.params.pool, ctx.resource_id)


def _mark_detached(ctx: StepContext[DetachParams]) -> None:
    """Detached; a non-persistent volume, whose data the host removed, is deleted with it."""
    mark_detached(ctx)
    if not ctx.params.persistent:
        with ctx.session() as s:
            transition(s, Volume, ctx.resource_id, VolumeState.DELETING, already_ok=True)
            transition(s, Volume, ctx.resource_id, VolumeState.DELETED, already_ok=True, deleted_at=utcnow(),
                       status_reason="a non-persistent local volume is removed at detach")


DETACH_LOCAL_VOLUME = detaching("detach-local-volume", Step("discard-non-persistent", _discard_non_persistent),
                                _mark_detached, exclusive=False)


# -- snapshot back to shared storage ---------------------------------------------------------------------

def _scratch_target(ctx: StepContext[SnapshotLocalParams]) -> None:
    p = ctx.params
    agent = shared.storage_agent(ctx)
    shared.until_ready(lambda: agent.ensure_volume(p.pool, p.scratch_volume_id, p.size_gib, None),
                       lambda progress: None, unreachable_s=shared.patience(ctx))


def _remove_scratch_target(ctx: StepContext[SnapshotLocalParams]) -> None:
    p = ctx.params
    agent = shared.storage_agent(ctx)
    agent.remove_connection(p.pool, p.scratch_volume_id, p.host)
    agent.remove_volume(p.pool, p.scratch_volume_id)


def _writer_vm(ctx: StepContext[SnapshotLocalParams]) -> str | None:
    with ctx.services.db.read() as s:
        return s.scalar(select(Attachment.vm_id).where(Attachment.volume_id == ctx.params.volume_id,
                                                       Attachment.status == AttachmentState.ATTACHED))


def _copy_to_shared(ctx: StepContext[SnapshotLocalParams]) -> None:
    """The host copies the volume into the scratch volume's export: its hypervisor at one instant while a VM
    has the disk, else ``qemu-img convert`` of the idle file."""
    p = ctx.params
    agent = shared.storage_agent(ctx)
    host = _host(ctx, p.host)
    report = stored.scaled(shared.progress_reporter(ctx, Snapshot, SnapshotState.PENDING), 0,
                           100 if p.store_share is None else p.store_share)
    target = shared.waiting(lambda: agent.connection_for(p.pool, p.scratch_volume_id, _identity(ctx, p.host), False),
                            limit_s=ctx.services.cfg.give_up_after_s).connection
    vm = _writer_vm(ctx)
    serial = ids.virtio_serial(p.volume_id)
    if vm is not None:
        shared.until_ready(lambda: host.ensure_copy(vm, serial, ctx.resource_id, target),
                           lambda progress: report(progress * 9 // 10), unreachable_s=shared.patience(ctx))
        host.remove_copy(vm, serial, ctx.resource_id)
    else:
        shared.until_ready(lambda: host.copy_local_volume(p.local_pool, p.volume_id, ctx.resource_id, target),
                           lambda progress: report(progress * 9 // 10), unreachable_s=shared.patience(ctx))
        host.forget_local_copy(p.local_pool, p.volume_id, ctx.resource_id)
    agent.remove_connection(p.pool, p.scratch_volume_id, p.host)


def _cancel_copy_to_shared(ctx: StepContext[SnapshotLocalParams]) -> None:
    p = ctx.params
    host = _host(ctx, p.host)
    host.forget_local_copy(p.local_pool, p.volume_id, ctx.resource_id)
    vm = _writer_vm(ctx)
    if vm is not None:
        host.remove_copy(vm, ids.virtio_serial(p.volume_id), ctx.resource_id)
    shared.storage_agent(ctx).remove_connection(p.pool, p.scratch_volume_id, p.host)


SNAPSHOT_LOCAL_VOLUME = shared.creation(
    "snapshot-local-volume", SnapshotLocalParams,
    (Step("scratch-volume", _scratch_target, undo=_remove_scratch_target),
     Step("host-copy", _copy_to_shared, undo=_cancel_copy_to_shared),
     Step("storage-snapshot", snapshot_scratch, undo=remove_snapshot),
     Step("store-upload", store_copy),
     Step("remove-scratch", _remove_scratch_target)),
    Snapshot, "snapshot failed and was rolled back", forward_from="store-upload", on_give_up=store_gave_up)

LOCAL_WORKFLOWS: list[Workflow[Any]] = [CREATE_LOCAL_VOLUME, DELETE_LOCAL_VOLUME, ATTACH_LOCAL_VOLUME,
                                        DETACH_LOCAL_VOLUME, SNAPSHOT_LOCAL_VOLUME]
