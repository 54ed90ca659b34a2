"""StartSnapshot, PutSnapshotBlock, CompleteSnapshot: a snapshot written block by block.

The snapshot is an ordinary VBS snapshot from its start (``pending``, then ``completed``), kept only in the
snapshot store (``pool_copy`` false): its blocks go through a storage agent that reaches a store (the
parent's, when it has one) into chunks, and the controller records which block went to which chunk
(``direct_blocks``) until CompleteSnapshot has the agent write its manifest. A volume made from it is
restored from the store, as any snapshot whose pool gave up its copy.

A ``direct_snapshots`` row's state keeps a block from slipping in beside a completion: a put inserts its
block in the transaction that finds the row ``open`` (and locks it); CompleteSnapshot turns it
``completing`` before it reads the blocks. A completion that a crash left ``completing`` is ``open`` again
after ``COMPLETING_STALE_S``; a pending snapshot past its Timeout is ``error``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.auth.store_key import store_key
from vbs.controller.db import DirectBlock, DirectSnapshot, Node, Snapshot
from vbs.controller.db.states import SnapshotState
from vbs.controller.db.tables import utcnow
from vbs.controller.ebs.encryption import snapshot_key
from vbs.controller.ebs.errors import ConcurrentLimit, Conflict, Internal, NotFoundError, Validation
from vbs.controller.ebs.tokens import sha256_b64
from vbs.controller.fleet.nodes import is_alive, storage_info
from vbs.controller.placement import quotas
from vbs.controller.requests.snapshot_permissions import owned_snapshot
from vbs.controller.requests.snapshot_tiers import refuse_if_moved_out
from vbs.controller.requests.tags import set_tags
from vbs.controller.runtime import Controller
from vbs.controller.workflows import stored
from vbs.errors import NotFound, SnapshotDataError, VbsError
from vbs.snapshot_store.format import BLOCK_SIZE
from vbs.wire.direct_blocks import DirectManifest

__all__ = ["StartRequest", "start_snapshot", "put_block", "complete_snapshot", "expire_pending", "DIRECT_VOLUME_ID",
           "lineage_of", "owned", "GIB"]

GIB = 1 << 30
# What DescribeSnapshots shows as the volume of a snapshot made through StartSnapshot (AWS: vol-ffffffff).
DIRECT_VOLUME_ID = "vol-" + "f" * 17
DEFAULT_TIMEOUT_MIN = 60
COMPLETING_STALE_S = 600.0
OPEN, COMPLETING, DONE, FAILED = "open", "completing", "done", "failed"


@dataclass(frozen=True)
class StartRequest:
    volume_size_gib: int
    parent_snapshot_id: str | None
    tags: dict[str, str]
    description: str
    client_token: str | None
    timeout_min: int
    # None: left out (a child is encrypted as its parent is, docs/ebs-direct.md "Encrypted snapshots").
    encrypted: bool | None = None
    kms_key_arn: str | None = None

    def digest(self) -> str:
        fields: list[object] = [self.volume_size_gib, self.parent_snapshot_id, sorted(self.tags.items()),
                                self.description, self.timeout_min]
        if self.encrypted is not None or self.kms_key_arn is not None:  # a plain request's digest as before
            fields += [self.encrypted, self.kms_key_arn]
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def lineage_of(s: Session, snap: Snapshot) -> str:
    """The lineage ListChangedBlocks compares within: a direct snapshot's recorded one, else its volume."""
    found = s.scalar(select(DirectSnapshot.lineage).where(DirectSnapshot.snapshot_id == snap.id))
    return found if found is not None else snap.volume_id


def owned(s: Session, snapshot_id: str, tenant: str) -> Snapshot:
    """The tenant's snapshot, or ``ResourceNotFoundException`` (also for another tenant's)."""
    if not ids.is_valid("snapshot", snapshot_id):
        raise NotFoundError(f"The snapshot '{snapshot_id[:64]}' does not exist.")
    try:
        return owned_snapshot(s, snapshot_id, tenant)
    except NotFound as exc:
        raise NotFoundError(exc.message) from None


def _store_node(s: Session, svc: Controller, store: str | None) -> tuple[str, str, str]:
    """A live storage node and pool whose snapshot store is ``store`` (any store when None): undrained
    nodes first. (node, pool, store)."""
    now = utcnow()
    nodes = sorted(s.scalars(select(Node).where(Node.kind == "storage")), key=lambda n: (n.drained, n.name))
    for node in nodes:
        if not is_alive(node, svc.cfg.heartbeat_timeout_s, now):
            continue
        for pool in storage_info(node).pools:
            if pool.snapshot_store is not None and (store is None or pool.snapshot_store == store):
                return node.name, pool.name, pool.snapshot_store
    where = f"the snapshot store {store}" if store else "a snapshot store"
    raise Internal(f"No live storage node reaches {where}: snapshots cannot be written block by block now.")


