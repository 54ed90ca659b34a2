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

revision = "0016_lifecycle_policies"
down_revision = "0015_recycle_bin"


def upgrade() -> None:
    op.create_table(
        "lifecycle_policies",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("description", sa.String(length=500), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("execution_role_arn", sa.String(length=2048), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("modified_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("schedules_from", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_lifecycle_policies_tenant", "lifecycle_policies", ["tenant"])
    op.create_table(
        "policy_runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("policy_id", sa.String(length=32), nullable=False),
        sa.Column("schedule_name", sa.String(length=120), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("controller", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("deleted", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
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
