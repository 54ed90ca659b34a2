"""Attach (rolls back if anything fails or is interrupted) and detach (rolls forward).

The order matters both ways: export, then hot-plug; unplug, then remove the export — removing an
iSCSI target under a live session hangs the client forever.
"""

from __future__ import annotations

from sqlalchemy import exists, select, update

from vbs.connection import HostIdentity
from vbs.controller.db import Attachment, Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.states import AttachmentState, VolumeState
from vbs.controller.workflows.engine import Step, StepContext, Workflow

LIVE = [AttachmentState.ATTACHING, AttachmentState.ATTACHED, AttachmentState.DETACHING, AttachmentState.BUSY]


def _host_identity(p: dict) -> HostIdentity:  # type: ignore[type-arg]
    return HostIdentity(name=p["host"], address=p["host_address"], initiator_name=p.get("initiator_name"))


def export_volume(ctx: StepContext) -> None:
    p = ctx.params
    storage = ctx.services.agents.storage(p["node"])
    p["connection"] = storage.ensure_export(p["pool"], ctx.resource_id, _host_identity(p), p["read_only"])


def unexport_volume(ctx: StepContext) -> None:
    """Remove the volume's export to this host, unless another VM on the host still uses it.

    Exports are per (volume, host): with multi-attach, two VMs of one host share one.
    """
    with ctx.services.db.session() as s:
        shared = s.scalar(select(Attachment.id).where(
            Attachment.volume_id == ctx.resource_id, Attachment.host == ctx.params["host"],
            Attachment.id != ctx.params["attachment_id"], Attachment.status.in_(LIVE)))
    if shared is None:
        ctx.services.agents.storage(ctx.params["node"]).remove_export(ctx.resource_id, ctx.params["host"])


def plug_into_vm(ctx: StepContext) -> None:
    p = ctx.params
    ctx.services.agents.host(p["host"]).attach(p["vm_id"], p["serial"], p["connection"],
                                               read_only=p["read_only"], qos=p.get("qos"))


def unplug_forcibly(ctx: StepContext) -> None:
    p = ctx.params
    ctx.services.agents.host(p["host"]).detach(p["vm_id"], p["serial"], force=True, timeout=10.0)


def unplug_from_vm(ctx: StepContext) -> None:
    p = ctx.params
    ctx.services.agents.host(p["host"]).detach(p["vm_id"], p["serial"], force=p["force"], timeout=p["timeout"])


def _set_attachment(ctx: StepContext, from_states: list[str], to_state: str) -> None:
    with ctx.services.db.session() as s:
        s.execute(update(Attachment).where(Attachment.id == ctx.params["attachment_id"],
                                           Attachment.status.in_(from_states))
                  .values(status=to_state, updated_at=utcnow()))
        _release_volume_if_free(s, ctx.resource_id)


def _release_volume_if_free(s, volume_id: str) -> None:  # type: ignore[no-untyped-def]
    """``in-use`` → ``available`` once no live attachment is left (one statement: no lost update)."""
    other = exists().where(Attachment.volume_id == volume_id, Attachment.status.in_(LIVE))
    s.execute(update(Volume).where(Volume.id == volume_id, Volume.status == VolumeState.IN_USE, ~other)
              .values(status=VolumeState.AVAILABLE, updated_at=utcnow()))


def mark_attached(ctx: StepContext) -> None:
    _set_attachment(ctx, [AttachmentState.ATTACHING], AttachmentState.ATTACHED)


def mark_detached(ctx: StepContext) -> None:
    _set_attachment(ctx, [AttachmentState.DETACHING], AttachmentState.DETACHED)


def attach_rolled_back(ctx: StepContext, _reason: str) -> None:
    _set_attachment(ctx, [AttachmentState.ATTACHING], AttachmentState.DETACHED)


def detach_gives_up(ctx: StepContext, exc: Exception) -> bool:
    """The guest holds on to the disk: the attachment is ``busy``; detach again, or with force."""
    if getattr(exc, "code", None) != "DeviceBusy":
        return False
    _set_attachment(ctx, [AttachmentState.DETACHING], AttachmentState.BUSY)
    return True


def is_attached(ctx: StepContext) -> bool:
    with ctx.services.db.read() as s:
        status = s.scalar(select(Attachment.status).where(Attachment.id == ctx.params["attachment_id"]))
    return status not in (None, AttachmentState.ATTACHING)


ATTACH_VOLUME = Workflow(
    kind="attach-volume",
    resume="rollback",
    steps=(Step("storage-export", export_volume, undo=unexport_volume),
           Step("host-attach", plug_into_vm, undo=unplug_forcibly),
           Step("mark-attached", mark_attached)),
    on_rollback=attach_rolled_back,
    finished=is_attached,
)

DETACH_VOLUME = Workflow(
    kind="detach-volume",
    resume="forward",
    steps=(Step("host-detach", unplug_from_vm),
           Step("storage-unexport", unexport_volume),
           Step("mark-detached", mark_detached)),
    gives_up=detach_gives_up,
)