def start_snapshot(svc: Controller, req: StartRequest, tenant: str) -> Snapshot:
    """A new pending snapshot, or the one this client token made already (same request)."""
    if not 1 <= req.volume_size_gib <= svc.cfg.max_volume_gib:
        raise Validation(f"The volume size must be 1-{svc.cfg.max_volume_gib} GiB, not {req.volume_size_gib}.",
                         "INVALID_VOLUME_SIZE")
    token = hashlib.sha256(req.client_token.encode()).hexdigest() if req.client_token else None
    digest = req.digest()
    with svc.db.session() as s:
        if token is not None:
            seen = s.scalar(select(DirectSnapshot).where(DirectSnapshot.tenant == tenant,
                                                         DirectSnapshot.client_token == token))
            if seen is not None:
                if seen.request_digest != digest:
                    raise Conflict("The client token was used for another, different StartSnapshot request.")
                return owned(s, seen.snapshot_id, tenant)
        parent = _parent(s, req, tenant)
        pending = s.scalar(select(func.count()).select_from(DirectSnapshot).where(
            DirectSnapshot.tenant == tenant, DirectSnapshot.state.in_((OPEN, COMPLETING)))) or 0
        if pending >= svc.cfg.ebs_pending_snapshots_max:
            raise ConcurrentLimit(f"{pending} snapshots are pending (the limit is {svc.cfg.ebs_pending_snapshots_max}):"
                                  " complete one first.")
        quotas.check_snapshots(s, svc.cfg, tenant)
        node, pool, store = _store_node(s, svc, parent.store if parent is not None else None)
        key_id = snapshot_key(s, svc, tenant, encrypted=req.encrypted, kms_key_arn=req.kms_key_arn, parent=parent)
        now = utcnow()
        snap = Snapshot(id=ids.new_id("snapshot"), volume_id=DIRECT_VOLUME_ID, volume_size_gib=req.volume_size_gib,
                        comment=req.description, storage_node=node, pool=pool, status=SnapshotState.PENDING,
                        progress=0, started_at=now, updated_at=now, tenant=tenant, store_state=stored.UPLOADING,
                        store=store, pool_copy=False, key_id=key_id, plain_data=key_id is not None)
        s.add(snap)
        s.add(DirectSnapshot(snapshot_id=snap.id, tenant=tenant, client_token=token, request_digest=digest,
                             parent_snapshot_id=parent.id if parent is not None else None,
                             lineage=lineage_of(s, parent) if parent is not None else snap.id,
                             volume_size_bytes=req.volume_size_gib * GIB,
                             expires_at=now + timedelta(minutes=req.timeout_min), state=OPEN, state_changed_at=now))
        set_tags(s, snap.id, req.tags)
        s.flush()
        return snap


def _parent(s: Session, req: StartRequest, tenant: str) -> Snapshot | None:
    if req.parent_snapshot_id is None:
        return None
    parent = owned(s, req.parent_snapshot_id, tenant)
    if parent.status != SnapshotState.COMPLETED:
        raise Validation(f"The parent snapshot '{parent.id}' is {parent.status}, not completed.")
    if parent.store_state != stored.STORED or parent.store is None:
        raise Validation(f"The parent snapshot '{parent.id}' is not in the snapshot store (yet).")
    refuse_if_moved_out(s, parent.id)
    if parent.volume_size_gib > req.volume_size_gib:
        raise Validation(f"The volume size ({req.volume_size_gib} GiB) is smaller than the parent snapshot's "
                         f"({parent.volume_size_gib} GiB).", "INVALID_VOLUME_SIZE")
    return parent


def _pending(s: Session, snapshot_id: str, tenant: str) -> tuple[Snapshot, DirectSnapshot]:
    snap = owned(s, snapshot_id, tenant)
    direct = s.get(DirectSnapshot, snap.id)
    if direct is None:
        raise Validation(f"The snapshot '{snap.id}' was not started with StartSnapshot: its blocks cannot be written.")
    return snap, direct


