"""``vbs up --backend rbd``: the data dir's own single-node Ceph, two storage agents serving its one
pool, and ``vbs migrate-volume`` moving a volume from one agent to the other in an instant.

Real parts only: ``vbs up`` starts the Ceph daemons (mon, mgr, one OSD on a sparse file) in
``<data-dir>/ceph`` and stops them on SIGINT, OSD first; the test checks that every PID ``up.json``
listed is gone. The operator's view is checked with the ``rbd`` tool and the conf ``vbs up`` names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Vbs, VbsUp, wait_until
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest, pattern_sha256

pytestmark = pytest.mark.integration

HEARTBEAT_TIMEOUT_S = 4.0
ENV = {"VBS_CONTROLLER_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
       "VBS_STORAGE_AGENT_HEARTBEAT_INTERVAL_S": "1"}
UP_TIMEOUT_S = 300  # the first start makes the cluster; a loaded 2-core machine takes its time


class RbdUp:
    def __init__(self, tmp: Path) -> None:
        self.up = VbsUp(tmp / "var", tmp / "vbs-up.log", extra=["--backend", "rbd", "--storage-nodes", "2"], env=ENV)
        self.data_dir = self.up.data_dir
        self.conf = self.data_dir / "ceph" / "ceph.conf"
        self.vbs: Vbs | None = None

    def start(self) -> Vbs:
        self.vbs = self.up.start(timeout=UP_TIMEOUT_S)
        return self.vbs

    def services(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = json.loads((self.data_dir / "up.json").read_text())["services"]
        return found

    def pid_of(self, name: str) -> int:
        return next(int(s["pid"]) for s in self.services() if s["name"] == name)

    def stop(self) -> None:
        """SIGINT, then every service and Ceph daemon must be gone (killed by PID if not: a failure)."""
        pids = {s["name"]: int(s["pid"]) for s in self.services()} if (self.data_dir / "up.json").exists() else {}
        self.up.stop()
        alive = [name for name, pid in pids.items() if _alive(pid)]
        for name in alive:
            os.kill(pids[name], signal.SIGKILL)
        assert not alive, f"still running after vbs up stopped: {alive}"

    def rbd(self, *args: str) -> Any:
        proc = subprocess.run(["rbd", "-c", str(self.conf), *args, "--format", "json"], capture_output=True,
                              text=True, timeout=60, check=True)
        return json.loads(proc.stdout or "null")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RbdUp]:
    up = RbdUp(tmp_path_factory.mktemp("rbd-up"))
    try:
        up.start()
        yield up
    finally:
        up.stop()


def _volumes_on(vbs: Vbs) -> dict[str, str]:
    return {v["volume_id"]: v["storage_node"] for v in vbs.all_volumes() if v["status"] != "deleted"}


def test_the_data_dirs_own_ceph_holds_the_volumes_of_both_agents_and_an_operator_lists_them(cloud: RbdUp) -> None:
    vbs = cloud.vbs
    assert vbs is not None
    assert oct(cloud.conf.parent.stat().st_mode & 0o777) == oct(0o700)
    assert {s["name"] for s in cloud.services() if s["role"] == "ceph"} == {"mon.a", "mgr.x", "osd.0"}
    nodes = vbs.cli("describe-storage-nodes")["storage_nodes"]
    shared = {p["shared_id"] for n in nodes for p in n["pools"]}
    assert len(nodes) == 2 and len(shared) == 1 and next(iter(shared)).startswith("ceph:"), nodes
    made = [vbs.cli("create-volume", "--size", "1", "--wait")["volume_id"] for _ in range(4)]
    on = _volumes_on(vbs)
    assert {on[v] for v in made} == {"storage-1", "storage-2"}  # one pool, served by both in turn
    assert set(made) <= set(cloud.rbd("ls", "vbs"))
    report = vbs.http.get("/v1/admin/check").json()
    assert report["clean"], report["findings"]  # neither agent's listing makes the other's volumes orphans


def test_a_volume_whose_agent_hangs_moves_to_the_other_in_an_instant_and_keeps_working(cloud: RbdUp) -> None:
    vbs = cloud.vbs
    assert vbs is not None
    vol = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-1", "--wait")["volume_id"]
    snap = vbs.cli("create-snapshot", vol, "--wait")["snapshot_id"]
    stuck = cloud.pid_of("storage-1")
    os.kill(stuck, signal.SIGSTOP)  # hung, not dead: vbs up would restart a dead one at once
    try:
        wait_until(lambda: {n["name"]: n["state"] for n in vbs.cli("describe-storage-nodes")["storage_nodes"]}
                   ["storage-1"] == "down", 60, what="storage-1 down")
        started = time.monotonic()
        moved = vbs.cli("migrate-volume", vol, "--storage-node", "storage-2", "--wait")
        took = time.monotonic() - started
        assert moved["status"] == "succeeded" and moved["target_node"] == "storage-2", moved
        assert vbs.volume(vol)["storage_node"] == "storage-2"
        assert vbs.snapshot(snap)["storage_node"] == "storage-2"  # a snapshot of the same image moves too
        # Everything works through storage-2 while storage-1 is still hung.
        again = vbs.cli("create-snapshot", vol, "--wait")["snapshot_id"]
        clone = vbs.cli("create-volume", "--snapshot", snap, "--wait")
        assert clone["storage_node"] == "storage-2" and clone["status"] == "available", clone
        assert {again, snap} <= {s["name"] for s in cloud.rbd("snap", "ls", f"vbs/{vol}")}
        vbs.cli("delete-snapshot", again)
        wait_until(lambda: again not in {s["name"] for s in cloud.rbd("snap", "ls", f"vbs/{vol}")}, 60,
                   what="the snapshot gone from the image")
        print(f"migrate-volume with --wait took {took:.2f} s")  # a figure for the log, not a check
    finally:
        os.kill(stuck, signal.SIGCONT)
    wait_until(lambda: all(n["state"] == "up" for n in vbs.cli("describe-storage-nodes")["storage_nodes"]), 60,
               what="storage-1 back")
    report = wait_until(lambda: (r := vbs.http.get("/v1/admin/check").json())["clean"] and r, 60,
                        what="a clean check")
    assert report["clean"]


def test_a_volume_a_guest_has_open_natively_moves_while_its_agent_hangs_and_detaches_through_the_new_one(
        cloud: RbdUp) -> None:
    vbs = cloud.vbs
    assert vbs is not None
    guest = TestGuest("vm1", cloud.data_dir.parent / "guests", build_guest(), cloud.data_dir / "vms")
    guest.start()
    try:
        guest.wait_ready(120)
        wait_until(lambda: any(i["vm_id"] == "vm1" and i["state"] == "running" for i in
                               vbs.http.get("/v1/instances").json()["instances"]), 60, what="the guest")
        vol = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-1", "--wait")["volume_id"]
        vbs.cli("attach-volume", vol, "--host", "host-1", "--vm", "vm1", "--wait")
        dev = guest.wait_for_disk(virtio_serial(vol), 60)
        nodes = guest.qmp("query-named-block-nodes", {"flat": True})
        assert any(virtio_serial(vol) in n["node-name"] and n["drv"] == "rbd" for n in nodes)  # QEMU's own librbd
        guest.check(f"yes moved | head -c {4 << 20} | dd of=/dev/{dev} bs=1M conv=fsync 2>/dev/null", timeout=120)
        stuck = cloud.pid_of("storage-1")
        os.kill(stuck, signal.SIGSTOP)
        try:
            moved = vbs.cli("migrate-volume", vol, "--storage-node", "storage-2", "--wait")
            assert moved["status"] == "succeeded", moved
            # The guest never noticed: its disk is the cluster's, not the agent's.
            assert guest.checksum(dev, 4) == pattern_sha256("moved", 4)
            assert vbs.cli("detach-volume", vol, "--wait")["state"] == "detached"  # through storage-2
            guest.wait_disk_gone(virtio_serial(vol), 60)
            users = subprocess.run(["ceph", "-c", str(cloud.conf), "auth", "ls", "--format", "json"],
                                   capture_output=True, text=True, timeout=60, check=True).stdout
            assert vol not in users  # the attachment's cephx user went with the detach
        finally:
            os.kill(stuck, signal.SIGCONT)
    finally:
        guest.stop()
    wait_until(lambda: all(n["state"] == "up" for n in vbs.cli("describe-storage-nodes")["storage_nodes"]), 60,
               what="storage-1 back")


def test_migrate_volume_refuses_what_it_cannot_do_and_changes_nothing(cloud: RbdUp) -> None:
    vbs = cloud.vbs
    assert vbs is not None
    vol = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-1", "--wait")["volume_id"]
    cases = [({"storage_node": "storage-9"}, 400, "does not exist"),
             ({"storage_node": "storage-1"}, 400, "already served"),
             ({"storage_node": "storage-2", "pool": "other"}, 400, "serves no pool"),
             ({"storage_node": "Storage 2"}, 400, ""),
             ({"storage_node": "storage-2", "extra": 1}, 400, "")]
    for body, status, reason in cases:
        r = vbs.http.post(f"/v1/volumes/{vol}/migrate", json=body)
        assert r.status_code == status and reason in r.text, (body, r.status_code, r.text)
    assert vbs.http.post("/v1/volumes/vol-0000000000000000a/migrate",
                         json={"storage_node": "storage-2"}).status_code == 404
    assert vbs.volume(vol)["storage_node"] == "storage-1"


def test_stopping_stops_every_ceph_daemon_and_a_restart_finds_the_volumes(cloud: RbdUp) -> None:
    vbs = cloud.vbs
    assert vbs is not None
    before = set(_volumes_on(vbs))
    cloud.stop()
    assert not (cloud.data_dir / "up.json").exists()
    vbs = cloud.start()  # the same data dir: the cluster restarts on its data
    assert set(_volumes_on(vbs)) == before
    assert before <= set(cloud.rbd("ls", "vbs"))
