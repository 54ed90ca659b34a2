"""An instance live-migrates between two host agents of this machine and its VBS volume follows it.

A test guest (QEMU, TCG) runs on host h1 with a VBS volume attached and a writer in the guest; the test,
as an orchestrator would, starts the destination QEMU of the same VM on h2 with ``-incoming defer``;
``vbs migrate-instance`` exports the volume to h2, plugs it into the waiting VM, has QEMU migrate the
guest and revokes h1. The guest then keeps reading and writing the volume on h2 (checksums against
the volume's file), the attachment says h2 and h1 has no export left. A controller killed at a step
converges: back to h1 before the migration completes, forward to h2 after (the rest of the crash
points are behind ``torture``).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Services, stop_process, wait_until
from vbs import ids
from vbs.rigs.testguest import TestGuest, build_guest
from vbs.rigs.testguest.guest import pattern_sha256

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
CHECKED_MIB = 12  # the pattern (4 MiB) and the writer's blocks (4-12 MiB)
# Writes 64 KiB blocks at 4-12 MiB until /tmp/stop exists, counting them in /tmp/count; detached from the
# console command that starts it, so it outlives that command and the migration.
WRITER = ("setsid sh -c 'i=0; while [ ! -e /tmp/stop ]; do yes w$i | head -c 65536 | "
          "dd of=/dev/{dev} bs=65536 seek=$((64 + i % 128)) conv=fsync 2>/dev/null; i=$((i+1)); echo $i > /tmp/count; "
          "done; echo done > /tmp/stopped' </dev/null >/dev/null 2>&1 &")


@dataclass
class Setup:
    svc: Services
    tmp: Path
    source: TestGuest
    instance_id: str
    volume_id: str
    dev: str
    twin: TestGuest | None = None

    @property
    def volume_file(self) -> Path:
        return self.svc.data_dir / "pool" / "volumes" / f"{self.volume_id}.raw"

    def file_sha(self, mib: int) -> str:
        with self.volume_file.open("rb") as fh:
            return hashlib.sha256(fh.read(mib * MIB)).hexdigest()

    def start_twin(self) -> TestGuest:
        self.twin = self.source.incoming_twin(self.svc.tmp / "vms-h2", self.tmp / "guest-h2")
        wait_until(lambda: any(i["host"] == "h2" and i["vm_id"] == "vm1" and i["state"] == "incoming"
                               for i in self.svc.vbs.http.get("/v1/instances").json()["instances"]), 30,
                   what="h2 reporting the incoming VM")
        return self.twin

    def exports(self) -> set[tuple[str, str]]:
        found = httpx.get(f"http://127.0.0.1:{self.svc.agent_port}/v1/exports",
                          headers={"authorization": f"Bearer {self.svc.agent_token}"}, timeout=30).json()["exports"]
        return {(e["key"], e["host"]) for e in found}

    def attachment_hosts(self) -> list[str]:
        for inst in self.svc.vbs.http.get("/v1/instances").json()["instances"]:
            if inst["instance_id"] == self.instance_id:
                return [a["host"] for a in inst["volumes"]]
        return []

    def writes(self, guest: TestGuest) -> int:
        return int(guest.check("cat /tmp/count 2>/dev/null || echo 0").strip() or 0)


@contextmanager
def migration_setup(svc: Services, tmp: Path, **controller_env: str) -> Iterator[Setup]:
    """Controller, storage agent, hosts h1 and h2; the guest on h1 with a 1 GiB volume attached, a pattern
    written at its start and the writer running."""
    guest = TestGuest("vm1", tmp / "guest-h1", build_guest(), tmp / "vms-h1")
    setup: Setup | None = None
    try:
        guest.start()  # boots while the daemons start
        svc.start_controller(**controller_env)
        svc.start_agent()
        svc.start_host_agent("h1")
        svc.start_host_agent("h2")
        guest.wait_ready(120)
        instance_id = svc.vbs.instance("vm1")
        vol = svc.vbs.create_volume(size_gib=1)["volume_id"]
        svc.vbs.wait_volume(vol, "available")
        att = svc.vbs.http.post(f"/v1/volumes/{vol}/attach", json={"instance_id": instance_id, "device": "/dev/vdb"})
        assert att.status_code == 200, att.text
        svc.vbs.wait_volume(vol, "in-use")
        dev = guest.wait_for_disk(ids.virtio_serial(vol), 30)
        assert guest.write_pattern(dev, "before", 4) == pattern_sha256("before", 4)
        guest.check(WRITER.format(dev=dev))
        setup = Setup(svc, tmp, guest, instance_id, vol, dev)
        wait_until(lambda: setup.writes(guest) > 3, 60, what="the writer running on h1")
        yield setup
    finally:
        if setup is not None and setup.twin is not None:
            setup.twin.stop()
        guest.stop()


def the_guest_lives_on_h2(setup: Setup) -> None:
    """The guest runs on h2 and keeps writing there; what it reads is what the volume's file holds."""
    twin = setup.twin
    assert twin is not None
    wait_until(lambda: twin.qmp("query-status")["status"] == "running", 30, what="the guest running on h2")
    assert setup.source.qmp("query-status")["status"] == "postmigrate"
    moved_at = setup.writes(twin)
    wait_until(lambda: setup.writes(twin) > moved_at + 3, 60, what="the writer going on on h2")
    twin.check("touch /tmp/stop")
    wait_until(lambda: "done" in twin.check("cat /tmp/stopped 2>/dev/null || true"), 30, what="the writer to stop")
    assert twin.checksum(setup.dev, CHECKED_MIB) == setup.file_sha(CHECKED_MIB)
    assert twin.write_pattern(setup.dev, "after", 4) == pattern_sha256("after", 4) == setup.file_sha(4)
    assert setup.attachment_hosts() == ["h2"]
    assert setup.exports() == {(setup.volume_id, "h2")}, "h1 keeps no export"
    # The source's QEMU (the orchestrator's to quit) holds no connection to the volume any more.
    nodes = {n["node-name"] for n in setup.source.qmp("query-named-block-nodes", {"flat": True})}
    assert not any(n.endswith(("-proto", "-proto2")) for n in nodes), nodes


