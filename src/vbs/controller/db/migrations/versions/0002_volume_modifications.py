"""volume modifications

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import integer, string, text, timestamp

revision = "0002"
down_revision = "0001"


def upgrade() -> None:

    op.create_table(
        "volume_modifications",
        string("id", 32),
        string("volume_id", 32),
        string("state", 16),
        text("status_message", null=True),
        integer("original_size_gib"),
        integer("target_size_gib"),
        string("original_volume_type", 16),
        string("target_volume_type", 16),
        integer("original_iops", null=True),
        integer("target_iops", null=True),
        integer("original_throughput", null=True),
        integer("target_throughput", null=True),
        integer("progress"),
        timestamp("start_time"),
        timestamp("end_time", null=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("volume_modifications", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_volume_modifications_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_volume_modifications_volume_id"), ["volume_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("volume_modifications", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_volume_modifications_volume_id"))
        batch_op.drop_index(batch_op.f("ix_volume_modifications_state"))

    op.drop_table("volume_modifications")
