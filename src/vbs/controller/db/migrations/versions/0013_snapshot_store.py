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

import sqlalchemy as sa
from alembic import op

revision = "0013_snapshot_store"
down_revision = "0012_volume_usage_lock_order"


def upgrade() -> None:
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.add_column(sa.Column("store_state", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("store", sa.String(length=1024), nullable=True))
        batch_op.add_column(sa.Column("stored_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("pool_copy", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table("snapshots", schema=None) as batch_op:
        batch_op.drop_column("pool_copy")
        batch_op.drop_column("stored_bytes")
        batch_op.drop_column("store")
        batch_op.drop_column("store_state")
