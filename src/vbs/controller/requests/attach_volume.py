"""AttachVolume as the API offers it: the instance (or host and VM) resolved, the volume reserved and the
attachment recorded with its operation in one transaction, then handed to the attach workflow; and
what is shared by the requests that change an instance's attachments.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Attachment, Instance, Node, Operation, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import LIVE_ATTACHMENT, UNFINISHED_OPERATION, AttachmentState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.db.transitions import transition
from vbs.controller.fleet.nodes import host_info, host_is_alive, is_alive
from vbs.controller.requests.describe_volumes import live_volume
from vbs.controller.resolvers import is_cloud_ref
from vbs.controller.rest.schemas.volumes import AttachmentOut, AttachVolumeRequest
from vbs.controller.runtime import Controller
from vbs.controller.workflows.attach_volume import ATTACH_VOLUME, AttachParams, volume_limits
from vbs.controller.workflows.local_volumes import ATTACH_LOCAL_VOLUME
from vbs.controller.workflows.migrate_instance import MIGRATE_INSTANCE
from vbs.errors import AgentUnavailable, IncorrectState, InvalidParameter, MissingParameter, NotFound, VolumeInUse


def migration_in_progress(s: Session, instance_id: str) -> None:
    """Refuse a change of the instance's attachments while its disks move with it (live migration)."""
    op = s.scalar(select(Operation.id).where(Operation.kind == MIGRATE_INSTANCE.kind,
                                             Operation.resource_id == instance_id,
                                             Operation.status.in_(UNFINISHED_OPERATION)))
    if op is not None:
        raise IncorrectState(f"The instance '{instance_id}' is being live-migrated ({op}); try again when it is done.",
                             code="IncorrectInstanceState")


def instance_not_found(what: str) -> NotFound:
    return NotFound(f"The instance {what} does not exist.", code="InvalidInstanceID.NotFound")


def _resolve_instance(s: Session, req: AttachVolumeRequest) -> Instance:
    """The instance to attach to, its row locked: two attaches to one VM check its devices in turn."""
    inst = _find_instance(s, req)
    lock_rows(s, Instance, inst.id)
    return inst


def _find_instance(s: Session, req: AttachVolumeRequest) -> Instance:
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


def attachment_out(a: Attachment) -> AttachmentOut:
    return AttachmentOut(attachment_id=a.id, volume_id=a.volume_id, instance_id=a.instance_id, host=a.host,
                         vm_id=a.vm_id, device=a.device, mode=a.mode, state=a.status, state_reason=a.status_reason,
                         attach_time=a.created_at)


