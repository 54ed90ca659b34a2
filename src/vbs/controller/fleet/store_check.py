"""``vbs check``'s look at the snapshot stores (docs/snapshots.md): every snapshot the database says is
stored is checked in its store by a live storage node that reports that store (manifest read, every
chunk found; ``deep``: every chunk fetched and hashed again), and the snapshots of pools with a store
that are not in it yet are listed; snapshots moved into a separate archive store are checked there
(docs/snapshot-tiers.md). It reads and changes nothing else: a store is shared, and what is
wrong in it is for a person to judge (a restore of a damaged snapshot fails, naming the chunk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr
from sqlalchemy import select

from vbs.controller.auth.store_key import store_key
from vbs.controller.db import Node, Snapshot, SnapshotTier
from vbs.controller.db.states import SnapshotState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import is_alive, storage_info
from vbs.controller.fleet.reconcile import Finding
from vbs.controller.services import Services
from vbs.errors import VbsError
from vbs.wire.storage import MAX_CHECKED_SNAPSHOTS

__all__ = ["StoreCheck", "check_stores"]

_FINDING_KINDS = {"manifest": "store-manifest", "key": "store-key", "missing": "store-missing-chunk",
                  "corrupt": "store-corrupt-chunk"}


@dataclass
class StoreCheck:
    """Each store checked (by which node, how much), the snapshots not stored yet, and what is wrong:
    findings of kinds store-manifest, store-key, store-missing-chunk, store-corrupt-chunk and
    store-unreachable, their ``node`` the store's description."""

    stores: list[dict[str, Any]] = field(default_factory=list)
    unstored: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def check_stores(svc: Services, *, deep: bool) -> StoreCheck:
    """Check every store some snapshot is recorded in, through the first live node that reports it."""
    result = StoreCheck()
    now = utcnow()
    with svc.db.read() as s:
        nodes = [n for n in s.scalars(select(Node).where(Node.kind == "storage"))
                 if is_alive(n, svc.cfg.heartbeat_timeout_s, now)]
        rows = s.execute(select(Snapshot.id, Snapshot.status, Snapshot.store_state, Snapshot.store,
                                Snapshot.storage_node, Snapshot.pool, Snapshot.status_reason)
                         .where(Snapshot.status != SnapshotState.DELETED).order_by(Snapshot.id)).all()
        # Moved to a separate archive store: checked there (docs/snapshot-tiers.md).
        archived: dict[str, str] = {snap: where for snap, where in s.execute(
            select(SnapshotTier.snapshot_id, SnapshotTier.archive_store).where(
                SnapshotTier.archive_store.is_not(None), SnapshotTier.tier == "archive")).tuples() if where}
    reached_by: dict[str, str] = {}  # store -> the node that checks it
    archive_reached_by: dict[str, str] = {}  # archive store -> the node that checks it
    store_of: dict[tuple[str, str], str] = {}  # (node, pool) -> its store
    for node in sorted(nodes, key=lambda n: n.name):
        for pool in storage_info(node).pools:
            if pool.snapshot_store is not None:
                reached_by.setdefault(pool.snapshot_store, node.name)
                store_of[(node.name, pool.name)] = pool.snapshot_store
            if pool.archive_store is not None:
                archive_reached_by.setdefault(pool.archive_store, node.name)
    stored: dict[str, list[str]] = {}
    in_archive: dict[str, list[str]] = {}
    for row in rows:
        if row.id in archived:
            in_archive.setdefault(archived[row.id], []).append(row.id)
        elif row.store_state == "stored" and row.store is not None:
            stored.setdefault(row.store, []).append(row.id)
        elif (row.status in (SnapshotState.PENDING, SnapshotState.COMPLETED)
              and (row.storage_node, row.pool) in store_of):
            result.unstored.append({"snapshot_id": row.id, "status": row.status,
                                    "store_state": row.store_state or "not started",
                                    "store": store_of[(row.storage_node, row.pool)],
                                    "reason": row.status_reason or ""})
    key = store_key(svc.db, svc.master_key) if deep and (stored or in_archive) else None
    for where, snapshot_ids in sorted(stored.items()):
        _check_one(svc, result, where, reached_by.get(where), snapshot_ids, deep, key, archive=False)
    for where, snapshot_ids in sorted(in_archive.items()):
        _check_one(svc, result, where, archive_reached_by.get(where), snapshot_ids, deep, key, archive=True)
    return result


def _check_one(svc: Services, result: StoreCheck, where: str, node_name: str | None, snapshot_ids: list[str],
               deep: bool, key: SecretStr | None, *, archive: bool) -> None:
    """Check ``snapshot_ids`` in the store (or archive store) ``where`` through ``node_name``."""
    if node_name is None:
        result.findings.append(Finding("store-unreachable", where, where, f"{len(snapshot_ids)} stored "
                                            "snapshot(s), and no live storage node reports this store"))
        return
    counts = {"snapshots": 0, "chunks_checked": 0, "bytes_checked": 0}
    try:
        agent = svc.agents.storage(node_name)
        for start in range(0, len(snapshot_ids), MAX_CHECKED_SNAPSHOTS):
            report = agent.check_store(snapshot_ids[start:start + MAX_CHECKED_SNAPSHOTS], deep=deep,
                                       store_key=key, archive=archive)
            counts["snapshots"] += report.snapshots
            counts["chunks_checked"] += report.chunks_checked
            counts["bytes_checked"] += report.bytes_checked
            for p in report.problems:
                chunk = f"chunk {p.chunk_id} (index {p.chunk_index}): " if p.chunk_id else ""
                result.findings.append(Finding(_FINDING_KINDS[p.kind], where, p.snapshot_id, chunk + p.detail))
    except VbsError as exc:
        result.findings.append(Finding("store-unreachable", where, where, f"via {node_name}: {exc.message}"))
    result.stores.append({"store": where, "node": node_name, "deep": deep, **counts,
                          **({"archive": True} if archive else {})})
