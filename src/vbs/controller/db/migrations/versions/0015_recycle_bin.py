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

from vbs.controller.db.migration_columns import integer, json_value, string, text, timestamp

revision = "0015_recycle_bin"
down_revision = "0014_snapshot_lifecycle"


def upgrade() -> None:
    op.create_table(
        "recycle_bin_rules",
        string("id", 16),
        string("tenant", 64),
        string("resource_type", 16),
        text("description"),
        integer("retention_days"),
        json_value("resource_tags"),
        json_value("exclude_tags"),
        json_value("tags"),
        string("lock_state", 16),
        integer("unlock_delay_days", null=True),
        timestamp("lock_end_at", null=True),
        timestamp("created_at"),
        timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_recycle_bin_rules_tenant_type", "recycle_bin_rules", ["tenant", "resource_type"])
    op.create_table(
        "recycle_bin_entries",
        string("resource_id", 32),
        string("resource_type", 16),
        string("tenant", 64),
        string("former_status", 16),
        timestamp("entered_at"),
        timestamp("exits_at"),
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
