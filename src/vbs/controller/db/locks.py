"""Locks that make a check and the write it guards one step on PostgreSQL, as they are on SQLite.

On SQLite a writing transaction holds the whole database from its first statement (``BEGIN
IMMEDIATE``): a check and the write after it cannot be separated, and these functions do nothing.
On PostgreSQL at READ COMMITTED each statement sees what was committed when *it* started. A check
of other rows (``NOT EXISTS`` a live attachment, the sum of a pool's volumes) is only as good as the
moment it runs, so it must run after a lock that every writer who could change its answer also
takes: a statement that starts after the lock was granted sees everything the previous holder
committed.

What is locked, and in this order (one order everywhere: no deadlock): a volume's or snapshot's
row; placement (an advisory lock), then the storage node rows; the tenant (quotas: an advisory lock,
there is no tenant row); a shared pool's storage (an advisory lock); then rows the transaction only
adds or updates (volume usage, attachments, operations, tags).

Creates of volumes take placement and their tenant *shared*: they do not wait for each other there,
only for whatever takes them exclusively (a drain, a volume's growth, a local volume's quota check,
a snapshot's). Two creates meet at the usage rows their volume's insert updates (its tenant's and
its pool's), from that insert to their commit; each checks its quota and its pool's room after the
insert, when those rows hold everything committed before plus its own volume
(``volumes._insert_volume``). The advisory locks queue fairly: an exclusive request waits for the
shared holders and holds back the shared requests that come after it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

__all__ = ["on_postgresql", "lock_for_create", "lock_placement", "lock_rows", "lock_storage", "lock_tenant"]


def on_postgresql(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def lock_rows(session: Session, table: Any, *ids: str) -> None:
    """``SELECT … FOR UPDATE`` the rows of ``table`` with these ids (in id order), until the transaction ends."""
    if ids and on_postgresql(session):
        session.execute(select(table.id).where(table.id.in_(ids)).order_by(table.id).with_for_update())


def _advisory_key(kind: str, name: str) -> int:
    """A stable signed 64-bit key for ``pg_advisory_xact_lock`` (Python's hash() changes per process)."""
    return int.from_bytes(hashlib.blake2b(f"vbs:{kind}:{name}".encode(), digest_size=8).digest(), "big", signed=True)


_PLACEMENT = _advisory_key("placement", "storage")


def _advisory(session: Session, key: int, *, shared: bool) -> None:
    if on_postgresql(session):
        call = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        session.execute(text(f"SELECT {call}(:key)"), {"key": key})


def lock_tenant(session: Session, tenant: str, *, shared: bool = False) -> None:
    """Serialise the quota checks of one tenant until the transaction ends (``shared``: a create's,
    which checks after its insert; see above)."""
    _advisory(session, _advisory_key("tenant", tenant), shared=shared)


def lock_placement(session: Session, *, shared: bool = False) -> None:
    """Hold placement until the transaction ends. Exclusively: no create places a volume meanwhile,
    and every create in flight has committed (or rolled back) when this returns."""
    _advisory(session, _PLACEMENT, shared=shared)


def lock_for_create(session: Session, tenant: str) -> None:
    """Placement and the tenant, both shared, in one statement: what a create of a volume holds (see
    above) until the transaction ends."""
    if on_postgresql(session):
        session.execute(text("SELECT pg_advisory_xact_lock_shared(:placement), pg_advisory_xact_lock_shared(:tenant)"),
                        {"placement": _PLACEMENT, "tenant": _advisory_key("tenant", tenant)})


def lock_storage(session: Session, storage: str) -> None:
    """Serialise the creates on one shared pool's storage (several agents serve it, and each records its
    volumes on its own usage row) until the transaction ends."""
    _advisory(session, _advisory_key("storage", storage), shared=False)
