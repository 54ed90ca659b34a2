"""Nodes as their heartbeats describe them, and the scheduler that places new volumes.

A heartbeat is a ``vbs.wire`` model; what the controller keeps of it (``Node.info``) is read back
through the typed views here, never as a loose dict.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, NamedTuple, Protocol

from pydantic import ValidationError
from sqlalchemy import bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Instance, Node, Snapshot, Volume, VolumeUsage, plain
from vbs.controller.db.documents import LARGE_DOCUMENT_CHARS, ParsedDocuments
from vbs.controller.db.locks import lock_placement, on_postgresql
from vbs.controller.db.states import SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.placement.growth import Growing, growing
from vbs.controller.rest.schemas import DrainOut, HostOut, PoolOut, ResidentOut, StorageNodeOut, ZoneOut
from vbs.errors import IncorrectState, InsufficientCapacity, InvalidParameter, NotFound
from vbs.wire.base import Wire
from vbs.wire.connection import HostIdentity
from vbs.wire.host import HostHeartbeat, HypervisorCapabilities
from vbs.wire.probes import Probe
from vbs.wire.storage import ExportInfo, PoolInfo, StorageHeartbeat

log = logging.getLogger(__name__)

GIB = 1 << 30


class StorageNodeInfo(Wire):
    """What the controller keeps of a storage node's last heartbeat. No ``availability_zone``: the
    controller's own zone."""

    pools: list[PoolInfo] = []
    exports: list[ExportInfo] = []
    availability_zone: str | None = None
    volume_usage: dict[str, int] = {}


class HostNodeInfo(Wire):
    """What the controller keeps of a host's last heartbeat."""

    initiator_name: str | None = None
    hypervisor: str = "unknown"
    capabilities: HypervisorCapabilities = HypervisorCapabilities(protocols=[])
    probes: list[Probe] = []
    local_pools: list[PoolInfo] = []


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


def record_storage_heartbeat(session: Session, hb: StorageHeartbeat) -> None:
    _record(session, hb.name, "storage", hb.url, hb.address, hb.started_at,
            StorageNodeInfo(pools=hb.pools, exports=hb.exports, availability_zone=hb.availability_zone,
                            volume_usage=hb.volume_usage))


def record_host_heartbeat(session: Session, hb: HostHeartbeat) -> None:
    """Register the host and its VMs; each VM becomes an instance ``i-…`` the first time it is seen."""
    _record(session, hb.name, "host", hb.url, hb.address, hb.started_at,
            HostNodeInfo(initiator_name=hb.initiator_name, hypervisor=hb.hypervisor, capabilities=hb.capabilities,
                         probes=hb.probes, local_pools=hb.local_pools))
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


def is_alive(node: StorageNodeRecord, timeout_s: float, now: datetime) -> bool:
    return node.last_heartbeat >= now - timedelta(seconds=timeout_s)


def host_is_alive(session: Session, name: str, timeout_s: float) -> bool:
    node = session.get(Node, (name, "host"))
    return node is not None and is_alive(node, timeout_s, utcnow())


def _storage_node_out(n: Node, timeout_s: float, default_zone: str, now: datetime) -> StorageNodeOut:
    return StorageNodeOut(
        name=n.name, url=n.url, state="up" if is_alive(n, timeout_s, now) else "down", drained=n.drained,
        availability_zone=zone_of(n, default_zone), last_heartbeat=n.last_heartbeat,
        pools=[pool_out(p) for p in storage_info(n).pools],
    )


def pool_out(p: PoolInfo) -> PoolOut:
    return PoolOut(name=p.name, backend=p.backend, capacity_bytes=p.capacity_bytes, free_bytes=p.free_bytes,
                   clone_method=p.clone_method, point_in_time=p.point_in_time, shared_id=p.shared_id)


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
                             local_pools=[pool_out(p) for p in info.local_pools]))
    return hosts


def live_storage_nodes(session: Session, timeout_s: float) -> list[Node]:
    now = utcnow()
    return [n for n in session.scalars(select(Node).where(Node.kind == "storage").order_by(Node.name))
            if is_alive(n, timeout_s, now)]


