"""Nodes as their heartbeats describe them: storage nodes and hosts, recorded from each heartbeat and
read back through typed views (``Node.info`` is a ``vbs.wire`` model, never a loose dict), and whether
each is alive.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any, NamedTuple, Protocol

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Instance, Node
from vbs.controller.db.documents import LARGE_DOCUMENT_CHARS, ParsedDocuments
from vbs.controller.db.locks import on_postgresql
from vbs.controller.db.tables import utcnow
from vbs.versions import Peer
from vbs.wire.base import Wire
from vbs.wire.connection import HostIdentity
from vbs.wire.host import HostHeartbeat, HypervisorCapabilities
from vbs.wire.probes import Probe
from vbs.wire.storage import ExportInfo, PoolInfo, StorageHeartbeat

GIB = 1 << 30


class StorageNodeInfo(Wire):
    """What the controller keeps of a storage node's last heartbeat. No ``availability_zone``: the
    controller's own zone."""

    pools: list[PoolInfo] = []
    exports: list[ExportInfo] = []
    availability_zone: str | None = None
    volume_usage: dict[str, int] = {}
    # The agent's VBS release and wire version, as its heartbeat's headers said (vbs.versions; None:
    # not said, a VBS older than the headers).
    vbs_version: str | None = None
    wire_version: int | None = None


class HostNodeInfo(Wire):
    """What the controller keeps of a host's last heartbeat."""

    initiator_name: str | None = None
    hypervisor: str = "unknown"
    capabilities: HypervisorCapabilities = HypervisorCapabilities(protocols=[])
    probes: list[Probe] = []
    local_pools: list[PoolInfo] = []
    vbs_version: str | None = None  # as StorageNodeInfo's
    wire_version: int | None = None


def _parse_storage_info(info: Any) -> StorageNodeInfo:
    try:
        return StorageNodeInfo.model_validate(info)
    except ValidationError:
        return StorageNodeInfo()  # written by an older controller; the next heartbeat replaces it


# A storage node with many volumes reports the usage of each: its record is validated once per heartbeat
# (the database layer hands back the same decoded document until the next one), not at every read. The
# database layer shares documents from LARGE_DOCUMENT_CHARS on: a record's usage alone reaches that
# from about this many volumes (some 35 characters each).
MANY_VOLUMES = LARGE_DOCUMENT_CHARS // 35


def _many_volumes(info: Any) -> bool:
    return isinstance(info, dict) and len(info.get("volume_usage", ())) >= MANY_VOLUMES


_storage_infos = ParsedDocuments(_parse_storage_info, _many_volumes)


class StorageNodeRecord(Protocol):
    """What placement and health read of a storage node: a ``Node``, or a plain row (``StorageNodeRow``)."""

    @property
    def name(self) -> str: ...
    @property
    def info(self) -> Any: ...
    @property
    def last_heartbeat(self) -> datetime: ...
    @property
    def drained(self) -> bool: ...


class StorageNodeRow(NamedTuple):
    name: str
    info: Any
    last_heartbeat: datetime
    drained: bool


def storage_info(node: StorageNodeRecord) -> StorageNodeInfo:
    return storage_info_document(node.info)


def storage_info_document(info: Any) -> StorageNodeInfo:
    """``storage_info`` of a node's ``info`` column read without its row."""
    return _storage_infos.view(info)


def pool_of(node: Node | None, name: str) -> PoolInfo | None:
    """What storage node ``node`` last reported of its pool ``name``; None if either is unknown."""
    return None if node is None else next((p for p in storage_info(node).pools if p.name == name), None)


def zone_of(node: StorageNodeRecord, default_zone: str) -> str:
    """The availability zone of a storage node: the one its agent reports, else the controller's."""
    return storage_info(node).availability_zone or default_zone


def host_info(node: Node) -> HostNodeInfo:
    try:
        return HostNodeInfo.model_validate(node.info)
    except ValidationError:
        return HostNodeInfo()


def host_identity(node: Node) -> HostIdentity:
    """The host an export is made for, as its agent reported itself."""
    return HostIdentity(name=node.name, address=node.address, initiator_name=host_info(node).initiator_name)