def the_guest_stayed_on_h1(setup: Setup) -> None:
    assert setup.source.qmp("query-status")["status"] == "running"
    before = setup.writes(setup.source)
    wait_until(lambda: setup.writes(setup.source) > before + 3, 60, what="the writer going on on h1")
    assert setup.attachment_hosts() == ["h1"]
    assert setup.exports() == {(setup.volume_id, "h1")}, "h2's export is revoked"
    setup.source.check("touch /tmp/stop")
    wait_until(lambda: "done" in setup.source.check("cat /tmp/stopped 2>/dev/null || true"), 30,
               what="the writer to stop")
    assert setup.source.checksum(setup.dev, CHECKED_MIB) == setup.file_sha(CHECKED_MIB)


def operation(svc: Services, op_id: str) -> dict[str, Any]:
    return svc.vbs.http.get(f"/v1/operations/{op_id}").json()  # type: ignore[no-any-return]


def test_the_volume_follows_the_live_migrated_instance(services: Services, tmp_path: Path) -> None:
    with migration_setup(services, tmp_path) as setup:
        refused = services.vbs.http.post(f"/v1/instances/{setup.instance_id}/migrations", json={"host": "h2"})
        assert refused.status_code == 409 and "-incoming defer" in refused.json()["error"]["message"], refused.text
        setup.start_twin()
        moved = services.vbs.cli("migrate-instance", setup.instance_id, "--host", "h2", "--wait")
        assert moved["status"] == "succeeded", moved
        assert moved["volume_ids"] == [setup.volume_id] and moved["external"] is False
        the_guest_lives_on_h2(setup)
        instance = next(i for i in services.vbs.http.get("/v1/instances").json()["instances"]
                        if i["instance_id"] == setup.instance_id)
        assert (instance["host"], instance["state"]) == ("h2", "running")
        # The attachment is h2's now: a detach unplugs the disk from the guest there.
        assert services.vbs.http.post(f"/v1/volumes/{setup.volume_id}/detach", json={}).status_code == 200
        services.vbs.wait_volume(setup.volume_id, "available")
        assert setup.twin is not None
        setup.twin.wait_disk_gone(ids.virtio_serial(setup.volume_id), 30)
        assert setup.exports() == set()


CRASH_POINTS = [
    # Before the migration completes: back to h1.
    pytest.param("target-export:done", "h1", marks=pytest.mark.torture),
    pytest.param("target-plug:done", "h1"),
    pytest.param("live-migrate:started", "h1", marks=pytest.mark.torture),
    # After: forward to h2.
    pytest.param("live-migrate:done", "h2", marks=pytest.mark.torture),
    pytest.param("source-unplug:done", "h2", marks=pytest.mark.torture),
    pytest.param("source-unexport:done", "h2", marks=pytest.mark.torture),
]


@pytest.mark.parametrize(("point", "ends_on"), CRASH_POINTS)
def test_a_controller_killed_mid_migration_converges(services: Services, tmp_path: Path, point: str,
                                                     ends_on: str) -> None:
    with migration_setup(services, tmp_path, VBS_CRASH_AT=f"migrate-instance:{point}") as setup:
        setup.start_twin()
        # Every crash point is after the request's answer: the workflow's first call takes longer.
        op_id = services.vbs.http.post(f"/v1/instances/{setup.instance_id}/migrations",
                                       json={"host": "h2"}).json()["operation_id"]
        services.wait_controller_killed()
        services.start_controller()
        final = wait_until(lambda: (op := operation(services, op_id))["status"] not in ("running", "rolling-back")
                           and op, 120, what="the operation to end")
        assert final["status"] == ("succeeded" if ends_on == "h2" else "rolled-back"), final
        if ends_on == "h2":
            the_guest_lives_on_h2(setup)
        else:
            the_guest_stayed_on_h1(setup)


