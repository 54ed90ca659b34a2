"""Check-then-write races on a real PostgreSQL (READ COMMITTED), through the controller's own code.

On SQLite a writing transaction holds the whole database, so these interleavings cannot happen
there. On PostgreSQL each statement sees what was committed when it started: a check of other rows
that runs while a competing transaction is still open sees the world before it. Each test lets one
API call (the "holder") make all its writes and stop just before its commit (its transaction began
an operation), starts the competing call
(the "waiter"), waits until PostgreSQL shows the waiter blocked on a lock (or finished: then nothing
serialised it), lets the holder commit, and checks that the outcome is one that a serial order of
the two could give.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import event, func, select, text

from tests.conftest import wait_until
from tests.postgres_cluster import PostgresForTests
from vbs import ids
from vbs.config import ControllerConfig
from vbs.controller.db import Attachment, Database, Instance, Node, Snapshot, Volume, VolumeUsage
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.controller.fleet.describe_nodes import drain_storage_node
from vbs.controller.fleet.nodes import StorageNodeInfo
from vbs.controller.requests.attach_volume import attach_volume
from vbs.controller.requests.create_snapshot import create_snapshot
from vbs.controller.requests.create_volume import create_volume
from vbs.controller.requests.delete_snapshot import delete_snapshot
from vbs.controller.requests.delete_volume import delete_volume
from vbs.controller.requests.modify_volume import modify_volume
from vbs.controller.rest.schemas.snapshots import CreateSnapshotRequest
from vbs.controller.rest.schemas.volumes import AttachVolumeRequest, CreateVolumeRequest, ModifyVolumeRequest
from vbs.controller.workflows import StepContext, WorkflowEngine
from vbs.controller.workflows.detach_volume import DetachParams, mark_detached
from vbs.controller.workflows.registry import WORKFLOWS
from vbs.errors import IncorrectState, InvalidParameter, LimitExceeded, SnapshotInUse, VbsError
from vbs.wire.storage import PoolInfo

pytestmark = pytest.mark.integration

GIB = 1 << 30


class PausingEngine(WorkflowEngine):
    """Records operations like the real engine but runs none; with ``pause``, the transaction that
    begins an operation stops just before its commit (all its writes made) until ``go``."""

    def __init__(self, db: Database, *, pause: bool) -> None:
        super().__init__(db, WORKFLOWS, None, threads=1)  # type: ignore[arg-type]
        self.pause = pause
        self.holding = threading.Event()
        self.go = threading.Event()

    def begin(self, session: Any, workflow: Any, resource_id: str, params: Any, *, new_resource: bool = False,
              stamp: Any = None) -> str:
        op_id = super().begin(session, workflow, resource_id, params, new_resource=new_resource, stamp=stamp)
        if self.pause:
            event.listen(session, "before_commit", self._hold, once=True)
        return op_id

    def _hold(self, session: Any) -> None:
        session.flush()
        self.holding.set()
        assert self.go.wait(30), "the test never let the holder commit"

    def submit(self, op_id: str, *, resuming: bool = False) -> None:
        pass


@pytest.fixture
def db(postgres: PostgresForTests) -> Iterator[Database]:
    d = Database(postgres.new_database())
    d.migrate()
    yield d
    d.dispose()


def controller(db: Database, engine: PausingEngine, **cfg: Any) -> Any:
    """What the API functions use of a controller: its config, DB and engine."""
    return SimpleNamespace(cfg=ControllerConfig(**cfg), db=db, engine=engine)


def waiting_for_a_lock(db: Database) -> int:
    with db.engine.connect() as conn:
        return int(conn.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                    "AND wait_event_type = 'Lock'")) or 0)


def race(db: Database, holder: Callable[[PausingEngine], Any], waiter: Callable[[PausingEngine], Any],
         ) -> tuple[Any, Any]:
    """Run ``holder`` up to its commit, then ``waiter``; let the holder commit once the waiter waits for
    a lock (or is done). What each returned or raised."""
    hold, free = PausingEngine(db, pause=True), PausingEngine(db, pause=False)
    results: dict[str, Any] = {}

    def run(name: str, call: Callable[[PausingEngine], Any], engine: PausingEngine) -> None:
        try:
            results[name] = call(engine)
        except (VbsError, AssertionError) as exc:
            results[name] = exc

    first = threading.Thread(target=run, args=("holder", holder, hold))
    first.start()
    assert hold.holding.wait(30), f"the holder never reached its commit: {results}"
    second = threading.Thread(target=run, args=("waiter", waiter, free))
    second.start()
    wait_until(lambda: waiting_for_a_lock(db) > 0 or not second.is_alive(), 30, what="the waiter blocked")
    time.sleep(0.2)  # the waiter stays blocked: nothing else would let it go
    hold.go.set()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    return results["holder"], results["waiter"]


# -- the world the calls act on ------------------------------------------------------------------------


def add_storage_node(db: Database, name: str = "storage-1", shared_id: str | None = None) -> None:
    info = StorageNodeInfo(pools=[PoolInfo(name="default", backend="file", capacity_bytes=100 * GIB,
                                           free_bytes=100 * GIB, clone_method="copy", point_in_time=True,
                                           shared_id=shared_id)])
    with db.session() as s:
        s.add(Node(name=name, kind="storage", url="http://127.0.0.1:1", address="127.0.0.1",
                   info=info.model_dump(mode="json"), started_at=utcnow(), last_heartbeat=utcnow()))


def add_vm(db: Database, vm_id: str, host: str = "host-1") -> str:
    with db.session() as s:
        if s.get(Node, (host, "host")) is None:
            s.add(Node(name=host, kind="host", url="http://127.0.0.1:2", address="127.0.0.1", info={},
                       started_at=utcnow(), last_heartbeat=utcnow() + timedelta(hours=1)))
        inst = Instance(id=ids.new_id("instance"), host=host, vm_id=vm_id, name=vm_id, state="running",
                        first_seen=utcnow(), last_seen=utcnow())
        s.add(inst)
    return inst.id


def add_volume(db: Database, status: str = "available", multi_attach: bool = False) -> str:
    now = utcnow()
    vid = ids.new_id("volume")
    with db.session() as s:
        s.add(Volume(id=vid, size_gib=1, comment="", volume_type="gp3", multi_attach=multi_attach,
                     placement="shared", storage_node="storage-1", pool="default", status=status, progress=100,
                     tenant=DEFAULT_TENANT, created_at=now, updated_at=now))
    return vid


def add_attachment(db: Database, volume_id: str, instance_id: str, vm_id: str, status: str = "attached") -> str:
    now = utcnow()
    aid = ids.new_id("attachment")
    with db.session() as s:
        s.add(Attachment(id=aid, volume_id=volume_id, instance_id=instance_id, host="host-1", vm_id=vm_id,
                         device="vdb", mode="rw", status=status, created_at=now, updated_at=now))
    return aid


def add_snapshot(db: Database, volume_id: str) -> str:
    now = utcnow()
    sid = ids.new_id("snapshot")
    with db.session() as s:
        s.add(Snapshot(id=sid, volume_id=volume_id, volume_size_gib=1, comment="", storage_node="storage-1",
                       pool="default", status="completed", progress=100, tenant=DEFAULT_TENANT, started_at=now,
                       updated_at=now))
    return sid


def status(db: Database, table: Any, row_id: str) -> str:
    with db.read() as s:
        return str(s.scalar(select(table.status).where(table.id == row_id)))


# -- the races ------------------------------------------------------------------------------------------


def test_a_detach_that_ends_while_another_attach_commits_never_frees_the_volume(db: Database) -> None:
    """The last step of a detach frees the volume if no live attachment is left; an attach of the same
    (multi-attach) volume to another VM commits meanwhile. The volume must stay in-use."""
    vm_a, vm_b = add_vm(db, "vm-a"), add_vm(db, "vm-b")
    vol = add_volume(db, "in-use", multi_attach=True)
    old = add_attachment(db, vol, vm_a, "vm-a", status="detaching")
    detach = DetachParams(attachment_id=old, node="storage-1", pool="default", host="host-1", vm_id="vm-a",
                          serial=ids.virtio_serial(vol))

    def attach(engine: PausingEngine) -> Any:
        return attach_volume(controller(db, engine), vol, AttachVolumeRequest(instance_id=vm_b, device="vdc"),
                             DEFAULT_TENANT)

    def finish_detach(_engine: PausingEngine) -> None:
        mark_detached(StepContext("op-0", vol, detach, SimpleNamespace(db=db)))  # type: ignore[arg-type]

    attached, _ = race(db, attach, finish_detach)
    assert not isinstance(attached, Exception), attached
    assert status(db, Attachment, old) == "detached"
    assert status(db, Attachment, attached.attachment_id) == "attaching"
    assert status(db, Volume, vol) == "in-use", "the volume was freed while an attachment of it is live"


def test_an_attach_that_waits_for_the_last_detach_finds_the_volume_free(db: Database) -> None:
    """The other order: the detach ends first (frees the volume), the attach waits for it, then takes it."""
    vm_a, vm_b = add_vm(db, "vm-a"), add_vm(db, "vm-b")
    vol = add_volume(db, "in-use")
    old = add_attachment(db, vol, vm_a, "vm-a", status="detaching")
    freed = threading.Event()

    def finish_detach(engine: PausingEngine) -> None:
        # mark_detached's own transaction, held open after its writes as the engine holds the others.
        from vbs.controller.db.locks import lock_rows
        from vbs.controller.db.states import AttachmentState
        from vbs.controller.db.transitions import transition
        from vbs.controller.workflows.attach_volume import release_volume_if_free

        with db.session() as s:
            lock_rows(s, Volume, vol)
            transition(s, Attachment, old, AttachmentState.DETACHED)
            release_volume_if_free(s, vol)
            s.flush()
            engine.holding.set()
            engine.go.wait(30)
        freed.set()

    def attach(engine: PausingEngine) -> Any:
        return attach_volume(controller(db, engine), vol, AttachVolumeRequest(instance_id=vm_b), DEFAULT_TENANT)

    _, attached = race(db, finish_detach, attach)
    assert freed.is_set()
    assert not isinstance(attached, Exception), attached
    assert status(db, Volume, vol) == "in-use"
    assert status(db, Attachment, attached.attachment_id) == "attaching"


def test_a_volume_is_not_deleted_under_a_snapshot_that_committed_meanwhile(db: Database) -> None:
    vol = add_volume(db)

    def snapshot(engine: PausingEngine) -> Any:
        return create_snapshot(controller(db, engine), CreateSnapshotRequest(volume_id=vol), DEFAULT_TENANT)

    def delete(engine: PausingEngine) -> Any:
        return delete_volume(controller(db, engine), vol, DEFAULT_TENANT)

    snap, deleted = race(db, snapshot, delete)
    assert not isinstance(snap, Exception), snap
    assert isinstance(deleted, IncorrectState), deleted
    assert status(db, Volume, vol) == "available"
    assert status(db, Snapshot, snap.snapshot_id) == "pending"


def test_a_snapshot_is_not_deleted_under_a_volume_that_started_copying_it(db: Database) -> None:
    add_storage_node(db)
    snap = add_snapshot(db, add_volume(db))

    def clone(engine: PausingEngine) -> Any:
        return create_volume(controller(db, engine), CreateVolumeRequest(snapshot_id=snap), DEFAULT_TENANT)

    def delete(engine: PausingEngine) -> Any:
        return delete_snapshot(controller(db, engine), snap, DEFAULT_TENANT)

    made, deleted = race(db, clone, delete)
    assert not isinstance(made, Exception), made
    assert isinstance(deleted, SnapshotInUse | IncorrectState), deleted
    assert status(db, Snapshot, snap) == "completed"
    assert status(db, Volume, made.volume_id) == "creating"


def test_two_snapshots_of_one_tenant_cannot_both_take_its_last_place(db: Database) -> None:
    """Snapshots of two different volumes share no row: only the tenant's lock serialises the quota."""
    one, two = add_volume(db), add_volume(db)

    def snapshot_of(vol: str) -> Callable[[PausingEngine], Any]:
        return lambda engine: create_snapshot(controller(db, engine, quota_snapshots=1),
                                              CreateSnapshotRequest(volume_id=vol), DEFAULT_TENANT)

    first, second = race(db, snapshot_of(one), snapshot_of(two))
    assert not isinstance(first, Exception), first
    assert isinstance(second, LimitExceeded) and second.code == "SnapshotLimitExceeded", second
    with db.read() as s:
        assert len(s.scalars(select(Snapshot.id)).all()) == 1


