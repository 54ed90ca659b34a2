"""The decisions of the migrate-instance workflow: where the guest is (from the two VMs' states), and the
engine going forward instead of back once a workflow is past its point of no return."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from tests.conftest import fresh_database, wait_until
from vbs.controller.db import Database, Instance, Node, Operation, OperationStep
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import HostNodeInfo
from vbs.controller.requests.migrate_instance import _check_hosts
from vbs.controller.workflows import Params, Step, StepContext, Workflow, WorkflowEngine
from vbs.controller.workflows.migrate_instance import GuestAt, locate_guest, migrating_volume_ids
from vbs.errors import DriverError, IncorrectState
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.host.hypervisors.qemu_slots import slot_of
from vbs.wire.host import PCI_SLOT_RE, MigrationInfo, StartMigration

pytestmark = pytest.mark.unit

INSTANCE = "i-0123456789abcdef0"


def vm(status: str, state: str | None = None) -> MigrationInfo:
    return MigrationInfo(vm_id="vm1", status=status, state=state)


@pytest.mark.parametrize(("source", "target", "disks", "where"), [
    # Nothing started yet: the destination waits.
    (vm("running"), vm("inmigrate"), False, GuestAt.SOURCE),
    # Streaming, or switching over (the source stopped its vCPUs for the last pass).
    (vm("running", "active"), vm("inmigrate", "active"), False, GuestAt.IN_FLIGHT),
    (vm("finish-migrate", "device"), vm("inmigrate", "active"), False, GuestAt.IN_FLIGHT),
    # The source handed over; the destination has not started the guest yet.
    (vm("postmigrate", "completed"), vm("inmigrate", "active"), False, GuestAt.IN_FLIGHT),
    # Completed: the destination runs the guest with its disks.
    (vm("postmigrate", "completed"), vm("running", "completed"), True, GuestAt.TARGET),
    # ... and the orchestrator already quit the source.
    (None, vm("running", "completed"), True, GuestAt.TARGET),
    # A failed or cancelled migration leaves the guest running on the source (QEMU resumes it).
    (vm("running", "failed"), None, False, GuestAt.SOURCE),
    (vm("running", "cancelled"), vm("inmigrate"), False, GuestAt.SOURCE),
    # A destination that runs but never was an incoming VM, while the source runs: not a migration.
    (vm("running"), vm("running"), True, GuestAt.SOURCE),
    # A running destination without the disks is not the guest's new home.
    (vm("postmigrate", "completed"), vm("running", "completed"), False, GuestAt.IN_FLIGHT),
    # The source handed over and the destination died: only the source can run the guest again.
    (vm("postmigrate", "completed"), None, False, GuestAt.STRANDED),
    # Both gone: nothing runs the guest.
    (None, None, False, GuestAt.NOWHERE),
    (None, vm("inmigrate"), False, GuestAt.NOWHERE),
])
def test_where_the_guest_is_follows_the_vms_states(source: MigrationInfo | None, target: MigrationInfo | None,
                                                   disks: bool, where: GuestAt) -> None:
    assert locate_guest(source, target, disks) == where


def test_the_reconciler_leaves_the_volumes_of_a_migration_alone() -> None:
    params = {"disks": [{"volume_id": "vol-0123456789abcdef0"}, {"volume_id": "vol-0123456789abcdef1"}]}
    assert migrating_volume_ids(params) == ["vol-0123456789abcdef0", "vol-0123456789abcdef1"]
    assert migrating_volume_ids({"scratch_volume_id": "vol-0123456789abcdef0"}) == []
    assert migrating_volume_ids({"disks": "nonsense"}) == []


def test_pci_slots_and_migration_uris_are_checked() -> None:
    # qom-get answers a device's devfn; device_add takes "slot.function" in hex (an int is misread).
    assert slot_of(16) == "02.0"
    assert slot_of(0xB1) == "16.1"
    assert PCI_SLOT_RE.match("02.0") and not PCI_SLOT_RE.match("16") and not PCI_SLOT_RE.match("02.8")
    # In a PCIe port: the port's id first (a QEMU id: a letter, then letters, digits, "_.-").
    assert PCI_SLOT_RE.match("rp1/00.0") and PCI_SLOT_RE.match("pci.3/00.0")
    for bad in ("/00.0", "1rp/00.0", "rp 1/00.0", "rp1/00.0/00.0", "rp1;x/00.0", "rp1/"):
        assert not PCI_SLOT_RE.match(bad), bad
    with pytest.raises(ValueError):
        StartMigration(uri="tcp:127.0.0.1:4444; rm -rf /")
    with pytest.raises(ValueError):
        StartMigration(uri="exec:cat > /tmp/x")
    assert StartMigration(uri="tcp:[::1]:4444").uri == "tcp:[::1]:4444"


class Moving(Params):
    pass


class ThreeStepMigration:
    """A migration as the engine sees it: three steps, the last one's completion the point of no return."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.moved = False  # the guest runs on the target
        self.fail: set[str] = set()
        self.lock = threading.Lock()

    def step(self, name: str, *, moves: bool = False) -> Step[Moving]:
        def do(ctx: StepContext[Moving]) -> None:
            with self.lock:
                self.calls.append(f"do:{name}")
            if moves:
                self.moved = True
            if name in self.fail:
                raise DriverError(f"{name} failed")

        def undo(ctx: StepContext[Moving]) -> None:
            with self.lock:
                self.calls.append(f"undo:{name}")
            if self.moved:
                raise IncorrectState("the guest runs on the target")

        return Step(name, do, undo)

    def workflow(self) -> Workflow[Moving]:
        return Workflow("move", Moving, "rollback",
                        (self.step("prepare"), self.step("migrate", moves=True), self.step("cleanup")),
                        committed=lambda ctx: self.moved)


