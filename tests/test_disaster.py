"""Issue 33's disaster: a storage node's whole pool is destroyed (its directory removed) while it holds
volumes with snapshots in a snapshot store that two storage nodes share (``vbs up --storage-nodes 2``
gives both its one ``dir`` store).

Every ``completed`` snapshot restores bit for bit onto the other node (hashed on the host, and one of
them inside a TCG guest, which also wrote it); the lost volumes end ``error`` with the reason; the node
stays up and reports its pool lost, with no room, so nothing new is placed there; nothing else changes
(the other node's volume and snapshot, every snapshot's state, a volume created meanwhile). Once in a
cloud with a guest, the reconciler running on its own; once as a user would, with the ``vbs`` CLI only
and ``vbs check --repair --now``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clouds import GUEST_DETACH_ENV, Cloud
from tests.conftest import Vbs, running_vbs_up, wait_until
from tests.snapshot_stores import pattern, sha, write_at
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest

pytestmark = pytest.mark.integration

MiB = 1 << 20
# The reconciler's passes every second, a pool judged lost once it has stayed gone for 3 s.
FAST_RECONCILE = {"VBS_CONTROLLER_RECONCILE_INTERVAL_S": "1", "VBS_CONTROLLER_ORPHAN_GRACE_S": "3"}


def pool_of(vbs: Vbs, node: str) -> Path:
    return vbs.pool if node == "storage-1" else vbs.data_dir / "pools" / node


def file_of(vbs: Vbs, volume: dict[str, Any]) -> Path:
    return pool_of(vbs, volume["storage_node"]) / "volumes" / f"{volume['volume_id']}.raw"


def completed(vbs: Vbs, volume_id: str) -> str:
    """A snapshot of ``volume_id``, once it is completed (stored): its id."""
    snap = vbs.cli("create-snapshot", volume_id)["snapshot_id"]
    done = vbs.wait_snapshot(snap, "completed", timeout=300)
    assert done["store_state"] == "stored" and done["data_location"] == "store", done
    return str(snap)


def restored(vbs: Vbs, snapshot_id: str, *where: str) -> dict[str, Any]:
    """A volume made from ``snapshot_id`` (``where``: placement flags), once it is available."""
    made = vbs.cli("create-volume", "--snapshot", snapshot_id, *where, "--wait")
    assert made["status"] == "available", made
    return made  # type: ignore[no-any-return]


def storage_node(vbs: Vbs, node: str) -> dict[str, Any]:
    nodes = vbs.cli("describe-storage-nodes")["storage_nodes"]
    (found,) = [n for n in nodes if n["name"] == node]
    return found  # type: ignore[no-any-return]


def everything(vbs: Vbs) -> tuple[dict[str, tuple[str, str, str | None]], dict[str, tuple[str, str]]]:
    """Every volume's (status, node, reason) and every snapshot's (status, where its data is), by id."""
    vols = {v["volume_id"]: (v["status"], v["storage_node"], v["status_reason"])
            for v in vbs.cli("describe-volumes")["volumes"]}
    snaps = {s["snapshot_id"]: (s["status"], s["data_location"]) for s in vbs.cli("describe-snapshots")["snapshots"]}
    return vols, snaps


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cloud, TestGuest]]:
    """vbs up with two storage nodes (one store), a guest vm1 on host-1, the reconciler fast."""
    with Cloud(tmp_path_factory.mktemp("disaster"), extra=["--storage-nodes", "2"],
               env={**FAST_RECONCILE, **GUEST_DETACH_ENV}) as cloud:
        (guest,) = cloud.start_guests({"vm1": "host-1"})
        cloud.instance("host-1", "vm1", timeout=60)
        yield cloud, guest


def attached(cloud: Cloud, guest: TestGuest, volume_id: str) -> str:
    """Attach ``volume_id`` to vm1: its device name in the guest."""
    cloud.vbs.cli("attach-volume", volume_id, "--host", "host-1", "--vm", "vm1", "--wait")
    return guest.wait_for_disk(virtio_serial(volume_id), 30)


def detached(cloud: Cloud, guest: TestGuest, volume_id: str) -> None:
    cloud.vbs.cli("detach-volume", volume_id, "--wait")
    guest.wait_disk_gone(virtio_serial(volume_id), 30)


def test_a_destroyed_pool_loses_its_volumes_and_every_stored_snapshot_restores_elsewhere(
        cloud: tuple[Cloud, TestGuest]) -> None:
    c, guest = cloud
    vbs = c.vbs
    # -- storage-1 holds two volumes with snapshots; storage-2 one ------------------------------------------------
    a = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-1", "--wait")["volume_id"]
    b = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-1", "--wait")["volume_id"]
    other = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-2", "--wait")
    # The guest writes a (8 MiB at its start) and reads back what it wrote.
    written = guest.write_pattern(attached(c, guest, a), "disaster", 8)
    detached(c, guest, a)
    a_path = vbs.pool / "volumes" / f"{a}.raw"
    images = {}
    snap_a1 = completed(vbs, a)
    images[snap_a1] = sha(a_path)
    write_at(a_path, 300 * MiB, pattern(b"a-later", 2))  # an incremental snapshot of more data
    snap_a2 = completed(vbs, a)
    images[snap_a2] = sha(a_path)
    b_path = vbs.pool / "volumes" / f"{b}.raw"
    write_at(b_path, 0, pattern(b"b", 3))
    write_at(b_path, 1000 * MiB, pattern(b"b-end", 1))
    snap_b = completed(vbs, b)
    images[snap_b] = sha(b_path)
    other_path = file_of(vbs, other)
    write_at(other_path, 5 * MiB, pattern(b"other", 2))
    snap_other = completed(vbs, other["volume_id"])
    images[snap_other] = sha(other_path)
    other_image = images[snap_other]
    vols_before, snaps_before = everything(vbs)

    # -- the disaster: storage-1's pool is gone ----------------------------------------------------------------------
    shutil.rmtree(vbs.pool)

    for lost in (a, b):
        gone = vbs.wait_volume(lost, "error", timeout=120)
        assert "its pool default on storage-1 is lost" in gone["status_reason"], gone
        assert str(vbs.pool) in gone["status_reason"], gone
    # Its next heartbeat (every 5 s) reports the pool lost: placement then gives it no room.
    node = wait_until(lambda: (n := storage_node(vbs, "storage-1"))["pools"][0].get("lost") and n, 60,
                      what="storage-1 reporting its pool lost")
    assert node["state"] == "up", "the node itself lives on: only its pool is lost"
    (pool,) = node["pools"]
    assert pool["lost"] == f"{vbs.pool} is gone" and pool["capacity_bytes"] == 0 and pool["free_bytes"] == 0

    # -- every completed snapshot restores bit for bit on storage-2, without being told where ------------------------
    made = {snap: restored(vbs, snap) for snap in images}
    for snap, volume in made.items():
        assert volume["storage_node"] == "storage-2", volume
        assert sha(file_of(vbs, volume)) == images[snap], f"{snap} restored differs"
    # ... and the guest reads what it wrote, from the restored volume.
    restored_a1 = made[snap_a1]["volume_id"]
    assert guest.checksum(attached(c, guest, restored_a1), 8) == written
    detached(c, guest, restored_a1)

    # -- nothing else changed ---------------------------------------------------------------------------------------
    meanwhile = vbs.cli("create-volume", "--size", "1", "--wait")
    assert meanwhile["status"] == "available" and meanwhile["storage_node"] == "storage-2", meanwhile
    vols_after, snaps_after = everything(vbs)
    assert snaps_after == snaps_before, "every snapshot as it was"
    for vol_id, before in vols_before.items():
        expected = ("error", "storage-1", vols_after[vol_id][2]) if vol_id in (a, b) else before
        assert vols_after[vol_id] == expected, vol_id
    assert set(vols_after) == set(vols_before) | {v["volume_id"] for v in made.values()} | {meanwhile["volume_id"]}
    assert sha(other_path) == other_image
    assert vbs.volume(other["volume_id"])["status"] == "available"


def test_a_user_recovers_from_a_lost_pool_with_the_cli(tmp_path: Path) -> None:
    """vbs up --storage-nodes 2 as it comes (its one dir store, the reconciler's own pace), driven by ``vbs``."""
    with running_vbs_up(tmp_path, "--storage-nodes", "2") as vbs:
        vol = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-1", "--wait")["volume_id"]
        path = vbs.pool / "volumes" / f"{vol}.raw"
        write_at(path, 0, pattern(b"user", 3))
        first = completed(vbs, vol)
        image_first = sha(path)
        write_at(path, 700 * MiB, pattern(b"user-later", 1))
        second = completed(vbs, vol)
        image_second = sha(path)
        kept = vbs.cli("create-volume", "--size", "1", "--storage-node", "storage-2", "--wait")["volume_id"]

        shutil.rmtree(vbs.pool)

        # vbs check says what is wrong (a volume changed in the last seconds is judged by a later check: its row
        # may be newer than the listing); --repair --now acts on it without waiting out the grace period.
        def findings() -> set[tuple[str, str]]:
            checked = vbs.cli("check", check=False)
            assert checked.returncode == 1, checked.stderr
            return {(f["kind"], f["resource_id"]) for f in json.loads(checked.stdout)["findings"]}

        found = wait_until(lambda: f if ("missing-file", vol) in (f := findings()) else None, 60,
                           what="vbs check naming the lost volume")
        assert ("lost-pool", "default") in found, found
        assert vbs.cli("describe-volumes", vol)["volumes"][0]["status"] == "available", "check alone changes nothing"
        repaired = vbs.cli("check", "--repair", "--now")
        assert any(f["kind"] == "missing-file" and f["resource_id"] == vol and f["action"] == "repaired"
                   for f in repaired["findings"]), repaired
        (lost,) = vbs.cli("describe-volumes", vol)["volumes"]
        assert lost["status"] == "error" and "its pool default on storage-1 is lost" in lost["status_reason"], lost

        wait_until(lambda: storage_node(vbs, "storage-1")["pools"][0].get("lost"), 60,
                   what="storage-1 reporting its pool lost")
        for snap, image in ((first, image_first), (second, image_second)):
            made = restored(vbs, snap)
            assert made["storage_node"] == "storage-2" and sha(file_of(vbs, made)) == image, made
            assert vbs.cli("describe-snapshots", snap)["snapshots"][0]["status"] == "completed"
        assert vbs.cli("describe-volumes", kept)["volumes"][0]["status"] == "available"
