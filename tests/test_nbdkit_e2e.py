"""``vbs up --export nbdkit`` with a real TCG guest: a volume attached through its own nbdkit process
(unix socket), written and read back in the guest, kept across a killed storage agent (the new agent
adopts the process: same PID, the guest's session never drops), limited by the hypervisor (nbdkit has
no throttle), grown online, snapshotted while attached (the guest's QEMU copies it), detached.

The guest and ``vbs up`` are stopped at teardown; nbdkit processes are reaped by their pidfiles."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Vbs, VbsUp, wait_until
from vbs.host.hypervisors.qemu_ids import disk_ids
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest

pytestmark = pytest.mark.integration

GIB = 1 << 30


class Rig:
    def __init__(self, vbs: Vbs, up: VbsUp, guest: TestGuest) -> None:
        self.vbs, self.up, self.guest = vbs, up, guest

    @property
    def run_dir(self) -> Path:
        return self.vbs.data_dir / "storage-state" / "nbdkit" / "run"

    def processes(self) -> dict[int, list[bytes]]:
        """The nbdkit processes of this install by PID, with their command lines."""
        out: dict[int, list[bytes]] = {}
        for pidfile in self.run_dir.glob("*.pid"):
            try:
                pid = int(pidfile.read_text())
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
        return out

    def serving(self, vol: str) -> int:
        """The PID of the one nbdkit that serves ``vol``."""
        pids = [pid for pid, argv in self.processes().items() if any(vol.encode() in a for a in argv)]
        assert len(pids) == 1, self.processes()
        return pids[0]

    def attach(self, device: str, **volume: Any) -> tuple[str, str]:
        vol = self.vbs.create_volume(**{"size_gib": 1, **volume})["volume_id"]
        self.vbs.wait_volume(vol, "available")
        r = self.vbs.http.post(f"/v1/volumes/{vol}/attach", json={"instance_id": self.vbs.instance("vm1"),
                                                                  "device": device})
        assert r.status_code == 200, r.text
        self.vbs.wait_volume(vol, "in-use")
        return vol, self.guest.wait_for_disk(virtio_serial(vol), 60)

    def detach(self, vol: str) -> None:
        r = self.vbs.http.post(f"/v1/volumes/{vol}/detach", json={})
        assert r.status_code == 200, r.text
        self.vbs.wait_volume(vol, "available")
        self.guest.wait_disk_gone(virtio_serial(vol), 30)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("nbdkit")
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--export", "nbdkit"])
    guest = TestGuest("vm1", tmp / "guests", build_guest(), tmp / "var" / "vms")
    try:
        guest.start()
        vbs = up.start()
        guest.wait_ready(120)
        yield Rig(vbs, up, guest)
    finally:
        guest.stop()
        up.stop()


def test_a_guest_writes_and_reads_a_volume_through_its_own_nbdkit_and_detaches(rig: Rig) -> None:
    vol, dev = rig.attach("vdb")
    pid = rig.serving(vol)
    argv = rig.processes()[pid]
    assert b"-U" in argv and b"-p" not in argv  # a unix socket under vbs up, no TCP listener
    digest = rig.guest.write_pattern(dev, "through-nbdkit", 8)
    assert rig.guest.checksum(dev, 8) == digest
    rig.detach(vol)
    wait_until(lambda: pid not in rig.processes(), 30, what="the export's process gone")
    with open(rig.vbs.pool / "volumes" / f"{vol}.raw", "rb") as f:
        assert b"through-nbdkit" in f.read(8 << 20)


def test_a_killed_storage_agent_adopts_the_process_the_guest_is_using(rig: Rig) -> None:
    vol, dev = rig.attach("vdb")
    pid = rig.serving(vol)
    before = rig.guest.write_pattern(dev, "before-the-kill", 4)
    agent = rig.up.child_pid("storage-agent")
    assert agent is not None
    offset = rig.up.log_path.stat().st_size
    os.kill(agent, signal.SIGKILL)
    wait_until(lambda: rig.up.child_pid("storage-agent") not in (None, agent), 60, what="a new storage agent")
    wait_until(lambda: f"adopted nbdkit pid {pid}".encode() in rig.up.log_path.read_bytes()[offset:], 60,
               what="the new agent adopting the process")
    assert rig.serving(vol) == pid  # adopted, not restarted
    assert rig.guest.checksum(dev, 4) == before
    after = rig.guest.write_pattern(dev, "after-the-kill", 4)
    assert rig.guest.checksum(dev, 4) == after
    rig.detach(vol)


def test_the_hypervisor_limits_a_volume_nbdkit_cannot_throttle(rig: Rig) -> None:
    vol, dev = rig.attach("vdc", size_gib=4, volume_type="io2", iops=100)
    ids = disk_ids(virtio_serial(vol))
    nodes = {n["node-name"] for n in rig.guest.qmp("query-named-block-nodes", {"flat": True})}
    assert ids.throttle in nodes
    limits = rig.guest.qmp("qom-get", {"path": f"/objects/{ids.throttle_group}", "property": "limits"})
    assert limits["iops-total"] == 100, limits
    rig.guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=4k count=20 oflag=direct 2>/dev/null", timeout=120)
    rig.detach(vol)


def test_an_attached_volume_grows_online(rig: Rig) -> None:
    vol, dev = rig.attach("vdb")
    pid = rig.serving(vol)
    written = rig.guest.write_pattern(dev, "before-growing", 2)
    r = rig.vbs.http.post(f"/v1/volumes/{vol}/modify", json={"size_gib": 2})
    assert r.status_code == 200, r.text
    wait_until(lambda: int(rig.guest.check(f"cat /sys/block/{dev}/size").strip()) * 512 == 2 * GIB, 120,
               what="the guest to see 2 GiB")
    assert rig.serving(vol) == pid  # the same process: a new connection sees the new size
    assert rig.guest.checksum(dev, 2) == written
    rig.guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=1M count=1 seek=2000 oflag=direct 2>/dev/null", timeout=120)
    rig.detach(vol)


def test_a_snapshot_of_an_attached_volume_holds_what_the_guest_wrote(rig: Rig) -> None:
    vol, dev = rig.attach("vdb")
    written = rig.guest.write_pattern(dev, "snapshot-me", 4)
    snap = rig.vbs.cli("create-snapshot", vol, "--wait")
    rig.vbs.wait_snapshot(snap["snapshot_id"], "completed")
    clone = rig.vbs.cli("create-volume", "--snapshot", snap["snapshot_id"], "--wait")["volume_id"]
    rig.detach(vol)
    r = rig.vbs.http.post(f"/v1/volumes/{clone}/attach", json={"instance_id": rig.vbs.instance("vm1"),
                                                                "device": "vdd"})
    assert r.status_code == 200, r.text
    rig.vbs.wait_volume(clone, "in-use")
    clone_dev = rig.guest.wait_for_disk(virtio_serial(clone), 60)
    assert rig.guest.checksum(clone_dev, 4) == written
    rig.detach(clone)