def two_creates(db: Database, size_gib: int, **cfg: Any) -> tuple[Any, Any]:
    """Two creates of one tenant on one storage node, raced: what the holder and the waiter got."""
    add_storage_node(db)

    def create(engine: PausingEngine) -> Any:
        return create_volume(controller(db, engine, **cfg), CreateVolumeRequest(size_gib=size_gib), DEFAULT_TENANT)

    return race(db, create, create)


def test_two_creates_cannot_both_take_a_pools_last_room(db: Database) -> None:
    """Overcommit 1: the pool promises its 100 GiB once; two 60 GiB creates race for it."""
    first, second = two_creates(db, 60, overcommit_ratio=1.0)
    assert not isinstance(first, Exception), first
    assert isinstance(second, VbsError) and second.code == "InsufficientVolumeCapacity", second


def test_two_creates_through_two_agents_of_a_shared_pool_cannot_both_take_its_last_room(db: Database) -> None:
    """Each agent records its volumes on its own usage row, and two tenants' creates share no other
    row: the storage's own lock serialises them."""
    add_storage_node(db, "storage-1", shared_id="ceph:rbd")
    add_storage_node(db, "storage-2", shared_id="ceph:rbd")

    def create_on(node: str, tenant: str) -> Callable[[PausingEngine], Any]:
        return lambda engine: create_volume(controller(db, engine, overcommit_ratio=1.0),
                                            CreateVolumeRequest(size_gib=60, storage_node=node), tenant)

    first, second = race(db, create_on("storage-1", DEFAULT_TENANT), create_on("storage-2", "tenant-b"))
    assert not isinstance(first, Exception), first
    assert isinstance(second, VbsError) and second.code == "InsufficientVolumeCapacity", second