def provisioned_gib(session: Session, node: str, pool: str) -> int:
    """What the volumes on ``node``/``pool`` were promised (GiB), deleted ones excepted."""
    return _promised(session, [node]).get((node, pool), 0)


def _promised(session: Session, nodes: list[str]) -> dict[tuple[str, str], int]:
    """``provisioned_gib`` of every pool of these nodes, in one query: the rows the database keeps
    (``VolumeUsage``), not a sum over the pools' volumes."""
    rows = plain.execute(session, _PROMISED_QUERY, {"nodes": nodes})  # volumes this transaction holds count
    return {(node, pool): int(gib) for node, pool, gib in rows}


_PROMISED_QUERY = select(VolumeUsage.owner, VolumeUsage.pool, VolumeUsage.gib).where(
    VolumeUsage.scope == "pool", VolumeUsage.owner.in_(bindparam("nodes", expanding=True)))


def pool_key(node: str, pool: PoolInfo) -> str:
    """What identifies a pool's storage: its shared id (a Ceph pool that several agents serve), else
    the node and pool names (files on that node's disks)."""
    return pool.shared_id or f"{node}/{pool.name}"


def _promised_per_storage(session: Session, nodes: Sequence[StorageNodeRecord], grows: Growing
                          ) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """What each pool's storage was promised, summed over every agent that serves it (a shared pool
    counts once, whichever agent its volumes are recorded on), and each (node, pool) alone, growths
    in progress (``grows``) included."""
    promised = _promised(session, [n.name for n in nodes])
    for pair, gib in grows.pools.items():
        promised[pair] = promised.get(pair, 0) + gib
    per_storage: dict[str, int] = {}
    for n in nodes:
        for p in storage_info(n).pools:
            key = pool_key(n.name, p)
            per_storage[key] = per_storage.get(key, 0) + promised.get((n.name, p.name), 0)
    return per_storage, promised


def _fits(capacity_bytes: int, provisioned: int, size_gib: int, overcommit: float) -> bool:
    return (provisioned + size_gib) * GIB <= capacity_bytes * overcommit


@dataclass(frozen=True)
class Placement:
    """Where a new volume may go: anywhere, or within a zone, on a node, in a pool of that name.

    ``drained_ok``: a drained node may take it (a clone of a snapshot that lives there).
    """

    zone: str | None = None
    node: str | None = None
    pool: str | None = None
    drained_ok: bool = False
    encrypted: bool = False  # only pools that make encrypted volumes (PoolInfo.encryption)

    def includes(self, node: StorageNodeRecord, default_zone: str) -> bool:
        """Whether ``node`` is the named node (if any) in the named zone (if any)."""
        return (self.node is None or node.name == self.node) and (
            self.zone is None or zone_of(node, default_zone) == self.zone)

    def where(self) -> str:
        parts = [f"in zone {self.zone}" if self.zone else "", f"on storage node {self.node}" if self.node else "",
                 f"in pool {self.pool}" if self.pool else "",
                 "in a pool that makes encrypted volumes" if self.encrypted else ""]
        return "".join(f" {p}" for p in parts if p)


def _check_hints(nodes: Sequence[StorageNodeRecord], want: Placement, *, timeout_s: float, default_zone: str,
                 now: datetime) -> None:
    """Refuse a zone, node or pool that cannot take the volume whatever the room: unknown (400), or a
    named node that is down or drained (409). Room itself is the scheduler's question."""
    if want.zone is not None and not any(zone_of(n, default_zone) == want.zone for n in nodes):
        raise InvalidParameter(f"Invalid availability zone: [{want.zone}]; no storage node is in it.")
    named = None
    if want.node is not None:
        named = next((n for n in nodes if n.name == want.node), None)
        if named is None:
            raise InvalidParameter(f"The storage node '{want.node}' does not exist.")
        if want.zone is not None and zone_of(named, default_zone) != want.zone:
            raise InvalidParameter(f"The storage node '{want.node}' is in zone {zone_of(named, default_zone)}, "
                                   f"not {want.zone}.")
        if not is_alive(named, timeout_s, now):
            raise IncorrectState(f"The storage node '{want.node}' is down: no heartbeat for more than {timeout_s:g} s.")
        if named.drained and not want.drained_ok:
            raise IncorrectState(f"The storage node '{want.node}' is drained: it takes no new volumes "
                                 f"(`vbs drain-storage-node {want.node} --undo` ends that).")
    if want.pool is not None:
        if named is not None:
            if not any(p.name == want.pool for p in storage_info(named).pools):
                raise InvalidParameter(f"The storage node '{named.name}' has no pool named '{want.pool}'.")
        elif not any(p.name == want.pool for n in nodes if want.includes(n, default_zone)
                     for p in storage_info(n).pools):
            in_zone = f" in zone {want.zone}" if want.zone else ""
            raise InvalidParameter(f"No storage node{in_zone} has a pool named '{want.pool}'.")


