"""Unit tests of placement: capacity-weighted water-filling, overcommit, dead and drained nodes, zones,
the hints a create may give, and the volume status check — on SQLite and (integration tier) PostgreSQL.

Storage nodes come in as their agents report them (``record_storage_heartbeat``); creates go through
``volumes.create_volume`` with an engine that records operations and runs none.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import select, update

from tests.conftest import UNIT_DATABASES, fresh_database
from tests.fakes import RecordingEngine
from vbs import ids
from vbs.config import ControllerConfig, StorageAgentConfig, load
from vbs.controller.db import Database, Node, Snapshot, Volume
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.controller.fleet.describe_nodes import (
    NodeHealth,
    availability_zones,
    drain_storage_node,
    volume_status,
    zone_id,
)
from vbs.controller.fleet.nodes import record_storage_heartbeat
from vbs.controller.placement.scheduler import Placement, choose_pool
from vbs.controller.requests.create_volume import _digest, create_volume
from vbs.controller.requests.describe_volumes import describe_volumes
from vbs.controller.rest.schemas.volumes import CreateVolumeRequest
from vbs.errors import IncorrectState, InsufficientCapacity, InvalidParameter, NotFound, VbsError
from vbs.wire.storage import PoolInfo, StorageHeartbeat

pytestmark = pytest.mark.unit

GIB = 1 << 30
TIMEOUT_S = 30.0
ZONE = "us-east-1a"


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database(request.param, request, tmp_path)


def pool(name: str, capacity_gib: float) -> PoolInfo:
    size = int(capacity_gib * GIB)
    return PoolInfo(name=name, backend="file", capacity_bytes=size, free_bytes=size, clone_method="copy",
                    point_in_time=True)


def heartbeat(db: Database, name: str, *pools: PoolInfo, zone: str | None = None) -> None:
    """What the node's agent reports (also again, later: the row is upserted)."""
    with db.session() as s:
        record_storage_heartbeat(s, StorageHeartbeat(name=name, url="http://127.0.0.1:1", address="127.0.0.1",
                                                     started_at=utcnow(), pools=list(pools),
                                                     availability_zone=zone))


def silence(db: Database, name: str) -> None:
    """The node's last heartbeat is older than the timeout."""
    with db.session() as s:
        s.execute(update(Node).where(Node.name == name)
                  .values(last_heartbeat=utcnow() - timedelta(seconds=TIMEOUT_S + 1)))


def drain(db: Database, name: str, drained: bool = True) -> None:
    with db.session() as s:
        drain_storage_node(s, name, drained=drained, timeout_s=TIMEOUT_S, default_zone=ZONE)


def place(db: Database, size_gib: int = 1, overcommit: float = 1.0, want: Placement | None = None) -> tuple[str, str]:
    """Choose a pool and insert the volume row in one transaction, as a create does."""
    with db.session() as s:
        node, pool_name = choose_pool(s, size_gib, timeout_s=TIMEOUT_S, overcommit=overcommit, default_zone=ZONE,
                                      want=want)
        now = utcnow()
        s.add(Volume(id=ids.new_id("volume"), size_gib=size_gib, comment="", volume_type="gp3", multi_attach=False,
                     placement="shared", storage_node=node, pool=pool_name, status="available", progress=0,
                     created_at=now, updated_at=now))
    return node, pool_name


def promised(db: Database) -> Counter[tuple[str, str]]:
    with db.read() as s:
        found: Counter[tuple[str, str]] = Counter()
        for v in s.scalars(select(Volume)):
            found[(v.storage_node, v.pool)] += v.size_gib
        return found



def controller(db: Database, **cfg: Any) -> Any:
    return SimpleNamespace(cfg=ControllerConfig(heartbeat_timeout_s=TIMEOUT_S, **cfg), db=db,
                           engine=RecordingEngine())


def create(db: Database, **body: Any) -> Any:
    return create_volume(controller(db, overcommit_ratio=4.0), CreateVolumeRequest(**body), DEFAULT_TENANT)


# -- water-filling ------------------------------------------------------------------------------------


def test_creates_spread_in_proportion_to_capacity(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 20))
    heartbeat(db, "s3", pool("p", 30))
    for _ in range(60):
        place(db)
    assert promised(db) == {("s1", "p"): 10, ("s2", "p"): 20, ("s3", "p"): 30}


