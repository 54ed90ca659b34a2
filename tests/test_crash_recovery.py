"""Kill -9 the controller between workflow steps, restart it, and check the world agrees with the DB.

``VBS_CRASH_AT=<workflow>:<step>:<started|done>`` makes the controller SIGKILL itself right after
recording that point. Creates roll back (the volume or snapshot ends in ``error`` and nothing is left
on the pool), deletes roll forward (the item is gone from the pool and ``deleted``).

The default run kills each workflow at the start of its steps; the kill after a step's end is marked
``torture`` (``make torture``), as the matrix of ``tests/test_torture.py`` keeps the controller's
``done`` points of these workflows in its default subset.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import httpx
import pytest

from tests.conftest import Services, wait_until
from tests.world import assert_world_agrees


def TORTURE(point: str) -> Any:  # noqa: N802 - reads as a label in the parametrize lists
    """A point of ``make torture`` only."""
    return pytest.param(point, marks=pytest.mark.torture)


def crash_and_recover(svc: Services, crash_at: str, action: Any, recover: Any = None) -> Any:
    """Run ``action`` on a controller armed to die at ``crash_at``, then restart it.

    The workflow starts as soon as its request commits, so the controller may die before the answer
    is sent: ``recover`` then finds the resource after the restart (a create repeated with its
    client token answers the same volume).
    """
    svc.start_controller(VBS_CRASH_AT=crash_at)
    svc.start_agent()
    try:
        result = action()
    except httpx.TransportError:
        result = None
    assert svc.controller is not None
    svc.controller.wait(60)
    assert svc.controller.returncode == -9, "the controller killed itself at the crash point"
    svc.start_controller()
    if result is None and recover is not None:
        result = recover()
    return result


def newest_snapshot(svc: Services) -> dict[str, Any]:
    with sqlite3.connect(svc.data_dir / "vbs.db") as db:
        (snap_id,) = db.execute("SELECT id FROM snapshots ORDER BY started_at DESC LIMIT 1").fetchone()
    return {"snapshot_id": snap_id}


def _prepare_volume(svc: Services) -> str:
    vol = svc.vbs.create_volume(size_gib=1)
    svc.vbs.wait_volume(vol["volume_id"], "available")
    with (svc.data_dir / "pool" / "volumes" / f"{vol['volume_id']}.raw").open("r+b") as fh:
        fh.write(b"x" * (64 << 20))
    return vol["volume_id"]


def _snapshot_crashed_at(services: Services, point: str) -> dict[str, Any]:
    """A snapshot of a volume with data, whose controller killed itself at ``create-snapshot:<point>``
    and was started again."""
    services.start_controller()
    services.start_agent()
    vol_id = _prepare_volume(services)
    services.stop()
    return crash_and_recover(services, f"create-snapshot:{point}",
                             lambda: services.vbs.http.post("/v1/snapshots", json={"volume_id": vol_id}).json(),
                             lambda: newest_snapshot(services))


@pytest.mark.parametrize("point", ["storage-create:started", TORTURE("storage-create:done"), "mark-available:started"])
def test_create_volume_interrupted_rolls_back(services: Services, point: str) -> None:
    vol = crash_and_recover(services, f"create-volume:{point}",
                            lambda: services.vbs.create_volume(size_gib=1, client_token="crash"),
                            lambda: services.vbs.create_volume(size_gib=1, client_token="crash"))
    final = services.vbs.wait_volume(vol["volume_id"], "error", timeout=30)
    assert "rolled back" in (final["status_reason"] or "")
    assert_world_agrees(services)
    # The service goes on: the same request works now, and the error volume can be deleted.
    again = services.vbs.create_volume(size_gib=1)
    services.vbs.wait_volume(again["volume_id"], "available")
    assert services.vbs.http.delete(f"/v1/volumes/{vol['volume_id']}").status_code == 200
    services.vbs.wait_volume(vol["volume_id"], "deleted")
    assert_world_agrees(services)


@pytest.mark.parametrize("point", ["storage-create:started", TORTURE("storage-create:done")])
def test_create_volume_from_snapshot_with_copy_interrupted_rolls_back(services: Services, point: str) -> None:
    services.start_controller()
    services.start_agent()
    vol_id = _prepare_volume(services)
    snap = services.vbs.http.post("/v1/snapshots", json={"volume_id": vol_id}).json()
    services.vbs.wait_snapshot(snap["snapshot_id"], "completed")
    services.stop()
    def create() -> dict[str, Any]:
        return services.vbs.create_volume(snapshot_id=snap["snapshot_id"], client_token="crash-clone")

    clone = crash_and_recover(services, f"create-volume:{point}", create, create)
    services.vbs.wait_volume(clone["volume_id"], "error", timeout=30)
    assert_world_agrees(services)


@pytest.mark.parametrize("point", ["storage-snapshot:started", TORTURE("storage-snapshot:done")])
def test_create_snapshot_interrupted_rolls_back(services: Services, point: str) -> None:
    snap = _snapshot_crashed_at(services, point)
    services.vbs.wait_snapshot(snap["snapshot_id"], "error", timeout=30)
    assert_world_agrees(services)


@pytest.mark.parametrize("point", ["storage-delete:started", TORTURE("storage-delete:done"), "mark-deleted:started"])
def test_delete_volume_interrupted_rolls_forward(services: Services, point: str) -> None:
    services.start_controller()
    services.start_agent()
    vol_id = _prepare_volume(services)
    services.stop()
    crash_and_recover(services, f"delete-volume:{point}",
                      lambda: services.vbs.http.delete(f"/v1/volumes/{vol_id}").json())
    services.vbs.wait_volume(vol_id, "deleted", timeout=30)
    assert_world_agrees(services)


@pytest.mark.parametrize("point", ["storage-delete:started", TORTURE("storage-delete:done")])
def test_delete_snapshot_interrupted_rolls_forward(services: Services, point: str) -> None:
    services.start_controller()
    services.start_agent()
    vol_id = _prepare_volume(services)
    snap = services.vbs.http.post("/v1/snapshots", json={"volume_id": vol_id}).json()
    services.vbs.wait_snapshot(snap["snapshot_id"], "completed")
    services.stop()
    crash_and_recover(services, f"delete-snapshot:{point}",
                      lambda: services.vbs.http.delete(f"/v1/snapshots/{snap['snapshot_id']}").json())
    wait_until(lambda: services.vbs.http.get(f"/v1/snapshots/{snap['snapshot_id']}").status_code == 404,
               30, what="snapshot deleted")
    assert_world_agrees(services)


def test_create_waits_for_a_restarting_storage_agent(services: Services) -> None:
    services.start_controller()
    services.start_agent()
    assert services.agent is not None
    services.agent.kill()
    services.agent.wait()
    # The agent's last heartbeat is still fresh: the volume is placed there and waits for it.
    vol = services.vbs.create_volume(size_gib=1)
    assert services.vbs.volume(vol["volume_id"])["status"] == "creating"
    services.start_agent()
    services.vbs.wait_volume(vol["volume_id"], "available", timeout=30)
    assert_world_agrees(services)


def test_no_live_storage_node_refuses_create_and_changes_nothing(services: Services) -> None:
    services.start_controller(VBS_CONTROLLER_HEARTBEAT_TIMEOUT_S="1.5")
    services.start_agent()
    assert services.agent is not None
    services.agent.kill()
    services.agent.wait()
    wait_until(lambda: services.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"][0]["state"] == "down",
               10, what="node down")
    r = services.vbs.http.post("/v1/volumes", json={"size_gib": 1})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "InsufficientVolumeCapacity"
    assert services.vbs.all_volumes() == []


@pytest.mark.parametrize("point", ["store-upload:started", TORTURE("store-upload:done")])
def test_create_snapshot_interrupted_in_its_upload_goes_forward(services: Services, point: str) -> None:
    """Once the pool's point-in-time copy is made, a controller restart resumes the upload instead of
    rolling back: the snapshot ends ``completed``, in the store."""
    snap = _snapshot_crashed_at(services, point)
    done = services.vbs.wait_snapshot(snap["snapshot_id"], "completed", timeout=60)
    assert done["data_location"] == "store"
    assert (services.data_dir / "storage-state" / "snapshots" / "manifests" / snap["snapshot_id"]).is_file()
    assert_world_agrees(services)


def test_an_upload_whose_agent_is_killed_midway_sends_only_what_the_store_lacks(services: Services) -> None:
    """The storage agent is SIGKILLed while a snapshot's upload has put some of its chunks and not the
    rest (one chunk cannot be written: its fan-out directory is a file); after its restart the upload
    starts again and sends exactly the chunks the store does not hold. Those the killed try put were
    never synced, so the ``dir`` store reads each back, checks it and syncs it instead of sending it
    again (docs/snapshots.md, "Durability")."""
    import hashlib
    import os
    import random
    import re

    from vbs.controller.auth.keys import MasterKey
    from vbs.controller.auth.store_key import store_key
    from vbs.controller.db import Database
    from vbs.snapshot_store import StoreKey
    from vbs.snapshot_store.format import CHUNK_SIZE, chunk_id

    mib = 64
    count = (mib << 20) // CHUNK_SIZE  # the volume's chunks that hold data
    services.start_controller()
    services.start_agent()
    vol = services.vbs.create_volume(size_gib=1)
    services.vbs.wait_volume(vol["volume_id"], "available")
    data = random.Random(b"midway").randbytes(mib << 20)
    with (services.data_dir / "pool" / "volumes" / f"{vol['volume_id']}.raw").open("r+b") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    db = Database.for_data_dir(services.data_dir)
    try:
        key = StoreKey(bytes.fromhex(store_key(db, MasterKey(services.data_dir / "master.key")).get_secret_value()))
    finally:
        db.dispose()
    tenant_key = key.tenant_key("default")
    ids_ = [chunk_id(tenant_key, data[i * CHUNK_SIZE:(i + 1) * CHUNK_SIZE]) for i in range(count)]
    # A late chunk whose fan-out directory no other chunk of the volume shares (the key is new each run).
    blocked_index = max(i for i in range(count - 16, count) if sum(c[:2] == ids_[i][:2] for c in ids_) == 1)
    prefix = ids_[blocked_index][:2]
    store = services.data_dir / "storage-state" / "snapshots"
    blocker = store / "chunks" / prefix
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"")  # a file where the chunk's directory goes: that one put fails, every time

    snap = services.vbs.http.post("/v1/snapshots", json={"volume_id": vol["volume_id"]}).json()
    sid = snap["snapshot_id"]
    wait_until(lambda: (store / "uploads" / sid).is_file() and "upload failed" in (services.tmp / "agent.log")
               .read_text(errors="replace"), 60, what="an upload stopped at the blocked chunk")
    assert services.agent is not None
    services.agent.kill()
    services.agent.wait(30)
    stored_at_kill = {p.name for p in (store / "chunks").rglob("*") if p.is_file() and len(p.name) == 64}
    assert stored_at_kill and len(stored_at_kill) < count and not (store / "manifests" / sid).exists()
    assert ids_[blocked_index] not in stored_at_kill
    blocker.unlink()
    services.start_agent()
    done = services.vbs.wait_snapshot(sid, "completed", timeout=120)
    assert done["data_location"] == "store" and done["stored_bytes"] == mib << 20
    stored = {p.name for p in (store / "chunks").rglob("*") if p.is_file() and len(p.name) == 64}
    assert stored == set(ids_)
    log = (services.tmp / "agent.log").read_text(errors="replace")
    # (the agent's own store, in its state directory: reported with its node's name)
    # Every chunk of the 1 GiB volume is read (its holes as zeros, stored as none), and only what the store
    # lacked is sent; the killed try's chunks, younger than its marker, are verified, not sent again.
    sent, read = count - len(stored_at_kill), (1 << 30) // CHUNK_SIZE
    line = f"snapshot {sid} stored in dir:{store} on storage-1: {count} chunks, {read} read, {sent} new"
    assert re.search(rf"{re.escape(line)} \(\d+ bytes sent\), {len(stored_at_kill)} verified", log), line
    # And it restores bit for bit.
    clone = services.vbs.create_volume(snapshot_id=sid)
    services.vbs.wait_volume(clone["volume_id"], "available", timeout=120)
    with (services.data_dir / "pool" / "volumes" / f"{clone['volume_id']}.raw").open("rb") as fh:
        assert hashlib.sha256(fh.read(mib << 20)).digest() == hashlib.sha256(data).digest()
    assert_world_agrees(services)


def test_a_recycle_bin_expiry_killed_between_its_commit_and_its_delete_frees_the_data_once(
        services: Services) -> None:
    """A snapshot and a volume in the Recycle Bin (docs/recycle-bin.md) whose retention ends: the controller
    dies (``VBS_CRASH_AT=recycle-bin:expire:done``) after the transaction that takes the first out of the bin
    and begins its delete, before the delete runs. Restarted, it resumes that delete and expires the other:
    each is deleted by exactly one operation, the pool file and the store manifest of each are gone, and
    nothing is left in the bin, in error or unfinished."""
    day = {"VBS_CONTROLLER_RECYCLE_BIN_DAY_S": "5"}  # retention of one "day": time enough for both deletes
    services.start_controller(VBS_CRASH_AT="recycle-bin:expire:done", **day)
    services.start_agent()
    vbs = services.vbs
    rbin, ec2 = vbs.aws("rbin"), vbs.ec2()
    for kind in ("EBS_SNAPSHOT", "EBS_VOLUME"):
        rbin.create_rule(ResourceType=kind, RetentionPeriod={"RetentionPeriodValue": 1, "RetentionPeriodUnit": "DAYS"})
    vol = _prepare_volume(services)
    snap = vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
    vbs.wait_snapshot(snap, "completed", timeout=120)
    manifest = services.data_dir / "storage-state" / "snapshots" / "manifests" / snap
    vol_file = services.data_dir / "pool" / "volumes" / f"{vol}.raw"
    assert manifest.is_file() and vol_file.is_file()
    ec2.delete_snapshot(SnapshotId=snap)
    ec2.delete_volume(VolumeId=vol)
    assert {v["VolumeId"] for v in ec2.list_volumes_in_recycle_bin()["Volumes"]} == {vol}
    assert {s["SnapshotId"] for s in ec2.list_snapshots_in_recycle_bin()["Snapshots"]} == {snap}
    services.wait_controller_killed()
    with sqlite3.connect(services.data_dir / "vbs.db") as db:
        begun = db.execute("SELECT resource_id, status FROM operations WHERE kind IN "
                           "('delete-snapshot', 'delete-volume')").fetchall()
    assert len(begun) == 1 and begun[0][1] == "running", begun  # committed, never run
    services.start_controller(**day)
    wait_until(lambda: vbs.http.get(f"/v1/volumes/{vol}").json().get("status") == "deleted", 120,
               what="volume deleted")  # (404 while in the bin and while deleting)
    wait_until(lambda: vbs.http.get(f"/v1/snapshots/{snap}").status_code == 404, 120, what="snapshot deleted")
    wait_until(lambda: not manifest.exists(), 60, what="the snapshot's manifest removed")
    assert not vol_file.exists() and not (services.data_dir / "pool" / "snapshots" / f"{snap}.raw").exists()
    assert_world_agrees(services)
    with sqlite3.connect(services.data_dir / "vbs.db") as db:
        ops = sorted(db.execute("SELECT kind, resource_id, status FROM operations WHERE kind IN "
                                "('delete-snapshot', 'delete-volume')").fetchall())
        left = db.execute("SELECT resource_id FROM recycle_bin_entries").fetchall()
    assert ops == [("delete-snapshot", snap, "succeeded"), ("delete-volume", vol, "succeeded")], ops
    assert left == []
    assert ec2.list_snapshots_in_recycle_bin()["Snapshots"] == [] and ec2.list_volumes_in_recycle_bin()["Volumes"] == []
    log = (services.tmp / "controller.log").read_text(errors="replace")
    assert log.count(f"snapshot {snap}: its Recycle Bin retention ended") == 1
    assert log.count(f"volume {vol}: its Recycle Bin retention ended") == 1
