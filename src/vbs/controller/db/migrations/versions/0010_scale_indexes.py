"""indexes for the control plane at scale (10,000-100,000 volumes)

- volumes (tenant, id): describe-volumes reads a tenant's volumes in id order from the page token on;
  with the tenant index alone SQLite sorted every volume of the tenant for each page of 1,000.
- volumes (tenant, status, size_gib): the quota check of every create counts and sums the tenant's
  volumes from the index alone.
- volumes (storage_node, pool, status, size_gib): the placement of every create sums what each pool
  was promised from the index alone, already grouped.

Revision ID: 0010_scale_indexes
Revises: 0009_local_volumes
"""

from alembic import op

revision = "0010_scale_indexes"
down_revision = "0009_local_volumes"

INDEXES = {
    "ix_volumes_tenant_id": ["tenant", "id"],
    "ix_volumes_tenant_usage": ["tenant", "status", "size_gib"],
    "ix_volumes_pool_usage": ["storage_node", "pool", "status", "size_gib"],
}


def upgrade() -> None:
    for name, columns in INDEXES.items():
        op.create_index(name, "volumes", columns)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="volumes")
