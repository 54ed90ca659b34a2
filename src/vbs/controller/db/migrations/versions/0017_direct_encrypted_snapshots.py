"""Encrypted snapshots written through the EBS direct APIs (issue 34, docs/ebs-direct.md)

- snapshots.plain_data: the snapshot is encrypted under its key_id though its data is no LUKS container
  (its blocks were put as plaintext and are kept as the snapshot store keeps every chunk); existing rows:
  false (an encrypted snapshot's data is its volume's container).

Revision ID: 0017_direct_encrypted_snapshots
Revises: 0016_lifecycle_policies
"""

from vbs.controller.db.migration_columns import flag
from vbs.controller.db.migration_ops import add_columns, drop_columns

revision = "0017_direct_encrypted_snapshots"
down_revision = "0016_lifecycle_policies"


def upgrade() -> None:
    add_columns("snapshots", flag("plain_data", default=False))


def downgrade() -> None:
    drop_columns("snapshots", "plain_data")
