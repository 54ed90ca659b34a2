"""Crashes on the rbd backend: SIGKILL the storage agent (or the controller, or the OSD) in the middle
of each storage workflow, restart it, and check that the pool converges on what the DB says.

Workflows (``Flow``): create-volume, create-volume-from-snapshot (an RBD clone), create-snapshot,
delete-volume, delete-volume-with-snapshot (the image goes to the RBD trash), delete-snapshot, and
delete-last-snapshot (of a deleted volume: its trashed image is purged with it).

How each is interrupted (``mode``):

* ``inflight``: the storage agent is SIGKILLed while its call to the ``rbd`` tool that changes the
  pool runs (the test watches the agent's children for that ``rbd`` argv), and so is that tool
  (as the node's service manager would kill the whole unit). Snapshot creates and removals go through
  the agent's rbd worker (librbd, no tool), so their points run the agent with ``--no-rbd-worker``
  (WORKER_TOOLS); a worker killed mid-change is tests/test_rbd_worker.py's. The controller lives on and repeats
  the call once the agent is back 1 s later.
* ``agent-frozen``: ``VBS_CRASH_AT=<kind>:<step>:started`` kills the controller before its call;
  the agent is SIGKILLed while the controller is down; the controller is restarted first, so its
  recovery meets the dead agent; the agent comes back 1 s later.
* ``controller-done``: the controller dies right after the step's call succeeded; after the restart
  a create rolls back (the controller undoes the image it made: ``rbd rm``), a delete rolls forward.
* ``osd``: the cluster's only OSD is SIGKILLed before the workflow starts; its call blocks in the
  ``rbd`` tool; the OSD is started again ``OSD_DOWN_S`` later (CI: before the controller's 30 s call
  timeout; the torture run: after it, so the call times out and is retried).

After each point the world check ``tests/world.py::rbd_disagreements`` runs until ``rbd ls``,
``rbd snap ls`` of every image and ``rbd trash ls`` agree with the DB and no operation or resource is
in a transitional state (no orphan image, snapshot or ``rbd_id`` object, none missing), or fails
after 90 s; then the workflow's own outcome is checked (a create finished with the right data or
rolled back, a delete finished). The periodic reconciliation is off: what converges is the
workflows and the agent on their own.

The default run keeps ``CI_POINTS``; the whole matrix is marked ``torture``.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.ceph_cluster import CephForTests
from tests.conftest import Services, wait_until
from tests.rbd_cloud import MIB, rbd_export_sha256
from tests.world import (
    converge_rbd,
    kill_mid_tool,
    new_operation,
    rbd_disagreements,
    read_db,
    send_request,
    step_state,
    storage_request,
)

pytestmark = pytest.mark.integration

DATA_MIB = 8
DATA_BYTE = 0xAB
AGENT_DOWN_S = 1.0
OSD_DOWN_S = {"ci": 8.0, "torture": 45.0}
CONVERGE_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Flow:
    name: str
    kind: str  # the workflow kind (VBS_CRASH_AT, operations.kind)
    step: str  # its step that calls the storage agent
    tool: tuple[str, ...]  # the rbd subcommand of that call that changes the pool
    resume: str  # rollback | forward
    request: str  # the storage workflow whose request starts it (tests.world.storage_request)
    needs_snapshot: bool = False


FLOWS = {f.name: f for f in (
    Flow("create-volume", "create-volume", "storage-create", ("create",), "rollback", "create-volume"),
    Flow("create-volume-from-snapshot", "create-volume", "storage-create", ("clone",), "rollback",
         "create-volume-from-snapshot", True),
    Flow("create-snapshot", "create-snapshot", "storage-snapshot", ("snap", "create"), "rollback", "create-snapshot"),
    Flow("delete-volume", "delete-volume", "storage-delete", ("rm",), "forward", "delete-volume"),
    Flow("delete-volume-with-snapshot", "delete-volume", "storage-delete", ("trash", "mv"), "forward", "delete-volume",
         True),
    Flow("delete-snapshot", "delete-snapshot", "storage-delete", ("snap", "rm"), "forward", "delete-snapshot", True),
    Flow("delete-last-snapshot", "delete-snapshot", "storage-delete", ("snap", "rm"), "forward", "delete-snapshot",
         True),
)}
MODES = ("inflight", "agent-frozen", "controller-done", "osd")
# The changes the agent's long-lived rbd worker makes through librbd (storage/backends/rbd_worker_main.py),
# which run no rbd tool: their inflight points run the agent with --no-rbd-worker, so that the tool
# call can be caught; a worker killed in the middle of such a change is tests/test_rbd_worker.py's.
WORKER_TOOLS = {("snap", "create"), ("snap", "rm")}
CI_POINTS = {
    "create-volume-from-snapshot-inflight",
    "delete-volume-with-snapshot-inflight",
    "create-volume-agent-frozen",
    "create-volume-from-snapshot-controller-done",
    "create-snapshot-osd",
}


def _params() -> list[Any]:
    out = []
    for flow in FLOWS.values():
        for mode in MODES:
            pid = f"{flow.name}-{mode}"
            out.append(pytest.param(flow, mode, id=pid, marks=() if pid in CI_POINTS else (pytest.mark.torture,)))
    return out


class RbdServices(Services):
    """Controller and a storage agent ``--backend rbd`` on one pool, as processes a test may kill."""

    def __init__(self, tmp: Path, ceph: CephForTests, pool: str) -> None:
        super().__init__(tmp)
        self.ceph = ceph
        self.pool = pool
        self.env = {**self.env, "VBS_CONTROLLER_RECONCILE_INTERVAL_S": "86400"}

    def start_agent(self, *extra: str) -> None:
        super().start_agent("--backend", "rbd", "--export", "nbd", "--ceph-conf", str(self.ceph.conf_path),
                            "--ceph-user", "admin", "--rbd-pool", self.pool, *extra)

    def kill_agent(self) -> None:
        assert self.agent is not None
        self.agent.kill()
        self.agent.wait(30)

    def converge(self) -> float:
        return converge_rbd(self.data_dir, self.vbs.http, self.ceph.conf_path, self.pool, CONVERGE_TIMEOUT_S)

    def spec(self, image: str) -> str:
        return f"{self.pool}/{image}"


@pytest.fixture
def svc(ceph: CephForTests, tmp_path: Path) -> Iterator[RbdServices]:
    s = RbdServices(tmp_path, ceph, ceph.new_pool())
    try:
        s.start_controller()
        s.start_agent()
        yield s
    finally:
        s.stop()
        _ensure_osds_running(ceph)


def _ensure_osds_running(ceph: CephForTests) -> None:
    """A failed ``osd`` point must not leave the session's cluster without its OSD."""
    running = ceph.cluster.pids
    for osd_id in ceph.cluster.osd_ids():
        if f"osd.{osd_id}" not in running:
            ceph.cluster.start_osd(osd_id)
    ceph.cluster.wait_clean(300)


