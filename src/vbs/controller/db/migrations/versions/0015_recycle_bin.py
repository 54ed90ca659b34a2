"""the Recycle Bin (issue 34, docs/recycle-bin.md): retention rules and what a delete put in the bin

- recycle_bin_rules: a tenant's retention rules: the resource type (EBS_SNAPSHOT, EBS_VOLUME), the
  retention in days, the resource tags it keeps (none: region-level) and a region-level rule's
  exclusions, its own tags, its lock (unlocked, locked, pending_unlock until lock_end_at) and unlock delay.
- recycle_bin_entries: a volume or snapshot in the bin (its row's status is "recoverable"): when it
  entered, when its retention ends, and the state a restore gives it back.

Revision ID: 0015_recycle_bin
Revises: 0014_snapshot_lifecycle
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_recycle_bin"
down_revision = "0014_snapshot_lifecycle"


def upgrade() -> None:
    op.create_table(
        "recycle_bin_rules",
        sa.Column("id", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("resource_type", sa.String(length=16), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("retention_days", sa.Integer(), nullable=False),
        sa.Column("resource_tags", sa.JSON(), nullable=False),
        sa.Column("exclude_tags", sa.JSON(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("lock_state", sa.String(length=16), nullable=False),
        sa.Column("unlock_delay_days", sa.Integer(), nullable=True),
        sa.Column("lock_end_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_recycle_bin_rules_tenant_type", "recycle_bin_rules", ["tenant", "resource_type"])
    op.create_table(
        "recycle_bin_entries",
        sa.Column("resource_id", sa.String(length=32), nullable=False),
        sa.Column("resource_type", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("former_status", sa.String(length=16), nullable=False),
        sa.Column("entered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("exits_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("resource_id"),
    )
    op.create_index("ix_recycle_bin_entries_tenant_type", "recycle_bin_entries",
                    ["tenant", "resource_type", "resource_id"])
    op.create_index("ix_recycle_bin_entries_exits_at", "recycle_bin_entries", ["exits_at"])


def downgrade() -> None:
    op.drop_index("ix_recycle_bin_entries_exits_at", table_name="recycle_bin_entries")
    op.drop_index("ix_recycle_bin_entries_tenant_type", table_name="recycle_bin_entries")
    op.drop_table("recycle_bin_entries")
    op.drop_index("ix_recycle_bin_rules_tenant_type", table_name="recycle_bin_rules")
    op.drop_table("recycle_bin_rules")
