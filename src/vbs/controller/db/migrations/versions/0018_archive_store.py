"""A separate archive store (docs/snapshot-tiers.md)

- snapshot_tiers.archive_store: the archive store (as its storage agents report it) that holds the
  archived snapshot's manifest and chunks; NULL: the snapshot was archived in the snapshot store itself
  (no archive store), or it is not archived. Existing rows: NULL.

Revision ID: 0018_archive_store
Revises: 0017_direct_encrypted_snapshots
"""

import sqlalchemy as sa
from alembic import op

revision = "0018_archive_store"
down_revision = "0017_direct_encrypted_snapshots"


def upgrade() -> None:
    with op.batch_alter_table("snapshot_tiers") as batch:
        batch.add_column(sa.Column("archive_store", sa.String(1024), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("snapshot_tiers") as batch:
        batch.drop_column("archive_store")