def test_a_create_does_little_while_it_holds_the_locks_every_create_waits_on(db: Database) -> None:
    """Creates meet at the usage rows their insert updates (their tenant's, their pool's), from that
    insert to their commit, on every controller. Placement, the operation's time and fence and the
    answer's node health are read and the operation's rows written before: after the insert only the
    check of those rows runs."""
    add_storage_node(db)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        out = create_volume(controller(db, PausingEngine(db, pause=False)), CreateVolumeRequest(size_gib=1),
                            DEFAULT_TENANT)
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    assert out.storage_node == "storage-1" and out.availability_zone and out.volume_status == "insufficient-data"
    assert not any(st.endswith("FOR UPDATE") for st in statements), "a create locked rows other creates read"
    locked = next(i for i, st in enumerate(statements) if st.startswith("INSERT INTO volumes "))
    before, inside = statements[:locked], statements[locked:]
    assert any("clock_timestamp()" in st and "nextval" in st for st in before), before
    assert any("pg_advisory_xact_lock_shared" in st for st in before), before
    assert not any("clock_timestamp()" in st or "nextval" in st or "advisory" in st for st in inside), inside
    # The volume and the check of the usage rows it updated (the operation's rows come before).
    assert len(inside) <= 2, "\n".join(inside)


def test_creates_on_other_nodes_for_other_tenants_do_not_wait_for_each_other(db: Database) -> None:
    """A create that has made all its writes holds nothing another tenant's create on another node
    needs: that one commits first. (Placement used to lock every storage node row until commit.)"""
    add_storage_node(db, "storage-1")
    add_storage_node(db, "storage-2")
    holder = PausingEngine(db, pause=True)
    results: dict[str, Any] = {}

    def run(name: str, engine: PausingEngine, tenant: str, node: str) -> None:
        try:
            results[name] = create_volume(controller(db, engine), CreateVolumeRequest(size_gib=1, storage_node=node),
                                          tenant)
        except VbsError as exc:
            results[name] = exc

    first = threading.Thread(target=run, args=("holder", holder, DEFAULT_TENANT, "storage-1"))
    first.start()
    try:
        assert holder.holding.wait(30), results
        second = threading.Thread(target=run, args=("other", PausingEngine(db, pause=False), "tenant-b",
                                                     "storage-2"))
        second.start()
        second.join(20)
        assert not second.is_alive(), "the other tenant's create waited for the first one's commit"
        assert results["other"].storage_node == "storage-2", results
    finally:
        holder.go.set()
        first.join(30)
    assert results["holder"].storage_node == "storage-1", results
    assert status(db, Volume, results["holder"].volume_id) == status(db, Volume, results["other"].volume_id)


