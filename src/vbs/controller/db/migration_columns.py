"""The columns migrations declare, by type: ``string("tenant", 64)``, ``timestamp("created_at", null=True)``.

Each is the ``sa.Column`` alembic's autogenerate would write (``nullable=False`` unless ``null``), so a
migration lists its table's columns one short line each. A column with more to it (a server default, a
primary key of its own) is still written as an ``sa.Column``.

A migration is history: never change what a helper here makes once a released migration calls it; a
changed column is a new helper, called by a new migration.
"""

from typing import Any

import sqlalchemy as sa

__all__ = ["string", "text", "integer", "big_integer", "boolean", "flag", "json_value", "timestamp"]


def string(name: str, length: int, *, null: bool = False) -> sa.Column[Any]:
    """A ``VARCHAR(length)``."""
    return sa.Column(name, sa.String(length=length), nullable=null)


def text(name: str, *, null: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.Text(), nullable=null)


def integer(name: str, *, null: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.Integer(), nullable=null)


def big_integer(name: str, *, null: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.BigInteger(), nullable=null)


def boolean(name: str, *, null: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.Boolean(), nullable=null)


def flag(name: str, *, default: bool) -> sa.Column[Any]:
    """A boolean never null, ``default`` for the rows a migration adds it to (``server_default``)."""
    return sa.Column(name, sa.Boolean(), nullable=False, server_default=sa.true() if default else sa.false())


def json_value(name: str, *, null: bool = False) -> sa.Column[Any]:
    """A JSON document (``JSON`` on PostgreSQL, text on SQLite)."""
    return sa.Column(name, sa.JSON(), nullable=null)


def timestamp(name: str, *, null: bool = False) -> sa.Column[Any]:
    """A point in time with its time zone (``timestamp with time zone``)."""
    return sa.Column(name, sa.DateTime(timezone=True), nullable=null)
