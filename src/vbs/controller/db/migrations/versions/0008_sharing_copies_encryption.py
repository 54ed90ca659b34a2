"""snapshot sharing, copies and encrypted volumes

- snapshot_permissions (snapshot_id, grantee): a tenant, or "all", that may use another tenant's snapshot.
- snapshots.source_snapshot_id (existing rows: NULL): the snapshot a CopySnapshot copies.
- volume_keys (id, sealed_key, kms_key_id, created_at): the data keys of encrypted volumes, sealed with
  the master key; volumes.key_id and snapshots.key_id (existing rows: NULL, not encrypted) name theirs.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import string, text, timestamp
from vbs.controller.db.migration_ops import add_columns, drop_columns

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    op.create_table(
        "snapshot_permissions",
        string("snapshot_id", 32),
        string("grantee", 64),
        sa.PrimaryKeyConstraint("snapshot_id", "grantee"),
    )
    op.create_index("ix_snapshot_permissions_grantee", "snapshot_permissions", ["grantee"])
    op.create_table(
        "volume_keys",
        string("id", 32),
        text("sealed_key"),
        string("kms_key_id", 2048),
        timestamp("created_at"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.add_column(string("source_snapshot_id", 32, null=True))
        batch_op.create_index("ix_snapshots_source_snapshot_id", ["source_snapshot_id"])
        batch_op.add_column(string("key_id", 32, null=True))
    add_columns("volumes", string("key_id", 32, null=True))


def downgrade() -> None:
    drop_columns("volumes", "key_id")
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.drop_column("key_id")
        batch_op.drop_index("ix_snapshots_source_snapshot_id")
        batch_op.drop_column("source_snapshot_id")
    op.drop_table("volume_keys")
    op.drop_index("ix_snapshot_permissions_grantee", table_name="snapshot_permissions")
    op.drop_table("snapshot_permissions")
