"""A ``busy`` detach ends once the guest lets the disk go: a real guest, paused while its disk's unplug is
asked (so the detach gives up waiting and the attachment is ``busy``), then resumed: it answers QEMU's
unplug request late, and the reconciler finishes the detach (docs/operations.md, ``released-disk``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clouds import Cloud
from tests.conftest import GuestOfVbsUp, wait_until
from vbs.ids import virtio_serial

pytestmark = pytest.mark.integration


def test_a_busy_detach_ends_detached_once_the_guest_lets_the_disk_go(tmp_path: Path) -> None:
    env = {"VBS_CONTROLLER_DETACH_TIMEOUT_S": "2", "VBS_CONTROLLER_RECONCILE_INTERVAL_S": "1"}
    with Cloud(tmp_path, env=env) as cloud:
        [guest] = cloud.start_guests({"vm1": "host-1"})
        vbs = cloud.vbs
        user = GuestOfVbsUp()
        user.vbs, user.guest = vbs, guest
        vol = vbs.create_volume(size_gib=1)["volume_id"]
        vbs.wait_volume(vol, "available")
        user.attach(vol)
        serial = virtio_serial(vol)

        guest.qmp("stop")  # the guest cannot answer the unplug while it is paused
        try:
            r = vbs.http.post(f"/v1/volumes/{vol}/detach", json={})
            assert r.status_code == 200, r.text
            wait_until(lambda: cloud.attachment_state(vol) == "busy", 120, what="the detach busy")
            assert vbs.volume(vol)["status"] == "in-use"
            assert serial in {d["serial"] for d in cloud.host_disks("vm1")}, "a busy disk stays in the VM"
            assert vol in {e["key"] for e in cloud.exports()}, "and its export with it"
        finally:
            guest.qmp("cont")
        # The guest answers the unplug request it was given while paused; the reconciler sees the disk gone
        # and ends the detach: no disk, no export, the volume available.
        guest.wait_disk_gone(serial, 120)
        wait_until(lambda: vbs.volume(vol)["status"] == "available", 120, what="the detach finished")
        assert cloud.attachment_state(vol) is None
        assert serial not in {d["serial"] for d in cloud.host_disks("vm1")}
        assert vol not in {e["key"] for e in cloud.exports()}
        ops = vbs.http.get("/v1/operations", params={"resource_id": vol}).json()["operations"]
        assert [(o["kind"], o["status"]) for o in ops].count(("detach-volume", "succeeded")) == 1, ops
        # Attached again, the disk works.
        dev = user.attach(vol)
        assert guest.check(f"cat /sys/block/{dev}/size").strip() == str(2 * 1024 * 1024)
        user.detach(vol)
