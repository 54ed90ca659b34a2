"""tenants and access keys: who owns a volume or snapshot, and the keys vbs create-key makes

- volumes.tenant and snapshots.tenant (existing rows: "default", the bootstrap keys' tenant);
- access_keys: key id, tenant, role (admin | user) and the secret sealed with the master key.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import string, text, timestamp

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    for table in ("volumes", "snapshots"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("tenant", sa.String(64), nullable=False, server_default="default"))
            batch_op.create_index(f"ix_{table}_tenant", ["tenant"])
    op.create_table(
        "access_keys",
        sa.Column("id", sa.String(128), primary_key=True),
        string("tenant", 64),
        string("role", 16),
        text("sealed_secret"),
        timestamp("created_at"),
    )
    op.create_index("ix_access_keys_tenant", "access_keys", ["tenant"])


def downgrade() -> None:
    op.drop_index("ix_access_keys_tenant", table_name="access_keys")
    op.drop_table("access_keys")
    for table in ("volumes", "snapshots"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(f"ix_{table}_tenant")
            batch_op.drop_column("tenant")
