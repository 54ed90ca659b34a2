"""Alembic operations that more than one migration runs, as those migrations ran them.

A migration is history: never change what a helper here does once a released migration calls it; a
changed operation is a new helper, called by a new migration.
"""

from typing import Any

import sqlalchemy as sa
from alembic import op


def add_columns(table: str, *columns: sa.Column[Any]) -> None:
    """``columns`` added to ``table``, in order, in one batch (on SQLite, alembic's batch mode)."""
    with op.batch_alter_table(table, schema=None) as batch_op:
        for column in columns:
            batch_op.add_column(column)


def drop_columns(table: str, *names: str) -> None:
    """The columns ``names`` dropped from ``table``, in order, in one batch (on SQLite, alembic's batch mode)."""
    with op.batch_alter_table(table, schema=None) as batch_op:
        for name in names:
            batch_op.drop_column(name)
