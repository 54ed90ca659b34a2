"""Nodes as their heartbeats describe them, and the scheduler that places new volumes.

A heartbeat is a ``vbs.wire`` model; what the controller keeps of it (``Node.info``) is read back
through the typed views here, never as a loose dict.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Instance, Node, Volume
from vbs.controller.db.locks import on_postgresql
from vbs.controller.db.tables import utcnow
from vbs.controller.schemas import HostOut, PoolOut, StorageNodeOut
from vbs.controller.states import VolumeState
from vbs.errors import InsufficientCapacity
from vbs.wire.base import Wire
from vbs.wire.connection import HostIdentity
from vbs.wire.host import HostHeartbeat, HypervisorCapabilities
from vbs.wire.storage import ExportInfo, PoolInfo, StorageHeartbeat

log = logging.getLogger(__name__)

GIB = 1 << 30


class StorageNodeInfo(Wire):
    """What the controller keeps of a storage node's last heartbeat."""

    pools: list[PoolInfo] = []
    exports: list[ExportInfo] = []


class HostNodeInfo(Wire):
    """What the controller keeps of a host's last heartbeat."""

    initiator_name: str | None = None
    hypervisor: str = "unknown"
    capabilities: HypervisorCapabilities = HypervisorCapabilities(protocols=[])


def storage_info(node: Node) -> StorageNodeInfo:
    try:
        return StorageNodeInfo.model_validate(node.info)
    except ValidationError:
        return StorageNodeInfo()  # written by an older controller; the next heartbeat replaces it


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
    insert); on PostgreSQL it also locks the row, so one node's heartbeats take turns."""
    values = {"url": url, "address": address, "info": info.model_dump(mode="json"), "started_at": started_at,
              "last_heartbeat": utcnow()}
    insert = postgresql.insert if on_postgresql(session) else sqlite.insert
    session.execute(insert(Node).values(name=name, kind=kind, **values)
                    .on_conflict_do_update(index_elements=[Node.name, Node.kind], set_=values))


def record_storage_heartbeat(session: Session, hb: StorageHeartbeat) -> None:
    _record(session, hb.name, "storage", hb.url, hb.address, hb.started_at,
            StorageNodeInfo(pools=hb.pools, exports=hb.exports))


def record_host_heartbeat(session: Session, hb: HostHeartbeat) -> None:
    """Register the host and its VMs; each VM becomes an instance ``i-…`` the first time it is seen."""
    _record(session, hb.name, "host", hb.url, hb.address, hb.started_at,
            HostNodeInfo(initiator_name=hb.initiator_name, hypervisor=hb.hypervisor, capabilities=hb.capabilities))
    if hb.vms is None:
        return
    now = utcnow()
    known = {i.vm_id: i for i in session.scalars(select(Instance).where(Instance.host == hb.name))}
    reported = {vm.vm_id for vm in hb.vms}
    for vm in hb.vms:
        inst = known.get(vm.vm_id)
        state = "running" if vm.running else "stopped"
        if inst is None:
            session.add(Instance(id=ids.new_id("instance"), host=hb.name, vm_id=vm.vm_id, name=vm.name or vm.vm_id,
                                 state=state, first_seen=now, last_seen=now))
        else:
            inst.state, inst.last_seen, inst.name = state, now, vm.name or vm.vm_id
    for vm_id, inst in known.items():
        if vm_id not in reported and inst.state != "gone":
            inst.state = "gone"


def is_alive(node: Node, timeout_s: float, now: datetime) -> bool:
    return node.last_heartbeat >= now - timedelta(seconds=timeout_s)


def host_is_alive(session: Session, name: str, timeout_s: float) -> bool:
    node = session.get(Node, (name, "host"))
    return node is not None and is_alive(node, timeout_s, utcnow())


def describe_storage_nodes(session: Session, timeout_s: float) -> list[StorageNodeOut]:
    now = utcnow()
    nodes = session.scalars(select(Node).where(Node.kind == "storage").order_by(Node.name)).all()
    return [
        StorageNodeOut(
            name=n.name, url=n.url, state="up" if is_alive(n, timeout_s, now) else "down",
            last_heartbeat=n.last_heartbeat,
            pools=[PoolOut(name=p.name, backend=p.backend, capacity_bytes=p.capacity_bytes, free_bytes=p.free_bytes,
                           clone_method=p.clone_method, point_in_time=p.point_in_time)
                   for p in storage_info(n).pools],
        )
        for n in nodes
    ]


