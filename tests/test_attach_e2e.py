"""Attach and detach for real: vbs up (NBD or iSCSI export), two host agents, QEMU guests under TCG.

A guest writes a pattern on a hot-plugged volume, the volume moves to a guest behind another host
agent and reads the same checksum, and a snapshot's clone shows it to a third attachment. Injected
failures at every attach step leave no export, no guest disk, and the volume available.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clouds import GUEST_DETACH_ENV, TwoHostCloud, detach_is_busy_until_forced, new_volume
from tests.conftest import node_token, private_qmp, start_bare_vm, stop_process, wait_until
from vbs.config import host_initiator_name
from vbs.ids import virtio_serial
from vbs.storage.exports.iscsi import parse_targets
from vbs.system.argv import run
from vbs.system.socket_paths import socket_path


@pytest.fixture(scope="module", params=["nbd", "iscsi"])
def cloud(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHostCloud]:
    export = request.param
    with TwoHostCloud(tmp_path_factory.mktemp(f"cloud-{export}"), extra=["--export", export],
                      env={"VBS_TEST_HOOKS": "1", **GUEST_DETACH_ENV}) as cloud:
        yield cloud


def iscsi_acls(cloud: TwoHostCloud) -> list[set[str]] | None:
    """The ACL of each target of the storage agent's tgtd (None if none runs)."""
    for key_file in (cloud.vbs.data_dir / "storage-state").rglob("iqn.key"):
        base = socket_path(key_file.parent, "tgtd.sock")
        for sock in base.parent.glob("tgtd.sock.*"):
            control = sock.name.removeprefix("tgtd.sock.")
            if not control.isdigit():
                continue  # tgtd's lock file beside its socket
            out = run(["tgtadm", "-C", control, "--lld", "iscsi", "--mode", "target", "--op", "show"], timeout=30,
                      env={"PATH": os.environ["PATH"], "TGT_IPC_SOCKET": str(base)}).stdout
            return [t.acl for t in parse_targets(out).values()]
    return None


def test_volume_moves_between_vms_on_two_hosts_with_its_data(cloud: TwoHostCloud, request: pytest.FixtureRequest
                                                              ) -> None:
    vol_id = new_volume(cloud)
    serial = virtio_serial(vol_id)

    att = cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "vm1", "--device", "vdb", "--wait")
    assert att["state"] == "attached" and att["host"] == "host-1"
    assert cloud.vbs.volume(vol_id)["status"] == "in-use"
    dev = cloud.vm1.wait_for_disk(serial, 10)
    written = cloud.vm1.write_pattern(dev, "extendable", 8)
    if request.node.callspec.params["cloud"] == "iscsi":
        # host-1 reported its own initiator name, the controller passed it on, tgtd binds it (not
        # 127.0.0.1, which every host here shares), and QEMU logged in with it.
        assert iscsi_acls(cloud) == [{host_initiator_name("host-1")}]

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
def test_a_failure_at_any_attach_step_leaves_everything_as_before(cloud: TwoHostCloud, step: str, when: str) -> None:
    vol_id = new_volume(cloud)
    r = cloud.vbs.http.post("/internal/v1/test/fail-step", json={"kind": "attach-volume", "step": step, "when": when},
                            headers={"authorization": "Bearer "
                                     + node_token(cloud.vbs.data_dir, "storage", "storage-1")})
    assert r.status_code == 200, r.text
    att = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"host": "host-1", "vm_id": "vm1"})
    assert att.status_code == 200, att.text
    cloud.vbs.wait_volume(vol_id, "available", timeout=30)
    wait_until(lambda: cloud.attachment_state(vol_id) is None, 30, what="attachment gone")
    # A disk that was plugged is unplugged by force (a rollback does not wait on the guest): a guest slow
    # to answer (under load) keeps the device, its I/O failing, until it lets go, and the volume is
    # available meanwhile, but not to this VM (``IncorrectState``). The guest's release is the event:
    # QEMU deletes the device (DEVICE_DELETED) and the host agent no longer lists the disk; the guest
    # reports it gone once it scans again.
    wait_until(lambda: virtio_serial(vol_id) not in {d["serial"] for d in cloud.host_disks("vm1")}, 60,
               what="the guest released the disk")
    cloud.vm1.wait_disk_gone(virtio_serial(vol_id), 10)
    assert virtio_serial(vol_id) not in cloud.vm1.disks()
    assert [e for e in cloud.exports() if e["key"] == vol_id] == []
    # And the next attach works.
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "vm1", "--wait")
    cloud.vm1.wait_for_disk(virtio_serial(vol_id), 10)
    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm1.wait_disk_gone(virtio_serial(vol_id), 10)


def test_bad_attach_requests_change_nothing(cloud: TwoHostCloud) -> None:
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


def test_hosts_and_instances_are_described(cloud: TwoHostCloud) -> None:
    hosts = {h["name"]: h for h in cloud.vbs.cli("describe-hosts")["hosts"]}
    assert hosts["host-1"]["state"] == hosts["host-2"]["state"] == "up"
    instances = cloud.vbs.cli("describe-instances")["instances"]
    assert {(i["host"], i["vm_id"]) for i in instances} >= {("host-1", "vm1"), ("host-2", "vm2")}
    assert all(i["instance_id"].startswith("i-") for i in instances)




@pytest.fixture
def bare_vm(cloud: TwoHostCloud, tmp_path: Path) -> Iterator[str]:
    """A VM with no guest OS on host-1: it takes a hot-plugged disk but never acknowledges an unplug."""
    vm_dir = cloud.vm_dir("host-1")
    proc = start_bare_vm(vm_dir, "bare", tmp_path / "bare.log")  # the host agent holds its first monitor
    try:
        cloud.instance("host-1", "bare")
        yield "bare"
    finally:
        stop_process(proc)
        (vm_dir / "bare.qmp").unlink(missing_ok=True)
        private_qmp(vm_dir, "bare").unlink(missing_ok=True)


def test_a_guest_that_holds_the_disk_makes_detach_busy_and_force_ends_it(cloud: TwoHostCloud, bare_vm: str) -> None:
    detach_is_busy_until_forced(cloud, bare_vm)


def test_attach_to_a_host_whose_agent_is_down_fails_clearly_and_rolls_back(cloud: TwoHostCloud) -> None:
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
        cloud.host2 = cloud.start_host_agent("host-2")
    cloud.instance("host-2", "vm2")


def test_guest_io_resumes_after_the_export_daemon_is_killed(cloud: TwoHostCloud) -> None:
    vol_id = new_volume(cloud)
    serial = virtio_serial(vol_id)
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "vm1", "--wait")
    dev = cloud.vm1.wait_for_disk(serial, 10)
    before = cloud.vm1.write_pattern(dev, "before", 4)

    old = cloud.export_daemon_pid()
    assert old is not None
    os.kill(old, signal.SIGKILL)
    # The storage agent notices within a second, restarts the daemon and re-creates the export with
    # the same name and secrets; the guest's initiator reconnects by itself.
    wait_until(lambda: cloud.export_daemon_pid() not in (None, old), 30, what="export daemon restarted")
    assert cloud.vm1.checksum(dev, 4) == before
    after = cloud.vm1.write_pattern(dev, "after", 4)
    assert cloud.vm1.checksum(dev, 4) == after != before

    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm1.wait_disk_gone(serial, 10)
    assert [e for e in cloud.exports() if e["key"] == vol_id] == []
