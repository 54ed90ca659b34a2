"""A separate archive store (docs/snapshot-tiers.md)

- snapshot_tiers.archive_store: the archive store (as its storage agents report it) that holds the
  archived snapshot's manifest and chunks; NULL: the snapshot was archived in the snapshot store itself
  (no archive store), or it is not archived. Existing rows: NULL.

Revision ID: 0018_archive_store
Revises: 0017_direct_encrypted_snapshots
"""

from vbs.controller.db.migration_columns import string
from vbs.controller.db.migration_ops import add_columns, drop_columns

revision = "0018_archive_store"
down_revision = "0017_direct_encrypted_snapshots"


def upgrade() -> None:
    add_columns("snapshot_tiers", string("archive_store", 1024, null=True))


def downgrade() -> None:
    drop_columns("snapshot_tiers", "archive_store")
