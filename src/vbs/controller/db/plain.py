"""Statements the hot paths run as plain rows: built once, with bound parameters, on the session's
connection.

A Core statement run on the session's connection skips the ORM's loading of objects and its bulk
path for UPDATEs (most of what a create's bookkeeping cost), and its autoflush too: ``execute``
flushes what the session holds first, so that the transaction's own writes are seen, and are
written (and their rows locked) before the statement's, as the ORM would have done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import ColumnElement, CursorResult, Executable, Table, Update, bindparam, update
from sqlalchemy.orm import Session

__all__ = ["execute", "driver_rows", "update_of", "bound"]


def execute(session: Session, statement: Executable,
            params: Mapping[str, Any] | list[dict[str, Any]] | None = None) -> CursorResult[*tuple[Any, ...]]:
    """``statement`` on ``session``'s connection, after what the session holds."""
    session.flush()
    return session.connection().execute(statement, params)


def driver_rows(session: Session, statement: Executable,
                params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """The rows of ``statement`` (run as ``execute`` runs it) as the database driver returns them: plain
    tuples, without SQLAlchemy's row objects and result processing, which cost several times the read
    when a statement returns 100,000 rows. Only for columns whose driver values are what the caller
    wants as they are: strings, integers, conditions computed in SQL (0/1 on SQLite, booleans on
    PostgreSQL); never a date, JSON or enum column."""
    result = execute(session, statement, params)
    try:
        return list(result.cursor.fetchall())  # tuples, from SQLite's driver and psycopg's
    finally:
        result.close()


def update_of(table: Table, columns: frozenset[str], *where: ColumnElement[bool]) -> Update:
    """UPDATE ``table`` SET each of ``columns`` to the parameter ``v_<column>`` WHERE ``where`` (whose
    own parameters ``bound`` names ``w_<name>``)."""
    return update(table).where(*where).values({name: bindparam(f"v_{name}") for name in sorted(columns)})


def bound(values: Mapping[str, Any], **where: Any) -> dict[str, Any]:
    """The parameters of an ``update_of`` statement: ``v_<column>`` for each of ``values``, ``w_<name>``
    for each of ``where``."""
    return {**{f"w_{k}": v for k, v in where.items()}, **{f"v_{k}": v for k, v in values.items()}}
