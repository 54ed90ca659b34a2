"""SQL that more than one migration writes, frozen as those migrations ran it.

A migration is history: never edit a constant here once a released migration uses it; a changed
statement is a new constant, used by a new migration.
"""

# The counting part of ``vbs_volume_usage()`` (PostgreSQL), the same in 0011 and 0012: what a volume's
# insert, update and delete add to and take from its tenant's and its pool's rows of volume_usage.
VOLUME_USAGE_COUNTING = """    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.status <> 'deleted' THEN
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
"""
