"""QoS seen from a guest: under ``vbs up`` (NBD exports, QEMU host agent) a volume with an IOPS limit has
it on its export at the storage node (a throttle node in the export's chain), an unlimited one has none,
the limit is enforced once (not again in the VM), and ModifyVolume raises it live: the same disk, never
detached, on the same export, with the new limit. What the limits do to the guest's speed is measured
in bench/ (a loaded machine would make a timing here flaky).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Vbs, vbs_up_with_guest, wait_until
from vbs.host.hypervisors.qemu_ids import disk_ids
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest

pytestmark = pytest.mark.integration

WRITES = 200  # synchronous 4 KiB writes


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

    def write(self, dev: str) -> None:
        self.guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=4k count={WRITES} oflag=direct 2>/dev/null", timeout=120)

    def served(self, volume_id: str) -> dict[str, Any]:
        """What the storage node's NBD export driver holds of the volume (its ``exports.json``)."""
        items = [item for path in self.vbs.data_dir.rglob("exports.json")
                 for item in json.loads(path.read_text())["items"] if item["key"] == volume_id]
        assert len(items) == 1, items
        return items[0]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with vbs_up_with_guest(tmp_path_factory.mktemp("qos")) as (vbs, _up, guest):
        yield Env(vbs, guest)


def test_a_limited_volume_is_limited_at_its_export_and_modify_raises_it_live(env: Env) -> None:
    limited, slow_dev = env.attached("vdb", size_gib=4, volume_type="io2", iops=100)
    free, free_dev = env.attached("vdc", size_gib=1, volume_type="gp3")
    # gp3 reports its baseline, but vbs up does not enforce it (enforce_type_limits is off).
    shown = env.vbs.volume(free)
    assert (shown["iops"], shown["throughput"]) == (3000, 125)
    # Enforced once, at the storage node: the VM's chain has no throttle node of its own.
    nodes = {n["node-name"] for n in env.guest.qmp("query-named-block-nodes", {"flat": True})}
    assert disk_ids(virtio_serial(limited)).throttle not in nodes

    # At the storage node: the limited volume's export has its limit and a throttle node to apply it.
    served = env.served(limited)
    assert served["limits"]["qos"]["iops"] == 100, served
    assert served["chains"] and all(c["throttle_node"] for c in served["chains"]), served
    assert ((env.served(free)["limits"] or {}).get("qos") or {}).get("iops") is None, env.served(free)
    env.write(free_dev)
    env.write(slow_dev)

    attachment = env.vbs.volume(limited)["attachments"]
    r = env.vbs.http.post(f"/v1/volumes/{limited}/modify", json={"iops": 4000})
    assert r.status_code == 200, r.text
    wait_until(lambda: env.vbs.volume(limited)["iops"] == 4000, 60, what="the modification recorded")
    assert env.vbs.volume(limited)["attachments"] == attachment  # the same attachment: no detach
    assert env.guest.disks().get(virtio_serial(limited)) == slow_dev
    # Raised live on the same export (same chains, same exports), not re-exported.
    wait_until(lambda: env.served(limited)["limits"]["qos"]["iops"] == 4000, 60, what="the export's new limit")
    raised = env.served(limited)
    assert (raised["chains"], raised["exports"]) == (served["chains"], served["exports"])
    env.write(slow_dev)
