"""Data Lifecycle Manager (issue 34): snapshot policies and their runs

- lifecycle_policies: a tenant's policy: its description, state (ENABLED, DISABLED), execution role as
  given, its validated PolicyDetails document (JSON), its tags (JSON), when it was made and changed, and
  from when its schedules' due times count (made, enabled again, or given a new document).
- policy_runs: one due time of one schedule of a policy, unique by (policy, schedule, due time): the
  insert is the claim, so one controller takes it. Its status (running, succeeded, failed, skipped), the
  controller that took it, when it started and finished, the snapshots made per target (JSON), the
  snapshots its retention deleted or archived (JSON), and its error or why it was skipped.

Revision ID: 0016_lifecycle_policies
Revises: 0015_recycle_bin
"""

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import json_value, string, text, timestamp

revision = "0016_lifecycle_policies"
down_revision = "0015_recycle_bin"


def upgrade() -> None:
    op.create_table(
        "lifecycle_policies",
        string("id", 32),
        string("tenant", 64),
        string("description", 500),
        string("state", 16),
        string("execution_role_arn", 2048),
        json_value("details"),
        json_value("tags"),
        timestamp("created_at"),
        timestamp("modified_at"),
        timestamp("schedules_from"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_lifecycle_policies_tenant", "lifecycle_policies", ["tenant"])
    op.create_table(
        "policy_runs",
        string("id", 32),
        string("policy_id", 32),
        string("schedule_name", 120),
        timestamp("due_at"),
        string("status", 16),
        string("controller", 64, null=True),
        timestamp("started_at", null=True),
        timestamp("finished_at", null=True),
        json_value("targets"),
        json_value("deleted"),
        text("error", null=True),
        sa.ForeignKeyConstraint(["policy_id"], ["lifecycle_policies.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("uq_policy_runs_due", "policy_runs", ["policy_id", "schedule_name", "due_at"], unique=True)
    op.create_index("ix_policy_runs_policy_id", "policy_runs", ["policy_id"])
    op.create_index("ix_policy_runs_status", "policy_runs", ["status"])


def downgrade() -> None:
    op.drop_index("ix_policy_runs_status", table_name="policy_runs")
    op.drop_index("ix_policy_runs_policy_id", table_name="policy_runs")
    op.drop_index("uq_policy_runs_due", table_name="policy_runs")
    op.drop_table("policy_runs")
    op.drop_index("ix_lifecycle_policies_tenant", table_name="lifecycle_policies")
    op.drop_table("lifecycle_policies")
