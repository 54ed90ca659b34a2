"""drained storage nodes: an operator's mark that a node takes no new volumes

- nodes.drained (existing rows: false). Heartbeats never write it; `vbs drain-storage-node` does.

Revision ID: 0006
Revises: 0005
"""

from vbs.controller.db.migration_columns import flag
from vbs.controller.db.migration_ops import add_columns, drop_columns

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    add_columns("nodes", flag("drained", default=False))


def downgrade() -> None:
    drop_columns("nodes", "drained")
