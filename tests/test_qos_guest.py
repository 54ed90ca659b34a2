"""QoS seen from a guest: under ``vbs up`` (NBD exports, QEMU host agent) a volume with an IOPS limit is
measurably slower for the guest than an unlimited one, the limit is enforced once (at the storage
node's export, not again in the VM), and ModifyVolume raises it live: the same disk, never detached,
gets faster. Ratios of times measured in the same guest, never absolute times.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Vbs, vbs_up_with_guest, wait_until
from vbs.host.hypervisors.qemu_ids import disk_ids
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest

pytestmark = pytest.mark.integration

WRITES = 200  # synchronous 4 KiB writes: 2 s at 100 IOPS


class Env:
    def __init__(self, vbs: Vbs, guest: TestGuest) -> None:
        self.vbs, self.guest = vbs, guest

    def attached(self, device: str, **volume: Any) -> tuple[str, str]:
        vol = self.vbs.create_volume(**volume)["volume_id"]
        self.vbs.wait_volume(vol, "available")
        r = self.vbs.http.post(f"/v1/volumes/{vol}/attach",
                               json={"instance_id": self.vbs.instance("vm1"), "device": device})
        assert r.status_code == 200, r.text
        self.vbs.wait_volume(vol, "in-use")
        return vol, self.guest.wait_for_disk(virtio_serial(vol), 60)

    def write_time(self, dev: str) -> float:
        start = time.monotonic()
        self.guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=4k count={WRITES} oflag=direct 2>/dev/null", timeout=120)
        return time.monotonic() - start


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with vbs_up_with_guest(tmp_path_factory.mktemp("qos")) as (vbs, _up, guest):
        yield Env(vbs, guest)


def test_a_limited_volume_is_slower_for_the_guest_and_modify_raises_it_live(env: Env) -> None:
    limited, slow_dev = env.attached("vdb", size_gib=4, volume_type="io2", iops=100)
    free, free_dev = env.attached("vdc", size_gib=1, volume_type="gp3")
    # gp3 reports its baseline, but vbs up does not enforce it (enforce_type_limits is off).
    shown = env.vbs.volume(free)
    assert (shown["iops"], shown["throughput"]) == (3000, 125)
    # Enforced once, at the storage node: the VM's chain has no throttle node of its own.
    nodes = {n["node-name"] for n in env.guest.qmp("query-named-block-nodes", {"flat": True})}
    assert disk_ids(virtio_serial(limited)).throttle not in nodes

    unlimited_s, limited_s = env.write_time(free_dev), env.write_time(slow_dev)
    assert limited_s > 1.5, f"{WRITES} writes at 100 IOPS took {limited_s:.2f} s"
    assert limited_s > 2.5 * unlimited_s, f"limited {limited_s:.2f} s, unlimited {unlimited_s:.2f} s"

    attachment = env.vbs.volume(limited)["attachments"]
    r = env.vbs.http.post(f"/v1/volumes/{limited}/modify", json={"iops": 4000})
    assert r.status_code == 200, r.text
    wait_until(lambda: env.vbs.volume(limited)["iops"] == 4000, 60, what="the modification recorded")
    assert env.vbs.volume(limited)["attachments"] == attachment  # the same attachment: no detach
    assert env.guest.disks().get(virtio_serial(limited)) == slow_dev
    raised_s = env.write_time(slow_dev)
    assert limited_s > 2.5 * raised_s, f"at 100 IOPS {limited_s:.2f} s, raised to 4000: {raised_s:.2f} s"