def _record(session: Session, name: str, kind: str, url: str, address: str, started_at: datetime, info: Wire) -> None:
    """Insert or update the node's row in one statement (two first heartbeats of a node cannot both
    insert); on PostgreSQL it also locks the row, so one node's heartbeats take turns. ``drained`` is
    not among what it sets: that is the operator's, and a heartbeat keeps it.

    A heartbeat that reports what the row already holds only moves its time: a storage node's record
    holds the usage of each of its volumes (megabytes at 100,000), and rewriting it every few seconds
    kept SQLite's write lock, its log and its checkpoints busy for nothing."""
    document = info.model_dump(mode="json")
    now = utcnow()
    this_node = (Node.name == name, Node.kind == kind)
    if session.execute(select(Node.info).where(*this_node)).scalar_one_or_none() == document:
        moved = session.execute(update(Node).where(*this_node).values(
            url=url, address=address, started_at=started_at, last_heartbeat=now))
        if moved.rowcount == 1:  # type: ignore[attr-defined]
            return
    values = {"url": url, "address": address, "info": document, "started_at": started_at, "last_heartbeat": now}
    insert = postgresql.insert if on_postgresql(session) else sqlite.insert
    session.execute(insert(Node).values(name=name, kind=kind, **values)
                    .on_conflict_do_update(index_elements=[Node.name, Node.kind], set_=values))


def record_storage_heartbeat(session: Session, hb: StorageHeartbeat, sender: Peer | None = None) -> None:
    """``sender``: the versions the heartbeat's headers named (vbs.versions), kept with the node."""
    _record(session, hb.name, "storage", hb.url, hb.address, hb.started_at,
            StorageNodeInfo(pools=hb.pools, exports=hb.exports, availability_zone=hb.availability_zone,
                            volume_usage=hb.volume_usage, **_versions(sender)))


def record_host_heartbeat(session: Session, hb: HostHeartbeat, sender: Peer | None = None) -> None:
    """Register the host and its VMs; each VM becomes an instance ``i-…`` the first time it is seen."""
    _record(session, hb.name, "host", hb.url, hb.address, hb.started_at,
            HostNodeInfo(initiator_name=hb.initiator_name, hypervisor=hb.hypervisor, capabilities=hb.capabilities,
                         probes=hb.probes, local_pools=hb.local_pools, **_versions(sender)))

    if hb.vms is None:
        return
    now = utcnow()
    known = {i.vm_id: i for i in session.scalars(select(Instance).where(Instance.host == hb.name))}
    reported = {vm.vm_id for vm in hb.vms}
    for vm in hb.vms:
        inst = known.get(vm.vm_id)
        # "incoming": the destination of a live migration, waiting for it (vbs.controller.requests.migrate_instance).
        state = "running" if vm.running else "incoming" if vm.status == "inmigrate" else "stopped"
        cloud_ids = json.dumps(vm.cloud_ids, sort_keys=True)
        if inst is None:
            session.add(Instance(id=ids.new_id("instance"), host=hb.name, vm_id=vm.vm_id, name=vm.name or vm.vm_id,
                                 state=state, first_seen=now, last_seen=now, cloud_ids=cloud_ids))
        else:
            if state == "incoming" and inst.state != "incoming":
                inst.first_seen = now  # a new destination VM on a known id: its wait starts now
            inst.state, inst.last_seen, inst.name = state, now, vm.name or vm.vm_id
            if inst.cloud_ids != cloud_ids:
                inst.cloud_ids = cloud_ids
    for vm_id, inst in known.items():
        if vm_id not in reported and inst.state != "gone":
            inst.state = "gone"


def _versions(sender: Peer | None) -> dict[str, Any]:
    return {} if sender is None else {"vbs_version": sender.release, "wire_version": sender.wire}


def is_alive(node: StorageNodeRecord, timeout_s: float, now: datetime) -> bool:
    return node.last_heartbeat >= now - timedelta(seconds=timeout_s)


def host_is_alive(session: Session, name: str, timeout_s: float) -> bool:
    node = session.get(Node, (name, "host"))
    return node is not None and is_alive(node, timeout_s, utcnow())



def live_storage_nodes(session: Session, timeout_s: float) -> list[Node]:
    now = utcnow()
    return [n for n in session.scalars(select(Node).where(Node.kind == "storage").order_by(Node.name))
            if is_alive(n, timeout_s, now)]