def _unless_late(svc: Controller, direct: DirectSnapshot) -> DirectSnapshot:
    """``direct``, failed first if it is open past its Timeout."""
    if direct.state == OPEN and direct.expires_at < utcnow() and _set_state(svc, direct.snapshot_id, OPEN, FAILED):
        _fail(svc, direct.snapshot_id, "The snapshot was not completed within its Timeout.")
        with svc.db.read() as s:
            found = s.get(DirectSnapshot, direct.snapshot_id)
            assert found is not None
            return found
    return direct


def _check_checksum(algorithm: str | None, checksum: str | None) -> bytes:
    if algorithm != "SHA256":
        raise Validation(f"The checksum algorithm must be SHA256, not {str(algorithm)[:32]!r}.")
    try:
        digest = base64.b64decode(checksum or "", validate=True)
    except (binascii.Error, ValueError):
        digest = b""
    if len(digest) != 32:
        raise Validation("The checksum must be the base64 of a SHA-256 digest.")
    return digest


def put_block(svc: Controller, tenant: str, snapshot_id: str, block_index: int, data: bytes, *, data_length: int,
              checksum: str | None, algorithm: str | None, progress: int | None) -> str:
    """Write one block of a pending snapshot; the checksum it was written with."""
    _check_checksum(algorithm, checksum)
    if data_length != BLOCK_SIZE or len(data) != data_length:
        raise Validation(f"A block is {BLOCK_SIZE} bytes: DataLength {data_length}, {len(data)} bytes sent.",
                         "INVALID_BLOCK")
    if sha256_b64(data) != checksum:
        raise Validation("The block's data does not match its checksum.", "INVALID_BLOCK")
    with svc.db.read() as s:
        snap, direct = _pending(s, snapshot_id, tenant)
    direct = _unless_late(svc, direct)
    with svc.db.read() as s:
        if direct.state != OPEN:
            raise Validation(f"The snapshot '{snap.id}' is not pending: no block can be written to it.")
        if not 0 <= block_index < -(-direct.volume_size_bytes // BLOCK_SIZE):
            raise Validation(f"Block {block_index} is past the end of the snapshot's "
                             f"{direct.volume_size_bytes // GIB} GiB.", "INVALID_BLOCK")
    chunk = stored.store_agent(svc, snap).put_block(tenant, store_key(svc.db, svc.master_key), data)
    with svc.db.session() as s:
        # Takes the row's lock: a CompleteSnapshot turning it ``completing`` waits for this block, or this
        # put finds it ``completing`` and keeps nothing.
        hit = s.execute(update(DirectSnapshot).where(DirectSnapshot.snapshot_id == snap.id,
                                                     DirectSnapshot.state == OPEN)
                        .values(state=OPEN)).rowcount  # type: ignore[attr-defined]
        if hit != 1:
            raise Validation(f"The snapshot '{snap.id}' was completed while the block was written: it was not kept.",
                             "CONFLICTING_BLOCK_UPDATE")
        s.merge(DirectBlock(snapshot_id=snap.id, block_index=block_index, chunk_id=chunk, checksum=checksum))
        if progress is not None:
            s.execute(update(Snapshot).where(Snapshot.id == snap.id, Snapshot.status == SnapshotState.PENDING)
                      .values(progress=max(0, min(99, progress)), updated_at=utcnow()))
    assert checksum is not None
    return checksum


def _set_state(svc: Controller, snapshot_id: str, was: str, now_state: str) -> bool:
    with svc.db.session() as s:
        return bool(s.execute(update(DirectSnapshot).where(DirectSnapshot.snapshot_id == snapshot_id,
                                                           DirectSnapshot.state == was)
                              .values(state=now_state, state_changed_at=utcnow())).rowcount)  # type: ignore[attr-defined]


def complete_snapshot(svc: Controller, tenant: str, snapshot_id: str, *, changed_blocks: int, checksum: str | None,
                      algorithm: str | None, aggregation: str | None) -> str:
    """Seal a pending snapshot: its manifest written into the store. Its status: ``completed``, ``pending``
    (another CompleteSnapshot is at it) or ``error``."""
    with svc.db.read() as s:
        snap, direct = _pending(s, snapshot_id, tenant)
    direct = _unless_late(svc, direct)
    if direct.state != OPEN:
        return {DONE: "completed", FAILED: "error"}.get(direct.state, "pending")
    if checksum is not None and aggregation != "LINEAR":
        raise Validation(f"The checksum aggregation method must be LINEAR, not {str(aggregation)[:32]!r}.")
    if not _set_state(svc, snap.id, OPEN, COMPLETING):  # another CompleteSnapshot got there first
        with svc.db.read() as s:
            now_state = _pending(s, snapshot_id, tenant)[1].state
        return {DONE: "completed", FAILED: "error"}.get(now_state, "pending")
    try:
        manifest = _checked_blocks(svc, snap.id, changed_blocks, checksum, algorithm, direct, tenant)
        listing = stored.store_agent(svc, snap).complete_direct(snap.id, manifest)
    except SnapshotDataError as exc:
        _fail(svc, snap.id, f"CompleteSnapshot failed: {exc.message}")
        return "error"
    except Validation:
        _set_state(svc, snap.id, COMPLETING, OPEN)
        raise
    except VbsError as exc:
        _set_state(svc, snap.id, COMPLETING, OPEN)
        raise Internal(f"The snapshot could not be completed now ({exc.message}); try again.") from None
    with svc.db.session() as s:
        s.execute(update(Snapshot).where(Snapshot.id == snap.id, Snapshot.status == SnapshotState.PENDING).values(
            status=SnapshotState.COMPLETED, progress=100, store_state=stored.STORED, store=listing.store,
            stored_bytes=listing.stored_bytes, status_reason=None, updated_at=utcnow()))
        s.execute(update(DirectSnapshot).where(DirectSnapshot.snapshot_id == snap.id)
                  .values(state=DONE, state_changed_at=utcnow()))
        s.execute(delete(DirectBlock).where(DirectBlock.snapshot_id == snap.id))
    return "completed"


def _checked_blocks(svc: Controller, snapshot_id: str, changed_blocks: int, checksum: str | None,
                    algorithm: str | None, direct: DirectSnapshot, tenant: str) -> DirectManifest:
    with svc.db.read() as s:
        rows = s.execute(select(DirectBlock.block_index, DirectBlock.chunk_id, DirectBlock.checksum)
                         .where(DirectBlock.snapshot_id == snapshot_id).order_by(DirectBlock.block_index)).all()
    if changed_blocks != len(rows):
        raise Validation(f"ChangedBlocksCount is {changed_blocks}, but {len(rows)} blocks were written.")
    if checksum is not None:
        _check_checksum(algorithm, checksum)
        aggregate = hashlib.sha256(b"".join(base64.b64decode(r.checksum) for r in rows)).digest()
        if base64.b64encode(aggregate).decode("ascii") != checksum:
            raise Validation("The aggregate checksum does not match the blocks written (LINEAR: SHA-256 of their "
                             "SHA-256 digests in block order).")
    return DirectManifest(tenant=tenant, store_key=store_key(svc.db, svc.master_key),
                          volume_id=DIRECT_VOLUME_ID, volume_size=direct.volume_size_bytes,
                          parent_snapshot_id=direct.parent_snapshot_id,
                          blocks=[(r.block_index, r.chunk_id) for r in rows])


def _fail(svc: Controller, snapshot_id: str, reason: str) -> None:
    with svc.db.session() as s:
        s.execute(update(Snapshot).where(Snapshot.id == snapshot_id, Snapshot.status == SnapshotState.PENDING)
                  .values(status=SnapshotState.ERROR, store_state=stored.FAILED, status_reason=reason[:2000],
                          updated_at=utcnow()))
        s.execute(update(DirectSnapshot).where(DirectSnapshot.snapshot_id == snapshot_id)
                  .values(state=FAILED, state_changed_at=utcnow()))
        s.execute(delete(DirectBlock).where(DirectBlock.snapshot_id == snapshot_id))


def expire_pending(svc: Controller, now: datetime | None = None) -> int:
    """Fail the pending snapshots past their Timeout, and open again the completions a crash left; how many
    snapshots failed. (Their chunks go with the store's garbage collection.)"""
    now = now or utcnow()
    with svc.db.read() as s:
        late = list(s.scalars(select(DirectSnapshot.snapshot_id).where(DirectSnapshot.state == OPEN,
                                                                       DirectSnapshot.expires_at < now)))
        stale = list(s.scalars(select(DirectSnapshot.snapshot_id).where(
            DirectSnapshot.state == COMPLETING,
            DirectSnapshot.state_changed_at < now - timedelta(seconds=COMPLETING_STALE_S))))
    for snapshot_id in stale:
        _set_state(svc, snapshot_id, COMPLETING, OPEN)
    failed = 0
    for snapshot_id in late:
        if _set_state(svc, snapshot_id, OPEN, FAILED):
            _fail(svc, snapshot_id, "The snapshot was not completed within its Timeout.")
            failed += 1
    return failed
