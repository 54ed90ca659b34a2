"""what each tenant and each pool holds, kept by the database itself

``volume_usage`` has a row per tenant (scope "tenant", pool "") and per storage node and pool (scope
"pool"): the count and the GiB of their volumes that are not deleted. Triggers on ``volumes`` keep it
in the same transaction as the change, on every path (ORM, bulk UPDATE, a DELETE): the quota check and
the placement of a create read one row each instead of summing every volume of the tenant and of the
pools (two index scans that grew with the volumes: about 33 ms a create at 100,000 on SQLite). An
UPDATE touches the rows only when it changes what they count (its size, tenant, node or pool, or a
status to or from "deleted").

Revision ID: 0011_volume_usage
Revises: 0010_scale_indexes
"""

import sqlalchemy as sa
from alembic import op

from vbs.controller.db.migration_columns import big_integer, string
from vbs.controller.db.migration_sql import VOLUME_USAGE_COUNTING

revision = "0011_volume_usage"
down_revision = "0010_scale_indexes"

# An UPDATE that changes what volume_usage counts.
_COUNTED_CHANGE = ("OLD.size_gib <> NEW.size_gib OR OLD.tenant <> NEW.tenant OR OLD.storage_node <> NEW.storage_node"
                   " OR OLD.pool <> NEW.pool OR (OLD.status = 'deleted') <> (NEW.status = 'deleted')")

_SQLITE_ADD = """
INSERT INTO volume_usage (scope, owner, pool, volumes, gib)
    SELECT 'tenant', NEW.tenant, '', 1, NEW.size_gib WHERE NEW.status <> 'deleted'
    ON CONFLICT (scope, owner, pool) DO UPDATE SET volumes = volumes + 1, gib = gib + excluded.gib;
INSERT INTO volume_usage (scope, owner, pool, volumes, gib)
    SELECT 'pool', NEW.storage_node, NEW.pool, 1, NEW.size_gib WHERE NEW.status <> 'deleted'
    ON CONFLICT (scope, owner, pool) DO UPDATE SET volumes = volumes + 1, gib = gib + excluded.gib;
"""
_SQLITE_REMOVE = """
UPDATE volume_usage SET volumes = volumes - 1, gib = gib - OLD.size_gib
    WHERE OLD.status <> 'deleted' AND scope = 'tenant' AND owner = OLD.tenant AND pool = '';
UPDATE volume_usage SET volumes = volumes - 1, gib = gib - OLD.size_gib
    WHERE OLD.status <> 'deleted' AND scope = 'pool' AND owner = OLD.storage_node AND pool = OLD.pool;
"""
SQLITE_TRIGGERS = [
    f"CREATE TRIGGER volume_usage_insert AFTER INSERT ON volumes BEGIN {_SQLITE_ADD} END",
    f"CREATE TRIGGER volume_usage_update AFTER UPDATE OF size_gib, tenant, storage_node, pool, status ON volumes "
    f"WHEN {_COUNTED_CHANGE} BEGIN {_SQLITE_REMOVE} {_SQLITE_ADD} END",
    f"CREATE TRIGGER volume_usage_delete AFTER DELETE ON volumes BEGIN {_SQLITE_REMOVE} END",
]

# Rows are locked tenant first, then pool, the same order on every path.
POSTGRESQL_FUNCTION = f"""
CREATE FUNCTION vbs_volume_usage() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
{VOLUME_USAGE_COUNTING}    RETURN NULL;
END
$$
"""
POSTGRESQL_TRIGGERS = [
    "CREATE TRIGGER volume_usage_insert_delete AFTER INSERT OR DELETE ON volumes "
    "FOR EACH ROW EXECUTE FUNCTION vbs_volume_usage()",
    "CREATE TRIGGER volume_usage_update AFTER UPDATE OF size_gib, tenant, storage_node, pool, status ON volumes "
    f"FOR EACH ROW WHEN ({_COUNTED_CHANGE}) EXECUTE FUNCTION vbs_volume_usage()",
]

BACKFILL = """
INSERT INTO volume_usage (scope, owner, pool, volumes, gib)
    SELECT 'tenant', tenant, '', COUNT(*), COALESCE(SUM(size_gib), 0) FROM volumes
    WHERE status <> 'deleted' GROUP BY tenant
    UNION ALL
    SELECT 'pool', storage_node, pool, COUNT(*), COALESCE(SUM(size_gib), 0) FROM volumes
    WHERE status <> 'deleted' GROUP BY storage_node, pool
"""


def upgrade() -> None:
    op.create_table(
        "volume_usage",
        string("scope", 8),
        string("owner", 64),
        string("pool", 64),
        big_integer("volumes"),
        big_integer("gib"),
        sa.PrimaryKeyConstraint("scope", "owner", "pool"),
    )
    # Backfilled and triggered in one transaction: no change to volumes falls between.
    op.execute(BACKFILL)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRESQL_FUNCTION)
        for trigger in POSTGRESQL_TRIGGERS:
            op.execute(trigger)
    else:
        for trigger in SQLITE_TRIGGERS:
            op.execute(trigger)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER volume_usage_update ON volumes")
        op.execute("DROP TRIGGER volume_usage_insert_delete ON volumes")
        op.execute("DROP FUNCTION vbs_volume_usage()")
    else:
        for name in ("volume_usage_insert", "volume_usage_update", "volume_usage_delete"):
            op.execute(f"DROP TRIGGER {name}")
    op.drop_table("volume_usage")
