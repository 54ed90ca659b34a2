"""Storage nodes as their heartbeats describe them, and the scheduler that places new volumes."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Instance, Node
from vbs.controller.db.tables import utcnow
from vbs.controller.schemas import HostHeartbeat, HostOut, PoolOut, StorageHeartbeat, StorageNodeOut
from vbs.errors import InsufficientCapacity

GIB = 1 << 30


def record_storage_heartbeat(session: Session, hb: StorageHeartbeat) -> None:
    node = session.get(Node, (hb.name, "storage"))
    info = {"pools": [p.model_dump() for p in hb.pools], "exports": hb.exports}
    if node is None:
        session.add(Node(name=hb.name, kind="storage", url=hb.url, address=hb.address, info=info,
                         started_at=hb.started_at, last_heartbeat=utcnow()))
        return
    node.url, node.address, node.info = hb.url, hb.address, info
    node.started_at = hb.started_at
    node.last_heartbeat = utcnow()


def is_alive(node: Node, timeout_s: float, now: datetime) -> bool:
    return node.last_heartbeat >= now - timedelta(seconds=timeout_s)


def describe_storage_nodes(session: Session, timeout_s: float) -> list[StorageNodeOut]:
    now = utcnow()
    nodes = session.scalars(select(Node).where(Node.kind == "storage").order_by(Node.name)).all()
    return [
        StorageNodeOut(
            name=n.name, url=n.url, state="up" if is_alive(n, timeout_s, now) else "down",
            last_heartbeat=n.last_heartbeat,
            pools=[PoolOut(**{k: p[k] for k in ("name", "capacity_bytes", "free_bytes", "clone_method")})
                   for p in n.info.get("pools", [])],
        )
        for n in nodes
    ]


def choose_pool(session: Session, size_gib: int, *, timeout_s: float, overcommit: float,
                node: str | None = None, pool: str | None = None) -> tuple[str, str]:
    """The live (node, pool) with the most free space that can hold ``size_gib`` thin-provisioned.

    Where the volume must live on a given node/pool (it clones a snapshot there), only that one is
    considered. Capacity is weighed by free space, so the emptiest pool fills first.
    """
    now = utcnow()
    best: tuple[int, str, str] | None = None
    for n in session.scalars(select(Node).where(Node.kind == "storage")).all():
        if (node is not None and n.name != node) or not is_alive(n, timeout_s, now):
            continue
        for p in n.info.get("pools", []):
            if pool is not None and p["name"] != pool:
                continue
            if size_gib * GIB > p["capacity_bytes"] * overcommit:
                continue
            if best is None or p["free_bytes"] > best[0]:
                best = (p["free_bytes"], n.name, p["name"])
    if best is None:
        where = f" on storage node {node}" if node else ""
        raise InsufficientCapacity(f"There is not enough live capacity{where} for a {size_gib} GiB volume.")
    return best[1], best[2]


def record_host_heartbeat(session: Session, hb: HostHeartbeat) -> None:
    """Register the host and its VMs; each VM becomes an instance ``i-…`` the first time it is seen."""
    now = utcnow()
    node = session.get(Node, (hb.name, "host"))
    info = {"initiator_name": hb.initiator_name}
    if node is None:
        session.add(Node(name=hb.name, kind="host", url=hb.url, address=hb.address, info=info,
                         started_at=hb.started_at, last_heartbeat=now))
    else:
        node.url, node.address, node.info, node.started_at, node.last_heartbeat = (
            hb.url, hb.address, info, hb.started_at, now)
    if hb.vms is None:
        return
    known = {i.vm_id: i for i in session.scalars(select(Instance).where(Instance.host == hb.name))}
    reported = {vm.vm_id: vm for vm in hb.vms}
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


def host_is_alive(session: Session, name: str, timeout_s: float) -> bool:
    node = session.get(Node, (name, "host"))
    return node is not None and is_alive(node, timeout_s, utcnow())


def describe_hosts(session: Session, timeout_s: float) -> list[HostOut]:
    now = utcnow()
    counts: dict[str, int] = {}
    for host in session.scalars(select(Instance.host).where(Instance.state != "gone")):
        counts[host] = counts.get(host, 0) + 1
    return [
        HostOut(name=n.name, url=n.url, address=n.address, state="up" if is_alive(n, timeout_s, now) else "down",
                last_heartbeat=n.last_heartbeat, instances=counts.get(n.name, 0))
        for n in session.scalars(select(Node).where(Node.kind == "host").order_by(Node.name))
    ]
