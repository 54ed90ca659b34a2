"""Encrypted snapshots written through the EBS direct APIs (issue 34, docs/ebs-direct.md)

- snapshots.plain_data: the snapshot is encrypted under its key_id though its data is no LUKS container
  (its blocks were put as plaintext and are kept as the snapshot store keeps every chunk); existing rows:
  false (an encrypted snapshot's data is its volume's container).

Revision ID: 0017_direct_encrypted_snapshots
Revises: 0016_lifecycle_policies
"""

import sqlalchemy as sa
from alembic import op

revision = "0017_direct_encrypted_snapshots"
down_revision = "0016_lifecycle_policies"


def upgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("plain_data", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("plain_data")