@pytest.mark.torture
def test_an_orchestrators_own_migration_is_followed(services: Services, tmp_path: Path) -> None:
    """No `vbs migrate-instance`: VBS sees the destination VM waiting on h2 (heartbeat, then a reconcile
    pass), prepares the volume there; the orchestrator migrates with QEMU's own commands; VBS then moves
    the attachment and revokes h1."""
    with migration_setup(services, tmp_path, VBS_CONTROLLER_RECONCILE_INTERVAL_S="2") as setup:
        twin = setup.start_twin()
        device = f"vbs-{ids.virtio_serial(setup.volume_id)}-dev"
        wait_until(lambda: device in {c["name"] for c in twin.qmp("qom-list", {"path": "/machine/peripheral"})},
                   60, what="VBS plugging the volume into the destination VM")
        twin.qmp("migrate-incoming", {"uri": "tcp:127.0.0.1:0"})
        port = twin.qmp("query-migrate")["socket-address"][0]["port"]
        setup.source.qmp("migrate", {"uri": f"tcp:127.0.0.1:{port}"})
        wait_until(lambda: setup.attachment_hosts() == ["h2"], 120, what="the attachment following to h2")
        with sqlite3.connect(services.data_dir / "vbs.db") as db:
            found = db.execute("SELECT status, params FROM operations WHERE kind = 'migrate-instance'").fetchall()
        assert [(status, json.loads(params)["external"]) for status, params in found] == [("succeeded", True)]
        the_guest_lives_on_h2(setup)


@pytest.mark.torture
def test_a_migration_whose_destination_dies_rolls_back(services: Services, tmp_path: Path) -> None:
    """The orchestrator's destination QEMU dies while the guest streams: the source keeps running the
    guest, h2's export is revoked and the attachment stays on h1."""
    with migration_setup(services, tmp_path) as setup:
        twin = setup.start_twin()
        # Slow enough to be caught streaming: the guest's RAM at 1 MiB/s.
        setup.source.qmp("migrate-set-parameters", {"max-bandwidth": 1 << 20})
        op_id = services.vbs.http.post(f"/v1/instances/{setup.instance_id}/migrations",
                                       json={"host": "h2"}).json()["operation_id"]
        wait_until(lambda: setup.source.qmp("query-migrate").get("status") == "active", 60, what="streaming")
        twin.stop()
        final = wait_until(lambda: (op := operation(services, op_id))["status"] not in ("running", "rolling-back")
                           and op, 120, what="the operation to end")
        assert final["status"] == "rolled-back" and "did not complete" in final["error"], final
        setup.source.qmp("migrate-set-parameters", {"max-bandwidth": 128 << 20})
        the_guest_stayed_on_h1(setup)


@pytest.mark.torture
def test_a_source_host_that_dies_after_the_switch_over_does_not_hold_the_attachment_back(
        services: Services, tmp_path: Path) -> None:
    """The controller dies as the guest starts on h2, and h1's agent dies too: on restart the operation
    goes forward on h2's word alone, leaves the unplug on h1 out once it keeps failing, revokes h1's
    export and records the attachment on h2."""
    with migration_setup(services, tmp_path, VBS_CRASH_AT="migrate-instance:live-migrate:done") as setup:
        setup.start_twin()
        op_id = services.vbs.http.post(f"/v1/instances/{setup.instance_id}/migrations",
                                       json={"host": "h2"}).json()["operation_id"]
        services.wait_controller_killed()
        stop_process(services.host_agents[0])  # h1's agent
        services.start_controller(VBS_CONTROLLER_GIVE_UP_AFTER_S="6")
        final = wait_until(lambda: (op := operation(services, op_id))["status"] not in ("running", "rolling-back")
                           and op, 120, what="the operation to end")
        assert final["status"] == "succeeded", final
        assert [(s["name"], s["state"]) for s in final["steps"]][3:] == [
            ("source-unplug", "skipped"), ("source-unexport", "done"), ("switch-host", "done")]
        assert setup.attachment_hosts() == ["h2"]
        assert setup.exports() == {(setup.volume_id, "h2")}
        twin = setup.twin
        assert twin is not None
        twin.check("touch /tmp/stop")
        wait_until(lambda: "done" in twin.check("cat /tmp/stopped 2>/dev/null || true"), 30, what="the writer")
        assert twin.checksum(setup.dev, CHECKED_MIB) == setup.file_sha(CHECKED_MIB)