def test_every_prefix_of_the_creates_stays_within_one_volume_of_the_proportion(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 20))
    heartbeat(db, "s3", pool("p", 30))
    for n in range(1, 31):
        place(db)
        for (node, _), gib in promised(db).items():
            share = {"s1": 1 / 6, "s2": 2 / 6, "s3": 3 / 6}[node]
            assert abs(gib - n * share) <= 1, (n, node, gib)


def test_the_pools_of_one_node_fill_by_their_own_capacity(db: Database) -> None:
    heartbeat(db, "s1", pool("small", 10), pool("big", 30))
    for _ in range(8):
        place(db)
    assert promised(db) == {("s1", "small"): 2, ("s1", "big"): 6}


def test_equal_pools_take_turns_in_name_order(db: Database) -> None:
    heartbeat(db, "s2", pool("p", 10))
    heartbeat(db, "s1", pool("p", 10))
    assert [place(db)[0] for _ in range(4)] == ["s1", "s2", "s1", "s2"]


def test_volumes_already_promised_count_deleted_ones_do_not(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 10))
    place(db, size_gib=5, want=Placement(node="s1"))
    assert place(db, size_gib=1)[0] == "s2"
    with db.session() as s:
        s.execute(update(Volume).where(Volume.storage_node == "s1").values(status="deleted"))
    assert place(db, size_gib=1)[0] == "s1"


# -- overcommit and capacity ------------------------------------------------------------------------


def test_a_full_pool_is_skipped_and_all_full_is_a_400(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 2))
    heartbeat(db, "s2", pool("p", 4))
    for _ in range(12):  # 2 x 1.5 + 4 x 1.5 = 9 GiB in all
        try:
            place(db, overcommit=1.5)
        except InsufficientCapacity as exc:
            assert exc.status == 400 and "capacity x overcommit ratio 1.5" in exc.message
            break
    else:
        raise AssertionError("the pools never filled up")
    assert promised(db) == {("s1", "p"): 3, ("s2", "p"): 6}


def test_a_volume_larger_than_any_pool_may_promise_is_refused(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    with pytest.raises(InsufficientCapacity) as err:
        place(db, size_gib=11)
    assert err.value.status == 400
    assert promised(db) == {}


# -- dead and drained nodes ---------------------------------------------------------------------------


def test_a_node_that_stopped_heartbeating_gets_nothing(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 100))
    silence(db, "s2")
    assert {place(db)[0] for _ in range(5)} == {"s1"}
    silence(db, "s1")
    with pytest.raises(InsufficientCapacity) as err:
        place(db)
    assert err.value.status == 503 and "live capacity" in err.value.message


def test_a_drained_node_gets_nothing_until_undrained(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 100))
    drain(db, "s2")
    assert {place(db)[0] for _ in range(5)} == {"s1"}
    drain(db, "s2", drained=False)
    assert place(db)[0] == "s2"


def test_a_heartbeat_keeps_the_drain(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 100))
    drain(db, "s2")
    heartbeat(db, "s2", pool("p", 100))
    with db.read() as s:
        assert s.get(Node, ("s2", "storage")).drained  # type: ignore[union-attr]
    assert place(db)[0] == "s1"


def test_a_clone_may_go_to_a_drained_node(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 100))
    drain(db, "s1")
    with pytest.raises(InsufficientCapacity):
        place(db)
    assert place(db, want=Placement(node="s1", pool="p", drained_ok=True)) == ("s1", "p")


def test_draining_an_unknown_node_is_not_found(db: Database) -> None:
    with pytest.raises(NotFound) as err:
        drain(db, "nowhere")
    assert err.value.code == "InvalidStorageNode.NotFound"


def test_draining_says_what_still_lives_on_the_node(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 10))
    on_s1 = [place(db, want=Placement(node="s1")) for _ in range(2)]
    place(db, want=Placement(node="s2"))
    with db.session() as s:
        out = drain_storage_node(s, "s1", drained=True, timeout_s=TIMEOUT_S, default_zone=ZONE)
    assert out.storage_node.drained and out.storage_node.name == "s1"
    assert len(out.volumes) == len(on_s1) and {v.pool for v in out.volumes} == {"p"}
    assert out.snapshots == []


# -- hints --------------------------------------------------------------------------------------------


def test_a_node_and_pool_hint_places_there(db: Database) -> None:
    heartbeat(db, "s1", pool("a", 10), pool("b", 10))
    heartbeat(db, "s2", pool("a", 100))
    assert place(db, want=Placement(node="s1"))[0] == "s1"
    assert place(db, want=Placement(pool="b")) == ("s1", "b")
    assert place(db, want=Placement(node="s1", pool="a")) == ("s1", "a")


