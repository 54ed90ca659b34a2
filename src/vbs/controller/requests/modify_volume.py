"""ModifyVolume: grow a volume (also while attached: the guest sees the new size) or change its type.

One modification at a time per volume; the volume stays usable (``available`` or ``in-use``)
while it runs. Sizes only grow, as on EBS.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session, aliased

from vbs import ids
from vbs.controller.db import Attachment, Node, Volume, VolumeModification
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import AttachmentState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import host_info, storage_info
from vbs.controller.placement import quotas, volume_types
from vbs.controller.placement.growth import GROWING_STATES
from vbs.controller.placement.scheduler import check_growth
from vbs.controller.requests import filters as flt
from vbs.controller.requests.describe_volumes import live_volume
from vbs.controller.rest.schemas.volumes import ModificationList, ModificationOut, ModifyVolumeRequest
from vbs.controller.runtime import Controller
from vbs.controller.workflows.modify_volume import MODIFY_VOLUME, ModifyParams
from vbs.errors import IncorrectState, InvalidParameter
from vbs.wire.qos import ExportLimits

IN_PROGRESS = GROWING_STATES


def _out(m: VolumeModification) -> ModificationOut:
    return ModificationOut(
        modification_id=m.id, volume_id=m.volume_id, state=m.state, status_message=m.status_message,
        original_size_gib=m.original_size_gib, target_size_gib=m.target_size_gib,
        original_volume_type=m.original_volume_type, target_volume_type=m.target_volume_type,
        # As describe shows them: a limit not given is the type's nominal figure, not "none".
        original_iops=volume_types.reported_iops(m.original_volume_type, m.original_size_gib, m.original_iops),
        target_iops=volume_types.reported_iops(m.target_volume_type, m.target_size_gib, m.target_iops),
        original_throughput=volume_types.reported_throughput(m.original_volume_type, m.original_throughput),
        target_throughput=volume_types.reported_throughput(m.target_volume_type, m.target_throughput),
        progress=m.progress, start_time=m.start_time, end_time=m.end_time)


def modify_volume(svc: Controller, volume_id: str, req: ModifyVolumeRequest, tenant: str) -> ModificationOut:
    with svc.db.session() as s:
        # The volume first (db.locks' order): what follows reads its attachments and modifications as
        # they are once every earlier change of it committed.
        lock_rows(s, Volume, volume_id)
        vol = live_volume(s, volume_id, tenant)
        if vol.placement == "local":
            raise IncorrectState(f"The volume '{volume_id}' is local to host '{vol.host}'; local volumes are not "
                                 "modified (snapshot it and make a new one).")
        size = req.size_gib if req.size_gib is not None else vol.size_gib
        if size < vol.size_gib:
            raise InvalidParameter(f"New size cannot be smaller than existing size ({vol.size_gib} GiB).")
        if size > svc.cfg.max_volume_gib:
            raise InvalidParameter(f"The size {size} GiB exceeds this service's limit of {svc.cfg.max_volume_gib} GiB.")
        new_type = req.volume_type or vol.volume_type
        iops, throughput = volume_types.retarget(new_type, vol.iops, vol.throughput, req.iops, req.throughput)
        multi = req.multi_attach if req.multi_attach is not None else vol.multi_attach
        volume_types.check(new_type, size, iops, throughput, multi)
        target = (size, new_type, iops, throughput)
        if target == (vol.size_gib, vol.volume_type, vol.iops, vol.throughput) and multi == vol.multi_attach:
            raise InvalidParameter("The modification changes nothing: give a larger size or another type, "
                                   "iops, throughput or multi-attach setting.", code="InvalidParameterCombination")
        attached = list(s.scalars(select(Attachment).where(Attachment.volume_id == volume_id,
                                                           Attachment.status != AttachmentState.DETACHED)))
        if not multi and len({a.instance_id or a.vm_id for a in attached}) > 1:
            raise IncorrectState(f"The volume '{volume_id}' is attached to several instances; detach all but one "
                                 "before turning Multi-Attach off.")
        if size > vol.size_gib:
            if vol.key_id is not None and attached:
                raise IncorrectState(f"The volume '{volume_id}' is encrypted; it grows while detached only "
                                     "(detach it first).")
            _check_online_growth(s, volume_id, attached)
            check_growth(s, vol.storage_node, vol.pool, size - vol.size_gib, overcommit=svc.cfg.overcommit_ratio)
            quotas.check_volumes(s, svc.cfg, tenant, new_volumes=0, new_gib=size - vol.size_gib)
        busy = s.scalar(select(VolumeModification.id).where(VolumeModification.volume_id == volume_id,
                                                            VolumeModification.state.in_(IN_PROGRESS)))
        if busy is not None:
            raise IncorrectState(f"The volume '{volume_id}' is already being modified.",
                                 code="IncorrectModificationState")
        # The volume must stay put (not be deleted) while it is modified: conditional touch.
        hit = s.execute(update(Volume).where(Volume.id == volume_id,
                                             Volume.status.in_([VolumeState.AVAILABLE, VolumeState.IN_USE]))
                        .values(updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
        if hit != 1:
            raise IncorrectState(f"The volume '{volume_id}' is '{vol.status}'; it must be available or in-use.")
        vol.multi_attach = multi  # a flag, in effect at once: the next attach checks it
        only_flag = target == (vol.size_gib, vol.volume_type, vol.iops, vol.throughput)
        mod = VolumeModification(
            id=ids.new_id("modification"), volume_id=volume_id, state="completed" if only_flag else "modifying",
            original_size_gib=vol.size_gib, target_size_gib=target[0], original_volume_type=vol.volume_type,
            target_volume_type=target[1], original_iops=vol.iops, target_iops=target[2],
            original_throughput=vol.throughput, target_throughput=target[3], progress=100 if only_flag else 0,
            start_time=utcnow(), end_time=utcnow() if only_flag else None)
        s.add(mod)
        s.flush()
        out = _out(mod)
        if only_flag:
            return out
        op_id = svc.engine.begin(s, MODIFY_VOLUME, volume_id, ModifyParams(
            modification_id=mod.id, node=vol.storage_node, pool=vol.pool, size_gib=target[0],
            grow=target[0] > vol.size_gib, encrypted=vol.key_id is not None,
            limits=_new_limits(svc, vol, target)))
    svc.engine.submit(op_id)
    return out


def _new_limits(svc: Controller, vol: Volume, target: tuple[int, str, int | None, int | None]) -> ExportLimits | None:
    """The limits the data path enforces after the modification; None where they stay as they are."""
    type_limits = svc.cfg.enforce_type_limits
    before = volume_types.enforced_limits(vol.volume_type, vol.size_gib, vol.iops, vol.throughput,
                                          type_limits=type_limits)
    after = volume_types.enforced_limits(target[1], target[0], target[2], target[3], type_limits=type_limits)
    return after if after != before else None


def _check_online_growth(s: Session, volume_id: str, attached: list[Attachment]) -> None:
    """A volume grows under its guests only where every one of their hypervisors can show them the new size."""
    if any(a.mode == "ro" for a in attached):
        raise IncorrectState(f"The volume '{volume_id}' has a read-only attachment, which cannot grow online; "
                             "detach it first.")
    for a in attached:
        node = s.get(Node, (a.host, "host"))
        caps = host_info(node).capabilities if node is not None else None
        if caps is None or not caps.online_resize:
            raise IncorrectState(f"The volume '{volume_id}' is attached on host '{a.host}', whose hypervisor cannot "
                                 "grow a disk online; detach it first.")
        if caps.online_resize_protocols is not None:
            protocol = _protocol_of(s, volume_id, caps.protocols)
            if protocol not in caps.online_resize_protocols:
                raise IncorrectState(f"The volume '{volume_id}' is attached on host '{a.host}' over {protocol}, which "
                                     "its hypervisor cannot grow online; detach it first.")


def _protocol_of(s: Session, volume_id: str, host_protocols: Sequence[str]) -> str:
    """How the host opens the volume: natively from an RBD pool when it opens rbd, else through the
    storage node's export."""
    vol = s.get(Volume, volume_id)
    node = s.get(Node, (vol.storage_node, "storage")) if vol is not None else None
    pools = {p.name: p for p in storage_info(node).pools} if node is not None else {}
    pool = pools.get(vol.pool) if vol is not None else None
    if pool is not None and pool.backend == "rbd" and "rbd" in host_protocols:
        return "rbd"
    return "an export"


