"""instance cloud ids: the ids external clouds give a VM, for instance-id resolvers

- instances.cloud_ids (existing rows: "{}"): a JSON object {scheme: id} from the host heartbeat.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cloud_ids", sa.String(length=2048), nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.drop_column("cloud_ids")
