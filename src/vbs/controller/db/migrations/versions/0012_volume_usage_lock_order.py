"""volume_usage rows locked in key order on PostgreSQL: opposite moves queue instead of deadlocking

0011's trigger function updated a move's old pool row, then its new one. Two volumes crossing between
the same two pools at the same moment (A to B and B to A) thus locked the two rows in opposite orders,
and PostgreSQL broke the deadlock by failing one of the transactions (its caller got a 503). Now an
UPDATE first locks every row it will change in one order, tenant rows before pool rows (the order of
every INSERT and DELETE), each kind by key. SQLite has one writer at a time: nothing changes there.

Revision ID: 0012_volume_usage_lock_order
Revises: 0011_volume_usage
"""

from alembic import op

revision = "0012_volume_usage_lock_order"
down_revision = "0011_volume_usage"
branch_labels = None
depends_on = None

POSTGRESQL_FUNCTION = """
CREATE OR REPLACE FUNCTION vbs_volume_usage() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        -- LockRows sits above the sort: the rows are locked in this order.
        PERFORM 1 FROM volume_usage
            WHERE (scope = 'tenant' AND pool = '' AND owner IN (OLD.tenant, NEW.tenant))
               OR (scope = 'pool' AND (owner, pool) IN ((OLD.storage_node, OLD.pool), (NEW.storage_node, NEW.pool)))
            ORDER BY scope DESC, owner, pool
            FOR UPDATE;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.status <> 'deleted' THEN
        UPDATE volume_usage SET volumes = volumes - 1, gib = gib - OLD.size_gib
            WHERE scope = 'tenant' AND owner = OLD.tenant AND pool = '';
        UPDATE volume_usage SET volumes = volumes - 1, gib = gib - OLD.size_gib
            WHERE scope = 'pool' AND owner = OLD.storage_node AND pool = OLD.pool;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.status <> 'deleted' THEN
        INSERT INTO volume_usage (scope, owner, pool, volumes, gib) VALUES ('tenant', NEW.tenant, '', 1, NEW.size_gib)
            ON CONFLICT (scope, owner, pool) DO UPDATE
            SET volumes = volume_usage.volumes + 1, gib = volume_usage.gib + EXCLUDED.gib;
        INSERT INTO volume_usage (scope, owner, pool, volumes, gib)
            VALUES ('pool', NEW.storage_node, NEW.pool, 1, NEW.size_gib)
            ON CONFLICT (scope, owner, pool) DO UPDATE
            SET volumes = volume_usage.volumes + 1, gib = volume_usage.gib + EXCLUDED.gib;
    END IF;
    RETURN NULL;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRESQL_FUNCTION)


def downgrade() -> None:
    # The function keeps counting exactly as 0011's did, with the same triggers: it stays (0011's own
    # downgrade drops it with them).
    pass
