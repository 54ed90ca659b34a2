"""initial schema

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:

    op.create_table(
        "instances",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("host", sa.String(length=64), nullable=False),
        sa.Column("vm_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.create_index("ix_instances_host_vm", ["host", "vm_id"], unique=True)

    op.create_table(
        "nodes",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("url", sa.String(length=255), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("info", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", "kind"),
    )
    op.create_table(
        "operations",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("resource_id", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_operations_resource_id"), ["resource_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_operations_status"), ["status"], unique=False)

    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("volume_id", sa.String(length=32), nullable=False),
        sa.Column("volume_size_gib", sa.Integer(), nullable=False),
        sa.Column("comment", sa.String(length=255), nullable=False),
        sa.Column("storage_node", sa.String(length=64), nullable=False),
        sa.Column("pool", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("progress", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_snapshots_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_snapshots_storage_node"), ["storage_node"], unique=False)
        batch_op.create_index(batch_op.f("ix_snapshots_volume_id"), ["volume_id"], unique=False)

    op.create_table(
        "tags",
        sa.Column("resource_id", sa.String(length=32), nullable=False),
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("value", sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint("resource_id", "key"),
    )
    op.create_table(
        "volumes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("size_gib", sa.Integer(), nullable=False),
        sa.Column("comment", sa.String(length=255), nullable=False),
        sa.Column("snapshot_id", sa.String(length=32), nullable=True),
        sa.Column("volume_type", sa.String(length=16), nullable=False),
        sa.Column("iops", sa.Integer(), nullable=True),
        sa.Column("throughput", sa.Integer(), nullable=True),
        sa.Column("multi_attach", sa.Boolean(), nullable=False),
        sa.Column("placement", sa.String(length=16), nullable=False),
        sa.Column("storage_node", sa.String(length=64), nullable=False),
        sa.Column("pool", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("progress", sa.Integer(), nullable=False),
        sa.Column("client_token", sa.String(length=64), nullable=True),
        sa.Column("request_digest", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("client_token"),
    )
    with op.batch_alter_table("volumes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_volumes_snapshot_id"), ["snapshot_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_volumes_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_volumes_storage_node"), ["storage_node"], unique=False)

    op.create_table(
        "attachments",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("volume_id", sa.String(length=32), nullable=False),
        sa.Column("instance_id", sa.String(length=32), nullable=True),
        sa.Column("host", sa.String(length=64), nullable=False),
        sa.Column("vm_id", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=32), nullable=False),
        sa.Column("mode", sa.String(length=2), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("connection", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["volume_id"],
            ["volumes.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("attachments", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attachments_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_attachments_volume_id"), ["volume_id"], unique=False)

    op.create_table(
        "operation_steps",
        sa.Column("operation_id", sa.String(length=32), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["operations.id"],
        ),
        sa.PrimaryKeyConstraint("operation_id", "position"),
    )


def downgrade() -> None:

    op.drop_table("operation_steps")
    with op.batch_alter_table("attachments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_attachments_volume_id"))
        batch_op.drop_index(batch_op.f("ix_attachments_status"))

    op.drop_table("attachments")
    with op.batch_alter_table("volumes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_volumes_storage_node"))
        batch_op.drop_index(batch_op.f("ix_volumes_status"))
        batch_op.drop_index(batch_op.f("ix_volumes_snapshot_id"))

    op.drop_table("volumes")
    op.drop_table("tags")
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_snapshots_volume_id"))
        batch_op.drop_index(batch_op.f("ix_snapshots_storage_node"))
        batch_op.drop_index(batch_op.f("ix_snapshots_status"))

    op.drop_table("snapshots")
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_operations_status"))
        batch_op.drop_index(batch_op.f("ix_operations_resource_id"))

    op.drop_table("operations")
    op.drop_table("nodes")
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.drop_index("ix_instances_host_vm")

    op.drop_table("instances")