def _write_data(s: RbdServices, volume_id: str) -> None:
    """DATA_MIB MiB of DATA_BYTE at the start of the volume's image, written through librbd."""
    opts = (f"driver=raw,file.driver=rbd,file.pool={s.pool},file.image={volume_id},"
            f"file.conf={s.ceph.conf_path},file.user=admin")
    subprocess.run(["qemu-io", "--image-opts", "-c", f"write -P {DATA_BYTE:#x} 0 {DATA_MIB}M", opts],
                   capture_output=True, timeout=120, check=True)


DATA_SHA = hashlib.sha256(bytes([DATA_BYTE]) * (DATA_MIB * MIB)).hexdigest()


@dataclass
class Prep:
    volume_id: str = ""
    snapshot_id: str = ""
    known: set[str] = field(default_factory=set)


def prepare(s: RbdServices, flow: Flow) -> Prep:
    prep = Prep()
    if flow.name != "create-volume":
        prep.volume_id = s.vbs.create_volume(size_gib=1)["volume_id"]
        s.vbs.wait_volume(prep.volume_id, "available", timeout=120)
        _write_data(s, prep.volume_id)
    if flow.needs_snapshot:
        r = s.vbs.http.post("/v1/snapshots", json={"volume_id": prep.volume_id})
        assert r.status_code == 200, r.text
        prep.snapshot_id = r.json()["snapshot_id"]
        s.vbs.wait_snapshot(prep.snapshot_id, "completed", timeout=120)
    if flow.name == "delete-last-snapshot":
        assert s.vbs.http.delete(f"/v1/volumes/{prep.volume_id}").status_code == 200
        s.vbs.wait_volume(prep.volume_id, "deleted", timeout=120)
    s.converge()
    prep.known = set(read_db(s.data_dir).operations)
    return prep


