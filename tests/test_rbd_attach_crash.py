"""Crashes while attaching and detaching natively opened RBD volumes (the host's QEMU opens the image
as the attachment's own cephx user ``client.vbs.<host>.<volume>``): the attach/detach part of the
crash matrix of ``tests/test_torture.py``, on the rbd backend and a TCG guest that sees its disks.

Points (``Point``), for attach-volume (storage-export, host-attach, mark-attached; rolls back) and
detach-volume (host-detach, storage-unexport, mark-detached; rolls forward):

* ``controller`` at each step ``started`` and ``done``: ``VBS_CRASH_AT=<kind>:<step>:<moment>`` makes
  the controller SIGKILL itself there; it is restarted at once and resumes the operation.
* ``storage-agent`` ``inflight``: SIGKILLed (with its child) while the ``ceph auth get-or-create``
  (storage-export) or ``ceph auth rm`` (storage-unexport) it runs for the step is at work; back 1 s later.
* ``host-agent`` ``inflight``: the guest's QEMU is frozen (SIGSTOP) before the flow, so the host agent's
  QMP calls of host-attach (object-add, blockdev-add, device_add) or host-detach (device_del) block in
  it; once the step is ``started`` the host agent is SIGKILLed, QEMU thawed, the agent back 1 s later.

After each point the world check runs until it agrees, or fails after ``CONVERGE_TIMEOUT_S``:
``rbd_disagreements`` (the pool, the DB, the controller's ``/v1/admin/check``),
``cephx_user_disagreements`` (one cephx user per live attachment, none other) and the guest (a disk
by its serial exactly for each live attachment, its QEMU node of driver ``rbd``). Then the point's
own outcome: an attach finished (in-use, attached) or rolled back (available, no attachment live) —
a controller crash before ``mark-attached`` is done rolls back — and a detach finished. The periodic
reconciliation is off. One cloud per module serves every point (a failed point makes the next one
start a fresh cloud); ``CI_POINTS`` run by default, the rest is marked ``torture``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.ceph_cluster import CephForTests
from tests.clouds import Reusable
from tests.conftest import wait_until
from tests.rbd_cloud import RbdCloud, running_rbd_cloud
from tests.test_rbd_native import disk_protocol_nodes
from tests.world import (
    cephx_user_disagreements,
    converge_rbd,
    kill_mid_tool,
    new_operation,
    read_db,
    step_state,
)
from vbs.ids import virtio_serial

pytestmark = pytest.mark.integration

CONVERGE_TIMEOUT_S = 90.0
AGENT_DOWN_S = 1.0
INFLIGHT_GRACE_S = 0.5
ATTACH, DETACH = "attach-volume", "detach-volume"
STEPS = {ATTACH: ("storage-export", "host-attach", "mark-attached"),
         DETACH: ("host-detach", "storage-unexport", "mark-detached")}
# The step each agent's in-flight kill hits, and (storage agent) the tool call it is killed in.
INFLIGHT = {("storage-agent", ATTACH): ("storage-export", ("auth", "get-or-create")),
            ("storage-agent", DETACH): ("storage-unexport", ("auth", "rm")),
            ("host-agent", ATTACH): ("host-attach", ()),
            ("host-agent", DETACH): ("host-detach", ())}


@dataclass(frozen=True)
class Point:
    component: str  # controller | storage-agent | host-agent
    flow: str  # attach-volume | detach-volume
    step: str
    moment: str  # controller: started | done; agents: inflight

    @property
    def id(self) -> str:
        return f"{self.component}-{self.flow}-{self.step}-{self.moment}"


MATRIX = [Point("controller", flow, step, moment) for flow in (ATTACH, DETACH) for step in STEPS[flow]
          for moment in ("started", "done")]
MATRIX += [Point(component, flow, INFLIGHT[component, flow][0], "inflight")
           for component in ("storage-agent", "host-agent") for flow in (ATTACH, DETACH)]
CI_POINTS = {
    "controller-attach-volume-mark-attached-done",
    "controller-detach-volume-host-detach-started",
    "storage-agent-attach-volume-storage-export-inflight",
    "storage-agent-detach-volume-storage-unexport-inflight",
    "host-agent-attach-volume-host-attach-inflight",
}


# One cloud for the module; a failed point makes the next one start afresh.
Clouds = Reusable[RbdCloud]


@pytest.fixture(scope="module")
def clouds(ceph: CephForTests, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clouds]:
    tmp = tmp_path_factory.mktemp("rbd-attach-crash")
    with Clouds(lambda n: running_rbd_cloud(ceph, ceph.new_pool(), tmp / f"cloud-{n}", native=True,
                                            VBS_CONTROLLER_RECONCILE_INTERVAL_S="86400")) as c:
        yield c


def guest_disagreements(c: RbdCloud) -> list[str]:
    """The guest's disks against the DB: one by its serial for each live attachment (opened by QEMU's
    rbd driver), none for any other volume."""
    db = read_db(c.svc.data_dir)
    live = {a["volume_id"] for a in db.expected_attachments() if a["vm_id"] == c.guest.name}
    disks = c.guest.disks()
    problems = []
    for vol in db.volumes:
        serial = virtio_serial(vol)
        if vol in live:
            if serial not in disks:
                problems.append(f"attached volume {vol}: no disk {serial} in the guest")
            drivers = [n["drv"] for n in disk_protocol_nodes(c, vol)]
            if drivers != ["rbd"]:
                problems.append(f"attached volume {vol}: QEMU protocol nodes {drivers}, not one rbd node")
        elif serial in disks:
            problems.append(f"volume {vol} without a live attachment: disk {serial} still in the guest")
    return problems


def converge(c: RbdCloud) -> float:
    def more() -> list[str]:
        return cephx_user_disagreements(c.svc.data_dir, c.ceph.conf_path, c.pool) + guest_disagreements(c)

    return converge_rbd(c.svc.data_dir, c.vbs.http, c.ceph.conf_path, c.pool, CONVERGE_TIMEOUT_S, also=more)


def start_flow(c: RbdCloud, point: Point, vol: str, *, crashing: bool) -> None:
    if point.flow == ATTACH:
        c.vbs.cli("attach-volume", vol, "--host", "host-1", "--vm", c.guest.name, "--device", "vdb",
                  check=not crashing)
    else:
        c.vbs.cli("detach-volume", vol, check=not crashing)


def check_outcome(c: RbdCloud, point: Point, vol: str, op: dict[str, Any]) -> str:
    db = read_db(c.svc.data_dir)
    status = str(db.operations[op["id"]]["status"])
    if point.flow == DETACH:
        allowed = {"succeeded"}
    elif point.component == "controller":
        last = (point.step, point.moment) == ("mark-attached", "done")
        allowed = {"succeeded"} if last else {"rolled-back"}
    else:
        allowed = {"succeeded", "rolled-back"}
    assert status in allowed, f"{point.id}: operation ended {status} ({db.operations[op['id']]['error']})"
    live = [a for a in db.expected_attachments() if a["volume_id"] == vol]
    serial = virtio_serial(vol)
    if point.flow == ATTACH and status == "succeeded":
        assert db.volumes[vol]["status"] == "in-use" and [a["status"] for a in live] == ["attached"], (db.volumes[vol],
                                                                                                      live)
        assert serial in c.guest.disks() and [n["drv"] for n in disk_protocol_nodes(c, vol)] == ["rbd"]
    else:
        assert db.volumes[vol]["status"] == "available" and not live, (db.volumes[vol], live)
        assert serial not in c.guest.disks() and not disk_protocol_nodes(c, vol)
    # cephx_user_disagreements agreed: the user exists exactly when the attachment is live.
    return status


def cleanup(c: RbdCloud, vol: str) -> None:
    if c.vbs.volume(vol)["status"] == "in-use":
        c.detach(vol)
    assert c.vbs.http.delete(f"/v1/volumes/{vol}").status_code == 200
    c.vbs.wait_volume(vol, "deleted", timeout=120)


def run_point(c: RbdCloud, point: Point) -> tuple[float, str]:
    vol = c.new_volume(size_gib=1)
    if point.flow == DETACH:
        c.attach(vol, "vdb")
    converge(c)
    known = set(read_db(c.svc.data_dir).operations)
    if point.component == "controller":
        c.svc.restart_controller(VBS_CRASH_AT=f"{point.flow}:{point.step}:{point.moment}")
        start_flow(c, point, vol, crashing=True)
        op = new_operation(c.svc.data_dir, point.flow, known)
        c.svc.wait_controller_killed()
        t0 = time.monotonic()
        c.svc.start_controller()
    elif point.component == "storage-agent":
        start_flow(c, point, vol, crashing=False)
        assert c.svc.agent is not None
        if not kill_mid_tool(c.svc.agent, "ceph", INFLIGHT[point.component, point.flow][1]):
            print(f"{point.id}: the ceph call had finished when the agent was killed")
        op = new_operation(c.svc.data_dir, point.flow, known)
        t0 = time.monotonic()
        time.sleep(AGENT_DOWN_S)
        c.restart_agent()
    else:
        qemu = c.guest.pid
        assert qemu is not None and c.svc.host_agent is not None
        os.kill(qemu, signal.SIGSTOP)
        try:
            start_flow(c, point, vol, crashing=False)
            op = new_operation(c.svc.data_dir, point.flow, known)
            wait_until(lambda: step_state(c.svc.data_dir, op["id"], point.step) in ("started", "done"), 60,
                       what=f"step {point.step} started")
            time.sleep(INFLIGHT_GRACE_S)
            assert step_state(c.svc.data_dir, op["id"], point.step) == "started", "the step got by a frozen QEMU"
            c.svc.host_agent.kill()
            c.svc.host_agent.wait(30)
        finally:
            os.kill(qemu, signal.SIGCONT)
        t0 = time.monotonic()
        time.sleep(AGENT_DOWN_S)
        c.restart_host_agent()
    converge(c)
    seconds = time.monotonic() - t0
    status = check_outcome(c, point, vol, op)
    cleanup(c, vol)
    return seconds, status


@pytest.mark.parametrize("point", [pytest.param(p, id=p.id, marks=() if p.id in CI_POINTS else (pytest.mark.torture,))
                                   for p in MATRIX])
def test_rbd_attach_crash_point(point: Point, clouds: Clouds) -> None:
    c = clouds.get()
    try:
        seconds, status = run_point(c, point)
    except BaseException:
        clouds.discard()
        raise
    print(f"{point.id}: {status}, the world agreed {seconds:.1f} s after the restart")


def test_the_matrix_has_every_step_and_the_ci_points_are_in_it() -> None:
    assert len(MATRIX) == 16 and len({p.id for p in MATRIX}) == 16
    assert CI_POINTS <= {p.id for p in MATRIX}
    assert {p.component for p in MATRIX if p.id in CI_POINTS} == {"controller", "storage-agent", "host-agent"}


def test_the_cephx_user_check_finds_a_stray_user(clouds: Clouds) -> None:
    """The oracle is not vacuous: a user made by hand for a volume with no attachment is reported."""
    c = clouds.get()
    conf = str(c.ceph.conf_path)
    stray = "client.vbs.host-1.vol-0123456789abcdef0"
    subprocess_run(["ceph", "--conf", conf, "auth", "get-or-create", stray, "mon", "profile rbd", "osd",
                    f"profile rbd pool={c.pool}"])
    try:
        found = cephx_user_disagreements(c.svc.data_dir, c.ceph.conf_path, c.pool)
        assert found == [f"stray cephx user {stray} (no live attachment)"], found
    finally:
        subprocess_run(["ceph", "--conf", conf, "auth", "rm", stray])
    assert cephx_user_disagreements(c.svc.data_dir, c.ceph.conf_path, c.pool) == []


def subprocess_run(argv: list[str]) -> None:
    subprocess.run(argv, capture_output=True, timeout=120, check=True)
