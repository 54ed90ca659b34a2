"""snapshots in the snapshot store (issue 33)

- snapshots.store_state (existing rows: NULL, kept in their pool only): "uploading" while the storage
  node puts the snapshot into the snapshot store, "stored" once its manifest is there, "error" if that
  gave up.
- snapshots.store (NULL): the store that holds it, as its storage nodes describe it (dir:PATH,
  s3://BUCKET/PREFIX/ at URL): any storage node reporting the same store may restore it.
- snapshots.stored_bytes (NULL): the bytes of its chunks that are not zeros.
- snapshots.pool_copy (existing rows: true): whether its pool still holds its own copy (a reflink or
  RBD pool keeps it as the fast tier; a copy pool gives it up once the snapshot is stored).

Revision ID: 0013_snapshot_store
Revises: 0012_volume_usage_lock_order
"""

from vbs.controller.db.migration_columns import big_integer, flag, string
from vbs.controller.db.migration_ops import add_columns, drop_columns

revision = "0013_snapshot_store"
down_revision = "0012_volume_usage_lock_order"


def upgrade() -> None:
    add_columns("snapshots", string("store_state", 16, null=True), string("store", 1024, null=True),
                big_integer("stored_bytes", null=True),
                flag("pool_copy", default=True))


def downgrade() -> None:
    drop_columns("snapshots", "pool_copy", "stored_bytes", "store", "store_state")
