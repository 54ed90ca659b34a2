"""driver kit: exclusive operations, bounded retries, no secrets in operation rows

- operations.exclusive and a partial unique index: one unfinished exclusive operation per resource
  (states.EXCLUSIVE_KINDS);
- operations.failing_since: since when the current step keeps failing (retries are bounded);
- attachments.status_reason; attachments.connection goes: connections may hold secrets and are
  never stored;
- connections (with their CHAP/PSK secrets) that older controllers left in operations.params are
  removed.

Revision ID: 0003
Revises: 0002
"""

import json

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import flag, json_value, text, timestamp
from vbs.controller.db.migration_ops import add_columns, drop_columns

revision = "0003"
down_revision = "0002"

EXCLUSIVE_KINDS = ("create-volume", "delete-volume", "attach-volume", "detach-volume", "modify-volume",
                   "migrate-volume", "delete-snapshot")
UNFINISHED = "status IN ('running', 'rolling-back') AND exclusive"


def upgrade() -> None:
    add_columns("operations", flag("exclusive", default=False),
                timestamp("failing_since", null=True))
    bind = op.get_bind()
    operations = sa.table("operations", sa.column("id", sa.String), sa.column("kind", sa.String),
                          sa.column("params", sa.JSON), sa.column("exclusive", sa.Boolean))
    bind.execute(operations.update().where(operations.c.kind.in_(EXCLUSIVE_KINDS)).values(exclusive=True))
    for op_id, params in bind.execute(sa.select(operations.c.id, operations.c.params)).all():
        data = json.loads(params) if isinstance(params, str) else params
        if isinstance(data, dict) and "connection" in data:
            data.pop("connection")
            bind.execute(operations.update().where(operations.c.id == op_id).values(params=data))
    op.create_index("uq_operations_exclusive_unfinished", "operations", ["resource_id"], unique=True,
                    sqlite_where=sa.text(UNFINISHED), postgresql_where=sa.text(UNFINISHED))
    with op.batch_alter_table("attachments", schema=None) as batch_op:
        batch_op.add_column(text("status_reason", null=True))
        batch_op.drop_column("connection")


def downgrade() -> None:
    with op.batch_alter_table("attachments", schema=None) as batch_op:
        batch_op.add_column(json_value("connection", null=True))
        batch_op.drop_column("status_reason")
    op.drop_index("uq_operations_exclusive_unfinished", table_name="operations")
    drop_columns("operations", "failing_since", "exclusive")
