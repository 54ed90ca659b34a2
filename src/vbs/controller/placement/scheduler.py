"""The scheduler: which storage node and pool a new volume goes to (capacity-weighted, within the
placement hints and zone asked for, reserving its GiB in the transaction that creates its row), whether
a volume may grow where it is, and which local pool of a host takes a local volume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from vbs.controller.db import Node, VolumeUsage, plain
from vbs.controller.db.locks import lock_placement
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import (
    GIB,
    StorageNodeRecord,
    StorageNodeRow,
    host_info,
    is_alive,
    storage_info,
    zone_of,
)
from vbs.controller.placement.growth import Growing, growing
from vbs.controller.placement.room import full_message, is_full
from vbs.errors import IncorrectState, InsufficientCapacity, InvalidParameter
from vbs.wire.storage import PoolInfo


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
    # Only pools whose snapshots go to this snapshot store (a volume restored from a snapshot in it).
    store: str | None = None

    def includes(self, node: StorageNodeRecord, default_zone: str) -> bool:
        """Whether ``node`` is the named node (if any) in the named zone (if any)."""
        return (self.node is None or node.name == self.node) and (
            self.zone is None or zone_of(node, default_zone) == self.zone)

    def where(self) -> str:
        parts = [f"in zone {self.zone}" if self.zone else "", f"on storage node {self.node}" if self.node else "",
                 f"in pool {self.pool}" if self.pool else "",
                 "in a pool that makes encrypted volumes" if self.encrypted else "",
                 f"in a pool that reaches the snapshot store {self.store}" if self.store else ""]
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
    filled: list[str] = []  # pools whose storage is full now, whatever they may still promise
    for n in live:
        for p in storage_info(n).pools:
            if (want.pool is not None and p.name != want.pool) or (want.encrypted and not p.encryption) \
                    or (want.store is not None and p.snapshot_store != want.store):
                continue
            provisioned = per_storage.get(pool_key(n.name, p), 0)
            if not _fits(p.capacity_bytes, provisioned, size_gib, overcommit):
                full = True
                continue
            if is_full(p):
                filled.append(full_message(n.name, p))
                continue
            # The least full storage, then (among the agents of a shared pool) the one serving least.
            candidate = ((provisioned + size_gib) * GIB / p.capacity_bytes, promised.get((n.name, p.name), 0),
                         n.name, p.name)
            if best is None or candidate < best:
                best = candidate
    if best is None:
        if filled:
            raise InsufficientCapacity(f"There is not enough capacity{want.where()} for a {size_gib} GiB volume: "
                                       f"{'; '.join(filled)}. Free space in a pool, then try again.")
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
