"""DetachVolume as the API offers it: the attachment moved to ``detaching`` with its operation in one
transaction (``--force`` skips waiting for the guest), then handed to the detach workflow; and the end of a
``busy`` detach whose guest let the disk go later (``finish_released``, started by the reconciler).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Attachment, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import LIVE_ATTACHMENT, AttachmentState
from vbs.controller.db.transitions import try_transition
from vbs.controller.requests.attach_volume import attachment_out, migration_in_progress
from vbs.controller.requests.describe_volumes import live_volume
from vbs.controller.rest.schemas.volumes import AttachmentOut, DetachVolumeRequest
from vbs.controller.runtime import Controller
from vbs.controller.workflows.detach_volume import DETACH_VOLUME, DetachParams
from vbs.controller.workflows.local_volumes import DETACH_LOCAL_VOLUME
from vbs.errors import IncorrectState, MissingParameter


def detach_volume(svc: Controller, volume_id: str, req: DetachVolumeRequest, tenant: str) -> AttachmentOut:
    with svc.db.session() as s:
        lock_rows(s, Volume, ids.check("volume", volume_id))
        vol = live_volume(s, volume_id, tenant)
        stmt = select(Attachment).where(Attachment.volume_id == volume_id, Attachment.status.in_(LIVE_ATTACHMENT))
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
        if att.instance_id is not None:
            migration_in_progress(s, att.instance_id)
        if not try_transition(s, Attachment, att.id, AttachmentState.DETACHING, status_reason=None):
            raise IncorrectState(f"The attachment of '{volume_id}' is {att.status}; wait until it is attached.")
        op_id = _begin(svc, s, vol, att, force=req.force)
        s.refresh(att)
        out = attachment_out(att).model_copy(update={"operation_id": op_id})
    svc.engine.submit(op_id)
    return out


def finish_released(svc: Controller, attachment_id: str) -> str | None:
    """Detach a ``busy`` attachment whose VM has let its disk go since its detach gave up waiting (the guest
    answered QEMU's unplug request late): the reconciler saw the disk gone. The detach finds no disk to
    unplug and releases what served it. None: the attachment is no longer busy."""
    with svc.db.session() as s:
        att = s.get(Attachment, attachment_id)
        if att is None:
            return None
        lock_rows(s, Volume, att.volume_id)
        vol = s.get(Volume, att.volume_id)
        if vol is None or not try_transition(s, Attachment, att.id, AttachmentState.DETACHING,
                                             from_states=[AttachmentState.BUSY], status_reason=None):
            return None
        op_id = _begin(svc, s, vol, att, force=False)
    svc.engine.submit(op_id)
    return op_id


def _begin(svc: Controller, s: Session, vol: Volume, att: Attachment, *, force: bool) -> str:
    detach = DetachParams(attachment_id=att.id, node=vol.storage_node, pool=vol.pool, host=att.host,
                          vm_id=att.vm_id, serial=ids.virtio_serial(vol.id), force=force,
                          timeout=svc.cfg.detach_timeout_s)
    if vol.placement == "local":
        local = detach.model_copy(update={"persistent": vol.persistent})
        return svc.engine.begin(s, DETACH_LOCAL_VOLUME, vol.id, local)
    return svc.engine.begin(s, DETACH_VOLUME, vol.id, detach)
