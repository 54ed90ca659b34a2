"""Every workflow whose target vanishes mid-step ends in bounded time, in a stable state, with the reason.

The controller holds a step before its call (``hold-step``); the test removes what the step talks
to — the storage agent, the host agent, the VM — and lets the step go. Nothing may stay in a
transitional state and no operation may retry forever: a roll-back ends ``rolled-back`` (or
``failed`` naming what it could not undo), a roll-forward ends done or ``failed`` with the resource
stable. A vanished VM, host or export daemon leaves the volume ``available``: its data is intact.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Services, start_bare_vm, stop_bare_vm, wait_until

pytestmark = pytest.mark.integration

GIVE_UP_S = "3"
ENV = {"VBS_TEST_HOOKS": "1", "VBS_CONTROLLER_GIVE_UP_AFTER_S": GIVE_UP_S, "VBS_CONTROLLER_RETRY_INTERVAL_S": "0.2",
       "VBS_CONTROLLER_DETACH_TIMEOUT_S": "2"}
FINAL = ("succeeded", "rolled-back", "failed")


class Lab:
    def __init__(self, svc: Services, vm_dir: Path, tmp: Path) -> None:
        self.svc, self.vm_dir, self.tmp = svc, vm_dir, tmp
        self.vms: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def http(self) -> Any:
        return self.svc.vbs.http

    def internal(self, path: str, body: dict[str, str]) -> Any:
        """The controller's internal API (test hooks) takes the agents' token, not an access key."""
        r = httpx.post(f"{self.svc.vbs.endpoint}/internal/v1/test/{path}", json=body,
                       headers={"authorization": f"Bearer {self.svc.agent_token}"}, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def start_vm(self, name: str) -> None:
        self.vms[name] = start_bare_vm(self.vm_dir, name, self.tmp / f"{name}.log")
        wait_until(lambda: any(i["vm_id"] == name and i["state"] == "running"
                               for i in self.http.get("/v1/instances").json()["instances"]), 30, what=f"VM {name}")

    def stop_vm(self, name: str) -> None:
        stop_bare_vm(self.vms.pop(name))

    def hold(self, kind: str, step: str) -> None:
        self.internal("hold-step", {"kind": kind, "step": step})

    def wait_held(self, kind: str, step: str) -> None:
        wait_until(lambda: self.internal("held-step", {"kind": kind, "step": step})["held"], 30, what=f"{step} held")

    def release(self, kind: str, step: str) -> None:
        self.internal("release-step", {"kind": kind, "step": step})

    def operation(self, op_id: str) -> dict[str, Any]:
        return wait_until(lambda: (op := self.http.get(f"/v1/operations/{op_id}").json())["status"] in FINAL and op,
                          60, what=f"operation {op_id} to end")

    def last_operation(self, resource_id: str, kind: str) -> str:
        import sqlite3

        with sqlite3.connect(self.svc.data_dir / "vbs.db", timeout=10) as db:
            row = db.execute("SELECT id FROM operations WHERE resource_id = ? AND kind = ? ORDER BY created_at DESC "
                             "LIMIT 1", (resource_id, kind)).fetchone()
        assert row, f"no {kind} operation of {resource_id}"
        return str(row[0])

    def volume(self, size: int = 1) -> str:
        vol = self.svc.vbs.create_volume(size_gib=size)
        self.svc.vbs.wait_volume(vol["volume_id"], "available")
        return str(vol["volume_id"])

    def attach(self, vol: str, vm: str) -> dict[str, Any]:
        r = self.http.post(f"/v1/volumes/{vol}/attach", json={"host": "host-1", "vm_id": vm})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def attached(self, vol: str, vm: str) -> None:
        self.attach(vol, vm)
        self.svc.vbs.wait_volume(vol, "in-use")
        wait_until(lambda: self.svc.vbs.volume(vol)["attachments"][0]["state"] == "attached", 30, what="attached")

    def kill_storage_agent(self) -> None:
        assert self.svc.agent is not None
        self.svc.agent.send_signal(signal.SIGKILL)
        self.svc.agent.wait()

    def kill_host_agent(self) -> None:
        assert self.svc.host_agent is not None
        self.svc.host_agent.send_signal(signal.SIGKILL)
        self.svc.host_agent.wait()


@pytest.fixture
def lab(services: Services, tmp_path: Path) -> Iterator[Lab]:
    services.start_controller(**ENV)
    services.start_agent()
    vm_dir = services.start_host_agent()
    lab = Lab(services, vm_dir, tmp_path)
    try:
        yield lab
    finally:
        for vm in list(lab.vms):
            lab.stop_vm(vm)


# -- storage node gone ---------------------------------------------------------------------------------


def test_create_volume_whose_storage_node_vanishes_ends_error_not_creating(lab: Lab) -> None:
    lab.hold("create-volume", "storage-create")
    vol = lab.svc.vbs.create_volume(size_gib=1)["volume_id"]
    lab.wait_held("create-volume", "storage-create")
    lab.kill_storage_agent()
    lab.release("create-volume", "storage-create")

    op = lab.operation(lab.last_operation(vol, "create-volume"))

    assert op["status"] in ("rolled-back", "failed")
    v = lab.svc.vbs.volume(vol)
    assert v["status"] == "error" and "creation failed" in v["status_reason"]


def test_delete_volume_whose_storage_node_vanishes_ends_error_and_can_be_deleted_again(lab: Lab) -> None:
    vol = lab.volume()
    lab.hold("delete-volume", "storage-delete")
    assert lab.http.delete(f"/v1/volumes/{vol}").status_code == 200
    lab.wait_held("delete-volume", "storage-delete")
    lab.kill_storage_agent()
    lab.release("delete-volume", "storage-delete")

    op = lab.operation(lab.last_operation(vol, "delete-volume"))

    assert op["status"] == "failed" and "gave up" in op["error"]
    v = lab.svc.vbs.volume(vol)
    assert v["status"] == "error" and "delete it again" in v["status_reason"]
    lab.svc.start_agent()
    assert lab.http.delete(f"/v1/volumes/{vol}").status_code == 200
    lab.svc.vbs.wait_volume(vol, "deleted")
    assert not (lab.svc.data_dir / "pool" / "volumes" / f"{vol}.raw").exists()


def test_create_snapshot_whose_storage_node_vanishes_ends_error(lab: Lab) -> None:
    vol = lab.volume()
    lab.hold("create-snapshot", "storage-snapshot")
    snap = lab.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
    lab.wait_held("create-snapshot", "storage-snapshot")
    lab.kill_storage_agent()
    lab.release("create-snapshot", "storage-snapshot")

    op = lab.operation(lab.last_operation(snap, "create-snapshot"))

    assert op["status"] in ("rolled-back", "failed")
    assert lab.svc.vbs.snapshot(snap)["status"] == "error"
    assert lab.svc.vbs.volume(vol)["status"] == "available"


def test_delete_snapshot_whose_storage_node_vanishes_ends_error(lab: Lab) -> None:
    vol = lab.volume()
    snap = lab.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
    lab.svc.vbs.wait_snapshot(snap, "completed")
    lab.hold("delete-snapshot", "storage-delete")
    assert lab.http.delete(f"/v1/snapshots/{snap}").status_code == 200
    lab.wait_held("delete-snapshot", "storage-delete")
    lab.kill_storage_agent()
    lab.release("delete-snapshot", "storage-delete")

    op = lab.operation(lab.last_operation(snap, "delete-snapshot"))

    assert op["status"] == "failed"
    s = lab.svc.vbs.snapshot(snap)
    assert s["status"] == "error" and "delete it again" in s["status_reason"]


def test_modify_volume_whose_storage_node_vanishes_ends_failed(lab: Lab) -> None:
    vol = lab.volume()
    lab.hold("modify-volume", "storage-grow")
    assert lab.http.post(f"/v1/volumes/{vol}/modify", json={"size_gib": 2}).status_code == 200
    lab.wait_held("modify-volume", "storage-grow")
    lab.kill_storage_agent()
    lab.release("modify-volume", "storage-grow")

    op = lab.operation(lab.last_operation(vol, "modify-volume"))

    assert op["status"] == "failed"
    mods = lab.http.get("/v1/volume-modifications", params={"volume_id": vol}).json()["modifications"]
    assert mods[0]["state"] == "failed" and mods[0]["status_message"]
    v = lab.svc.vbs.volume(vol)
    assert v["status"] == "available" and v["size_gib"] == 1
    # Nothing holds the volume any more: it can be deleted (no exclusive operation is left running).
    lab.svc.start_agent()
    assert lab.http.delete(f"/v1/volumes/{vol}").status_code == 200


# -- VM or host gone ---------------------------------------------------------------------------------


def test_attach_to_a_vm_that_vanishes_mid_attach_rolls_back_and_leaves_the_volume_available(lab: Lab) -> None:
    lab.start_vm("vm1")
    vol = lab.volume()
    lab.hold("attach-volume", "host-attach")
    att = lab.attach(vol, "vm1")
    lab.wait_held("attach-volume", "host-attach")
    lab.stop_vm("vm1")
    lab.release("attach-volume", "host-attach")

    op = lab.operation(att["operation_id"])

    assert op["status"] == "rolled-back", op
    v = lab.svc.vbs.volume(vol)
    assert v["status"] == "available" and v["attachments"] == []
    assert lab.svc.vbs.http.get("/v1/admin/check").json()["findings"] == []


def test_attach_to_a_host_that_vanishes_mid_attach_rolls_back(lab: Lab) -> None:
    lab.start_vm("vm1")
    vol = lab.volume()
    lab.hold("attach-volume", "host-attach")
    att = lab.attach(vol, "vm1")
    lab.wait_held("attach-volume", "host-attach")
    lab.kill_host_agent()
    lab.release("attach-volume", "host-attach")

    op = lab.operation(att["operation_id"])

    assert op["status"] == "rolled-back", op
    assert lab.svc.vbs.volume(vol)["status"] == "available"


def test_attach_again_right_after_the_vm_stopped_is_never_stuck_attaching(lab: Lab) -> None:
    """As a user hit it: attach, detach, stop the VM, attach to it again at once."""
    lab.start_vm("vm1")
    vol = lab.volume()
    lab.attached(vol, "vm1")
    r = lab.http.post(f"/v1/volumes/{vol}/detach", json={"force": True})
    assert r.status_code == 200, r.text
    lab.operation(r.json()["operation_id"])
    lab.svc.vbs.wait_volume(vol, "available")
    lab.stop_vm("vm1")

    r = lab.http.post(f"/v1/volumes/{vol}/attach", json={"host": "host-1", "vm_id": "vm1"})
    if r.status_code == 200:  # the controller had not heard of the VM's end yet
        op = lab.operation(r.json()["operation_id"])
        assert op["status"] == "rolled-back" and "vm1" in op["error"], op
    else:  # the host's heartbeat came first: refused at the door
        assert r.status_code == 409 and r.json()["error"]["code"] == "IncorrectInstanceState", r.text
    v = lab.svc.vbs.volume(vol)
    assert v["status"] == "available" and v["attachments"] == []


def test_detach_from_a_vm_that_vanished_completes(lab: Lab) -> None:
    lab.start_vm("vm1")
    vol = lab.volume()
    lab.attached(vol, "vm1")
    lab.hold("detach-volume", "host-detach")
    det = lab.http.post(f"/v1/volumes/{vol}/detach", json={}).json()
    lab.wait_held("detach-volume", "host-detach")
    lab.stop_vm("vm1")
    lab.release("detach-volume", "host-detach")

    op = lab.operation(det["operation_id"])

    assert op["status"] == "succeeded", op
    assert lab.svc.vbs.volume(vol)["status"] == "available"


def test_detach_from_a_host_that_vanished_ends_busy_and_a_forced_one_completes(lab: Lab) -> None:
    lab.start_vm("vm1")
    vol = lab.volume()
    lab.attached(vol, "vm1")
    lab.kill_host_agent()

    det = lab.http.post(f"/v1/volumes/{vol}/detach", json={}).json()
    op = lab.operation(det["operation_id"])

    assert op["status"] == "failed" and "gave up" in op["error"]
    att = lab.svc.vbs.volume(vol)["attachments"][0]
    assert att["state"] == "busy" and att["state_reason"]
    assert lab.svc.vbs.volume(vol)["status"] == "in-use"

    forced = lab.http.post(f"/v1/volumes/{vol}/detach", json={"force": True}).json()
    op = lab.operation(forced["operation_id"])

    assert op["status"] == "succeeded", op
    assert [s["state"] for s in op["steps"]] == ["skipped", "done", "done"]
    v = lab.svc.vbs.volume(vol)
    assert v["status"] == "available" and v["attachments"] == []