def attach_volume(svc: Controller, volume_id: str, req: AttachVolumeRequest, tenant: str) -> AttachmentOut:
    ids.check("volume", volume_id)
    if req.instance_id is not None and is_cloud_ref(req.instance_id):
        # An external cloud's id: resolved first, outside any transaction (a command may take a while).
        if req.host is not None or req.vm_id is not None:
            raise InvalidParameter("Give either instance_id, or host and vm_id, not both.")
        where = svc.resolvers.locate(svc.db, req.instance_id)
        req = req.model_copy(update={"instance_id": None, "host": where.host, "vm_id": where.vm_id})
    device = req.device
    with svc.db.session() as s:
        # The volume first: another tenant's volume is not found, whatever the instance. Its row is
        # locked (db.locks' order), so a detach or delete of it that is ending is seen ended.
        lock_rows(s, Volume, volume_id)
        vol = live_volume(s, volume_id, tenant)
        inst = _resolve_instance(s, req)
        migration_in_progress(s, inst.id)
        if inst.state != "running":
            raise IncorrectState(f"The instance '{inst.id}' is {inst.state}, not running.",
                                 code="IncorrectInstanceState")
        if not host_is_alive(s, inst.host, svc.cfg.heartbeat_timeout_s):
            raise AgentUnavailable(f"The host agent of '{inst.host}' is not reporting; cannot attach there.")
        if vol.key_id is not None:
            host = s.get(Node, (inst.host, "host"))
            if host is None or not host_info(host).capabilities.luks:
                raise IncorrectState(f"The volume '{volume_id}' is encrypted and the hypervisor of host "
                                     f"'{inst.host}' cannot open encrypted volumes (the qemu driver can).")
        live = list(s.scalars(select(Attachment).where(Attachment.volume_id == volume_id,
                                                       Attachment.status.in_(LIVE_ATTACHMENT))))
        if any(a.instance_id == inst.id for a in live):
            raise VolumeInUse(f"The volume '{volume_id}' is already attached to '{inst.id}'.")
        if any(a.host == inst.host and a.vm_id == inst.vm_id for a in live):
            raise VolumeInUse(f"The volume '{volume_id}' is already attached to that VM.")
        taken = s.scalar(select(func.count()).select_from(Attachment).where(
            Attachment.host == inst.host, Attachment.vm_id == inst.vm_id, Attachment.device == device,
            Attachment.status.in_(LIVE_ATTACHMENT)))
        if taken:
            raise InvalidParameter(f"The device name '{device}' is already in use on that instance.",
                                   code="InvalidParameterValue")
        if vol.placement == "local" and inst.host != vol.host:
            raise InvalidParameter(f"The volume '{volume_id}' is local to host '{vol.host}': it attaches to that "
                                   f"host's instances only, not to one on '{inst.host}'.")
        if vol.status == VolumeState.IN_USE and not vol.multi_attach:
            raise VolumeInUse(f"The volume '{volume_id}' is attached already and is not multi-attach.")
        sources = [VolumeState.AVAILABLE, VolumeState.IN_USE] if vol.multi_attach else [VolumeState.AVAILABLE]
        transition(s, Volume, volume_id, VolumeState.IN_USE, from_states=sources)
        now = utcnow()
        att = Attachment(id=ids.new_id("attachment"), volume_id=volume_id, instance_id=inst.id, host=inst.host,
                         vm_id=inst.vm_id, device=device, mode="ro" if req.read_only else "rw",
                         status=AttachmentState.ATTACHING, created_at=now, updated_at=now)
        s.add(att)
        s.flush()
        op_id = svc.engine.begin(s, ATTACH_LOCAL_VOLUME if vol.placement == "local" else ATTACH_VOLUME,
                                 volume_id, AttachParams(
            attachment_id=att.id, node=vol.storage_node, pool=vol.pool, host=inst.host, vm_id=inst.vm_id,
            read_only=req.read_only, serial=ids.virtio_serial(volume_id), limits=volume_limits(svc.cfg, vol)))
        warnings = rtt_warnings(s, inst.host, vol.storage_node, svc.cfg.rtt_warn_ms, svc.cfg.heartbeat_timeout_s)
        out = attachment_out(att).model_copy(update={"operation_id": op_id, "warnings": warnings})
    svc.engine.submit(op_id)
    return out


def rtt_warnings(s: Session, host: str, storage_node: str, warn_ms: float, timeout_s: float) -> list[str]:
    """A warning when ``host`` measured a round trip to ``storage_node`` above ``warn_ms``, naming the live
    host that measured the lowest one (where the VM would be nearer its data)."""
    node = s.get(Node, (host, "host"))
    measured = next((p for p in host_info(node).probes if p.storage_node == storage_node), None) if node else None
    if measured is None or measured.rtt_ms <= warn_ms:
        return []
    now = utcnow()
    others = sorted((p.rtt_ms, n.name) for n in s.scalars(select(Node).where(Node.kind == "host", Node.name != host))
                    if is_alive(n, timeout_s, now) for p in host_info(n).probes if p.storage_node == storage_node)
    nearer = (f"; host {others[0][1]} measured {others[0][0]:.2f} ms (`vbs advise` weighs moving the VM or the volume)"
              if others and others[0][0] < measured.rtt_ms else "")
    return [f"host {host} measured an RTT of {measured.rtt_ms:.2f} ms to storage node {storage_node}, above "
            f"rtt_warn_ms {warn_ms:g} ms: remote I/O will be slower{nearer}"]