@pytest.fixture
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database("sqlite", request, tmp_path)


def begin(engine: WorkflowEngine, db: Database) -> str:
    with db.session() as s:
        return engine.begin(s, engine.workflows["move"], INSTANCE, Moving())


def status(db: Database, op_id: str) -> str:
    with db.session() as s:
        op = s.get(Operation, op_id)
        assert op is not None
        return op.status


def test_a_failure_before_the_point_of_no_return_rolls_back(db: Database) -> None:
    world = ThreeStepMigration()
    world.fail = {"prepare"}
    engine = WorkflowEngine(db, [world.workflow()], None)  # type: ignore[arg-type]
    op_id = begin(engine, db)
    engine.run_now(op_id)
    assert world.calls == ["do:prepare", "undo:prepare"]
    assert status(db, op_id) == "rolled-back"


def test_a_failure_past_the_point_of_no_return_is_retried_forward(db: Database) -> None:
    world = ThreeStepMigration()
    world.fail = {"cleanup"}
    engine = WorkflowEngine(db, [world.workflow()], None, retry_interval=0.2)  # type: ignore[arg-type]
    op_id = begin(engine, db)
    engine.run_now(op_id)
    assert world.calls == ["do:prepare", "do:migrate", "do:cleanup"]  # no undo: the guest moved
    assert status(db, op_id) == "running"
    world.fail = set()
    engine.start()
    try:
        wait_until(lambda: status(db, op_id) == "succeeded", 10, what="the retry going forward")
    finally:
        engine.stop()
    assert world.calls[-1] == "do:cleanup" and not any(c.startswith("undo") for c in world.calls)


def test_a_restart_past_the_point_of_no_return_goes_forward(db: Database) -> None:
    world = ThreeStepMigration()
    wf = world.workflow()
    engine = WorkflowEngine(db, [wf], None)  # type: ignore[arg-type]
    op_id = begin(engine, db)
    # As if the controller died while "migrate" ran, and the migration completed meanwhile.
    with db.session() as s:
        for st in s.scalars(select(OperationStep).where(OperationStep.operation_id == op_id)):
            st.state = {0: "done", 1: "started"}.get(st.position, "pending")
    world.moved = True
    restarted = WorkflowEngine(db, [wf], None)  # type: ignore[arg-type]
    restarted.start()
    try:
        wait_until(lambda: status(db, op_id) == "succeeded", 10, what="resume forward")
    finally:
        restarted.stop()
    assert world.calls == ["do:migrate", "do:cleanup"]


def test_a_rollback_that_meets_a_completed_migration_turns_forward(db: Database) -> None:
    world = ThreeStepMigration()
    wf = world.workflow()
    engine = WorkflowEngine(db, [wf], None, retry_interval=0.2)  # type: ignore[arg-type]
    op_id = begin(engine, db)
    # The migrate step failed (its wait timed out, say) and the roll-back began; the migration completes
    # anyway before the undo of "migrate" runs: that undo refuses, and the next attempt goes forward.
    with db.session() as s:
        for st in s.scalars(select(OperationStep).where(OperationStep.operation_id == op_id)):
            st.state = {0: "done", 1: "started"}.get(st.position, "pending")
        op = s.get(Operation, op_id)
        assert op is not None
        op.status = "rolling-back"
    world.moved = True
    engine.start()
    try:
        wait_until(lambda: status(db, op_id) == "succeeded", 10, what="the roll-back turning forward")
    finally:
        engine.stop()
    assert "undo:prepare" not in world.calls and world.calls[-1] == "do:cleanup"


@pytest.mark.parametrize("scsi_host", ["source", "target"])
def test_a_host_on_the_virtio_scsi_bus_is_refused_before_any_step(db: Database, tmp_path: Path, scsi_host: str) -> None:
    """A QEMU driver on virtio-scsi reports no live migration (qemu_disk_bus): migrate-instance from or to
    its host is refused by the request, before an operation exists."""
    caps = {"source": QemuDriver(tmp_path).capabilities, "target": QemuDriver(tmp_path).capabilities}
    caps[scsi_host] = QemuDriver(tmp_path, disk_bus="virtio-scsi").capabilities
    now = utcnow()
    with db.session() as s:
        for name in ("source", "target"):
            s.add(Node(name=name, kind="host", url="http://127.0.0.1:1", address="127.0.0.1", last_heartbeat=now,
                       info=HostNodeInfo(hypervisor="qemu", capabilities=caps[name]).model_dump(mode="json")))
        inst = Instance(id=INSTANCE, host="source", vm_id="vm1", state="running", first_seen=now, last_seen=now)
        s.add(inst)
        s.flush()
        svc = SimpleNamespace(cfg=SimpleNamespace(heartbeat_timeout_s=30.0))
        with pytest.raises(IncorrectState, match=f"The hypervisor driver of '{scsi_host}' cannot live-migrate"):
            _check_hosts(s, svc, inst, "target")  # type: ignore[arg-type]
    with db.session() as s:
        assert s.scalars(select(Operation)).all() == []