def test_two_creates_of_one_tenant_cannot_both_take_its_last_place(db: Database) -> None:
    """The quota is checked after the insert, on the tenant's usage row that insert locked."""
    first, second = two_creates(db, 1, quota_volumes=1)
    assert not isinstance(first, Exception), first
    assert isinstance(second, LimitExceeded) and second.code == "VolumeLimitExceeded", second
    with db.read() as s:
        assert s.scalars(select(Volume.id)).all() == [first.volume_id]


def test_a_growth_waits_for_a_create_in_flight_and_counts_its_gib(db: Database) -> None:
    """A growth takes placement and the tenant exclusively, a create holds them shared until it
    commits: the growth then sees the create's GiB (quota 10 GiB: 1 held, a 6 GiB create, a growth
    of 4)."""
    add_storage_node(db)
    vol = add_volume(db)

    def create(engine: PausingEngine) -> Any:
        return create_volume(controller(db, engine, quota_gib=10), CreateVolumeRequest(size_gib=6), DEFAULT_TENANT)

    def grow(engine: PausingEngine) -> Any:
        return modify_volume(controller(db, engine, quota_gib=10), vol, ModifyVolumeRequest(size_gib=5),
                             DEFAULT_TENANT)

    made, grown = race(db, create, grow)
    assert not isinstance(made, Exception), made
    assert isinstance(grown, LimitExceeded) and grown.code == "VolumeLimitExceeded", grown
    with db.read() as s:
        total = s.scalar(select(func.sum(Volume.size_gib)))
        usage = s.scalar(select(VolumeUsage.gib).where(VolumeUsage.scope == "tenant",
                                                       VolumeUsage.owner == DEFAULT_TENANT))
    assert total == usage == 7, (total, usage)


