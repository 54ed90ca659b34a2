"""What the workflows share about the snapshot store (docs/snapshots.md): putting a snapshot into it,
making a volume from it, deleting a snapshot from it. The storage agents read and write the store; the
controller records where each snapshot's data lives and hands over the store key with each call.

- **Upload** (``upload``): after the pool's point-in-time copy, the snapshot's storage node puts it into
  the store, with progress in the snapshot's row (the pool's copy takes the first ``copy_share`` % of it:
  half on a pool that copies, none on one whose copies are instant); ``completed`` means stored. A store
  that is down leaves the snapshot ``pending`` with the reason, and the step is retried with back-off.
- **Where a snapshot lives** (``data_location``): ``pool`` (kept in its pool only: no store, or not
  stored yet), ``store`` (a copy pool gave its full copy up), ``pool+store`` (a reflink or RBD pool keeps
  its copy as the fast tier).
- **A volume from a snapshot** (``fill_from_snapshot``): a clone of the pool's copy where the volume is
  made in the snapshot's own pool and that pool holds it (instant on reflink and RBD, as before);
  otherwise hydrated from the store on the volume's node, every chunk checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import SecretStr
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from vbs.controller.auth.store_key import store_key
from vbs.controller.db import Node, Snapshot, SnapshotTier
from vbs.controller.db.states import SnapshotState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.agents import StorageAgent
from vbs.controller.fleet.nodes import is_alive, pool_of, storage_info
from vbs.controller.services import Services
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows.definition import StepContext
from vbs.errors import AgentUnavailable, IncorrectState, RetryLater

__all__ = ["UPLOADING", "STORED", "FAILED", "copy_share", "upload", "data_location", "fill_from_snapshot",
           "delete_from_store", "the_store_key", "store_agent", "archive_agent"]

UPLOADING, STORED, FAILED = "uploading", "stored", "error"
# The share of a snapshot's progress its pool's own copy takes when it is not instant; the upload the rest.
COPY_SHARE = 50
# The pools whose point-in-time copy is instant (a reflink, an RBD snapshot): the upload is all the progress.
INSTANT_CLONES = ("reflink", "rbd-clone")


def copy_share(s: Session, node: str, pool: str) -> int | None:
    """The share (0-100) of a new snapshot's progress its pool's copy takes, or None when its pool puts no
    snapshot into a store (no store, or a backend that cannot yet): then the copy is all of it."""
    info = pool_of(s.get(Node, (node, "storage")), pool)
    if info is None or info.snapshot_store is None:
        return None
    return 0 if info.clone_method in INSTANT_CLONES else COPY_SHARE


def scaled(report: Callable[[int], None], start: int, share: int) -> Callable[[int], None]:
    """A progress reporter of one phase: 0-100 of it is ``start`` to ``start + share`` of the whole."""
    return lambda progress: report(start + progress * share // 100)


def data_location(snap: Snapshot) -> str:
    """Where the snapshot's data lives: ``pool``, ``store`` or ``pool+store``."""
    if snap.store_state != STORED:
        return "pool"
    return "pool+store" if snap.pool_copy else "store"


def the_store_key(ctx: StepContext[Any]) -> SecretStr:
    """The store key, opened now for one agent call (never put in params)."""
    return store_key(ctx.services.db, ctx.services.master_key)


def _parent(s: Session, snap: Snapshot) -> str | None:
    """The volume's latest stored snapshot before this one: what the upload is incremental against (one in
    the Recycle Bin too: its manifest stays until its retention ends, docs/recycle-bin.md; not one moved into
    a separate archive store, whose manifest the snapshot store no longer has: docs/snapshot-tiers.md)."""
    moved_out = select(SnapshotTier.snapshot_id).where(SnapshotTier.archive_store.is_not(None),
                                                       SnapshotTier.tier == "archive")
    return s.scalar(select(Snapshot.id).where(
        Snapshot.volume_id == snap.volume_id, Snapshot.id != snap.id, Snapshot.tenant == snap.tenant,
        Snapshot.store_state == STORED, Snapshot.status.in_((SnapshotState.COMPLETED, SnapshotState.RECOVERABLE)),
        Snapshot.started_at <= snap.started_at, Snapshot.id.notin_(moved_out)
    ).order_by(Snapshot.started_at.desc()).limit(1))


def _set(ctx: StepContext[Any], snapshot_id: str, **values: Any) -> None:
    """Record store facts of a pending snapshot (a snapshot no longer pending is not touched)."""
    with ctx.services.db.session() as s:
        s.execute(update(Snapshot).where(Snapshot.id == snapshot_id, Snapshot.status == SnapshotState.PENDING)
                  .values(updated_at=utcnow(), **values))