def describe_hosts(session: Session, timeout_s: float) -> list[HostOut]:
    now = utcnow()
    counts: dict[str, int] = {}
    for host in session.scalars(select(Instance.host).where(Instance.state != "gone")):
        counts[host] = counts.get(host, 0) + 1
    hosts = []
    for n in session.scalars(select(Node).where(Node.kind == "host").order_by(Node.name)):
        info = host_info(n)
        hosts.append(HostOut(name=n.name, url=n.url, address=n.address,
                             state="up" if is_alive(n, timeout_s, now) else "down", last_heartbeat=n.last_heartbeat,
                             instances=counts.get(n.name, 0), hypervisor=info.hypervisor,
                             capabilities=info.capabilities))
    return hosts


def provisioned_gib(session: Session, node: str, pool: str) -> int:
    """What the volumes on ``node``/``pool`` were promised (GiB), deleted ones excepted."""
    total = session.scalar(select(func.coalesce(func.sum(Volume.size_gib), 0)).where(
        Volume.storage_node == node, Volume.pool == pool, Volume.status != VolumeState.DELETED))
    return int(total or 0)


def _fits(capacity_bytes: int, provisioned: int, size_gib: int, overcommit: float) -> bool:
    return (provisioned + size_gib) * GIB <= capacity_bytes * overcommit


def choose_pool(session: Session, size_gib: int, *, timeout_s: float, overcommit: float,
                node: str | None = None, pool: str | None = None) -> tuple[str, str]:
    """The live (node, pool) with the most free space that can hold ``size_gib`` more, thin-provisioned.

    A pool takes a volume only while what its volumes were promised, this one included, stays within
    its capacity × ``overcommit``. Call it in the transaction that inserts the volume: the storage
    node rows are locked, in name order (SQLite serialises writers anyway), so two creates cannot
    both take the last room. Where the volume must live on a given node/pool (it clones a snapshot
    there), only that one is considered. Capacity is weighed by free space, so the emptiest pool fills first.
    """
    now = utcnow()
    best: tuple[int, str, str] | None = None
    full = False
    nodes = select(Node).where(Node.kind == "storage").order_by(Node.name).with_for_update()
    for n in session.scalars(nodes).all():
        if (node is not None and n.name != node) or not is_alive(n, timeout_s, now):
            continue
        for p in storage_info(n).pools:
            if pool is not None and p.name != pool:
                continue
            if not _fits(p.capacity_bytes, provisioned_gib(session, n.name, p.name), size_gib, overcommit):
                full = True
                continue
            if best is None or p.free_bytes > best[0]:
                best = (p.free_bytes, n.name, p.name)
    if best is None:
        where = f" on storage node {node}" if node else ""
        if full:
            raise InsufficientCapacity(f"There is not enough capacity{where} for a {size_gib} GiB volume: the pools "
                                       f"have promised all they may (capacity x overcommit ratio {overcommit:g}).",
                                       status=400)
        raise InsufficientCapacity(f"There is not enough live capacity{where} for a {size_gib} GiB volume.")
    return best[1], best[2]


def check_growth(session: Session, node: str, pool: str, grow_gib: int, *, overcommit: float) -> None:
    """Refuse growing a volume on ``node``/``pool`` by ``grow_gib`` past what the pool may promise."""
    n = session.scalars(select(Node).where(Node.kind == "storage", Node.name == node).with_for_update()).first()
    pools = {p.name: p for p in storage_info(n).pools} if n is not None else {}
    if pool in pools and not _fits(pools[pool].capacity_bytes, provisioned_gib(session, node, pool), grow_gib,
                                   overcommit):
        raise InsufficientCapacity(f"The pool {pool} on {node} has promised all it may (capacity x overcommit ratio "
                                   f"{overcommit:g}); the volume cannot grow by {grow_gib} GiB there.", status=400)