def choose_pool(session: Session, size_gib: int, *, timeout_s: float, overcommit: float, default_zone: str,
                want: Placement | None = None) -> tuple[str, str]:
    """The (node, pool) a new volume of ``size_gib`` goes to (``choose_placement``, holding placement
    exclusively)."""
    chosen = choose_placement(session, size_gib, timeout_s=timeout_s, overcommit=overcommit,
                              default_zone=default_zone, want=want)
    return chosen.row.name, chosen.pool.name


@dataclass(frozen=True)
class Chosen:
    """Where placement puts a new volume: the storage node (its row as placement read it), the pool,
    and every (node, pool) whose volumes count toward that pool's storage (one, or every agent of a
    shared pool)."""

    row: StorageNodeRow
    pool: PoolInfo
    storage: tuple[tuple[str, str], ...]
    growing: Growing  # as placement read it, under its locks (``growth``)

    def still_has_room(self, promised: Mapping[tuple[str, str], int], overcommit: float) -> bool:
        """Whether the storage keeps within capacity x ``overcommit`` with ``promised`` (read after the new
        volume's insert: it is counted) and the growths in progress."""
        total = sum(promised.get(key, 0) + self.growing.pools.get(key, 0) for key in self.storage)
        return _fits(self.pool.capacity_bytes, total, 0, overcommit)


def choose_placement(session: Session, size_gib: int, *, timeout_s: float, overcommit: float, default_zone: str,
                     want: Placement | None = None, shared: bool = False) -> Chosen:
    """The storage node and pool a new volume of ``size_gib`` goes to: water-filling by capacity.

    Among the pools of live, undrained nodes (within ``want``) that can promise ``size_gib`` more —
    what their volumes were promised, this one included, stays within capacity × ``overcommit`` — the
    one that would be the least full relative to its capacity afterwards, ties by name. N creates
    thus spread in proportion to capacity, deterministically, and every pool fills up at once.

    Call it in the transaction that inserts the volume. By default it holds placement exclusively
    and locks the storage node rows (in name order; SQLite serialises writers anyway): nothing can
    take the room it found, and a drain that committed is seen. ``shared``: the caller holds
    placement shared (``locks.lock_for_create``) and the rows are only read, so concurrent creates
    may pick the same room; the caller checks it is still there after its insert
    (``Chosen.still_has_room``) and, if not, tries again exclusively.
    """
    want = want or Placement()
    now = utcnow()
    if not shared:
        lock_placement(session)
    # Plain rows, read now (a drain that committed is seen).
    nodes = [StorageNodeRow(*row) for row in plain.execute(session, _PLACEMENT_READ if shared else _PLACEMENT_LOCK)]
    _check_hints(nodes, want, timeout_s=timeout_s, default_zone=default_zone, now=now)
    live = [n for n in nodes if want.includes(n, default_zone) and is_alive(n, timeout_s, now)
            and (want.drained_ok or not n.drained)]
    # A shared pool's promises include those of its volumes on every agent (live or not), and growths
    # in progress.
    grows = growing(session)
    per_storage, promised = _promised_per_storage(session, nodes, grows)
    best: tuple[float, int, str, str] | None = None
    full = False
    for n in live:
        for p in storage_info(n).pools:
            if (want.pool is not None and p.name != want.pool) or (want.encrypted and not p.encryption):
                continue
            provisioned = per_storage.get(pool_key(n.name, p), 0)
            if not _fits(p.capacity_bytes, provisioned, size_gib, overcommit):
                full = True
                continue
            # The least full storage, then (among the agents of a shared pool) the one serving least.
            candidate = ((provisioned + size_gib) * GIB / p.capacity_bytes, promised.get((n.name, p.name), 0),
                         n.name, p.name)
            if best is None or candidate < best:
                best = candidate
    if best is None:
        if full:
            raise InsufficientCapacity(f"There is not enough capacity{want.where()} for a {size_gib} GiB volume: "
                                       f"the pools have promised all they may (capacity x overcommit ratio "
                                       f"{overcommit:g}).", status=400)
        raise InsufficientCapacity(f"There is not enough live capacity{want.where()} for a {size_gib} GiB volume.")
    row = next(n for n in live if n.name == best[2])
    pool = next(p for p in storage_info(row).pools if p.name == best[3])
    key = pool_key(row.name, pool)
    storage = tuple((n.name, p.name) for n in nodes for p in storage_info(n).pools if pool_key(n.name, p) == key)
    return Chosen(row, pool, storage, grows)


