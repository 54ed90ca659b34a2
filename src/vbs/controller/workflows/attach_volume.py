"""The attach-volume workflow (rolls back if anything fails or is interrupted): export for the host, then
hot-plug into the VM, then mark it attached. Its steps are also what detach and live migration undo.

The order matters both ways: export, then hot-plug; unplug, then remove the export (removing an iSCSI
target under a live session hangs the client forever). The connection a host gets (with its CHAP or
TLS-PSK secret) is never stored: the export step keeps it in memory for the plug step, and after a
restart the plug step asks the storage agent again (the same export gives the same connection).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from vbs.config import ControllerConfig
from vbs.controller.db import Attachment, Node, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import LIVE_ATTACHMENT, AttachmentState, VolumeState
from vbs.controller.db.transitions import transition, try_transition
from vbs.controller.fleet.nodes import host_identity, host_info
from vbs.controller.placement import volume_types
from vbs.controller.workflows.definition import Step, StepContext, Workflow
from vbs.controller.workflows.steps import StorageParams, data_key, storage_agent, waiting
from vbs.errors import NotFound
from vbs.wire.host import QoS
from vbs.wire.qos import ExportLimits
from vbs.wire.storage import ConnectionAnswer


class AttachParams(StorageParams):
    attachment_id: str
    host: str
    vm_id: str
    serial: str
    read_only: bool = False
    qos: QoS | None = None  # operations begun before ``limits``: the hypervisor's limits
    # The volume's limits: the storage node enforces them where its export daemon can, else the hypervisor.
    limits: ExportLimits | None = None


def volume_limits(cfg: ControllerConfig, vol: Volume) -> ExportLimits:
    """What the data path enforces for ``vol`` under the controller's ``enforce_type_limits``."""
    return volume_types.enforced_limits(vol.volume_type, vol.size_gib, vol.iops, vol.throughput,
                                        type_limits=cfg.enforce_type_limits)


def _connection(ctx: StepContext[AttachParams]) -> ConnectionAnswer:
    """The host's connection to the volume: made (or found again: it is idempotent) on the storage node,
    and whether the node enforces the volume's limits on it."""
    p = ctx.params
    with ctx.services.db.read() as s:
        node = s.get(Node, (p.host, "host"))
    if node is None:
        raise NotFound(f"host {p.host} is not known", code="InvalidHost.NotFound")
    agent = storage_agent(ctx)
    # What the host's hypervisor opens itself: a storage node that can be opened natively (Ceph RBD)
    # answers that instead of an export.
    protocols = host_info(node).capabilities.protocols
    answer: ConnectionAnswer = waiting(
        lambda: agent.connection_for(p.pool, ctx.resource_id, host_identity(node), p.read_only, protocols,
                                     limits=p.limits), limit_s=ctx.services.cfg.give_up_after_s)
    ctx.memo["connection"] = answer
    return answer


def host_qos(params: AttachParams, answer: ConnectionAnswer) -> QoS | None:
    """The limits the hypervisor enforces: none where the storage node does (never twice)."""
    return hypervisor_limits(params.limits, params.qos, answer)


def hypervisor_limits(limits: ExportLimits | None, qos: QoS | None, answer: ConnectionAnswer) -> QoS | None:
    """``limits`` (else the older ``qos``) unless the storage node already enforces them on ``answer``."""
    if limits is None:
        return qos
    return None if answer.limits_enforced else limits.qos


def export_volume(ctx: StepContext[AttachParams]) -> None:
    _connection(ctx)


def unexport_volume(ctx: StepContext[Any]) -> None:
    """Remove the volume's connection to this host, unless another VM on the host still uses it.

    Exports are per (volume, host): with multi-attach, two VMs of one host share one.
    """
    p = ctx.params
    with ctx.services.db.read() as s:
        shared = s.scalar(select(Attachment.id).where(
            Attachment.volume_id == ctx.resource_id, Attachment.host == p.host,
            Attachment.id != p.attachment_id, Attachment.status.in_(LIVE_ATTACHMENT)))
        pool = p.pool or s.scalar(select(Volume.pool).where(Volume.id == ctx.resource_id))
    if shared is None and pool is not None:
        storage_agent(ctx).remove_connection(pool, ctx.resource_id, p.host)


def plug_into_vm(ctx: StepContext[AttachParams]) -> None:
    p = ctx.params
    answer = ctx.memo.get("connection") or _connection(ctx)
    ctx.services.agents.host(p.host).attach(p.vm_id, p.serial, answer.connection, read_only=p.read_only,
                                            qos=host_qos(p, answer), luks=data_key(ctx, ctx.resource_id))


def unplug_forcibly(ctx: StepContext[AttachParams]) -> None:
    p = ctx.params
    ctx.services.agents.host(p.host).detach(p.vm_id, p.serial, force=True, timeout=10.0)


def release_volume_if_free(s: Session, volume_id: str) -> None:
    """``in-use`` → ``available`` once no live attachment is left: one conditional statement, after the
    volume's row is locked (``try_transition``), so an attach that committed meanwhile is seen."""
    others = exists().where(Attachment.volume_id == volume_id, Attachment.status.in_(LIVE_ATTACHMENT))
    try_transition(s, Volume, volume_id, VolumeState.AVAILABLE, ~others, from_states=[VolumeState.IN_USE])


def settle(ctx: StepContext[Any], to_state: AttachmentState, reason: str | None = None) -> None:
    with ctx.session() as s:
        lock_rows(s, Volume, ctx.resource_id)  # the volume before its attachments (db.locks' order)
        transition(s, Attachment, ctx.params.attachment_id, to_state, already_ok=True,
                   status_reason=reason[:2000] if reason else None)
        release_volume_if_free(s, ctx.resource_id)


def mark_attached(ctx: StepContext[AttachParams]) -> None:
    settle(ctx, AttachmentState.ATTACHED)


def attach_rolled_back(ctx: StepContext[AttachParams], reason: str) -> None:
    settle(ctx, AttachmentState.DETACHED, f"the attach failed and was rolled back: {reason}")


def is_attached(ctx: StepContext[AttachParams]) -> bool:
    with ctx.services.db.read() as s:
        status = s.scalar(select(Attachment.status).where(Attachment.id == ctx.params.attachment_id))
    return status not in (None, AttachmentState.ATTACHING)


ATTACH_VOLUME = Workflow(
    kind="attach-volume",
    exclusive=True,
    params=AttachParams,
    resume="rollback",
    steps=(Step("storage-export", export_volume, undo=unexport_volume),
           Step("host-attach", plug_into_vm, undo=unplug_forcibly),
           Step("mark-attached", mark_attached, ends=True)),
    on_rollback=attach_rolled_back,
    finished=is_attached,
)