def upload(ctx: StepContext[Any], node: str, pool: str, snapshot_id: str, share: int) -> None:
    """The snapshot's storage node puts it into the store (progress ``share``-100 % in its row); its row then
    says where its data lives. Raises ``RetryLater`` while the store is down (the reason in the row)."""
    with ctx.services.db.read() as s:
        snap = s.get(Snapshot, snapshot_id)
        if snap is None:
            raise IncorrectState(f"The snapshot '{snapshot_id}' is gone.")
        volume_id, tenant, parent = snap.volume_id, snap.tenant, _parent(s, snap)
    _set(ctx, snapshot_id, store_state=UPLOADING)
    agent = ctx.services.agents.storage(node)
    key = the_store_key(ctx)
    report = scaled(shared.progress_reporter(ctx, Snapshot, SnapshotState.PENDING, snapshot_id), share, 100 - share)
    try:
        status = shared.until_ready(lambda: agent.store_snapshot(pool, snapshot_id, volume_id, tenant, key, parent),
                                    report, unreachable_s=shared.patience(ctx))
    except RetryLater as exc:
        _set(ctx, snapshot_id, status_reason=f"waiting for the snapshot store: {exc.message}"[:2000])
        raise
    if status.store is None:
        raise IncorrectState(f"storage node {node} stored {snapshot_id} but did not say where")
    _set(ctx, snapshot_id, store_state=STORED, store=status.store, stored_bytes=status.stored_bytes,
         pool_copy=status.pool_copy, status_reason=None)


def store_agent(services: Services, snap: Snapshot) -> StorageAgent:
    """An agent that reaches the store holding ``snap``: its own storage node while it is alive, else any
    live node whose pools report that store."""
    timeout = services.cfg.heartbeat_timeout_s
    now = utcnow()
    with services.db.read() as s:
        own = s.get(Node, (snap.storage_node, "storage"))
        if own is not None and is_alive(own, timeout, now) or snap.store is None:
            return services.agents.storage(snap.storage_node)
        for node in s.scalars(select(Node).where(Node.kind == "storage").order_by(Node.name)):
            if is_alive(node, timeout, now) and any(p.snapshot_store == snap.store for p in storage_info(node).pools):
                return services.agents.storage(node.name)
    raise AgentUnavailable(f"no live storage node reaches the snapshot store {snap.store} of {snap.id}")


def archive_agent(services: Services, snap: Snapshot, archive: str) -> StorageAgent:
    """An agent that reaches both the snapshot's store and the archive store ``archive``: its own storage
    node while it is alive and does, else any live node whose pool reports both."""
    timeout = services.cfg.heartbeat_timeout_s
    now = utcnow()
    with services.db.read() as s:
        own = s.get(Node, (snap.storage_node, "storage"))
        candidates = [own] if own is not None else []
        candidates += [n for n in s.scalars(select(Node).where(Node.kind == "storage").order_by(Node.name))
                       if n.name != snap.storage_node]
        for node in candidates:
            if is_alive(node, timeout, now) and any(p.snapshot_store == snap.store and p.archive_store == archive
                                                    for p in storage_info(node).pools):
                return services.agents.storage(node.name)
    raise AgentUnavailable(f"no live storage node reaches both the snapshot store {snap.store} and the archive "
                           f"store {archive} of {snap.id}")


def delete_from_store(ctx: StepContext[Any], snapshot_id: str) -> None:
    """Delete the snapshot's manifest (and an upload's marker) from the store, if it went there, and from
    the archive store, if it went there too (docs/snapshot-tiers.md)."""
    with ctx.services.db.read() as s:
        snap = s.get(Snapshot, snapshot_id)
        tier = s.get(SnapshotTier, snapshot_id)
    if snap is None or snap.store_state is None:
        return
    if tier is not None and tier.archive_store is not None:
        archive_agent(ctx.services, snap, tier.archive_store).delete_stored(snapshot_id)
        return
    store_agent(ctx.services, snap).delete_stored(snapshot_id)


def restores_from_store(snap: Snapshot, node: str, pool: str) -> bool:
    """Whether a volume made from ``snap`` on ``node``/``pool`` is hydrated from the store (its own pool's
    copy is absent there) rather than cloned."""
    return not (snap.pool_copy and snap.storage_node == node and snap.pool == pool)


def fill_from_snapshot(ctx: StepContext[Any], node: str, pool: str, volume_id: str, size_gib: int,
                       snapshot_id: str, report: Callable[[int], None], *, encrypted: bool = False,
                       luks: SecretStr | None = None, source_luks: SecretStr | None = None) -> None:
    """Make the volume on ``node``'s ``pool`` from the snapshot: a clone of the pool's copy where it is, else
    a restore from the store (every chunk checked; a missing or corrupt one fails the step, naming it)."""
    agent = ctx.services.agents.storage(node)
    with ctx.services.db.read() as s:
        snap = s.get(Snapshot, snapshot_id)
    if snap is None:
        raise IncorrectState(f"The snapshot '{snapshot_id}' is gone.")
    if not restores_from_store(snap, node, pool):
        shared.until_ready(lambda: agent.ensure_volume(pool, volume_id, size_gib, snapshot_id, encrypted=encrypted,
                                                       luks=luks, source_luks=source_luks),
                           report, unreachable_s=shared.patience(ctx))
        return
    if snap.store_state != STORED:
        raise IncorrectState(f"The snapshot '{snapshot_id}' is not in its pool {snap.pool} on {snap.storage_node} "
                             f"and not in the snapshot store.")
    key = the_store_key(ctx)
    shared.until_ready(lambda: agent.restore_volume(pool, volume_id, size_gib, snapshot_id, snap.tenant, key,
                                                    encrypted=encrypted, luks=luks, source_luks=source_luks),
                       report, unreachable_s=shared.patience(ctx))
