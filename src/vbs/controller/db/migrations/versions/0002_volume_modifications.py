"""volume modifications

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:

    op.create_table(
        "volume_modifications",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("volume_id", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("status_message", sa.Text(), nullable=True),
        sa.Column("original_size_gib", sa.Integer(), nullable=False),
        sa.Column("target_size_gib", sa.Integer(), nullable=False),
        sa.Column("original_volume_type", sa.String(length=16), nullable=False),
        sa.Column("target_volume_type", sa.String(length=16), nullable=False),
        sa.Column("original_iops", sa.Integer(), nullable=True),
        sa.Column("target_iops", sa.Integer(), nullable=True),
        sa.Column("original_throughput", sa.Integer(), nullable=True),
        sa.Column("target_throughput", sa.Integer(), nullable=True),
        sa.Column("progress", sa.Integer(), nullable=False),
        sa.Column("start_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("end_time", sa.DateTime(timezone=True), nullable=True),
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
