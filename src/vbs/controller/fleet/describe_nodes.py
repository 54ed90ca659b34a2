"""Nodes as the API describes them: storage nodes and their pools, hosts, availability zones, each
node's health and what it means for its volumes' status checks; draining a storage node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from vbs.controller.db import Instance, Node, Snapshot, Volume, plain
from vbs.controller.db.locks import lock_placement
from vbs.controller.db.states import SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import (
    StorageNodeRow,
    host_info,
    is_alive,
    storage_info,
    storage_info_document,
    zone_of,
)
from vbs.controller.placement.room import is_full
from vbs.controller.rest.schemas.nodes import DrainOut, HostOut, PoolOut, ResidentOut, StorageNodeOut, ZoneOut
from vbs.errors import NotFound
from vbs.wire.storage import PoolInfo


def _storage_node_out(n: Node, timeout_s: float, default_zone: str, now: datetime) -> StorageNodeOut:
    info = storage_info(n)
    return StorageNodeOut(
        name=n.name, url=n.url, state="up" if is_alive(n, timeout_s, now) else "down", drained=n.drained,
        availability_zone=zone_of(n, default_zone), last_heartbeat=n.last_heartbeat,
        pools=[pool_out(p) for p in info.pools], vbs_version=info.vbs_version, wire_version=info.wire_version,
    )


def pool_out(p: PoolInfo) -> PoolOut:
    return PoolOut(name=p.name, backend=p.backend, capacity_bytes=p.capacity_bytes, free_bytes=p.free_bytes,
                   clone_method=p.clone_method, point_in_time=p.point_in_time, shared_id=p.shared_id,
                   lost=p.lost, full=is_full(p))


def describe_storage_nodes(session: Session, timeout_s: float, default_zone: str) -> list[StorageNodeOut]:
    now = utcnow()
    nodes = session.scalars(select(Node).where(Node.kind == "storage").order_by(Node.name)).all()
    return [_storage_node_out(n, timeout_s, default_zone, now) for n in nodes]


def drain_storage_node(session: Session, name: str, *, drained: bool, timeout_s: float,
                       default_zone: str) -> DrainOut:
    """Mark the node drained (no new volumes) or not, and say what still lives on it."""
    lock_placement(session)  # the creates in flight commit first; those after it see the mark
    hit = session.execute(update(Node).where(Node.kind == "storage", Node.name == name)
                          .values(drained=drained)).rowcount  # type: ignore[attr-defined]
    if hit != 1:
        raise NotFound(f"The storage node '{name[:64]}' does not exist.", code="InvalidStorageNode.NotFound")
    node = session.get(Node, (name, "storage"), populate_existing=True)
    assert node is not None
    vols = session.scalars(select(Volume).where(Volume.storage_node == name, Volume.status != VolumeState.DELETED)
                           .order_by(Volume.id))
    snaps = session.scalars(select(Snapshot).where(
        Snapshot.storage_node == name, Snapshot.status.not_in([SnapshotState.DELETED])).order_by(Snapshot.id))
    return DrainOut(
        storage_node=_storage_node_out(node, timeout_s, default_zone, utcnow()),
        volumes=[ResidentOut(id=v.id, tenant=v.tenant, pool=v.pool, size_gib=v.size_gib, status=v.status)
                 for v in vols],
        snapshots=[ResidentOut(id=x.id, tenant=x.tenant, pool=x.pool, size_gib=x.volume_size_gib, status=x.status)
                   for x in snaps])


def availability_zones(session: Session, timeout_s: float, default_zone: str, region: str) -> list[ZoneOut]:
    """The zones of the known storage nodes: ``available`` while one of its nodes is up."""
    now = utcnow()
    up: dict[str, bool] = {}
    for n in session.scalars(select(Node).where(Node.kind == "storage")):
        zone = zone_of(n, default_zone)
        up[zone] = up.get(zone, False) or is_alive(n, timeout_s, now)
    return [ZoneOut(zone_name=z, zone_id=zone_id(z, region), region_name=region,
                    state="available" if alive else "unavailable") for z, alive in sorted(up.items())]


def zone_id(zone: str, region: str) -> str:
    """A zone's id: ``<region>-az<n>`` for the region's n-th lettered zone (us-east-1a: us-east-1-az1),
    else its name."""
    suffix = zone.removeprefix(region)
    if zone.startswith(region) and len(suffix) == 1 and "a" <= suffix <= "z":
        return f"{region}-az{ord(suffix) - ord('a') + 1}"
    return zone


@dataclass(frozen=True)
class NodeHealth:
    """What describes of volumes need of their storage node."""

    zone: str
    alive: bool
    # Bytes each of its volumes holds, as its last heartbeat reported (not every backend tells).
    volume_usage: Mapping[str, int] = field(default_factory=dict)


def node_health(session: Session, names: set[str], *, timeout_s: float, default_zone: str) -> dict[str, NodeHealth]:
    now = utcnow()
    if not names:
        return {}
    # Three columns as plain rows, not Node objects: every describe asks.
    rows = plain.execute(session, _HEALTH_QUERY, {"names": sorted(names)})
    return health_of(rows, now=now, timeout_s=timeout_s, default_zone=default_zone)


def health_of(rows: Iterable[tuple[str, Any, datetime] | StorageNodeRow], *, now: datetime, timeout_s: float,
              default_zone: str) -> dict[str, NodeHealth]:
    """``node_health`` of storage node rows already read (a create's answer: the rows placement read)."""
    oldest = now - timedelta(seconds=timeout_s)
    health = {}
    for name, info_doc, last_heartbeat, *_ in rows:
        info = storage_info_document(info_doc)
        health[name] = NodeHealth(info.availability_zone or default_zone, last_heartbeat >= oldest, info.volume_usage)
    return health


_HEALTH_QUERY = select(Node.name, Node.info, Node.last_heartbeat).where(
    Node.kind == "storage", Node.name.in_(bindparam("names", expanding=True)))


VolumeStatusCheck = Literal["ok", "impaired", "insufficient-data"]
# The states in which a volume serves I/O (if its node does).
LIVE_VOLUME_STATES = (VolumeState.AVAILABLE, VolumeState.IN_USE)


def volume_status(state: str, node: NodeHealth | None) -> VolumeStatusCheck:
    """EC2's volume status check: can I/O reach the volume? ``impaired`` when its storage node stopped
    heartbeating or the volume is in error; ``insufficient-data`` while it is not (or no longer) a
    volume that serves I/O, or its node never reported."""
    if state == VolumeState.ERROR or (node is not None and not node.alive and state in LIVE_VOLUME_STATES):
        return "impaired"
    if node is None or state not in LIVE_VOLUME_STATES:
        return "insufficient-data"
    return "ok"


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
                             capabilities=info.capabilities, probes=info.probes,
                             local_pools=[pool_out(p) for p in info.local_pools],
                             vbs_version=info.vbs_version, wire_version=info.wire_version))
    return hosts
