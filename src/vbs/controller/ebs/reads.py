"""ListSnapshotBlocks, ListChangedBlocks, GetSnapshotBlock: a stored snapshot read block by block.

The blocks of a snapshot are its manifest's, which a storage agent that reaches its store reads (and keeps
a few of: manifests never change). Two snapshots' changed blocks are those whose chunk differs: chunk
ids are content ids, so a block written again with the same bytes is not listed (exact at 512 KiB).

An encrypted snapshot written through StartSnapshot holds its blocks as they were put (plaintext under the
store's per-tenant encryption) and is read as any other; an encrypted volume's snapshot is its LUKS
container, which the controller decrypts as it reads it (``luks_reads``, docs/ebs-direct.md "Encrypted
snapshots").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from vbs.controller.auth.store_key import store_key
from vbs.controller.db import Snapshot
from vbs.controller.db.states import SnapshotState
from vbs.controller.ebs import luks_reads
from vbs.controller.ebs.errors import Validation
from vbs.controller.ebs.tokens import BlockTokens, page_start, page_token, sha256_b64
from vbs.controller.ebs.writes import lineage_of, owned
from vbs.controller.requests.snapshot_tiers import refuse_if_archived
from vbs.controller.runtime import Controller
from vbs.controller.workflows import stored
from vbs.snapshot_store.format import BLOCK_SIZE
from vbs.wire.direct_blocks import SnapshotBlockList

__all__ = ["Page", "list_blocks", "list_changed_blocks", "get_block", "MAX_RESULTS_DEFAULT"]

MAX_RESULTS_DEFAULT = 10000


@dataclass(frozen=True)
class Page:
    """One page of a listing: (block index, first token, second token) rows (ListSnapshotBlocks: the
    second only), when their tokens expire, and the snapshot's size."""

    rows: list[tuple[int, str | None, str | None]]
    expires: datetime
    volume_size_gib: int
    next_token: str | None


def _readable(s: Session, snapshot_id: str, tenant: str) -> Snapshot:
    snap = owned(s, snapshot_id, tenant)
    if snap.status != SnapshotState.COMPLETED:
        raise Validation(f"The snapshot '{snap.id}' is {snap.status}: only a completed snapshot is read.",
                         "INVALID_SNAPSHOT_ID")
    refuse_if_archived(s, snap.id)
    if snap.store_state != stored.STORED or snap.store is None:
        raise Validation(f"The snapshot '{snap.id}' is not in the snapshot store: its blocks cannot be read "
                         "(this install keeps snapshots in their pools only, or its upload has not finished).",
                         "INVALID_SNAPSHOT_ID")
    return snap


def _blocks(svc: Controller, snap: Snapshot) -> dict[int, str]:
    """The snapshot's blocks that hold data, each with what it is made of (equal: equal content)."""
    listing: SnapshotBlockList = stored.store_agent(svc, snap).snapshot_blocks(snap.id)
    if luks_reads.is_container(snap):
        return luks_reads.payload_blocks(svc, snap, dict(listing.blocks), store_key(svc.db, svc.master_key))
    return dict(listing.blocks)


def _window(indexes: list[int], snapshot_id: str, start: int, page: str | None, max_results: int | None
            ) -> tuple[list[int], str | None]:
    if max_results is not None and not 100 <= max_results <= 10000:
        raise Validation(f"MaxResults must be 100-10000, not {max_results}.")
    if start < 0:
        raise Validation(f"StartingBlockIndex must be 0 or more, not {start}.")
    if page is not None:
        start = max(start, page_start(page, snapshot_id))
    limit = max_results or MAX_RESULTS_DEFAULT
    chosen = [i for i in indexes if i >= start][:limit + 1]
    more = len(chosen) > limit
    chosen = chosen[:limit]
    return chosen, page_token(snapshot_id, chosen[-1] + 1) if more else None


def _tokens(svc: Controller) -> tuple[BlockTokens, int, datetime]:
    expires = int(time.time()) + svc.cfg.ebs_block_token_ttl_s
    return (BlockTokens(store_key(svc.db, svc.master_key).get_secret_value()), expires,
            datetime.fromtimestamp(expires, UTC))


def list_blocks(svc: Controller, tenant: str, snapshot_id: str, *, start: int = 0, page: str | None = None,
                max_results: int | None = None) -> Page:
    with svc.db.read() as s:
        snap = _readable(s, snapshot_id, tenant)
    blocks = _blocks(svc, snap)
    chosen, next_token = _window(sorted(blocks), snap.id, start, page, max_results)
    tokens, expires, when = _tokens(svc)
    return Page([(i, None, tokens.make(snap.id, i, expires)) for i in chosen], when, snap.volume_size_gib, next_token)


def list_changed_blocks(svc: Controller, tenant: str, second_id: str, first_id: str | None, *, start: int = 0,
                        page: str | None = None, max_results: int | None = None) -> Page:
    with svc.db.read() as s:
        second = _readable(s, second_id, tenant)
        first = _readable(s, first_id, tenant) if first_id is not None else None
        if first is not None and lineage_of(s, first) != lineage_of(s, second):
            raise Validation(f"The snapshots '{first.id}' and '{second.id}' are not of one volume or lineage.",
                             "UNRELATED_SNAPSHOTS")
        if first is not None and (luks_reads.is_container(first), first.key_id) != (
                luks_reads.is_container(second), second.key_id):
            # An encrypted copy of a plain snapshot keeps its volume: blocks stored under two encodings.
            raise Validation(f"The snapshots '{first.id}' and '{second.id}' are not encrypted alike: their blocks "
                             "are not compared.", "UNRELATED_SNAPSHOTS")
    after = _blocks(svc, second)
    before = _blocks(svc, first) if first is not None else {}
    changed = sorted(i for i in set(before) | set(after) if before.get(i) != after.get(i))
    chosen, next_token = _window(changed, second.id, start, page, max_results)
    tokens, expires, when = _tokens(svc)
    rows = [(i, tokens.make(first.id, i, expires) if first is not None and i in before else None,
             tokens.make(second.id, i, expires) if i in after else None) for i in chosen]
    return Page(rows, when, second.volume_size_gib, next_token)


def get_block(svc: Controller, tenant: str, snapshot_id: str, block_index: int, token: str) -> tuple[bytes, str]:
    """The block's bytes and their checksum (base64 SHA-256), if ``token`` is good for it."""
    key = store_key(svc.db, svc.master_key)  # opened once: it checks the token and reads the chunk
    BlockTokens(key.get_secret_value()).check(token, snapshot_id, block_index, time.time())
    with svc.db.read() as s:
        snap = _readable(s, snapshot_id, tenant)
    if not 0 <= block_index < -(-snap.volume_size_gib * (1 << 30) // BLOCK_SIZE):
        raise Validation(f"Block {block_index} is past the end of the snapshot.", "INVALID_BLOCK")
    if luks_reads.is_container(snap):
        data = luks_reads.read_block(svc, snap, block_index, key)
    else:
        data = stored.store_agent(svc, snap).read_block(snap.id, block_index, tenant, key)
    return data, sha256_b64(data)