@pytest.mark.parametrize(("want", "error", "message"), [
    (Placement(node="nowhere"), InvalidParameter, "The storage node 'nowhere' does not exist."),
    (Placement(pool="nosuch"), InvalidParameter, "No storage node has a pool named 'nosuch'."),
    (Placement(node="s1", pool="nosuch"), InvalidParameter, "The storage node 's1' has no pool named 'nosuch'."),
    (Placement(zone="us-east-1z"), InvalidParameter, "Invalid availability zone: [us-east-1z]"),
    (Placement(zone="us-east-1b", node="s1"), InvalidParameter, "is in zone us-east-1a, not us-east-1b"),
    (Placement(zone="us-east-1b", pool="a"), InvalidParameter, "No storage node in zone us-east-1b has a pool"),
    (Placement(node="dead"), IncorrectState, "The storage node 'dead' is down"),
    (Placement(node="drained"), IncorrectState, "The storage node 'drained' is drained"),
])
def test_a_hint_that_cannot_be_met_is_refused_by_name(db: Database, want: Placement, error: type[VbsError],
                                                       message: str) -> None:
    heartbeat(db, "s1", pool("a", 10))
    heartbeat(db, "s2", pool("b", 10), zone="us-east-1b")
    heartbeat(db, "dead", pool("a", 10))
    silence(db, "dead")
    heartbeat(db, "drained", pool("a", 10))
    drain(db, "drained")
    with pytest.raises(error) as err:
        place(db, want=want)
    assert message in err.value.message
    assert 400 <= err.value.status < 500
    assert promised(db) == {}


def test_a_zone_restricts_placement_to_its_nodes(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 100))  # no zone of its own: the controller's
    heartbeat(db, "s2", pool("p", 10), zone="us-east-1b")
    assert {place(db, want=Placement(zone="us-east-1b"))[0] for _ in range(3)} == {"s2"}
    assert {place(db, want=Placement(zone=ZONE))[0] for _ in range(3)} == {"s1"}


def test_the_rest_request_carries_the_hints_and_a_clone_stays_with_its_snapshot(db: Database) -> None:
    heartbeat(db, "s1", pool("a", 10))
    heartbeat(db, "s2", pool("a", 10), pool("b", 10), zone="us-east-1b")
    made = create(db, size_gib=1, storage_node="s2", pool="b")
    assert (made.storage_node, made.pool, made.availability_zone) == ("s2", "b", "us-east-1b")
    assert create(db, size_gib=1, availability_zone=ZONE).storage_node == "s1"

    now = utcnow()
    with db.session() as s:
        s.add(Snapshot(id="snap-0123456789abcdef0", volume_id=made.volume_id, volume_size_gib=1, comment="",
                       storage_node="s2", pool="b", status="completed", progress=100, started_at=now, updated_at=now))
    drain(db, "s2")
    clone = create(db, snapshot_id="snap-0123456789abcdef0")
    assert (clone.storage_node, clone.pool) == ("s2", "b")
    with pytest.raises(InvalidParameter, match="made where it lives, on storage node s2, not s1"):
        create(db, snapshot_id="snap-0123456789abcdef0", storage_node="s1")
    with pytest.raises(InvalidParameter, match="on pool b, not a"):
        create(db, snapshot_id="snap-0123456789abcdef0", pool="a")
    with pytest.raises(InvalidParameter, match="is in zone us-east-1b, not us-east-1a"):
        create(db, snapshot_id="snap-0123456789abcdef0", availability_zone=ZONE)


