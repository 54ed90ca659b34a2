"""Local volumes end to end (semi-shared storage): vbs up whose host agent has a local pool, one QEMU guest (TCG).

A local volume made from a shared snapshot holds the snapshot's data; it is attached to the guest next to a
shared volume and both are usable at once; its snapshot lands on shared storage and a new shared volume made
from it has its data; detaching it removes it (non-persistent), while a persistent one stays, and its
snapshot (taken while no VM has it) is copied back too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Vbs, VbsUp, node_token
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest

pytestmark = pytest.mark.integration


class Node:
    def __init__(self, vbs: Vbs, guest: TestGuest, local_pool: Path) -> None:
        self.vbs, self.guest, self.local_pool = vbs, guest, local_pool

    def local_file(self, volume_id: str) -> Path:
        return self.local_pool / "volumes" / f"{volume_id}.raw"

    def attach(self, volume_id: str, device: str = "vdb") -> str:
        att = self.vbs.cli("attach-volume", volume_id, "--host", "host-1", "--vm", "vm1", "--device", device,
                           "--wait")
        assert att["state"] == "attached", att
        return self.guest.wait_for_disk(virtio_serial(volume_id), 20)

    def detach(self, volume_id: str) -> None:
        assert self.vbs.cli("detach-volume", volume_id, "--wait")["state"] == "detached"
        self.guest.wait_disk_gone(virtio_serial(volume_id), 20)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("local-volumes")
    local_pool = tmp / "local-pool"
    local_pool.mkdir()
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--local-pool", f"local={local_pool}"],
               env={"VBS_TEST_HOOKS": "1"})
    guest = TestGuest("vm1", tmp / "guests", build_guest(), tmp / "var" / "vms")
    try:
        guest.start()
        vbs = up.start()
        guest.wait_ready(180)
        yield Node(vbs, guest, local_pool)
    finally:
        guest.stop()
        up.stop()


def shared_volume(n: Node, *args: str) -> dict[str, Any]:
    vol = n.vbs.cli("create-volume", "--size", "1", "--wait", *args)
    assert vol["placement"] == "shared" and vol["storage_node"] == "storage-1"
    return vol  # type: ignore[no-any-return]


def test_a_local_volume_from_a_snapshot_works_next_to_a_shared_one_and_goes_back_to_shared(node: Node) -> None:
    # A shared volume with data, and its snapshot on the storage node.
    source = shared_volume(node)["volume_id"]
    written = node.guest.write_pattern(node.attach(source), "shared", 8)
    node.detach(source)
    snap = node.vbs.cli("create-snapshot", source, "--wait")

    # A local volume filled from that snapshot, on the host's own pool only.
    local = node.vbs.cli("create-volume", "--placement", "local", "--host", "host-1", "--snapshot",
                         snap["snapshot_id"], "--wait")
    local_id = local["volume_id"]
    assert (local["status"], local["placement"], local["host"], local["persistent"], local["pool"]) == (
        "available", "local", "host-1", False, "local")
    assert node.local_file(local_id).stat().st_size == 1 << 30
    assert not (node.vbs.pool / "volumes" / f"{local_id}.raw").exists()

    # Attached next to a shared volume: both usable at once.
    other = shared_volume(node)["volume_id"]
    local_dev = node.attach(local_id)
    shared_dev = node.attach(other, "vdc")
    assert node.guest.checksum(local_dev, 8) == written
    on_local = node.guest.write_pattern(local_dev, "local", 4)
    on_shared = node.guest.write_pattern(shared_dev, "othershared", 4)
    assert node.guest.checksum(local_dev, 4) == on_local != on_shared == node.guest.checksum(shared_dev, 4)
    assert node.vbs.volume(local_id)["status"] == "in-use"

    # Its snapshot (taken while attached: the hypervisor copies it at one instant) lands on shared storage.
    back = node.vbs.cli("create-snapshot", local_id, "--wait")
    assert back["status"] == "completed" and back["storage_node"] == "storage-1"
    assert back["data_location"] == "store", "stored, and the copy pool keeps no full copy"
    copy = shared_volume(node, "--snapshot", back["snapshot_id"])["volume_id"]
    copy_dev = node.attach(copy, "vdd")
    assert node.guest.checksum(copy_dev, 4) == on_local
    node.detach(copy)
    node.detach(other)

    # Detaching the non-persistent local volume removes it.
    node.detach(local_id)
    gone = node.vbs.volume(local_id)
    assert gone["status"] == "deleted"
    assert not node.local_file(local_id).exists()


def test_a_persistent_local_volume_outlives_its_detach_and_its_idle_snapshot_is_copied_back(node: Node) -> None:
    kept = node.vbs.cli("create-volume", "--size", "1", "--placement", "local", "--host", "host-1", "--persistent",
                        "--wait")
    kept_id = kept["volume_id"]
    assert kept["persistent"] is True
    [host] = node.vbs.http.get("/v1/hosts").json()["hosts"]
    assert [p["name"] for p in host["local_pools"]] == ["local"]
    refused = node.vbs.cli("modify-volume", kept_id, "--size", "2", check=False)
    assert refused.returncode != 0 and "local" in refused.stderr
    written = node.guest.write_pattern(node.attach(kept_id), "persistent", 4)
    node.detach(kept_id)
    assert node.vbs.volume(kept_id)["status"] == "available"
    assert node.local_file(kept_id).exists()

    # No VM has it: the host copies the file itself (qemu-img convert into the storage node's export).
    snap = node.vbs.cli("create-snapshot", kept_id, "--wait")
    assert snap["status"] == "completed" and snap["storage_node"] == "storage-1"
    copy = shared_volume(node, "--snapshot", snap["snapshot_id"])["volume_id"]
    assert node.guest.checksum(node.attach(copy), 4) == written
    node.detach(copy)

    node.vbs.cli("delete-volume", kept_id)
    node.vbs.wait_volume(kept_id, "deleted")
    assert not node.local_file(kept_id).exists()


def fail_next(n: Node, kind: str, step: str, when: str) -> None:
    r = n.vbs.http.post("/internal/v1/test/fail-step", json={"kind": kind, "step": step, "when": when},
                        headers={"authorization": "Bearer " + node_token(n.vbs.data_dir, "storage", "storage-1")})
    assert r.status_code == 200, r.text


def shared_files(n: Node) -> set[str]:
    return {p.name for p in (n.vbs.pool / "volumes").iterdir()}


def test_failed_local_creates_and_snapshots_roll_back_everything_they_made(node: Node) -> None:
    source = shared_volume(node)["volume_id"]
    snap = node.vbs.cli("create-snapshot", source, "--wait")["snapshot_id"]
    before = shared_files(node)

    # The fill is done, the scratch volume still there: a failure removes both copies.
    fail_next(node, "create-local-volume", "host-fill", "after")
    vol = node.vbs.create_volume(placement="local", host="host-1", snapshot_id=snap)["volume_id"]
    failed = node.vbs.wait_volume(vol, "error", timeout=60)
    assert "rolled back" in failed["status_reason"]
    assert not node.local_file(vol).exists()
    assert shared_files(node) == before

    # A snapshot of a local volume whose copy to shared storage is done: the scratch volume goes too.
    kept = node.vbs.create_volume(size_gib=1, placement="local", host="host-1", persistent=True)["volume_id"]
    node.vbs.wait_volume(kept, "available")
    fail_next(node, "snapshot-local-volume", "storage-snapshot", "before")
    r = node.vbs.http.post("/v1/snapshots", json={"volume_id": kept})
    assert r.status_code == 200, r.text
    errored = node.vbs.wait_snapshot(r.json()["snapshot_id"], "error", timeout=60)
    assert "rolled back" in errored["status_reason"]
    assert shared_files(node) == before
    assert not (node.vbs.pool / "snapshots" / f"{errored['snapshot_id']}.raw").exists()

    # More than the host's local pool may promise: refused at once, nothing made.
    r = node.vbs.http.post("/v1/volumes", json={"size_gib": 16000, "placement": "local", "host": "host-1"})
    assert r.status_code == 400 and "not enough room in the local pools" in r.text, r.text
    node.vbs.cli("delete-volume", kept)
    node.vbs.wait_volume(kept, "deleted")
