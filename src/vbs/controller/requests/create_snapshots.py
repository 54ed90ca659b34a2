"""CreateSnapshots as the API offers it: one crash-consistent set of the volumes attached to an instance."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs.controller.db import Attachment, Instance, Node, Snapshot, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import AttachmentState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import host_info, host_is_alive, pool_of
from vbs.controller.requests import filters as flt
from vbs.controller.requests.attach_volume import instance_not_found
from vbs.controller.requests.create_snapshot import new_snapshot_row
from vbs.controller.requests.describe_snapshots import describe_many
from vbs.controller.rest.schemas.snapshots import CreateSnapshotSetRequest, SnapshotOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.create_snapshots import CREATE_SNAPSHOT_SET, SetMember, SnapshotSetParams
from vbs.controller.workflows.stored import copy_share
from vbs.errors import AgentUnavailable, IncorrectState, InvalidParameter

MAX_SET = 40


def create_snapshot_set(svc: Controller, req: CreateSnapshotSetRequest, tenant: str) -> list[SnapshotOut]:
    """A pending snapshot of each of the tenant's volumes attached to ``req.instance_id`` (but those
    excluded), all taken at one instant: the VM pauses while their storage nodes fix it."""
    with svc.db.session() as s:
        op_id, snaps = begin_snapshot_set(svc, s, req, tenant)
        out = describe_many(s, snaps)
    svc.engine.submit(op_id)
    return out


def begin_snapshot_set(svc: Controller, s: Session, req: CreateSnapshotSetRequest, tenant: str
                       ) -> tuple[str, list[Snapshot]]:
    """The set's pending snapshot rows and its operation, in the caller's transaction (which submits the
    operation once it committed): the lifecycle policies' runs record them in the same transaction."""
    inst = s.get(Instance, req.instance_id)
    if inst is None:
        raise instance_not_found(f"'{req.instance_id}'")
    if inst.state != "running":
        raise IncorrectState(f"The instance '{inst.id}' is {inst.state}, not running.",
                             code="IncorrectInstanceState")
    host = s.get(Node, (inst.host, "host"))
    if host is None or not host_is_alive(s, inst.host, svc.cfg.heartbeat_timeout_s):
        raise AgentUnavailable(f"The host agent of '{inst.host}' is not reporting.")
    if not host_info(host).capabilities.pause:
        raise IncorrectState(f"The hypervisor of host '{inst.host}' cannot pause a VM, which a crash-consistent "
                             "snapshot set needs (the qemu driver can).")
    attached = sorted(set(s.scalars(select(Attachment.volume_id).where(
        Attachment.instance_id == inst.id, Attachment.status == AttachmentState.ATTACHED))))
    vol_ids = [v for v in attached if v not in set(req.exclude_volume_ids)]
    lock_rows(s, Volume, *vol_ids)
    vols = [v for v in s.scalars(select(Volume).where(Volume.id.in_(vol_ids), Volume.tenant == tenant,
                                                      Volume.status == VolumeState.IN_USE).order_by(Volume.id))]
    if not vols:
        raise InvalidParameter(f"The instance '{inst.id}' has no attached volume of yours to snapshot.")
    if len(vols) > MAX_SET:
        raise InvalidParameter(f"A snapshot set holds at most {MAX_SET} volumes; exclude some.")
    for vol in vols:
        pool = pool_of(s.get(Node, (vol.storage_node, "storage")), vol.pool)
        if pool is None or not pool.point_in_time:
            raise IncorrectState(f"The pool of '{vol.id}' cannot snapshot it at one instant while it is "
                                 "attached; a snapshot set needs pools that can (reflink, or an NBD export).")
    now = utcnow()
    snaps: list[Snapshot] = []
    for vol in vols:
        tags = {**flt.tags_of(s, [vol.id])[vol.id], **req.tags} if req.copy_tags_from_volume else req.tags
        snaps.append(new_snapshot_row(s, svc, vol, req.comment, tags, tenant, now))
    op_id = svc.engine.begin(s, CREATE_SNAPSHOT_SET, inst.id, SnapshotSetParams(
        host=inst.host, vm_id=inst.vm_id,
        members=[SetMember(snapshot_id=x.id, volume_id=x.volume_id, node=x.storage_node, pool=x.pool,
                           store_share=copy_share(s, x.storage_node, x.pool)) for x in snaps]))
    return op_id, snaps
