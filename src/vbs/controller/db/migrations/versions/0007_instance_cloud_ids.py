"""instance cloud ids: the ids external clouds give a VM, for instance-id resolvers

- instances.cloud_ids (existing rows: "{}"): a JSON object {scheme: id} from the host heartbeat.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa

from vbs.controller.db.migration_ops import add_columns, drop_columns

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    add_columns("instances", sa.Column("cloud_ids", sa.String(length=2048), nullable=False, server_default="{}"))


def downgrade() -> None:
    drop_columns("instances", "cloud_ids")
