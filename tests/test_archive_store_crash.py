"""Kill -9 the controller in the middle of moving a snapshot to or from a separate archive store, restart
it, and check that the move rolled forward: the snapshot ends archived (its manifest only in the archive
store) or restored (back in the snapshot store; out of the archive after a permanent restore), and the
world agrees with the DB. ``VBS_CRASH_AT=<workflow>:<step>:<started|done>`` (vbs.controller.workflows.faults).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Services, wait_until
from tests.world import assert_world_agrees
from vbs.snapshot_store import DirStore
from vbs.snapshot_store.format import manifest_key

pytestmark = pytest.mark.integration


def start(svc: Services, archive: Path, **env: str) -> None:
    svc.start_controller(**env)
    svc.start_agent("--archive-store", f"dir:{archive}")
    svc.wait_storage_node_up()


def tier(svc: Services, snap: str) -> dict[str, Any]:
    return dict(svc.vbs.http.get("/v1/snapshot-tiers", params={"snapshot_id": snap}).json()["tiers"][0])


def crashed_then_restarted(svc: Services, archive: Path, point: str, action: Any) -> None:
    """``action`` on a controller armed to die at ``point``, then the controller started again."""
    svc.stop()
    start(svc, archive, VBS_CRASH_AT=point)
    try:
        action()
    except httpx.TransportError:
        pass  # it died before it answered: the request had committed
    assert svc.controller is not None
    svc.controller.wait(60)
    assert svc.controller.returncode == -9, "the controller killed itself at the crash point"
    svc.start_controller()


def a_stored_snapshot(svc: Services, archive: Path) -> str:
    start(svc, archive)
    vol = svc.vbs.create_volume(size_gib=1)["volume_id"]
    svc.vbs.wait_volume(vol, "available")
    with (svc.data_dir / "pool" / "volumes" / f"{vol}.raw").open("r+b") as fh:
        fh.write(b"x" * (8 << 20))
    snap = str(svc.vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"])
    svc.vbs.wait_snapshot(snap, "completed", timeout=120)
    return snap


@pytest.mark.parametrize("point", ["archive-copy:started", "archive-copy:done"])
def test_an_archive_interrupted_rolls_forward_into_the_archive_store(services: Services, tmp_path: Path,
                                                                      point: str) -> None:
    archive = tmp_path / "archive"
    snap = a_stored_snapshot(services, archive)
    standard = DirStore(services.data_dir / "storage-state" / "snapshots")
    crashed_then_restarted(services, archive, f"archive-snapshot:{point}",
                           lambda: services.vbs.http.put(f"/v1/snapshots/{snap}/tier", json={"tier": "archive"}))
    wait_until(lambda: tier(services, snap)["last_status"] != "archival-in-progress", 90, what="archived")
    shown = tier(services, snap)
    assert (shown["storage_tier"], shown["last_status"]) == ("archive", "archival-completed"), shown
    assert DirStore(archive).has(manifest_key(snap)) and not standard.has(manifest_key(snap))
    assert_world_agrees(services)


def test_a_permanent_restore_interrupted_after_its_copy_rolls_forward(services: Services, tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    snap = a_stored_snapshot(services, archive)
    standard = DirStore(services.data_dir / "storage-state" / "snapshots")
    services.vbs.http.put(f"/v1/snapshots/{snap}/tier", json={"tier": "archive"})
    wait_until(lambda: tier(services, snap)["last_status"] == "archival-completed", 90, what="archived")
    crashed_then_restarted(services, archive, "restore-snapshot-tier:copy-back:done",
                           lambda: services.vbs.http.post(f"/v1/snapshots/{snap}/tier-restores",
                                                          json={"permanent": True}))
    wait_until(lambda: tier(services, snap)["last_status"] != "permanent-restore-in-progress", 90, what="restored")
    shown = tier(services, snap)
    assert (shown["storage_tier"], shown["last_status"]) == ("standard", "permanent-restore-completed"), shown
    assert standard.has(manifest_key(snap)) and not DirStore(archive).has(manifest_key(snap))
    vol = services.vbs.create_volume(snapshot_id=snap)["volume_id"]
    services.vbs.wait_volume(vol, "available", timeout=120)
    with (services.data_dir / "pool" / "volumes" / f"{vol}.raw").open("rb") as fh:
        assert fh.read(8 << 20) == b"x" * (8 << 20)
    assert_world_agrees(services)
