"""DescribeInstances as the API offers it: the VMs the host agents discovered, with their VBS attachments
and the ids a cloud knows them by.
"""

from __future__ import annotations

import json

from sqlalchemy import select

from vbs.controller.db import Attachment, Instance, Volume
from vbs.controller.db.states import LIVE_ATTACHMENT
from vbs.controller.requests.attach_volume import attachment_out
from vbs.controller.rest.schemas.nodes import InstanceOut
from vbs.controller.rest.schemas.volumes import AttachmentOut
from vbs.controller.runtime import Controller


def describe_instances(svc: Controller, tenant: str) -> list[InstanceOut]:
    """The VMs host agents report, each with the attachments of ``tenant``'s volumes only.

    Every key may list instances (attaching needs an instance id); another tenant's volumes on them stay hidden.
    """
    with svc.db.read() as s:
        insts = list(s.scalars(select(Instance).where(Instance.state != "gone").order_by(Instance.host,
                                                                                         Instance.vm_id)))
        atts: dict[str, list[AttachmentOut]] = {i.id: [] for i in insts}
        owned = select(Volume.id).where(Volume.tenant == tenant)
        for a in s.scalars(select(Attachment).where(Attachment.status.in_(LIVE_ATTACHMENT),
                                                    Attachment.volume_id.in_(owned))):
            if a.instance_id in atts:
                atts[a.instance_id].append(attachment_out(a))
        return [InstanceOut(instance_id=i.id, host=i.host, vm_id=i.vm_id, name=i.name, state=i.state,
                            volumes=atts[i.id], cloud_ids=_cloud_ids(i)) for i in insts]


def _cloud_ids(inst: Instance) -> dict[str, str]:
    try:
        found = json.loads(inst.cloud_ids or "{}")
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
