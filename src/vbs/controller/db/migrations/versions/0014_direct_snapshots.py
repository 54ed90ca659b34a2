"""snapshots written block by block through the EBS direct APIs (issue 34)

- direct_snapshots: one row per StartSnapshot (its client token, the digest of its request, its parent,
  its lineage, its size in bytes, when a pending one times out, its state: open, completing, done or
  failed); kept once completed, for lineage.
- direct_blocks: the blocks PutSnapshotBlock wrote into a pending snapshot (the chunk, the checksum);
  deleted when it completes or fails.

Revision ID: 0014_direct_snapshots
Revises: 0013_snapshot_store
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_direct_snapshots"
down_revision = "0013_snapshot_store"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "direct_snapshots",
        sa.Column("snapshot_id", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("client_token", sa.String(length=64), nullable=True),
        sa.Column("request_digest", sa.String(length=64), nullable=False),
        sa.Column("parent_snapshot_id", sa.String(length=32), nullable=True),
        sa.Column("lineage", sa.String(length=32), nullable=False),
        sa.Column("volume_size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("snapshot_id"),
    )
    op.create_index("uq_direct_snapshots_token", "direct_snapshots", ["tenant", "client_token"], unique=True)
    op.create_index("ix_direct_snapshots_parent_snapshot_id", "direct_snapshots", ["parent_snapshot_id"])
    op.create_index("ix_direct_snapshots_lineage", "direct_snapshots", ["lineage"])
    op.create_table(
        "direct_blocks",
        sa.Column("snapshot_id", sa.String(length=32), nullable=False),
        sa.Column("block_index", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("chunk_id", sa.String(length=64), nullable=True),
        sa.Column("checksum", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["snapshot_id"], ["direct_snapshots.snapshot_id"]),
        sa.PrimaryKeyConstraint("snapshot_id", "block_index"),
    )


def downgrade() -> None:
    op.drop_table("direct_blocks")
    op.drop_index("ix_direct_snapshots_lineage", table_name="direct_snapshots")
    op.drop_index("ix_direct_snapshots_parent_snapshot_id", table_name="direct_snapshots")
    op.drop_index("uq_direct_snapshots_token", table_name="direct_snapshots")
    op.drop_table("direct_snapshots")
