"""Locks that make a check and the write it guards one step on PostgreSQL, as they are on SQLite.

On SQLite a writing transaction holds the whole database from its first statement (``BEGIN
IMMEDIATE``): a check and the write after it cannot be separated, and these functions do nothing.
On PostgreSQL at READ COMMITTED each statement sees what was committed when *it* started. A check
of other rows (``NOT EXISTS`` a live attachment, the sum of a pool's volumes) is only as good as the
moment it runs, so it must run after a lock that every writer who could change its answer also
takes: a statement that starts after the lock was granted sees everything the previous holder
committed.

What is locked, and in this order (one order everywhere: no deadlock): a volume's or snapshot's
row; the storage node rows (placement); the tenant (quotas: an advisory lock, there is no tenant
row); then rows the transaction only adds or updates (attachments, operations, tags).
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

__all__ = ["on_postgresql", "lock_rows", "lock_tenant"]


def on_postgresql(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def lock_rows(session: Session, table: Any, *ids: str) -> None:
    """``SELECT … FOR UPDATE`` the rows of ``table`` with these ids (in id order), until the transaction ends."""
    if ids and on_postgresql(session):
        session.execute(select(table.id).where(table.id.in_(ids)).order_by(table.id).with_for_update())


def _advisory_key(kind: str, name: str) -> int:
    """A stable signed 64-bit key for ``pg_advisory_xact_lock`` (Python's hash() changes per process)."""
    return int.from_bytes(hashlib.blake2b(f"vbs:{kind}:{name}".encode(), digest_size=8).digest(), "big", signed=True)


def lock_tenant(session: Session, tenant: str) -> None:
    """Serialise the quota checks of one tenant until the transaction ends."""
    if on_postgresql(session):
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _advisory_key("tenant", tenant)})
