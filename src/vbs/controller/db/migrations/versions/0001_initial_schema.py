"""initial schema

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import boolean, integer, json_value, string, text, timestamp

revision = "0001"
down_revision = None


def upgrade() -> None:

    op.create_table(
        "instances",
        string("id", 32),
        string("host", 64),
        string("vm_id", 64),
        string("name", 255),
        string("state", 16),
        timestamp("first_seen"),
        timestamp("last_seen"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.create_index("ix_instances_host_vm", ["host", "vm_id"], unique=True)

    op.create_table(
        "nodes",
        string("name", 64),
        string("kind", 16),
        string("url", 255),
        string("address", 255),
        json_value("info"),
        timestamp("started_at", null=True),
        timestamp("last_heartbeat"),
        sa.PrimaryKeyConstraint("name", "kind"),
    )
    op.create_table(
        "operations",
        string("id", 32),
        string("kind", 32),
        string("resource_id", 32),
        string("status", 16),
        json_value("params"),
        text("error", null=True),
        integer("attempts"),
        timestamp("next_attempt_at", null=True),
        timestamp("created_at"),
        timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_operations_resource_id"), ["resource_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_operations_status"), ["status"], unique=False)

    op.create_table(
        "snapshots",
        string("id", 32),
        string("volume_id", 32),
        integer("volume_size_gib"),
        string("comment", 255),
        string("storage_node", 64),
        string("pool", 64),
        string("status", 16),
        text("status_reason", null=True),
        integer("progress"),
        timestamp("started_at"),
        timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_snapshots_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_snapshots_storage_node"), ["storage_node"], unique=False)
        batch_op.create_index(batch_op.f("ix_snapshots_volume_id"), ["volume_id"], unique=False)

    op.create_table(
        "tags",
        string("resource_id", 32),
        string("key", 128),
        string("value", 256),
        sa.PrimaryKeyConstraint("resource_id", "key"),
    )
    op.create_table(
        "volumes",
        string("id", 32),
        integer("size_gib"),
        string("comment", 255),
        string("snapshot_id", 32, null=True),
        string("volume_type", 16),
        integer("iops", null=True),
        integer("throughput", null=True),
        boolean("multi_attach"),
        string("placement", 16),
        string("storage_node", 64),
        string("pool", 64),
        string("status", 16),
        text("status_reason", null=True),
        integer("progress"),
        string("client_token", 64, null=True),
        string("request_digest", 64, null=True),
        timestamp("created_at"),
        timestamp("updated_at"),
        timestamp("deleted_at", null=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("client_token"),
    )
    with op.batch_alter_table("volumes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_volumes_snapshot_id"), ["snapshot_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_volumes_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_volumes_storage_node"), ["storage_node"], unique=False)

    op.create_table(
        "attachments",
        string("id", 32),
        string("volume_id", 32),
        string("instance_id", 32, null=True),
        string("host", 64),
        string("vm_id", 64),
        string("device", 32),
        string("mode", 2),
        string("status", 16),
        json_value("connection", null=True),
        timestamp("created_at"),
        timestamp("updated_at"),
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
        string("operation_id", 32),
        integer("position"),
        string("name", 64),
        string("state", 16),
        text("error", null=True),
        timestamp("updated_at"),
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
