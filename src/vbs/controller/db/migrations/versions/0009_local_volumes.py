"""local volumes (semi-shared storage)

- volumes.host (existing rows: NULL): the hypervisor node whose local pool holds a volume of placement
  "local" (its storage_node names that host too).
- volumes.persistent (existing rows: false): a local volume that outlives its detach.

Revision ID: 0009_local_volumes
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_local_volumes"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("volumes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("host", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("persistent", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("volumes", schema=None) as batch_op:
        batch_op.drop_column("persistent")
        batch_op.drop_column("host")
