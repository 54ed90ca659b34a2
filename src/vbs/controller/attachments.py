"""Attach and detach as the API offers them, and describing hosts and instances.

A volume is reserved (``available`` → ``in-use``, or a second attachment where multi-attach) and
its attachment row written in one transaction with the operation that carries it out.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Attachment, Instance, Node, Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.nodes import host_is_alive
from vbs.controller.schemas import AttachmentOut, AttachVolumeRequest, DetachVolumeRequest, InstanceOut
from vbs.controller.services import Services
from vbs.controller.states import AttachmentState, VolumeState
from vbs.controller.transitions import transition
from vbs.controller.volumes import volume_not_found
from vbs.errors import AgentUnavailable, IncorrectState, InvalidParameter, MissingParameter, NotFound, VolumeInUse

LIVE = [AttachmentState.ATTACHING, AttachmentState.ATTACHED, AttachmentState.DETACHING, AttachmentState.BUSY]


def instance_not_found(what: str) -> NotFound:
    return NotFound(f"The instance {what} does not exist.", code="InvalidInstanceID.NotFound")


def _resolve_instance(s: Session, req: AttachVolumeRequest) -> Instance:
    if req.instance_id is not None:
        if req.host is not None or req.vm_id is not None:
            raise InvalidParameter("Give either instance_id, or host and vm_id, not both.")
        inst = s.get(Instance, req.instance_id)
        if inst is None:
            raise instance_not_found(f"'{req.instance_id}'")
        return inst
    if req.host is None or req.vm_id is None:
        raise MissingParameter("The request must contain instance_id, or host and vm_id.")
    inst = s.scalar(select(Instance).where(Instance.host == req.host, Instance.vm_id == req.vm_id))
    if inst is None:
        raise instance_not_found(f"'{req.vm_id}' on host '{req.host}'")
    return inst


def _out(a: Attachment) -> AttachmentOut:
    return AttachmentOut(attachment_id=a.id, volume_id=a.volume_id, instance_id=a.instance_id, host=a.host,
                         vm_id=a.vm_id, device=a.device, mode=a.mode, state=a.status, attach_time=a.created_at)


def attach_volume(svc: Services, volume_id: str, req: AttachVolumeRequest) -> AttachmentOut:
    ids.check("volume", volume_id)
    device = req.device
    with svc.db.session() as s:
        inst = _resolve_instance(s, req)
        if inst.state != "running":
            raise IncorrectState(f"The instance '{inst.id}' is {inst.state}, not running.",
                                 code="IncorrectInstanceState")
        if not host_is_alive(s, inst.host, svc.cfg.heartbeat_timeout_s):
            raise AgentUnavailable(f"The host agent of '{inst.host}' is not reporting; cannot attach there.")
        vol = s.get(Volume, volume_id)
        if vol is None or vol.status == VolumeState.DELETED:
            raise volume_not_found(volume_id)
        live = list(s.scalars(select(Attachment).where(Attachment.volume_id == volume_id,
                                                       Attachment.status.in_(LIVE))))
        if any(a.instance_id == inst.id for a in live):
            raise VolumeInUse(f"The volume '{volume_id}' is already attached to '{inst.id}'.")
        if any(a.host == inst.host and a.vm_id == inst.vm_id for a in live):
            raise VolumeInUse(f"The volume '{volume_id}' is already attached to that VM.")
        taken = s.scalar(select(func.count()).select_from(Attachment).where(
            Attachment.host == inst.host, Attachment.vm_id == inst.vm_id, Attachment.device == device,
            Attachment.status.in_(LIVE)))
        if taken:
            raise InvalidParameter(f"The device name '{device}' is already in use on that instance.",
                                   code="InvalidParameterValue")
        if vol.status == VolumeState.IN_USE and not vol.multi_attach:
            raise VolumeInUse(f"The volume '{volume_id}' is attached already and is not multi-attach.")
        sources = [VolumeState.AVAILABLE, VolumeState.IN_USE] if vol.multi_attach else [VolumeState.AVAILABLE]
        transition(s, Volume, volume_id, sources, VolumeState.IN_USE)
        host_node = s.get(Node, (inst.host, "host"))
        assert host_node is not None
        now = utcnow()
        att = Attachment(id=ids.new_id("attachment"), volume_id=volume_id, instance_id=inst.id, host=inst.host,
                         vm_id=inst.vm_id, device=device, mode="ro" if req.read_only else "rw",
                         status=AttachmentState.ATTACHING, created_at=now, updated_at=now)
        s.add(att)
        s.flush()
        qos = {"iops": vol.iops, "mbps": vol.throughput} if (vol.iops or vol.throughput) else None
        op_id = svc.engine.begin(s, "attach-volume", volume_id, {
            "attachment_id": att.id, "node": vol.storage_node, "pool": vol.pool, "host": inst.host,
            "host_address": host_node.address, "initiator_name": host_node.info.get("initiator_name"),
            "vm_id": inst.vm_id, "read_only": req.read_only, "serial": ids.virtio_serial(volume_id), "qos": qos,
        })
        out = _out(att).model_copy(update={"operation_id": op_id})
    svc.engine.submit(op_id)
    return out


def detach_volume(svc: Services, volume_id: str, req: DetachVolumeRequest) -> AttachmentOut:
    ids.check("volume", volume_id)
    with svc.db.session() as s:
        vol = s.get(Volume, volume_id)
        if vol is None or vol.status == VolumeState.DELETED:
            raise volume_not_found(volume_id)
        stmt = select(Attachment).where(Attachment.volume_id == volume_id, Attachment.status.in_(LIVE))
        if req.instance_id is not None:
            stmt = stmt.where(Attachment.instance_id == req.instance_id)
        live = list(s.scalars(stmt))
        if not live:
            # EC2's wording: Terraform looks for the state in this message.
            raise IncorrectState(f"Volume '{volume_id}' is in the '{vol.status}' state"
                                 + (f" and not attached to '{req.instance_id}'." if req.instance_id else "."),
                                 code="IncorrectState")
        if len(live) > 1:
            raise MissingParameter("The volume is attached to several instances: give instance_id.")
        att = live[0]
        moved = s.execute(
            Attachment.__table__.update()
            .where(Attachment.id == att.id,
                   Attachment.status.in_([AttachmentState.ATTACHED, AttachmentState.BUSY]))
            .values(status=AttachmentState.DETACHING, updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
        if moved != 1:
            raise IncorrectState(f"The attachment of '{volume_id}' is {att.status}; wait until it is attached.")
        op_id = svc.engine.begin(s, "detach-volume", volume_id, {
            "attachment_id": att.id, "node": vol.storage_node, "host": att.host, "vm_id": att.vm_id,
            "serial": ids.virtio_serial(volume_id), "force": req.force,
            "timeout": svc.cfg.detach_timeout_s,
        })
        s.refresh(att)
        out = _out(att).model_copy(update={"operation_id": op_id})
    svc.engine.submit(op_id)
    return out


def describe_instances(svc: Services) -> list[InstanceOut]:
    with svc.db.read() as s:
        insts = list(s.scalars(select(Instance).where(Instance.state != "gone").order_by(Instance.host,
                                                                                         Instance.vm_id)))
        atts: dict[str, list[AttachmentOut]] = {i.id: [] for i in insts}
        for a in s.scalars(select(Attachment).where(Attachment.status.in_(LIVE))):
            if a.instance_id in atts:
                atts[a.instance_id].append(_out(a))
        return [InstanceOut(instance_id=i.id, host=i.host, vm_id=i.vm_id, name=i.name, state=i.state,
                            volumes=atts[i.id]) for i in insts]