_PLACEMENT_READ = (select(Node.name, Node.info, Node.last_heartbeat, Node.drained).where(Node.kind == "storage")
                   .order_by(Node.name))
_PLACEMENT_LOCK = _PLACEMENT_READ.with_for_update()


def check_growth(session: Session, node: str, pool: str, grow_gib: int, *, overcommit: float) -> None:
    """Refuse growing a volume on ``node``/``pool`` by ``grow_gib`` past what the pool may promise."""
    lock_placement(session)  # no create takes the room meanwhile
    n = session.scalars(select(Node).where(Node.kind == "storage", Node.name == node).with_for_update()).first()
    pools = {p.name: p for p in storage_info(n).pools} if n is not None else {}
    if pool not in pools:
        return
    grows = growing(session)  # other volumes' growths in progress
    if pools[pool].shared_id is None:
        provisioned = provisioned_gib(session, node, pool) + grows.pools.get((node, pool), 0)
    else:  # every agent's volumes of that storage
        nodes = list(session.scalars(select(Node).where(Node.kind == "storage")))
        provisioned = _promised_per_storage(session, nodes, grows)[0].get(pool_key(node, pools[pool]), 0)
    if not _fits(pools[pool].capacity_bytes, provisioned, grow_gib, overcommit):
        raise InsufficientCapacity(f"The pool {pool} on {node} has promised all it may (capacity x overcommit ratio "
                                   f"{overcommit:g}); the volume cannot grow by {grow_gib} GiB there.", status=400)


def choose_local_pool(session: Session, host: str, size_gib: int, *, timeout_s: float, overcommit: float) -> str:
    """The local pool of ``host`` a new local volume of ``size_gib`` goes to (semi-shared storage): the
    least full one that can promise it, as ``choose_pool`` weighs shared pools. Refused with a 4xx when
    the host is unknown or down, has no local pool, or none of its pools has room. The host's row is
    locked: two creates cannot both take the last room."""
    node = session.scalars(select(Node).where(Node.kind == "host", Node.name == host).with_for_update()
                           .execution_options(populate_existing=True)).first()
    if node is None:
        raise InvalidParameter(f"The host '{host}' does not exist.")
    if not is_alive(node, timeout_s, utcnow()):
        raise IncorrectState(f"The host '{host}' is down: no heartbeat for more than {timeout_s:g} s.")
    pools = host_info(node).local_pools
    if not pools:
        raise InvalidParameter(f"The host '{host}' has no local pool: local volumes need one (host agent "
                               f"--local-pool NAME=PATH).")
    promised = _promised(session, [host])
    best: tuple[float, str] | None = None
    for p in pools:
        provisioned = promised.get((host, p.name), 0)
        if _fits(p.capacity_bytes, provisioned, size_gib, overcommit):
            candidate = ((provisioned + size_gib) * GIB / p.capacity_bytes, p.name)
            best = candidate if best is None else min(best, candidate)
    if best is None:
        raise InsufficientCapacity(f"There is not enough room in the local pools of host '{host}' for a {size_gib} "
                                   f"GiB volume (capacity x overcommit ratio {overcommit:g}).", status=400)
    return best[1]
