"""snapshot locks (issue 34)

- snapshot_locks: LockSnapshot's lock of a snapshot against deletion: its mode (governance or
  compliance), when it was made and when its duration started, until when it holds, the duration in
  days it was asked for (or none: an expiration date), and a compliance lock's cooling-off period.

Revision ID: 0015_snapshot_locks
Revises: 0014_direct_snapshots
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_snapshot_locks"
down_revision = "0014_direct_snapshots"
branch_labels = None
depends_on = None


def upgrade() -> None:
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


def downgrade() -> None:
    op.drop_table("snapshot_locks")
