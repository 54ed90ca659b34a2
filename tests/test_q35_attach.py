"""Volumes into a q35 guest through the whole stack: ``vbs up``, the REST API and the CLI, the host
agent's QEMU driver, a TCG guest whose root bus takes no hot-plugged device and whose one PCIe root
port takes one disk at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import vbs_up_with_guest
from vbs.ids import virtio_serial
from vbs.rigs.testguest import pattern_sha256

pytestmark = pytest.mark.integration


def test_a_q35_guest_takes_a_volume_in_its_free_root_port_and_a_refused_attach_rolls_back(tmp_path: Path) -> None:
    with vbs_up_with_guest(tmp_path, machine="q35", root_ports=1) as (vbs, _up, guest):
        instance = vbs.instance("vm1")
        first, second = (vbs.create_volume(size_gib=1)["volume_id"] for _ in range(2))
        for volume_id in (first, second):
            vbs.wait_volume(volume_id, "available")

        vbs.cli("attach-volume", first, "--instance", instance, "--wait")
        dev = guest.wait_for_disk(virtio_serial(first))
        assert guest.write_pattern(dev, "q35-e2e", 2) == pattern_sha256("q35-e2e", 2)

        # The only port is taken: the host agent refuses with the reason and the attach rolls back.
        refused = vbs.cli("attach-volume", second, "--instance", instance, "--device", "vdc", "--wait", check=False)
        assert refused.returncode == 1
        assert "attach-volume rolled-back" in refused.stderr, refused.stderr
        assert "no free slot for another disk" in refused.stderr and "pcie-root-port" in refused.stderr
        assert vbs.volume(second)["status"] == "available" and vbs.volume(second)["attachments"] == []
        assert set(guest.disks()) == {virtio_serial(first)}

        # Detached, the port takes the other volume; the first kept its data.
        vbs.cli("detach-volume", first, "--wait")
        guest.wait_disk_gone(virtio_serial(first))
        vbs.cli("attach-volume", second, "--instance", instance, "--wait")
        guest.wait_for_disk(virtio_serial(second))
        vbs.cli("detach-volume", second, "--wait")
        guest.wait_disk_gone(virtio_serial(second))
        vbs.cli("attach-volume", first, "--instance", instance, "--wait")
        assert guest.checksum(guest.wait_for_disk(virtio_serial(first)), 2) == pattern_sha256("q35-e2e", 2)