def test_a_create_that_waits_for_a_growth_counts_the_gib_it_was_promised(db: Database) -> None:
    """The other order: the growth commits first, and its volume grows only when its workflow records
    it. The create still counts those GiB, in its tenant's quota and in its pool's room."""
    add_storage_node(db)
    vol = add_volume(db)

    def grow(engine: PausingEngine) -> Any:
        return modify_volume(controller(db, engine, quota_gib=10), vol, ModifyVolumeRequest(size_gib=5),
                             DEFAULT_TENANT)

    def create(engine: PausingEngine) -> Any:
        return create_volume(controller(db, engine, quota_gib=10), CreateVolumeRequest(size_gib=6), DEFAULT_TENANT)

    grown, made = race(db, grow, create)
    assert not isinstance(grown, Exception), grown
    assert isinstance(made, LimitExceeded) and made.code == "VolumeLimitExceeded", made
    # The pool's room (100 GiB, overcommit 1): 1 held and 4 growing leave 95.
    too_big = controller(db, PausingEngine(db, pause=False), overcommit_ratio=1.0)
    with pytest.raises(VbsError) as refused:
        create_volume(too_big, CreateVolumeRequest(size_gib=96), DEFAULT_TENANT)
    assert refused.value.code == "InsufficientVolumeCapacity"
    assert create_volume(too_big, CreateVolumeRequest(size_gib=95), DEFAULT_TENANT).size_gib == 95


