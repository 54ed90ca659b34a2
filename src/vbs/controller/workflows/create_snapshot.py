"""The create-snapshot workflow (rolls back if interrupted).

A snapshot is point-in-time, also of a volume that a guest writes to. The storage node takes it
where it can (reflink, or an export daemon that copies at one instant). Where it cannot — the
volume is exported by a daemon that writes to the file directly (tgtd) and a host writes to it —
it says so (``PointInTimeUnavailable``), and the hypervisor of the one VM the volume is attached to
copies it at one instant into a snapshot target the storage node exports to that host. A volume
attached to several VMs, or to a hypervisor that cannot copy, is refused with the reason: never a
snapshot that is not point-in-time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import select

from vbs import ids
from vbs.controller.db import Attachment, Node, Snapshot, Volume
from vbs.controller.db.states import AttachmentState, SnapshotState
from vbs.controller.db.transitions import transition
from vbs.controller.fleet.nodes import host_identity, host_info
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows import stored
from vbs.controller.workflows.definition import Step, StepContext
from vbs.controller.workflows.steps import StorageParams
from vbs.errors import IncorrectState, NotFound, PointInTimeUnavailable, SnapshotSourceLost, VbsError

log = logging.getLogger(__name__)

SETTLE_LIMIT_S = 120.0


class CreateSnapshotParams(StorageParams):
    volume_id: str
    # Set while (and after) the hypervisor of this VM copies the volume: its undo must cancel it.
    via_host: str | None = None
    via_vm: str | None = None
    # The snapshot goes into the store after its pool's copy, which takes this share (0-100) of its
    # progress (``stored.copy_share``); None: its pool puts none into a store (and older operations).
    store_share: int | None = None


def take_snapshot(ctx: StepContext[CreateSnapshotParams]) -> None:
    p = ctx.params
    agent = shared.storage_agent(ctx)
    report = stored.scaled(shared.progress_reporter(ctx, Snapshot, SnapshotState.PENDING), 0,
                           100 if p.store_share is None else p.store_share)
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while True:
        try:
            shared.until_ready(lambda: agent.ensure_snapshot(p.pool, ctx.resource_id, p.volume_id), report,
                               unreachable_s=shared.patience(ctx))
            return
        except PointInTimeUnavailable:
            pass
        attachment = _writer(ctx)
        if attachment is None:
            # Being attached or detached: the export is there, the disk not (yet, or any more).
            if time.monotonic() >= deadline:
                raise IncorrectState(f"The volume '{p.volume_id}' did not settle (attaching or detaching) within "
                                     f"{SETTLE_LIMIT_S:g}s; no point-in-time copy of it could be taken.")
            time.sleep(0.5)
            continue
        try:
            _copy_through_hypervisor(ctx, attachment, report)
            return
        except NotFound:
            # The disk left the VM meanwhile (a detach): start over, the storage node may copy it now.
            _remove_host_copy(ctx)
            agent.remove_snapshot(p.pool, ctx.resource_id)


def _writer(ctx: StepContext[CreateSnapshotParams]) -> Attachment | None:
    """The one attachment whose VM writes to the volume; IncorrectState if none can copy it."""
    p = ctx.params
    with ctx.services.db.read() as s:
        live = list(s.scalars(select(Attachment).where(Attachment.volume_id == p.volume_id,
                                                       Attachment.status != AttachmentState.DETACHED)))
        hosts = {n.name: n for n in s.scalars(select(Node).where(Node.kind == "host"))}
        encrypted = s.scalar(select(Volume.key_id).where(Volume.id == p.volume_id)) is not None
    if len(live) > 1:
        raise IncorrectState(f"The volume '{p.volume_id}' is attached to {len(live)} VMs and its storage node cannot "
                             "copy it at one instant; a point-in-time snapshot of it needs a reflink pool or an "
                             "NBD-exporting storage node.")
    if not live or live[0].status != AttachmentState.ATTACHED:
        return None
    if encrypted:
        # A hypervisor copies what its guest sees: plaintext. Never a snapshot that is not encrypted.
        raise IncorrectState(f"The volume '{p.volume_id}' is encrypted and its storage node cannot copy it at one "
                             "instant; detach it to snapshot it.")
    host = hosts.get(live[0].host)
    if host is None or not host_info(host).capabilities.point_in_time_copy:
        raise IncorrectState(f"Neither the storage node of '{p.volume_id}' nor the hypervisor of host "
                             f"'{live[0].host}' can copy it at one instant; detach it to snapshot it.")
    return live[0]


def _copy_through_hypervisor(ctx: StepContext[CreateSnapshotParams], attachment: Attachment,
                             report: Any) -> None:
    p = ctx.params
    agent = shared.storage_agent(ctx)
    with ctx.services.db.read() as s:
        node = s.get(Node, (attachment.host, "host"))
    if node is None:
        raise NotFound(f"host {attachment.host} is not known")
    p.via_host, p.via_vm = attachment.host, attachment.vm_id
    ctx.save()  # before anything is made: an undo after a crash must know where to look
    host = ctx.services.agents.host(attachment.host)
    serial = ids.virtio_serial(p.volume_id)
    target = agent.snapshot_target(p.pool, ctx.resource_id, p.volume_id, host_identity(node))
    shared.until_ready(lambda: host.ensure_copy(attachment.vm_id, serial, ctx.resource_id, target), report,
                       unreachable_s=shared.patience(ctx))
    # The finished job is the copy's record until now (a repeated ensure must not copy a later instant).
    host.remove_copy(attachment.vm_id, serial, ctx.resource_id)
    shared.until_ready(lambda: agent.finish_snapshot_target(p.pool, ctx.resource_id, attachment.host), report,
                       unreachable_s=shared.patience(ctx))


def _remove_host_copy(ctx: StepContext[CreateSnapshotParams]) -> None:
    p = ctx.params
    if p.via_host is not None and p.via_vm is not None:
        ctx.services.agents.host(p.via_host).remove_copy(p.via_vm, ids.virtio_serial(p.volume_id), ctx.resource_id)


def remove_snapshot(ctx: StepContext[Any]) -> None:
    shared.storage_agent(ctx).remove_snapshot(ctx.params.pool, ctx.resource_id)


def undo_snapshot(ctx: StepContext[CreateSnapshotParams]) -> None:
    _remove_host_copy(ctx)
    remove_snapshot(ctx)


def store_snapshot(ctx: StepContext[CreateSnapshotParams]) -> None:
    """The storage node puts the snapshot into the store: ``completed`` means stored (docs/snapshots.md)."""
    p = ctx.params
    if p.store_share is not None:
        stored.upload(ctx, p.node, p.pool, ctx.resource_id, p.store_share)


def unstore_snapshot(ctx: StepContext[Any]) -> None:
    stored.delete_from_store(ctx, ctx.resource_id)


def remove_snapshot_everywhere(ctx: StepContext[Any]) -> None:
    """Delete-snapshot's storage step: its manifest from the store (an upload under way stops) and its copy
    from its pool, wherever each is."""
    stored.delete_from_store(ctx, ctx.resource_id)
    with ctx.services.db.read() as s:
        in_pool = s.scalar(select(Snapshot.pool_copy).where(Snapshot.id == ctx.resource_id))
    if in_pool is not False:
        remove_snapshot(ctx)


def store_gave_up(ctx: StepContext[CreateSnapshotParams], reason: str) -> None:
    """The upload's retries are exhausted: the snapshot ends ``error`` with the reason. A pool without reflink
    ends its side of it now (a view in the export daemon, a hold that keeps the volume's exports off, or a
    copy: docs/snapshots.md); a reflink pool's copy goes when the snapshot is deleted."""
    if ctx.params.store_share:
        try:  # before the ending's first write: no transaction is open during the agent call
            remove_snapshot(ctx)
        except VbsError as exc:
            log.warning("snapshot %s: its pool's side stays until it is deleted: %s", ctx.resource_id, exc.message)
    with ctx.session() as s:
        transition(s, Snapshot, ctx.resource_id, SnapshotState.ERROR, already_ok=True, store_state=stored.FAILED,
                   status_reason=f"the snapshot could not be stored: {reason}"[:2000])


def source_lost(ctx: StepContext[Any], exc: Exception) -> bool:
    """An upload whose point in time is gone (its view died with its export daemon) ends the snapshot
    ``error`` at once: retrying for ``give_up_after_s`` could only end the same way, later."""
    if not isinstance(exc, SnapshotSourceLost):
        return False
    store_gave_up(ctx, exc.message)
    return True


CREATE_SNAPSHOT = shared.creation(
    "create-snapshot", CreateSnapshotParams,
    (Step("storage-snapshot", take_snapshot, undo=undo_snapshot),
     # From here on it goes forward: the point-in-time copy is made, and an upload resumes (after an agent
     # or a controller restart) without sending again what the store holds.
     Step("store-upload", store_snapshot, undo=unstore_snapshot)),
    Snapshot, "snapshot failed and was rolled back", forward_from="store-upload", on_give_up=store_gave_up,
    gives_up=source_lost)
