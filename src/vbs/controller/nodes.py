"""Storage nodes as their heartbeats describe them, and the scheduler that places new volumes."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs.controller.db import Node
from vbs.controller.db.tables import utcnow
from vbs.controller.schemas import PoolOut, StorageHeartbeat, StorageNodeOut
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


def _alive(node: Node, timeout_s: float, now: datetime) -> bool:
    return node.last_heartbeat >= now - timedelta(seconds=timeout_s)


def describe_storage_nodes(session: Session, timeout_s: float) -> list[StorageNodeOut]:
    now = utcnow()
    nodes = session.scalars(select(Node).where(Node.kind == "storage").order_by(Node.name)).all()
    return [
        StorageNodeOut(
            name=n.name, url=n.url, state="up" if _alive(n, timeout_s, now) else "down",
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
        if (node is not None and n.name != node) or not _alive(n, timeout_s, now):
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
