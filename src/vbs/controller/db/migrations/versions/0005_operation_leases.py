"""operation leases and fences: several controllers on one database (docs/architecture.md §6)

- operations.owner, operations.lease_until, operations.fence: who runs an unfinished operation,
  until when (by the DB's clock), and its fencing token; rows left by a single controller have no
  owner and are adopted by the first controller that starts;
- controllers: each running controller, with its URL and its last renewal (vbs describe-controllers);
- leases: singleton loops (reconciler, housekeeping) run on one controller at a time;
- fence_counter (SQLite) / the vbs_fence sequence (PostgreSQL): where fences come from.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import big_integer, string, timestamp

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(string("owner", 64, null=True))
        batch_op.add_column(timestamp("lease_until", null=True))
        batch_op.add_column(sa.Column("fence", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.create_index("ix_operations_owner", ["owner"])
    op.create_table(
        "controllers",
        sa.Column("id", sa.String(64), primary_key=True),
        string("url", 255),
        timestamp("started_at"),
        timestamp("last_seen"),
    )
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        string("owner", 64),
        timestamp("lease_until"),
        big_integer("fence"),
    )
    # The counter table exists on both (one schema); PostgreSQL draws from a sequence, which hands out
    # numbers without a row lock held to the end of the transaction.
    op.create_table("fence_counter", sa.Column("id", sa.Integer(), primary_key=True),
                    big_integer("value"))
    op.execute("INSERT INTO fence_counter (id, value) VALUES (1, 0)")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE SEQUENCE vbs_fence")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP SEQUENCE vbs_fence")
    op.drop_table("fence_counter")
    op.drop_table("leases")
    op.drop_table("controllers")
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_index("ix_operations_owner")
        batch_op.drop_column("fence")
        batch_op.drop_column("lease_until")
        batch_op.drop_column("owner")
