"""The ``command`` backend with the shipped ``qemu-img`` profile, end to end: ``vbs up --backend
command --backend-profile qemu-img`` (qcow2 images served over NBD by qemu-storage-daemon), a QEMU
guest under TCG, everything through the CLI.

A guest writes a pattern on a qcow2 volume; a snapshot of it taken while attached (the hypervisor
copies it into a qcow2 snapshot target) and one taken detached both hold the pattern; a thin clone
made from the snapshot, larger than it, shows it to the guest at its own size; the volume grows;
deleting the snapshot before its clone keeps the clone whole.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import Vbs, VbsUp, wait_until
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Vbs, TestGuest]]:
    tmp = tmp_path_factory.mktemp("qemu-img")
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--backend", "command", "--backend-profile", "qemu-img"])
    vbs = up.start()
    vm = TestGuest("vm1", tmp / "guests", build_guest(), tmp / "var" / "vms")
    try:
        vm.start()
        vm.wait_ready(120)
        yield vbs, vm
    finally:
        try:
            vm.stop()
        finally:
            up.stop()


def _image(vbs: Vbs, kind: str, item: str) -> dict[str, object]:
    [path] = list(vbs.data_dir.rglob(f"{kind}/{item}.qcow2"))
    out = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(path)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def test_qcow2_volumes_snapshots_and_clones_with_a_guest(cloud: tuple[Vbs, TestGuest]) -> None:
    vbs, vm = cloud
    vol = vbs.cli("create-volume", "--size", "1", "--wait")["volume_id"]
    assert _image(vbs, "volumes", vol)["format"] == "qcow2"
    serial = virtio_serial(vol)
    vbs.cli("attach-volume", vol, "--host", "host-1", "--vm", "vm1", "--wait")
    dev = vm.wait_for_disk(serial, 30)
    written = vm.write_pattern(dev, "qcow2-volume", 8)

    # Taken while the guest has the disk: the hypervisor copies it into a qcow2 target.
    live = vbs.cli("create-snapshot", vol, "--wait")
    assert live["status"] == "completed", live
    vbs.cli("detach-volume", vol, "--wait")
    vm.wait_disk_gone(serial, 30)
    cold = vbs.cli("create-snapshot", vol, "--wait")
    assert cold["status"] == "completed", cold
    for snap in (live, cold):
        assert "backing-filename" not in _image(vbs, "snapshots", snap["snapshot_id"]), "snapshots are standalone"

    clones = []
    for snap in (live, cold):
        clone = vbs.cli("create-volume", "--snapshot", snap["snapshot_id"], "--size", "2", "--wait")
        assert _image(vbs, "volumes", clone["volume_id"])["backing-filename"], "a clone is a thin overlay"
        clones.append(clone["volume_id"])
    # The snapshot goes first; its clone keeps reading through it.
    vbs.cli("delete-snapshot", live["snapshot_id"])
    for clone in clones:
        cserial = virtio_serial(clone)
        vbs.cli("attach-volume", clone, "--host", "host-1", "--vm", "vm1", "--wait")
        cdev = vm.wait_for_disk(cserial, 30)
        assert vm.checksum(cdev, 8) == written
        assert vm.disk_size(cserial) == 2 << 30
        vbs.cli("detach-volume", clone, "--wait")
        vm.wait_disk_gone(cserial, 30)
        vbs.cli("delete-volume", clone)

    grown = vbs.cli("modify-volume", vol, "--size", "3", "--wait")
    assert vbs.volume(vol)["size_gib"] == 3, grown
    assert _image(vbs, "volumes", vol)["virtual-size"] == 3 << 30
    vbs.cli("delete-snapshot", cold["snapshot_id"])
    vbs.cli("delete-volume", vol)
    wait_until(lambda: not list(vbs.data_dir.rglob("*.qcow2*")), 60, what="the pool emptied")
