"""Attach and detach for real: vbs up (NBD or iSCSI export), two host agents, QEMU guests under TCG.

A guest writes a pattern on a hot-plugged volume, the volume moves to a guest behind another host
agent and reads the same checksum, and a snapshot's clone shows it to a third attachment. Injected
failures at every attach step leave no export, no guest disk, and the volume available.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import VBS, Vbs, VbsUp, free_port, node_token, private_qmp, stop_process, wait_until
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest


class Cloud:
    """vbs up with its own host agent (host-1) plus a second host agent (host-2), a guest on each."""

    def __init__(self, vbs: Vbs, up: VbsUp, vm1: TestGuest, vm2: TestGuest, host2: subprocess.Popen[bytes]) -> None:
        self.vbs, self.up, self.vm1, self.vm2, self.host2 = vbs, up, vm1, vm2, host2

    def instance(self, host: str, vm: str) -> str:
        def find() -> str | None:
            for i in self.vbs.http.get("/v1/instances").json()["instances"]:
                if i["host"] == host and i["vm_id"] == vm and i["state"] == "running":
                    return str(i["instance_id"])
            return None

        return wait_until(find, 30, what=f"instance {vm} on {host}")  # type: ignore[no-any-return]

    def attachment_state(self, volume_id: str) -> str | None:
        atts = self.vbs.volume(volume_id)["attachments"]
        return atts[0]["state"] if atts else None

    def exports(self) -> list[dict[str, str]]:
        token = node_token(self.vbs.data_dir, "storage", "storage-1")
        node = self.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"][0]
        import httpx

        r = httpx.get(f"{node['url']}/v1/exports", headers={"authorization": f"Bearer {token}"}, timeout=10)
        return r.json()["exports"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=["nbd", "iscsi"])
def cloud(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    export = request.param
    tmp = tmp_path_factory.mktemp(f"cloud-{export}")
    image = build_guest()
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--export", export])
    up_env = {"VBS_TEST_HOOKS": "1", "VBS_CONTROLLER_DETACH_TIMEOUT_S": "3"}
    os.environ.update(up_env)
    vbs = up.start()
    vm1 = TestGuest("vm1", tmp / "guests", image, tmp / "var" / "vms")
    vm2 = TestGuest("vm2", tmp / "guests", image, tmp / "vms-2")
    token = node_token(tmp / "var", "host", "host-2")
    host2 = subprocess.Popen(
        [*VBS, "host-agent", "--node-name", "host-2", "--port", str(free_port()), "--controller-url", vbs.endpoint,
         "--vm-dir", str(tmp / "vms-2")],
        env={**os.environ, "VBS_AGENT_TOKEN": token}, stdout=(tmp / "host-2.log").open("ab"),
        stderr=subprocess.STDOUT)
    try:
        vm1.start()
        vm2.start()
        vm1.wait_ready(120)
        vm2.wait_ready(120)
        cloud = Cloud(vbs, up, vm1, vm2, host2)
        yield cloud
        host2 = cloud.host2  # a test may have restarted it
    finally:
        for vm in (vm1, vm2):
            vm.stop()
        stop_process(host2)
        up.stop()
        for key in up_env:
            os.environ.pop(key, None)


def new_volume(c: Cloud, size: int = 1, **extra: Any) -> str:
    vol = c.vbs.cli("create-volume", "--size", str(size), "--wait", *[str(x) for x in extra.get("args", [])])
    return str(vol["volume_id"])


def test_volume_moves_between_vms_on_two_hosts_with_its_data(cloud: Cloud) -> None:
    vol_id = new_volume(cloud)
    serial = virtio_serial(vol_id)

    att = cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "vm1", "--device", "vdb", "--wait")
    assert att["state"] == "attached" and att["host"] == "host-1"
    assert cloud.vbs.volume(vol_id)["status"] == "in-use"
    dev = cloud.vm1.wait_for_disk(serial, 10)
    written = cloud.vm1.write_pattern(dev, "extendable", 8)

    det = cloud.vbs.cli("detach-volume", vol_id, "--wait")
    assert det["state"] == "detached"
    cloud.vm1.wait_disk_gone(serial, 10)
    assert cloud.vbs.volume(vol_id)["status"] == "available"
    assert cloud.exports() == []

    inst2 = cloud.instance("host-2", "vm2")
    cloud.vbs.cli("attach-volume", vol_id, "--instance", inst2, "--wait")
    dev2 = cloud.vm2.wait_for_disk(serial, 10)
    assert cloud.vm2.checksum(dev2, 8) == written
    described = cloud.vbs.volume(vol_id)["attachments"][0]
    assert described["instance_id"] == inst2 and described["host"] == "host-2"
    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm2.wait_disk_gone(serial, 10)

    # Snapshot -> new volume -> another attachment sees the same data.
    snap = cloud.vbs.cli("create-snapshot", vol_id, "--wait")
    clone = cloud.vbs.cli("create-volume", "--snapshot", snap["snapshot_id"], "--wait")
    cloud.vbs.cli("attach-volume", clone["volume_id"], "--host", "host-1", "--vm", "vm1", "--wait")
    dev3 = cloud.vm1.wait_for_disk(virtio_serial(clone["volume_id"]), 10)
    assert cloud.vm1.checksum(dev3, 8) == written
    cloud.vbs.cli("detach-volume", clone["volume_id"], "--wait")
    cloud.vm1.wait_disk_gone(virtio_serial(clone["volume_id"]), 10)


@pytest.mark.parametrize(("step", "when"), [
    ("storage-export", "before"), ("storage-export", "after"),
    ("host-attach", "before"), ("host-attach", "after"),
    ("mark-attached", "before"),
])
def test_a_failure_at_any_attach_step_leaves_everything_as_before(cloud: Cloud, step: str, when: str) -> None:
    vol_id = new_volume(cloud)
    r = cloud.vbs.http.post("/internal/v1/test/fail-step", json={"kind": "attach-volume", "step": step, "when": when},
                            headers={"authorization": "Bearer "
                                     + node_token(cloud.vbs.data_dir, "storage", "storage-1")})
    assert r.status_code == 200, r.text
    att = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"host": "host-1", "vm_id": "vm1"})
    assert att.status_code == 200, att.text
    cloud.vbs.wait_volume(vol_id, "available", timeout=30)
    wait_until(lambda: cloud.attachment_state(vol_id) is None, 30, what="attachment gone")
    assert virtio_serial(vol_id) not in cloud.vm1.disks()
    assert [e for e in cloud.exports() if e["key"] == vol_id] == []
    # And the next attach works.
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "vm1", "--wait")
    cloud.vm1.wait_for_disk(virtio_serial(vol_id), 10)
    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm1.wait_disk_gone(virtio_serial(vol_id), 10)


def test_bad_attach_requests_change_nothing(cloud: Cloud) -> None:
    vol_id = new_volume(cloud)
    cases = [
        ({"host": "host-1", "vm_id": "no-such-vm"}, 404, "InvalidInstanceID.NotFound"),
        ({"host": "nohost", "vm_id": "vm1"}, 404, "InvalidInstanceID.NotFound"),
        ({"instance_id": "i-0123456789abcdef0"}, 404, "InvalidInstanceID.NotFound"),
        ({"host": "host-1", "vm_id": "vm1", "device": "vd1; rm -rf /"}, 400, "InvalidParameterValue"),
        ({"host": "host-1"}, 400, "MissingParameter"),
        ({"host": "host-1", "vm_id": "vm1", "instance_id": "i-0123456789abcdef0"}, 400, "InvalidParameterValue"),
    ]
    for body, status, code in cases:
        r = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (body, r.text)
    r = cloud.vbs.http.post("/v1/volumes/vol-0123456789abcdef0/attach", json={"host": "host-1", "vm_id": "vm1"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "InvalidVolume.NotFound")
    r = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/detach", json={})
    assert (r.status_code, r.json()["error"]["code"]) == (409, "IncorrectState")
    assert cloud.vbs.volume(vol_id)["status"] == "available"
    assert cloud.vbs.volume(vol_id)["attachments"] == []

    # One VM at a time unless multi-attach; an attached volume cannot be deleted.
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "vm1", "--wait")
    r = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"instance_id": cloud.instance("host-2", "vm2")})
    assert (r.status_code, r.json()["error"]["code"]) == (409, "VolumeInUse")
    r = cloud.vbs.http.delete(f"/v1/volumes/{vol_id}")
    assert (r.status_code, r.json()["error"]["code"]) == (409, "VolumeInUse")
    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm1.wait_disk_gone(virtio_serial(vol_id), 10)


def test_hosts_and_instances_are_described(cloud: Cloud) -> None:
    hosts = {h["name"]: h for h in cloud.vbs.cli("describe-hosts")["hosts"]}
    assert hosts["host-1"]["state"] == hosts["host-2"]["state"] == "up"
    instances = cloud.vbs.cli("describe-instances")["instances"]
    assert {(i["host"], i["vm_id"]) for i in instances} >= {("host-1", "vm1"), ("host-2", "vm2")}
    assert all(i["instance_id"].startswith("i-") for i in instances)




@pytest.fixture
def bare_vm(cloud: Cloud, tmp_path: Path) -> Iterator[str]:
    """A VM with no guest OS on host-1: it takes a hot-plugged disk but never acknowledges an unplug."""
    qmp = cloud.vbs.data_dir / "vms" / "bare.qmp"
    test_qmp = private_qmp(qmp.parent, "bare")  # the host agent holds the first monitor
    proc = subprocess.Popen(["qemu-system-x86_64", "-accel", "tcg", "-machine", "pc", "-m", "64", "-nodefaults",
                             "-display", "none", "-qmp", f"unix:{qmp},server=on,wait=off",
                             "-qmp", f"unix:{test_qmp},server=on,wait=off"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "bare.log").open("ab"))
    try:
        cloud.instance("host-1", "bare")
        yield "bare"
    finally:
        stop_process(proc)
        qmp.unlink(missing_ok=True)
        test_qmp.unlink(missing_ok=True)


def test_a_guest_that_holds_the_disk_makes_detach_busy_and_force_ends_it(cloud: Cloud, bare_vm: str) -> None:
    detach_is_busy_until_forced(cloud, bare_vm)


def detach_is_busy_until_forced(cloud: Cloud, vm: str) -> None:
    """Attach a volume to ``vm`` on host-1, a VM that never releases a disk: detach is ``busy`` and
    keeps the export; ``--force`` ends the attachment and removes the export."""
    vol_id = new_volume(cloud)
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", vm, "--wait")
    proc = cloud.vbs.cli("detach-volume", vol_id, "--wait", check=False)
    assert proc.returncode == 1, proc.stdout
    assert cloud.attachment_state(vol_id) == "busy"
    assert cloud.vbs.volume(vol_id)["status"] == "in-use"
    assert [e["key"] for e in cloud.exports()] == [vol_id], "the export stays while the guest holds it"

    det = cloud.vbs.cli("detach-volume", vol_id, "--force", "--wait")
    assert det["state"] == "detached"
    assert cloud.vbs.volume(vol_id)["status"] == "available"
    assert cloud.exports() == []


def test_attach_to_a_host_whose_agent_is_down_fails_clearly_and_rolls_back(cloud: Cloud) -> None:
    vol_id = new_volume(cloud)
    inst2 = cloud.instance("host-2", "vm2")
    stop_process(cloud.host2)
    try:
        # The last heartbeat is still fresh: the attach is accepted, its hot-plug step cannot reach the
        # agent, and the export made for it is removed again.
        proc = cloud.vbs.cli("attach-volume", vol_id, "--instance", inst2, "--wait", check=False)
        assert proc.returncode == 1
        assert "attach-volume rolled-back" in proc.stderr and "connection refused" in proc.stderr, proc.stderr
        assert cloud.vbs.volume(vol_id)["status"] == "available"
        assert [e for e in cloud.exports() if e["key"] == vol_id] == []
    finally:
        cloud.host2 = restart_host2(cloud)
    cloud.instance("host-2", "vm2")


def restart_host2(cloud: Cloud) -> subprocess.Popen[bytes]:
    token = node_token(cloud.vbs.data_dir, "host", "host-2")
    tmp = cloud.vbs.data_dir.parent
    return subprocess.Popen(
        [*VBS, "host-agent", "--node-name", "host-2", "--port", str(free_port()), "--controller-url",
         cloud.vbs.endpoint, "--vm-dir", str(tmp / "vms-2")],
        env={**os.environ, "VBS_AGENT_TOKEN": token}, stdout=(tmp / "host-2.log").open("ab"),
        stderr=subprocess.STDOUT)


def export_daemon_pid(cloud: Cloud) -> int | None:
    """The PID of the storage agent's running export daemon (qemu-storage-daemon or tgtd), if any."""
    for pidfile in (cloud.vbs.data_dir / "storage-state").rglob("*.pid"):
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ValueError):
            continue
        if (b"qemu-storage-daemon" in cmdline or b"tgtd" in cmdline) and "State:\tZ" not in status:
            return pid
    return None


def test_guest_io_resumes_after_the_export_daemon_is_killed(cloud: Cloud) -> None:
    vol_id = new_volume(cloud)
    serial = virtio_serial(vol_id)
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "vm1", "--wait")
    dev = cloud.vm1.wait_for_disk(serial, 10)
    before = cloud.vm1.write_pattern(dev, "before", 4)

    old = export_daemon_pid(cloud)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    # The storage agent notices within a second, restarts the daemon and re-creates the export with
    # the same name and secrets; the guest's initiator reconnects by itself.
    wait_until(lambda: export_daemon_pid(cloud) not in (None, old), 30, what="export daemon restarted")
    assert cloud.vm1.checksum(dev, 4) == before
    after = cloud.vm1.write_pattern(dev, "after", 4)
    assert cloud.vm1.checksum(dev, 4) == after != before

    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm1.wait_disk_gone(serial, 10)
    assert [e for e in cloud.exports() if e["key"] == vol_id] == []
