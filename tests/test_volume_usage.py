"""``volume_usage``: what each tenant and pool holds, kept by triggers on ``volumes`` (SQLite and
PostgreSQL). Whatever changes the volumes (ORM, bulk UPDATE, DELETE, a rollback, concurrent
transactions, the migration's backfill of an existing database), the rows equal a recount."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from tests.conftest import UNIT_DATABASES, fresh_database
from vbs import ids
from vbs.controller.db import Database, Volume, VolumeUsage
from vbs.controller.db.session import alembic_config
from vbs.controller.db.tables import utcnow
from vbs.controller.placement.quotas import tenant_usage
from vbs.controller.placement.scheduler import provisioned_gib

pytestmark = pytest.mark.unit

TENANTS = ("default", "team-a", "team-b")
POOLS = (("storage-1", "default"), ("storage-1", "fast"), ("storage-2", "default"))
STATES = ("creating", "available", "in-use", "error", "deleting", "deleted")


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database(request.param, request, tmp_path)


def new_volume(rng: random.Random, status: str | None = None) -> Volume:
    node, pool = rng.choice(POOLS)
    now = utcnow()
    return Volume(id=ids.new_id("volume"), size_gib=rng.randint(1, 500), volume_type="gp3", placement="shared",
                  storage_node=node, pool=pool, status=status or rng.choice(STATES), tenant=rng.choice(TENANTS),
                  created_at=now, updated_at=now)


def kept(s: Session) -> dict[tuple[str, str, str], tuple[int, int]]:
    rows = s.execute(select(VolumeUsage.scope, VolumeUsage.owner, VolumeUsage.pool, VolumeUsage.volumes,
                            VolumeUsage.gib))
    return {(scope, owner, pool): (int(n), int(gib)) for scope, owner, pool, n, gib in rows if n or gib}


def recounted(s: Session) -> dict[tuple[str, str, str], tuple[int, int]]:
    live = Volume.status != "deleted"
    found = {("tenant", t, ""): (int(n), int(g)) for t, n, g in s.execute(
        select(Volume.tenant, func.count(), func.sum(Volume.size_gib)).where(live).group_by(Volume.tenant))}
    found |= {("pool", node, pool): (int(n), int(g)) for node, pool, n, g in s.execute(
        select(Volume.storage_node, Volume.pool, func.count(), func.sum(Volume.size_gib)).where(live)
        .group_by(Volume.storage_node, Volume.pool))}
    return found


def assert_kept(db: Database) -> None:
    with db.session() as s:
        assert kept(s) == recounted(s)


def test_every_kind_of_change_keeps_the_usage_equal_to_a_recount(db: Database) -> None:
    rng = random.Random(15)
    with db.session() as s:
        s.add_all([new_volume(rng) for _ in range(40)])
    assert_kept(db)
    for round_ in range(120):
        with db.session() as s:
            vid = s.scalars(select(Volume.id).order_by(Volume.id).offset(rng.randrange(40)).limit(1)).one()
            kind = round_ % 6
            if kind == 0:  # a status change through the ORM, to or from deleted or neither
                s.get_one(Volume, vid).status = rng.choice(STATES)
            elif kind == 1:  # a resize, as modify-volume does it
                s.get_one(Volume, vid).size_gib += rng.randint(1, 50)
            elif kind == 2:  # a move to another node and pool, as a bulk UPDATE
                node, pool = rng.choice(POOLS)
                s.execute(update(Volume).where(Volume.id == vid).values(storage_node=node, pool=pool)
                          .execution_options(synchronize_session=False))
            elif kind == 3:  # several columns at once, a conditional UPDATE like a transition
                s.execute(update(Volume).where(Volume.id == vid, Volume.status != "deleting")
                          .values(status=rng.choice(STATES), size_gib=rng.randint(1, 500), tenant=rng.choice(TENANTS))
                          .execution_options(synchronize_session=False))
            elif kind == 4:  # a row removed, then another made
                s.execute(delete(Volume).where(Volume.id == vid))
                s.add(new_volume(rng))
            else:  # an UPDATE that changes nothing counted
                s.execute(update(Volume).where(Volume.id == vid).values(comment=f"round {round_}", progress=50))
        assert_kept(db)
    with db.session() as s:
        usage = kept(s)
        tenant, (count, gib) = next((k[1], v) for k, v in usage.items() if k[0] == "tenant")
        assert tenant_usage(s, tenant) == (count, gib)
        assert tenant_usage(s, "nobody") == (0, 0)
        node, pool = next((k[1], k[2]) for k in usage if k[0] == "pool")
        assert provisioned_gib(s, node, pool) == usage[("pool", node, pool)][1]
        assert provisioned_gib(s, "storage-9", "default") == 0


def test_a_rolled_back_transaction_leaves_the_usage_as_it_was(db: Database) -> None:
    rng = random.Random(16)
    with db.session() as s:
        s.add_all([new_volume(rng, "available") for _ in range(5)])
    with db.session() as s:
        before = kept(s)
    with pytest.raises(RuntimeError), db.session() as s:
        s.add(new_volume(rng, "available"))
        s.execute(update(Volume).values(size_gib=Volume.size_gib + 7))
        s.flush()
        raise RuntimeError("the request failed after its writes")
    with db.session() as s:
        assert kept(s) == before == recounted(s)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["postgresql"])
def test_concurrent_creates_and_deletes_on_postgresql_are_all_counted(kind: str, tmp_path: Path,
                                                                        request: pytest.FixtureRequest) -> None:
    db = fresh_database(kind, request, tmp_path)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(25):
                made = new_volume(rng, "available")
                with db.session() as s:
                    s.add(made)
                if rng.random() < 0.3:
                    with db.session() as s:
                        s.execute(update(Volume).where(Volume.id == made.id).values(status="deleted"))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    with db.session() as s:
        assert sum(n for (scope, _, _), (n, _) in kept(s).items() if scope == "tenant") == \
            s.scalar(select(func.count()).where(Volume.status != "deleted"))
    assert_kept(db)



@pytest.mark.integration
@pytest.mark.parametrize("kind", ["postgresql"])
def test_opposite_moves_between_two_pools_do_not_deadlock_on_postgresql(kind: str, tmp_path: Path,
                                                                        request: pytest.FixtureRequest) -> None:
    """Two tenants' volumes cross between two pools at the same moment, again and again: each move
    decrements its old pool's row and increments its new one's. Locked in the order of the change
    (old, then new), the two transactions would wait for each other (PostgreSQL breaks the deadlock
    by failing one: a 503 to its caller); locked in key order they only queue."""
    db = fresh_database(kind, request, tmp_path)
    a, b = ("storage-1", "default"), ("storage-2", "default")
    rng = random.Random(5)
    first, second = new_volume(rng, "available"), new_volume(rng, "available")
    (first.tenant, first.storage_node, first.pool), (second.tenant, second.storage_node, second.pool) = \
        ("team-a", *a), ("team-b", *b)
    with db.session() as s:
        s.add_all([first, second])
    rounds = 150
    start = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []

    def mover(volume_id: str, here: tuple[str, str], there: tuple[str, str]) -> None:
        try:
            for _ in range(rounds):
                start.wait()
                with db.session() as s:
                    s.execute(update(Volume).where(Volume.id == volume_id)
                              .values(storage_node=there[0], pool=there[1]))
                here, there = there, here
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=mover, args=(first.id, a, b)),
               threading.Thread(target=mover, args=(second.id, b, a))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [str(e) for e in errors] == []
    assert_kept(db)


def test_the_migration_counts_the_volumes_a_database_already_holds(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'old.db'}")
    try:
        cfg = alembic_config()
        with db.engine.begin() as connection:
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, "0010_scale_indexes")
        rng = random.Random(17)
        with db.session() as s:
            s.add_all([new_volume(rng) for _ in range(30)])
        db.migrate()
        assert_kept(db)
        with db.session() as s:
            assert kept(s)  # not empty: the backfill counted them
    finally:
        db.dispose()