def drain_held_open(db: Database, name: str, go: threading.Event, holding: threading.Event) -> threading.Thread:
    """A drain of ``name`` that has made its change and waits for ``go`` to commit."""
    def run() -> None:
        with db.session() as s:
            drain_storage_node(s, name, drained=True, timeout_s=60, default_zone="zone-a")
            holding.set()
            assert go.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_drain_waits_for_the_creates_in_flight_and_the_creates_after_it_see_it(db: Database) -> None:
    add_storage_node(db, "storage-1")

    def create(engine: PausingEngine) -> Any:
        return create_volume(controller(db, engine), CreateVolumeRequest(size_gib=1), DEFAULT_TENANT)

    def drain(_engine: PausingEngine) -> Any:
        with db.session() as s:
            return drain_storage_node(s, "storage-1", drained=True, timeout_s=60, default_zone="zone-a")

    made, drained = race(db, create, drain)
    assert not isinstance(made, Exception) and not isinstance(drained, Exception), (made, drained)
    assert made.volume_id in {r.id for r in drained.volumes}, "the drain missed a create that committed first"

    with db.session() as s:
        drain_storage_node(s, "storage-1", drained=False, timeout_s=60, default_zone="zone-a")
    go, holding = threading.Event(), threading.Event()
    thread = drain_held_open(db, "storage-1", go, holding)
    results: dict[str, Any] = {}

    def late_create() -> None:
        try:
            results["create"] = create(PausingEngine(db, pause=False))
        except VbsError as exc:
            results["create"] = exc

    try:
        assert holding.wait(30)
        waiter = threading.Thread(target=late_create)
        waiter.start()
        wait_until(lambda: waiting_for_a_lock(db) > 0, 30, what="the create waiting for the drain")
    finally:
        go.set()
        thread.join(30)
    waiter.join(30)
    assert isinstance(results["create"], VbsError) and results["create"].code == "InsufficientVolumeCapacity", \
        results


def test_two_attaches_to_one_vm_cannot_both_take_its_device(db: Database) -> None:
    vm = add_vm(db, "vm-a")
    one, two = add_volume(db), add_volume(db)

    def attach(vol: str) -> Callable[[PausingEngine], Any]:
        return lambda engine: attach_volume(controller(db, engine), vol,
                                            AttachVolumeRequest(instance_id=vm, device="vdb"), DEFAULT_TENANT)

    first, second = race(db, attach(one), attach(two))
    assert not isinstance(first, Exception), first
    assert isinstance(second, InvalidParameter), second
    assert status(db, Volume, two) == "available"


def test_a_transaction_that_meets_a_deadlock_changes_nothing_and_says_retry(db: Database) -> None:
    """Two transactions lock two rows in opposite orders: PostgreSQL cancels one of them. That one is
    answered 503 RetryLater (the SDKs retry), not 500; the other commits."""
    a, b = add_volume(db), add_volume(db)
    first_locked, second_locked = threading.Event(), threading.Event()
    outcomes: dict[str, str] = {}

    def one(name: str, mine: str, other: str, locked: threading.Event, wait_for: threading.Event) -> None:
        try:
            with db.session() as s:
                s.execute(select(Volume).where(Volume.id == mine).with_for_update())
                s.execute(text("UPDATE volumes SET comment = :c WHERE id = :id"), {"c": name, "id": mine})
                locked.set()
                wait_for.wait(10)
                s.execute(text("UPDATE volumes SET comment = :c WHERE id = :id"), {"c": name, "id": other})
            outcomes[name] = "committed"
        except VbsError as exc:
            outcomes[name] = f"{exc.code} {exc.status}"

    threads = [threading.Thread(target=one, args=("x", a, b, first_locked, second_locked)),
               threading.Thread(target=one, args=("y", b, a, second_locked, first_locked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes.values()) == ["RetryLater 503", "committed"], outcomes
    winner = next(n for n, o in outcomes.items() if o == "committed")
    with db.session() as s:
        assert set(s.scalars(select(Volume.comment).where(Volume.id.in_([a, b])))) == {winner}