def start_flow(s: RbdServices, flow: Flow, prep: Prep, *, crashing: bool) -> None:
    """Ask for the workflow. A controller that crashes at once may die before it answers: that is fine."""
    method, path, body = storage_request(flow.request, prep.volume_id, prep.snapshot_id)
    send_request(s.vbs.http, method, path, body, crashing=crashing)


def kill_agent_mid_call(s: RbdServices, flow: Flow) -> bool:
    """SIGKILL the agent and its ``rbd`` child the moment that child runs ``flow.tool``; whether the
    tool was still at work when it was killed."""
    assert s.agent is not None
    return kill_mid_tool(s.agent, "rbd", flow.tool)


def check_outcome(s: RbdServices, flow: Flow, mode: str, prep: Prep, op: dict[str, Any]) -> str:
    """The workflow's own result, once the world agrees; returns the operation's final status."""
    db = read_db(s.data_dir)
    status = str(db.operations[op["id"]]["status"])
    if flow.resume == "forward":
        allowed = {"succeeded"}
    elif mode in ("agent-frozen", "controller-done"):
        allowed = {"rolled-back"}  # a create interrupted by a controller crash rolls back
    else:
        allowed = {"succeeded", "rolled-back"}
    assert status in allowed, f"operation {op['id']} ended {status} ({db.operations[op['id']]['error']})"
    done = status == "succeeded"
    rid = op["resource_id"]
    if flow.kind == "create-volume":
        vol = db.volumes[rid]
        assert vol["status"] == ("available" if done else "error"), vol
        if done and flow.name == "create-volume-from-snapshot":
            assert rbd_export_sha256(s.ceph.conf_path, s.spec(rid), DATA_MIB) == DATA_SHA
    elif flow.kind == "create-snapshot":
        snap = db.snapshots[rid]
        assert snap["status"] == ("completed" if done else "error"), snap
        if done:
            assert rbd_export_sha256(s.ceph.conf_path, s.spec(f"{prep.volume_id}@{rid}"), DATA_MIB) == DATA_SHA
    elif flow.kind == "delete-volume":
        assert db.volumes[rid]["status"] == "deleted", db.volumes[rid]
    else:
        assert db.snapshots[rid]["status"] == "deleted", db.snapshots[rid]
    return status


