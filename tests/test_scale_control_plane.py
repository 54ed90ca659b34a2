"""The control plane at scale: what keeps create and describe from growing with the number of volumes.

A storage node's record (its last heartbeat, one usage entry per volume) is decoded once per heartbeat,
and still reads as the newest heartbeat says; a page of a tenant's volumes and the sums a create makes
are read from indexes, not by sorting or visiting the table's rows.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.sql import Select

from tests.conftest import fresh_database
from vbs import ids
from vbs.controller.db import Database, Node, Volume
from vbs.controller.db.states import VolumeState
from vbs.controller.fleet.nodes import MANY_VOLUMES, record_storage_heartbeat, storage_info
from vbs.wire.storage import PoolInfo, StorageHeartbeat

pytestmark = pytest.mark.unit

STARTED = datetime(2026, 11, 26, tzinfo=UTC)


@pytest.fixture
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database("sqlite", request, tmp_path)


def heartbeat(usage: dict[str, int]) -> StorageHeartbeat:
    pool = PoolInfo(name="default", backend="file", capacity_bytes=1 << 40, free_bytes=1 << 39, clone_method="copy",
                    point_in_time=False)
    return StorageHeartbeat(name="storage-1", url="http://127.0.0.1:9000", address="127.0.0.1", started_at=STARTED,
                            pools=[pool], volume_usage=usage)


def read_storage_node(db: Database) -> object:
    with db.read() as s:
        node = s.get(Node, ("storage-1", "storage"))
        assert node is not None
        return storage_info(node)


def test_a_big_storage_node_record_is_decoded_once_per_heartbeat_and_reads_as_the_newest(db: Database) -> None:
    usage = {ids.new_id("volume"): 4096 * i for i in range(MANY_VOLUMES * 2)}
    with db.session() as s:
        record_storage_heartbeat(s, heartbeat(usage))
    first, again = read_storage_node(db), read_storage_node(db)
    assert first is again  # two sessions, two row loads, one decoded and validated record
    assert first.volume_usage == usage  # type: ignore[attr-defined]

    grown = {**usage, ids.new_id("volume"): 1 << 20}
    with db.session() as s:
        record_storage_heartbeat(s, heartbeat(grown))
    newest = read_storage_node(db)
    assert newest is not first
    assert newest.volume_usage == grown  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def test_a_storage_node_record_is_shared_from_a_few_dozen_volumes_on(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Even a node of a thousand volumes is read twice per create: the record is validated once per
    heartbeat from MANY_VOLUMES on, and its JSON is long enough there for the decoded-text cache, on
    either database."""
    db = fresh_database(kind, request, tmp_path)
    with db.session() as s:
        record_storage_heartbeat(s, heartbeat({ids.new_id("volume"): 4096 * i for i in range(MANY_VOLUMES)}))
    assert read_storage_node(db) is read_storage_node(db)


def test_a_small_storage_node_record_reads_as_the_newest_heartbeat_too(db: Database) -> None:
    for used in (0, 4096, 8192):
        with db.session() as s:
            record_storage_heartbeat(s, heartbeat({"vol-0123456789abcdef0": used}))
        assert read_storage_node(db).volume_usage == {"vol-0123456789abcdef0": used}  # type: ignore[attr-defined]


def query_plan(db: Database, stmt: Select[tuple[object, ...]]) -> str:
    sql = str(stmt.compile(dialect=sqlite_dialect.dialect(), compile_kwargs={"literal_binds": True}))
    assert db.sqlite_path is not None
    with sqlite3.connect(db.sqlite_path) as con:
        return " | ".join(row[-1] for row in con.execute(f"EXPLAIN QUERY PLAN {sql}"))


def test_a_page_of_volumes_is_read_in_id_order_from_the_index_without_sorting_the_tenants_volumes(
        db: Database) -> None:
    stmt = (select(*Volume.__table__.columns)
            .where(Volume.tenant == "default", Volume.status != VolumeState.DELETED, Volume.id > "vol-8")
            .order_by(Volume.id).limit(1001))
    plan = query_plan(db, stmt)
    assert "ix_volumes_tenant_id" in plan
    assert "TEMP B-TREE" not in plan


def test_the_sums_of_a_create_read_only_indexes(db: Database) -> None:
    quota = select(func.count(), func.coalesce(func.sum(Volume.size_gib), 0)).where(
        Volume.tenant == "default", Volume.status != VolumeState.DELETED)
    placement = select(Volume.storage_node, Volume.pool, func.sum(Volume.size_gib)).where(
        Volume.storage_node.in_(["storage-1"]), Volume.status != VolumeState.DELETED).group_by(
        Volume.storage_node, Volume.pool)
    assert "COVERING INDEX ix_volumes_tenant_usage" in query_plan(db, quota)
    plan = query_plan(db, placement)
    assert "COVERING INDEX ix_volumes_pool_usage" in plan
    assert "TEMP B-TREE" not in plan


def node_row(db: Database) -> tuple[datetime, str]:
    with db.read() as s:
        node = s.get(Node, ("storage-1", "storage"))
        assert node is not None
        return node.last_heartbeat, node.url


def test_a_heartbeat_that_reports_nothing_new_moves_only_the_time_and_a_changed_one_replaces_the_record(
        db: Database) -> None:
    usage = {ids.new_id("volume"): 4096 * i for i in range(MANY_VOLUMES * 2)}
    with db.session() as s:
        record_storage_heartbeat(s, heartbeat(usage))
    before, record = node_row(db)[0], read_storage_node(db)
    with db.session() as s:
        record_storage_heartbeat(s, heartbeat(usage).model_copy(update={"url": "http://127.0.0.1:9001"}))
    after, url = node_row(db)
    assert after > before and url == "http://127.0.0.1:9001"
    assert read_storage_node(db) is record  # the record itself was not rewritten

    changed = {**usage, next(iter(usage)): 1 << 30}
    with db.session() as s:
        record_storage_heartbeat(s, heartbeat(changed))
    assert read_storage_node(db).volume_usage == changed  # type: ignore[attr-defined]
