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

revision = "0014_snapshot_lifecycle"
down_revision = "0013_snapshot_store"


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
    op.create_table(
        "snapshot_locks",
        sa.Column("snapshot_id", sa.String(length=32), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("duration_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("duration_days", sa.Integer(), nullable=True),
        sa.Column("cool_off_hours", sa.Integer(), nullable=True),
        sa.Column("cool_off_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("snapshot_id"),
    )
    op.create_table(
        "snapshot_tiers",
        sa.Column("snapshot_id", sa.String(length=32), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("last_status", sa.String(length=40), nullable=False),
        sa.Column("last_started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_progress", sa.Integer(), nullable=False),
        sa.Column("last_detail", sa.Text(), nullable=True),
        sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("restore_expires_at", sa.DateTime(timezone=True), nullable=True),
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