MODIFICATION_FILTERS = {
    "volume-id": flt.in_values(VolumeModification.volume_id),
    "modification-state": flt.in_values(VolumeModification.state),
    "target-size": flt.in_values(VolumeModification.target_size_gib, flt.bounded_int()),
    "original-size": flt.in_values(VolumeModification.original_size_gib, flt.bounded_int()),
    "target-volume-type": flt.in_values(VolumeModification.target_volume_type),
    "original-volume-type": flt.in_values(VolumeModification.original_volume_type),
}


def describe_modifications(svc: Controller, tenant: str, volume_ids: list[str], filters: dict[str, list[str]],
                           max_results: int | None, next_token: str | None, *,
                           latest_only: bool = False) -> ModificationList:
    for vid in volume_ids:
        ids.check("volume", vid)
    owned = select(Volume.id).where(Volume.tenant == tenant)
    stmt = select(VolumeModification).where(VolumeModification.volume_id.in_(owned),
                                            *flt.where_clauses(filters, VolumeModification.volume_id,
                                                               MODIFICATION_FILTERS))
    if volume_ids:
        stmt = stmt.where(VolumeModification.volume_id.in_(volume_ids))
    if latest_only:
        newer = aliased(VolumeModification)
        stmt = stmt.where(~exists().where(newer.volume_id == VolumeModification.volume_id,
                                          newer.start_time > VolumeModification.start_time))
    limit = flt.page_limit(max_results, [])
    stmt = flt.paginate(stmt, VolumeModification.id, limit, next_token)
    with svc.db.read() as s:
        rows, token = flt.page(list(s.scalars(stmt)), limit, lambda m: m.id)
        return ModificationList(modifications=[_out(m) for m in rows], next_token=token)
