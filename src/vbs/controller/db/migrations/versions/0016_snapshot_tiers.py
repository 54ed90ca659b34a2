"""snapshot storage tiers (issue 34)

- snapshot_tiers: a snapshot's storage tier once it was moved (archive, or standard again) and its last
  tiering operation (EC2's status names, when it started, its progress and detail), when it was
  archived, and when a temporary restore ends.

Revision ID: 0016_snapshot_tiers
Revises: 0015_snapshot_locks
"""

import sqlalchemy as sa
from alembic import op

revision = "0016_snapshot_tiers"
down_revision = "0015_snapshot_locks"
branch_labels = None
depends_on = None


def upgrade() -> None:
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
