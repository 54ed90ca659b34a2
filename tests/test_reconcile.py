"""Reconciliation: drift between the DB and the agents' real state is found (vbs check) and repaired."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import VBS, Services, node_token, start_bare_vm, stop_bare_vm, stop_process, wait_until
from vbs import ids


@pytest.fixture
def cluster(services: Services, tmp_path: Path) -> Iterator[tuple[Services, Path]]:
    # Fast passes and a short grace period, so the background loop is observable in a test.
    services.start_controller(VBS_CONTROLLER_RECONCILE_INTERVAL_S="0.5", VBS_CONTROLLER_ORPHAN_GRACE_S="2")
    services.start_agent()
    vm_dir = services.start_host_agent()
    vm = start_bare_vm(vm_dir, "vm1", tmp_path / "vm1.log")
    try:
        wait_until(lambda: services.vbs.http.get("/v1/instances").json()["instances"], 30, what="instance")
        yield services, vm_dir
    finally:
        stop_bare_vm(vm)


def check(svc: Services) -> dict[str, Any]:
    r = svc.vbs.http.get("/v1/admin/check")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def kinds(report: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["kind"], f["resource_id"]) for f in report["findings"]}


def agent(svc: Services) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{svc.agent_port}",
                        headers={"authorization": f"Bearer {svc.agent_token}"})


def available_volume(svc: Services) -> str:
    vol = svc.vbs.create_volume(size_gib=1)
    svc.vbs.wait_volume(vol["volume_id"], "available")
    return str(vol["volume_id"])


def test_a_clean_install_checks_clean_and_the_cli_says_so(cluster: tuple[Services, Path]) -> None:
    svc, _ = cluster
    available_volume(svc)
    report = check(svc)
    assert report["clean"] and report["storage_nodes"] == 1 and report["hosts"] == 1
    env = {**os.environ, "VBS_ENDPOINT": svc.vbs.endpoint, "VBS_ACCESS_KEY_ID": svc.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": svc.key.secret_access_key}
    proc = subprocess.run([*VBS, "-o", "table", "check"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "everything agrees" in proc.stdout


def test_an_orphan_pool_file_is_reported_then_removed_after_its_grace(cluster: tuple[Services, Path]) -> None:
    svc, _ = cluster
    orphan = ids.new_id("volume")
    path = svc.data_dir / "pool" / "volumes" / f"{orphan}.raw"
    path.write_bytes(b"left behind")
    assert ("orphan-file", orphan) in kinds(check(svc))
    # The background pass removes it once it has been an orphan for the grace period.
    wait_until(lambda: not path.exists(), 30, what="orphan file removed")
    assert check(svc)["clean"]


def test_a_volume_whose_file_vanished_is_marked_error(cluster: tuple[Services, Path]) -> None:
    svc, _ = cluster
    vol_id = available_volume(svc)
    (svc.data_dir / "pool" / "volumes" / f"{vol_id}.raw").unlink()
    # A volume that changed just before its pool was listed is judged once it has settled
    # (SETTLE_MARGIN_S): the check reports it then, unless the background pass (every 0.5 s here)
    # marked it first; after that the check has nothing left to report, which is also right.

    def reported_or_marked() -> bool:
        found = kinds(check(svc))
        status = svc.vbs.http.get(f"/v1/volumes/{vol_id}").json()["status"]
        return ("missing-file", vol_id) in found or status == "error"

    wait_until(reported_or_marked, 30, what="the lost file found")
    vol = svc.vbs.wait_volume(vol_id, "error", timeout=30)
    assert "vanished" in vol["status_reason"]
    # And the user can clean it up.
    assert svc.vbs.http.delete(f"/v1/volumes/{vol_id}").status_code == 200
    svc.vbs.wait_volume(vol_id, "deleted")


def test_an_orphan_export_and_an_orphan_disk_are_removed(cluster: tuple[Services, Path]) -> None:
    svc, vm_dir = cluster
    vol_id = available_volume(svc)
    host = svc.vbs.http.get("/v1/hosts").json()["hosts"][0]
    with agent(svc) as a:
        r = a.put(f"/v1/pools/default/volumes/{vol_id}/connections/host-1", json={
            "host": {"name": "host-1", "address": host["address"]}})
        assert r.status_code == 200, r.text
        connection = r.json()["connection"]
    serial = ids.virtio_serial(vol_id)
    r = httpx.put(f"{host['url']}/v1/vms/vm1/disks/{serial}", json={"connection": connection},
                  headers={"authorization": f"Bearer {node_token(svc.data_dir, 'host', 'host-1')}"}, timeout=30)
    assert r.status_code == 200, r.text
    found = kinds(check(svc))
    assert {("orphan-export", vol_id), ("orphan-disk", vol_id)} <= found
    report = svc.vbs.http.post("/v1/admin/reconcile?now=true").json()
    assert {f["action"] for f in report["findings"] if f["resource_id"] == vol_id} == {"repaired"}
    with agent(svc) as a:
        assert a.get("/v1/exports").json() == {"exports": []}
    host_auth = {"authorization": f"Bearer {node_token(svc.data_dir, 'host', 'host-1')}"}
    disks = httpx.get(f"{host['url']}/v1/vms/vm1/disks", headers=host_auth).json()
    # A bare VM never acknowledges an unplug: what stays of the disk has no connection any more.
    assert all(not d["connected"] for d in disks["disks"] if d["serial"] == serial)


def test_a_lost_export_of_an_attached_volume_is_recreated(cluster: tuple[Services, Path]) -> None:
    svc, _ = cluster
    vol_id = available_volume(svc)
    r = svc.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"host": "host-1", "vm_id": "vm1"})
    assert r.status_code == 200, r.text
    wait_until(lambda: svc.vbs.volume(vol_id)["attachments"][0]["state"] == "attached", 30, what="attached")
    # The storage agent loses its state: its daemon and its record of exports.
    assert svc.agent is not None
    stop_process(svc.agent)
    for state in (svc.data_dir / "storage-state").rglob("exports.json"):
        state.unlink()
    svc.start_agent()
    wait_until(lambda: agent(svc).get("/health").status_code == 200, 30, what="agent listening")
    wait_until(lambda: [e["key"] for e in agent(svc).get("/v1/exports").json()["exports"]] == [vol_id], 30,
               what="export re-created by reconciliation")
    assert check(svc)["clean"]
