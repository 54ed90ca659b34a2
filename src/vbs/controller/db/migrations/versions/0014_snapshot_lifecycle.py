"""snapshot lifecycle as AWS users run it (issue 34): snapshots written block by block, locks, tiers

- direct_snapshots: one row per StartSnapshot of the EBS direct APIs (its client token, the digest of
  its request, its parent, its lineage, its size in bytes, when a pending one times out, its state:
  open, completing, done or failed); kept once completed, for lineage.
- direct_blocks: the blocks PutSnapshotBlock wrote into a pending snapshot (the chunk, the checksum);
  deleted when it completes or fails.
- snapshot_locks: LockSnapshot's lock of a snapshot against deletion: its mode (governance or
  compliance), when it was made and when its duration started, until when it holds, the duration in
  days it was asked for (or none: an expiration date), and a compliance lock's cooling-off period.
- snapshot_tiers: a snapshot's storage tier once it was moved (archive, or standard again) and its last
  tiering operation (EC2's status names, when it started, its progress and detail), when it was
  archived, and when a temporary restore ends.

Revision ID: 0014_snapshot_lifecycle
Revises: 0013_snapshot_store
"""

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import big_integer, integer, string, text, timestamp

revision = "0014_snapshot_lifecycle"
down_revision = "0013_snapshot_store"


def upgrade() -> None:
    op.create_table(
        "direct_snapshots",
        string("snapshot_id", 32),
        string("tenant", 64),
        string("client_token", 64, null=True),
        string("request_digest", 64),
        string("parent_snapshot_id", 32, null=True),
        string("lineage", 32),
        big_integer("volume_size_bytes"),
        timestamp("expires_at"),
        string("state", 16),
        timestamp("state_changed_at"),
        sa.PrimaryKeyConstraint("snapshot_id"),
    )
    op.create_index("uq_direct_snapshots_token", "direct_snapshots", ["tenant", "client_token"], unique=True)
    op.create_index("ix_direct_snapshots_parent_snapshot_id", "direct_snapshots", ["parent_snapshot_id"])
    op.create_index("ix_direct_snapshots_lineage", "direct_snapshots", ["lineage"])
    op.create_table(
        "direct_blocks",
        string("snapshot_id", 32),
        sa.Column("block_index", sa.BigInteger(), autoincrement=False, nullable=False),
        string("chunk_id", 64, null=True),
        string("checksum", 64),
        sa.ForeignKeyConstraint(["snapshot_id"], ["direct_snapshots.snapshot_id"]),
        sa.PrimaryKeyConstraint("snapshot_id", "block_index"),
    )
    op.create_table(
        "snapshot_locks",
        string("snapshot_id", 32),
        string("mode", 16),
        timestamp("created_at"),
        timestamp("duration_start"),
        timestamp("expires_at"),
        integer("duration_days", null=True),
        integer("cool_off_hours", null=True),
        timestamp("cool_off_expires_at", null=True),
        sa.PrimaryKeyConstraint("snapshot_id"),
    )
    op.create_table(
        "snapshot_tiers",
        string("snapshot_id", 32),
        string("tier", 16),
        string("last_status", 40),
        timestamp("last_started_at"),
        integer("last_progress"),
        text("last_detail", null=True),
        timestamp("archived_at", null=True),
        timestamp("restore_expires_at", null=True),
        sa.PrimaryKeyConstraint("snapshot_id"),
    )


def downgrade() -> None:
    op.drop_table("snapshot_tiers")
    op.drop_table("snapshot_locks")
    op.drop_table("direct_blocks")
    op.drop_index("ix_direct_snapshots_lineage", table_name="direct_snapshots")
    op.drop_index("ix_direct_snapshots_parent_snapshot_id", table_name="direct_snapshots")
    op.drop_index("uq_direct_snapshots_token", table_name="direct_snapshots")
    op.drop_table("direct_snapshots")