def test_a_snapshot_in_the_store_is_restored_wherever_its_store_is_reached(db: Database) -> None:
    store = "dir:/srv/vbs-snapshots"
    stored = pool("a", 10).model_copy(update={"snapshot_store": store})
    heartbeat(db, "s1", stored)
    heartbeat(db, "s2", stored, pool("b", 100).model_copy(update={"snapshot_store": store}))
    heartbeat(db, "s3", pool("a", 1000))  # its snapshots go to no store: it cannot restore
    now = utcnow()

    def snapshot(sid: str, *, pool_copy: bool, state: str | None = "stored") -> str:
        with db.session() as s:
            s.add(Snapshot(id=sid, volume_id="vol-0123456789abcdef0", volume_size_gib=1, comment="",
                           storage_node="s1", pool="a", status="completed", progress=100, started_at=now,
                           updated_at=now, store_state=state, store=store if state else None, pool_copy=pool_copy))
        return sid

    # Only in the store (a copy pool gave its copy up): placement chooses among the pools of that store.
    only_store = snapshot("snap-0123456789abcdef1", pool_copy=False)
    placed = {(v.storage_node, v.pool) for v in (create(db, snapshot_id=only_store) for _ in range(4))}
    assert placed and placed <= {("s1", "a"), ("s2", "a"), ("s2", "b")} and ("s2", "b") in placed
    assert (create(db, snapshot_id=only_store, storage_node="s1").storage_node) == "s1"
    with pytest.raises(InsufficientCapacity, match="reaches the snapshot store dir:/srv/vbs-snapshots"):
        create(db, snapshot_id=only_store, storage_node="s3")
    # In its pool too (a reflink pool's fast tier): cloned beside it while its node is up, as before...
    both = snapshot("snap-0123456789abcdef2", pool_copy=True)
    assert {(create(db, snapshot_id=both).storage_node) for _ in range(3)} == {"s1"}
    # ... another place asked for is a restore there, and with its node down it is restored elsewhere.
    assert (create(db, snapshot_id=both, pool="b").storage_node, "b") == ("s2", "b")
    silence(db, "s1")
    assert {(create(db, snapshot_id=both).storage_node) for _ in range(3)} == {"s2"}
    # Not in the store: made where it lives, or refused with why.
    pool_only = snapshot("snap-0123456789abcdef3", pool_copy=True, state=None)
    heartbeat(db, "s1", stored)
    assert create(db, snapshot_id=pool_only).storage_node == "s1"
    with pytest.raises(InvalidParameter, match="not in the snapshot store"):
        create(db, snapshot_id=pool_only, storage_node="s2")


def test_the_rest_request_refuses_malformed_hints() -> None:
    for bad in ({"storage_node": "S1"}, {"storage_node": "a" * 64}, {"pool": "-x"}, {"pool": "a/b"},
                {"availability_zone": "us east"}, {"availability_zone": "z" * 33}):
        with pytest.raises(ValueError):
            CreateVolumeRequest(size_gib=1, **bad)


# -- zones and the volume status check ------------------------------------------------------------------


def test_zones_are_those_of_the_nodes_and_available_while_one_is_up(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 10), zone="us-east-1b")
    heartbeat(db, "s3", pool("p", 10), zone="us-east-1b")
    silence(db, "s2")
    with db.read() as s:
        zones = availability_zones(s, TIMEOUT_S, ZONE, "us-east-1")
    assert [(z.zone_name, z.zone_id, z.state) for z in zones] == [
        ("us-east-1a", "us-east-1-az1", "available"), ("us-east-1b", "us-east-1-az2", "available")]
    silence(db, "s3")
    with db.read() as s:
        assert [z.state for z in availability_zones(s, TIMEOUT_S, ZONE, "us-east-1")] == ["available", "unavailable"]
    assert zone_id("lab-rack-7", "us-east-1") == "lab-rack-7"


def test_volumes_report_their_nodes_zone_and_whether_io_reaches_them(db: Database) -> None:
    heartbeat(db, "s1", pool("p", 10))
    heartbeat(db, "s2", pool("p", 10), zone="us-east-1b")
    svc = controller(db)
    one = create(db, size_gib=1, storage_node="s1").volume_id
    two = create(db, size_gib=1, storage_node="s2").volume_id
    with db.session() as s:
        s.execute(update(Volume).values(status="available"))
    silence(db, "s2")
    found = {v.volume_id: v for v in describe_volumes(svc, DEFAULT_TENANT, [], {}, None, None).volumes}
    assert (found[one].availability_zone, found[one].volume_status) == (ZONE, "ok")
    assert (found[two].availability_zone, found[two].volume_status) == ("us-east-1b", "impaired")
    in_b = describe_volumes(svc, DEFAULT_TENANT, [], {"availability-zone": ["us-east-1b"]}, None, None).volumes
    assert [v.volume_id for v in in_b] == [two]


@pytest.mark.parametrize(("state", "node", "expected"), [
    ("available", NodeHealth(ZONE, alive=True), "ok"),
    ("in-use", NodeHealth(ZONE, alive=True), "ok"),
    ("available", NodeHealth(ZONE, alive=False), "impaired"),
    ("in-use", NodeHealth(ZONE, alive=False), "impaired"),
    ("error", NodeHealth(ZONE, alive=True), "impaired"),
    ("creating", NodeHealth(ZONE, alive=True), "insufficient-data"),
    ("deleting", NodeHealth(ZONE, alive=False), "insufficient-data"),
    ("available", None, "insufficient-data"),
])
def test_the_volume_status_check(state: str, node: NodeHealth | None, expected: str) -> None:
    assert volume_status(state, node) == expected


