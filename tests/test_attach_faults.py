"""Attach with a storage agent down, and the controller killed in the middle of attach and detach.

A QEMU without a guest OS stands in for the VM: it takes hot-plugged disks, and detach uses
``force`` (it never acknowledges an unplug). What the tests check is the VM's own state over QMP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Services, private_qmp, start_bare_vm, stop_bare_vm, stop_process, wait_until
from vbs.rigs.testguest.guest import qmp_execute


@pytest.fixture
def cluster(services: Services, tmp_path: Path) -> Iterator[tuple[Services, Path]]:
    services.start_controller()
    services.start_agent()
    vm_dir = services.start_host_agent()
    vm = start_bare_vm(vm_dir, "vm1", tmp_path / "vm1.log")
    try:
        wait_until(lambda: services.vbs.http.get("/v1/instances").json()["instances"], 30, what="instance")
        yield services, vm_dir
    finally:
        stop_bare_vm(vm)


def vm_devices(vm_dir: Path) -> list[str]:
    return [d["name"] for d in qmp_execute(private_qmp(vm_dir, "vm1"), "qom-list", {"path": "/machine/peripheral"})
            if d["name"].startswith("vbs-")]


def nbd_nodes(vm_dir: Path) -> list[str]:
    nodes = qmp_execute(private_qmp(vm_dir, "vm1"), "query-named-block-nodes", {"flat": True})
    return [n["node-name"] for n in nodes if n["drv"] == "nbd"]


def agent_exports(svc: Services) -> list[dict[str, str]]:
    r = httpx.get(f"http://127.0.0.1:{svc.agent_port}/v1/exports",
                  headers={"authorization": f"Bearer {svc.agent_token}"})
    assert r.status_code == 200, r.text
    return r.json()["exports"]  # type: ignore[no-any-return]


def available_volume(svc: Services) -> str:
    vol = svc.vbs.create_volume(size_gib=1)
    svc.vbs.wait_volume(vol["volume_id"], "available")
    return str(vol["volume_id"])


def test_attach_with_the_storage_agent_down_rolls_back(cluster: tuple[Services, Path]) -> None:
    svc, vm_dir = cluster
    vol_id = available_volume(svc)
    assert svc.agent is not None
    stop_process(svc.agent)
    r = svc.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"host": "host-1", "vm_id": "vm1"})
    assert r.status_code == 200, r.text
    svc.vbs.wait_volume(vol_id, "available", timeout=30)
    op = svc.vbs.http.get(f"/v1/operations/{r.json()['operation_id']}").json()
    assert op["status"] == "rolled-back" and "connection refused" in op["error"]
    assert svc.vbs.volume(vol_id)["attachments"] == []
    assert vm_devices(vm_dir) == []
    assert nbd_nodes(vm_dir) == []


@pytest.mark.parametrize("point", ["storage-export:done", "host-attach:started", "host-attach:done"])
def test_controller_killed_during_attach_rolls_back_at_restart(services: Services, tmp_path: Path, point: str) -> None:
    services.start_controller()
    services.start_agent()
    vm_dir = services.start_host_agent()
    vm = start_bare_vm(vm_dir, "vm1", tmp_path / "vm1.log")
    try:
        wait_until(lambda: services.vbs.http.get("/v1/instances").json()["instances"], 30, what="instance")
        vol_id = available_volume(services)
        assert services.controller is not None
        stop_process(services.controller)
        services.start_controller(VBS_CRASH_AT=f"attach-volume:{point}")
        services.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"host": "host-1", "vm_id": "vm1"})
        services.controller.wait(30)
        assert services.controller.returncode == -9
        services.start_controller()
        services.vbs.wait_volume(vol_id, "available", timeout=60)
        assert services.vbs.volume(vol_id)["attachments"] == []
        # The storage export is gone, and the VM keeps no connection to it: a device that got
        # hot-plugged was force-unplugged (this VM never acknowledges), which cuts its I/O path.
        assert agent_exports(services) == []
        assert nbd_nodes(vm_dir) == []
    finally:
        stop_bare_vm(vm)
