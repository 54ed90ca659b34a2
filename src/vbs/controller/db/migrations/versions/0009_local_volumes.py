"""local volumes (semi-shared storage)

- volumes.host (existing rows: NULL): the hypervisor node whose local pool holds a volume of placement
  "local" (its storage_node names that host too).
- volumes.persistent (existing rows: false): a local volume that outlives its detach.

Revision ID: 0009_local_volumes
Revises: 0008
"""

from vbs.controller.db.migration_columns import flag, string
from vbs.controller.db.migration_ops import add_columns, drop_columns

revision = "0009_local_volumes"
down_revision = "0008"


def upgrade() -> None:
    add_columns("volumes", string("host", 64, null=True),
                flag("persistent", default=False))


def downgrade() -> None:
    drop_columns("volumes", "persistent", "host")
