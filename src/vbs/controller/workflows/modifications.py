"""The modify-volume workflow (rolls forward): grow the file, show the new size to every attached
guest (a fresh export of the grown file, swapped under the guest's disk), then record it."""

from __future__ import annotations

from sqlalchemy import select, update

from vbs.controller.db import Attachment, Volume, VolumeModification
from vbs.controller.db.tables import utcnow
from vbs.controller.states import AttachmentState
from vbs.controller.workflows.engine import Step, StepContext, Workflow
from vbs.errors import AgentUnavailable, VbsError


class RetryLater(VbsError):
    code = "RetryLater"
    status = 503


def _set_modification(ctx: StepContext, **values: object) -> None:
    with ctx.services.db.session() as s:
        s.execute(update(VolumeModification).where(VolumeModification.id == ctx.params["modification_id"])
                  .values(**values))


def grow_on_storage(ctx: StepContext) -> None:
    p = ctx.params
    if p["grow"]:
        ctx.services.agents.storage(p["node"]).resize_volume(p["pool"], ctx.resource_id, p["size_gib"])
    _set_modification(ctx, progress=50)


def resize_in_guests(ctx: StepContext) -> None:
    p = ctx.params
    if not p["grow"]:
        return
    with ctx.services.db.session() as s:
        live = list(s.scalars(select(Attachment).where(Attachment.volume_id == ctx.resource_id,
                                                       Attachment.status.in_([AttachmentState.ATTACHING,
                                                                              AttachmentState.ATTACHED]))))
    if any(a.status == AttachmentState.ATTACHING for a in live):
        # Its export may predate the grown file: resize it once it is attached.
        raise RetryLater("an attachment of this volume is still being made")
    attached = live
    storage = ctx.services.agents.storage(p["node"])
    serial = ctx.resource_id.replace("-", "", 1)
    for att in attached:
        connection = storage.refresh_export(p["pool"], ctx.resource_id, att.host)
        ctx.services.agents.host(att.host).resize(att.vm_id, serial, connection, p["size_gib"])
        storage.retire_exports(ctx.resource_id, att.host)
    _set_modification(ctx, progress=90)


def record(ctx: StepContext) -> None:
    with ctx.services.db.session() as s:
        mod = s.get(VolumeModification, ctx.params["modification_id"])
        assert mod is not None
        s.execute(update(Volume).where(Volume.id == ctx.resource_id).values(
            size_gib=mod.target_size_gib, volume_type=mod.target_volume_type, iops=mod.target_iops,
            throughput=mod.target_throughput, updated_at=utcnow()))
        mod.state, mod.progress, mod.end_time = "completed", 100, utcnow()


def gives_up(ctx: StepContext, exc: Exception) -> bool:
    """A driver that refuses (not one that is unreachable) ends the modification as failed."""
    if isinstance(exc, AgentUnavailable) or getattr(exc, "status", 500) >= 500:
        return False
    _set_modification(ctx, state="failed", status_message=str(getattr(exc, "message", exc))[:2000],
                      end_time=utcnow())
    return True


MODIFY_VOLUME = Workflow(
    kind="modify-volume",
    resume="forward",
    steps=(Step("storage-grow", grow_on_storage), Step("guest-resize", resize_in_guests),
           Step("record", record)),
    gives_up=gives_up,
)
