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

from vbs.controller.db.migration_sql import VOLUME_USAGE_COUNTING

revision = "0012_volume_usage_lock_order"
down_revision = "0011_volume_usage"

POSTGRESQL_FUNCTION = f"""
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
{VOLUME_USAGE_COUNTING}    RETURN NULL;
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