# -- an agent's pools and zone ------------------------------------------------------------------------


def agent_config(**values: Any) -> StorageAgentConfig:
    return load(StorageAgentConfig, "storage_agent", overrides=values, environ={})


def test_an_agent_serves_the_pools_its_config_names(tmp_path: Path) -> None:
    cfg = agent_config(pools=[f"fast={tmp_path / 'f'}", f"big={tmp_path / 'b'}"], availability_zone="us-east-1b")
    assert [(p.name, p.path) for p in cfg.served_pools()] == [("fast", tmp_path / "f"), ("big", tmp_path / "b")]
    assert cfg.for_pool(cfg.served_pools()[1]).pool_name == "big"
    assert agent_config().served_pools()[0].name == "default"
    from_env = load(StorageAgentConfig, "storage_agent", environ={"VBS_STORAGE_AGENT_POOLS": "a=/srv/a,b=/srv/b"})
    assert [p.name for p in from_env.served_pools()] == ["a", "b"]


@pytest.mark.parametrize(("pools", "message"), [
    (["a=/srv/a", "a=/srv/b"], "the pool name 'a' is given twice"),
    (["a=/srv/a", "b=/srv/a/"], "the pools 'a' and 'b' have the same directory"),
    (["Fast=/srv/a"], "must be NAME=PATH"),
    (["a"], "must be NAME=PATH"),
    (["a="], "must be NAME=PATH"),
    (["a/b=/srv/a"], "must be NAME=PATH"),
])
def test_an_agents_pools_must_be_well_named_and_distinct(pools: list[str], message: str) -> None:
    with pytest.raises(InvalidParameter, match=message):
        agent_config(pools=pools)


def test_pools_and_the_one_pool_path_are_not_given_together() -> None:
    with pytest.raises(InvalidParameter, match="give either pools"):
        agent_config(pools=["a=/srv/a"], pool_path="/srv/b")


def test_a_heartbeat_without_a_zone_still_validates() -> None:
    old = {"name": "s1", "url": "http://127.0.0.1:1", "address": "127.0.0.1", "started_at": utcnow().isoformat(),
           "pools": []}
    assert StorageHeartbeat.model_validate(old).availability_zone is None
    with pytest.raises(ValueError):
        StorageHeartbeat.model_validate({**old, "availability_zone": "Zone A"})


def test_a_create_without_hints_has_the_digest_older_controllers_stored() -> None:
    """A client token retried across the upgrade that added placement hints still matches."""
    req = CreateVolumeRequest(size_gib=1, client_token="t")
    before_hints = req.model_dump(exclude={"client_token", "availability_zone", "storage_node", "pool", "host",
                                           "persistent"})
    assert _digest(req) == hashlib.sha256(json.dumps(before_hints, sort_keys=True).encode()).hexdigest()
    assert _digest(CreateVolumeRequest(size_gib=1, pool="a")) != _digest(req)


# -- storage several agents share (a Ceph pool) --------------------------------------------------------


def shared_pool(name: str, capacity_gib: float, shared_id: str = "ceph:0c4e2f1a-0000-4000-8000-000000000001/vbs"
                ) -> PoolInfo:
    return pool(name, capacity_gib).model_copy(update={"backend": "rbd", "shared_id": shared_id})


def test_a_pool_two_agents_serve_is_counted_once_and_its_volumes_spread_over_both(db: Database) -> None:
    heartbeat(db, "s1", shared_pool("ceph", 10))
    heartbeat(db, "s2", shared_pool("ceph", 10))
    heartbeat(db, "s3", pool("files", 10))
    for _ in range(20):
        place(db)
    got = promised(db)
    # 10 GiB of Ceph and 10 GiB of files: half each, the Ceph half served by both agents in turn.
    assert got[("s3", "files")] == 10
    assert got[("s1", "ceph")] == 5 and got[("s2", "ceph")] == 5
    # Full: 10 GiB promised by each storage, not 20 by the Ceph pool as two pools would have.
    with pytest.raises(InsufficientCapacity):
        place(db)


def test_a_shared_pool_counts_the_volumes_of_a_dead_agent_too(db: Database) -> None:
    heartbeat(db, "s1", shared_pool("ceph", 4))
    heartbeat(db, "s2", shared_pool("ceph", 4))
    for _ in range(4):
        place(db)
    silence(db, "s1")
    with pytest.raises(InsufficientCapacity):
        place(db)  # s2 alone is left, but what s1 serves lives in the same 4 GiB
