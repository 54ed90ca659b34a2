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

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("owner", sa.String(64), nullable=True))
        batch_op.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("fence", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.create_index("ix_operations_owner", ["owner"])
    op.create_table(
        "controllers",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("url", sa.String(255), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fence", sa.BigInteger(), nullable=False),
    )
    # The counter table exists on both (one schema); PostgreSQL draws from a sequence, which hands out
    # numbers without a row lock held to the end of the transaction.
    op.create_table("fence_counter", sa.Column("id", sa.Integer(), primary_key=True),
                    sa.Column("value", sa.BigInteger(), nullable=False))
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
