"""The ``libvirt-metadata`` resolver: a cloud's instance id as its hypervisor wrote it into the VM.

Host agents report, for each VM, the ids external clouds gave it (``VmInfo.cloud_ids``): the libvirt
driver reads them from the domain's ``<metadata>`` (Nova's ``<nova:instance>``: the domain UUID is
the Nova instance UUID). This resolver looks the id up among the instances those reports made, so
the controller needs no access to any libvirtd. The scheme names which cloud's ids (``nova``).
"""

from __future__ import annotations

import json

from sqlalchemy import select

from vbs.config import ControllerConfig
from vbs.controller.db import Database
from vbs.controller.db.tables import Instance
from vbs.controller.resolvers.base import Location
from vbs.errors import InvalidParameter

__all__ = ["LibvirtMetadataResolver"]

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


class LibvirtMetadataResolver:
    id_pattern = _UUID

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme

    @classmethod
    def from_config(cls, scheme: str, argument: str | None, cfg: ControllerConfig) -> LibvirtMetadataResolver:
        if argument is not None:
            raise InvalidParameter(f"resolvers: libvirt-metadata takes no argument ({scheme} = "
                                   f"\"libvirt-metadata:{argument[:40]}\")")
        return cls(scheme)

    def locate(self, db: Database, cloud_id: str) -> Location | None:
        needle = json.dumps(cloud_id)
        with db.read() as s:
            rows = s.execute(select(Instance.host, Instance.vm_id, Instance.cloud_ids)
                             .where(Instance.state != "gone", Instance.cloud_ids.contains(needle))
                             .order_by(Instance.last_seen.desc())).all()
        for host, vm_id, ids_json in rows:
            try:
                if json.loads(ids_json).get(self.scheme) == cloud_id:
                    return Location(host, vm_id)
            except (ValueError, AttributeError):
                continue
        return None