def run_point(s: RbdServices, flow: Flow, mode: str, osd_down_s: float) -> tuple[float, str]:
    """Interrupt ``flow`` as ``mode`` says; (seconds from the restart until the world agreed, op status)."""
    prep = prepare(s, flow)
    if mode in ("agent-frozen", "controller-done"):
        moment = "started" if mode == "agent-frozen" else "done"
        s.restart_controller(VBS_CRASH_AT=f"{flow.kind}:{flow.step}:{moment}")
        start_flow(s, flow, prep, crashing=True)
        op = new_operation(s.data_dir, flow.kind, prep.known)
        s.wait_controller_killed()
        if mode == "agent-frozen":
            s.kill_agent()
        t0 = time.monotonic()
        s.start_controller()
        if mode == "agent-frozen":
            time.sleep(AGENT_DOWN_S)
            s.start_agent()
    elif mode == "inflight":
        if flow.tool in WORKER_TOOLS:  # the agent's rbd worker would serve it: no tool process to catch
            s.kill_agent()
            s.start_agent("--no-rbd-worker")
        start_flow(s, flow, prep, crashing=False)
        if not kill_agent_mid_call(s, flow):
            print(f"{flow.name}: rbd {' '.join(flow.tool)} had finished when the agent was killed")
        op = new_operation(s.data_dir, flow.kind, prep.known)
        t0 = time.monotonic()
        time.sleep(AGENT_DOWN_S)
        s.start_agent()
    else:
        osd = s.ceph.cluster.osd_ids()[0]
        s.ceph.cluster.kill_osd(osd)
        start_flow(s, flow, prep, crashing=False)
        op = new_operation(s.data_dir, flow.kind, prep.known)
        wait_until(lambda: step_state(s.data_dir, op["id"], flow.step) in ("started", "done"), 60,
                   what=f"step {flow.step} started")
        time.sleep(osd_down_s)
        assert step_state(s.data_dir, op["id"], flow.step) == "started", "the step finished without the OSD"
        s.ceph.cluster.start_osd(osd)
        t0 = time.monotonic()
        s.ceph.cluster.wait_clean(300)
    s.converge()
    seconds = time.monotonic() - t0
    return seconds, check_outcome(s, flow, mode, prep, op)


@pytest.mark.parametrize(("flow", "mode"), _params())
def test_rbd_crash_point(svc: RbdServices, flow: Flow, mode: str, request: pytest.FixtureRequest) -> None:
    osd_down_s = OSD_DOWN_S["ci" if request.node.callspec.id in CI_POINTS else "torture"]
    seconds, status = run_point(svc, flow, mode, osd_down_s)
    print(f"{flow.name}-{mode}: {status}, the world agreed {seconds:.1f} s after the restart")


def test_the_ci_points_are_points_of_the_matrix() -> None:
    assert CI_POINTS <= {f"{f}-{m}" for f in FLOWS for m in MODES}
    assert {p.split("-")[-1] for p in CI_POINTS} >= {"inflight", "frozen", "done", "osd"}


def test_the_rbd_world_check_finds_what_disagrees_with_the_db(svc: RbdServices) -> None:
    """The oracle is not vacuous: each kind of drift it is meant to catch, made by hand, is reported."""
    vol = svc.vbs.create_volume(size_gib=1)["volume_id"]
    svc.vbs.wait_volume(vol, "available", timeout=120)
    svc.converge()
    conf, pool = str(svc.ceph.conf_path), svc.pool

    def tool(*argv: str) -> None:
        subprocess.run([argv[0], "--conf", conf, *argv[1:]], capture_output=True, check=True, timeout=120)

    stray, stray_snap = "vol-0123456789abcdef0", "snap-0123456789abcdef0"
    tool("rbd", "create", "--size", "1M", f"{pool}/{stray}")
    tool("rbd", "snap", "create", f"{pool}/{vol}@{stray_snap}")
    tool("rados", "-p", pool, "create", "rbd_id.vol-0fedcba9876543210")
    tool("rbd", "resize", "--size", "2G", f"{pool}/{vol}")
    found = "\n".join(rbd_disagreements(svc.data_dir, svc.vbs.http, svc.ceph.conf_path, pool))
    assert f"orphan image {pool}/{stray}" in found, found
    assert f"orphan snapshot {pool}/{vol}@{stray_snap}" in found, found
    assert "rbd_id.vol-0fedcba9876543210 of an image rbd does not list" in found, found
    assert f"image {pool}/{vol} has {2 << 30} bytes" in found, found
    tool("rbd", "snap", "rm", f"{pool}/{vol}@{stray_snap}")
    tool("rbd", "rm", f"{pool}/{vol}")
    found = "\n".join(rbd_disagreements(svc.data_dir, svc.vbs.http, svc.ceph.conf_path, pool))
    assert f"missing image {pool}/{vol}" in found, found
