"""The modify-volume workflow (rolls forward): grow the volume, show the new size to every attached
guest (a refreshed connection of the grown volume, swapped under the guest's disk), change its limits
live where it is attached (the storage node's throttle group, else each hypervisor's), then record it.

Growing a guest's disk online is a hypervisor capability: an attachment on a host that cannot is
refused before anything grows (``volumes.modify_volume`` checks), and found here again if it came
meanwhile.
"""

from __future__ import annotations

import logging

from sqlalchemy import select, update

from vbs import ids
from vbs.controller.db import Attachment, Volume, VolumeModification
from vbs.controller.db.states import AttachmentState
from vbs.controller.db.tables import utcnow
from vbs.controller.workflows.definition import Step, StepContext, Workflow
from vbs.controller.workflows.steps import StorageParams, storage_agent
from vbs.errors import AgentUnavailable, IncorrectState, RetryLater
from vbs.wire.qos import ExportLimits

log = logging.getLogger(__name__)


class ModifyParams(StorageParams):
    modification_id: str
    size_gib: int
    grow: bool
    encrypted: bool = False  # a LUKS container: its payload grows
    limits: ExportLimits | None = None  # what the data path enforces after it (None: operations before QoS)


def _set_modification(ctx: StepContext[ModifyParams], **values: object) -> None:
    with ctx.session() as s:
        s.execute(update(VolumeModification).where(VolumeModification.id == ctx.params.modification_id)
                  .values(**values))


def grow_on_storage(ctx: StepContext[ModifyParams]) -> None:
    p = ctx.params
    if p.grow:
        storage_agent(ctx).resize_volume(p.pool, ctx.resource_id, p.size_gib, encrypted=p.encrypted)
    _set_modification(ctx, progress=50)


def resize_in_guests(ctx: StepContext[ModifyParams]) -> None:
    p = ctx.params
    if not p.grow:
        return
    live = _live_attachments(ctx)
    storage = storage_agent(ctx)
    serial = ids.virtio_serial(ctx.resource_id)
    for att in live:
        connection = storage.refresh_connection(p.pool, ctx.resource_id, att.host)
        ctx.services.agents.host(att.host).resize(att.vm_id, serial, connection, p.size_gib)
        storage.retire_connections(p.pool, ctx.resource_id, att.host)
    _set_modification(ctx, progress=90)


def _live_attachments(ctx: StepContext[ModifyParams]) -> list[Attachment]:
    """The volume's attachments that are made; ``RetryLater`` while one is still being made (its
    connection may predate the change)."""
    with ctx.services.db.read() as s:
        live = list(s.scalars(select(Attachment).where(Attachment.volume_id == ctx.resource_id,
                                                       Attachment.status.in_([AttachmentState.ATTACHING,
                                                                              AttachmentState.ATTACHED]))))
    if any(a.status == AttachmentState.ATTACHING for a in live):
        raise RetryLater("an attachment of this volume is still being made")
    return live


def apply_limits(ctx: StepContext[ModifyParams]) -> None:
    """The new limits, live: on the storage node's exports if its daemon enforces them (every host
    shares that one group), else on each attached disk's hypervisor throttle. No detach either way."""
    p = ctx.params
    if p.limits is None:
        return
    live = _live_attachments(ctx)
    if not live or storage_agent(ctx).set_limits(ctx.resource_id, p.limits):
        return
    serial = ids.virtio_serial(ctx.resource_id)
    for att in live:
        try:
            ctx.services.agents.host(att.host).set_qos(att.vm_id, serial, p.limits.qos)
        except IncorrectState as exc:
            # A disk plugged without a throttle (or a hypervisor without live limits): its next attach has them.
            log.warning("%s on %s keeps its limits until it is attached again: %s", ctx.resource_id, att.host,
                        exc.message)


def record(ctx: StepContext[ModifyParams]) -> None:
    with ctx.session() as s:
        mod = s.get(VolumeModification, ctx.params.modification_id)
        if mod is None:
            raise RetryLater(f"modification {ctx.params.modification_id} is not recorded")
        s.execute(update(Volume).where(Volume.id == ctx.resource_id).values(
            size_gib=mod.target_size_gib, volume_type=mod.target_volume_type, iops=mod.target_iops,
            throughput=mod.target_throughput, updated_at=utcnow()))
        mod.state, mod.progress, mod.end_time = "completed", 100, utcnow()


def refused(ctx: StepContext[ModifyParams], exc: Exception) -> bool:
    """A driver that refuses (not one that is unreachable or busy) ends the modification as failed."""
    if isinstance(exc, AgentUnavailable | RetryLater) or getattr(exc, "status", 500) >= 500:
        return False
    failed(ctx, str(getattr(exc, "message", exc)))
    return True


def failed(ctx: StepContext[ModifyParams], reason: str) -> None:
    _set_modification(ctx, state="failed", status_message=reason[:2000], end_time=utcnow())


MODIFY_VOLUME = Workflow(
    kind="modify-volume",
    exclusive=True,
    params=ModifyParams,
    resume="forward",
    steps=(Step("storage-grow", grow_on_storage), Step("guest-resize", resize_in_guests),
           Step("limits", apply_limits), Step("record", record, ends=True)),
    gives_up=refused,
    on_give_up=failed,
)
