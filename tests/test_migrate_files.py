"""``vbs migrate-volume`` between storage nodes whose pools are their own files, with real parts: a
controller, two storage agents (their own pools, NBD export daemons over TLS-PSK), a QEMU host agent
and one booted test guest (TCG). An available volume is pulled by the new node; an attached one is
mirrored by the guest's QEMU while the guest writes, and switched with no pause it could see. The
controller is killed at steps of both workflows (``VBS_CRASH_AT``) and everything converges once it
restarts: rolled back before the switch (the volume where it was, untouched, nothing left on the new
node), rolled forward from it (the volume on the new node, nothing left on the old one). The whole
matrix of steps runs under ``make torture``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import VBS, Services, free_port, reap_daemons, stop_process, wait_until
from tests.numbered_blocks import NumberedBlocks
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest
from vbs.rigs.testguest.guest import qmp_execute

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
BLOCK = 4096
WRITES = 300
SLOTS = 1024  # blocks 0..WRITES-1 land at distinct 4 KiB slots of the first 4 MiB
STRIDE = 7
PREFILL_MIB = 16  # data the copy must carry besides the guest's writes, after the slots
BLOCKS = NumberedBlocks(writes=WRITES, slots=SLOTS, stride=STRIDE, block=BLOCK)
writer_script = BLOCKS.writer_script
blocks_in = BLOCKS.blocks_in

COPY_STEPS = ["export-to-target", "copy", "switch", "unexport", "remove-old-copy", "finish"]
MIRROR_STEPS = ["target-volume", "export-to-host", "mirror", "pivot", "switch", "remove-old-export",
                "remove-old-copy", "finish"]


class Cluster:
    """The module's services: ``storage-1`` (Services' own agent) and ``storage-2`` (started here)."""

    def __init__(self, tmp: Path) -> None:
        self.svc = Services(tmp)
        # Every NBD session authenticated: the hosts' and the storage nodes' pulling from each other.
        self.svc.env["VBS_STORAGE_AGENT_NBD_TLS"] = "psk"
        self.tmp = tmp
        self.pool2 = self.svc.data_dir / "pool-2"
        self.pool2.mkdir()
        self.agent2: subprocess.Popen[bytes] | None = None
        self.agent2_port = 0
        self.guest: TestGuest | None = None

    def start(self) -> None:
        self.svc.start_controller()
        self.svc.start_agent()
        self.agent2_port, nbd = free_port(), free_port()
        self.agent2 = subprocess.Popen(
            [*VBS, "storage-agent", "--node-name", "storage-2", "--port", str(self.agent2_port),
             "--pool-path", str(self.pool2), "--controller-url", self.svc.vbs.endpoint,
             "--state-dir", str(self.svc.data_dir / "storage-state-2"), "--nbd-port", str(nbd)],
            env=self.svc.node_env("storage", "storage-2"), stdout=(self.tmp / "agent-2.log").open("ab"),
            stderr=subprocess.STDOUT)
        wait_until(lambda: {n["name"] for n in self.svc.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]
                            if n["state"] == "up"} == {"storage-1", "storage-2"}, 60, what="two storage nodes")
        vm_dir = self.svc.start_host_agent()
        self.guest = TestGuest("vm1", self.tmp / "guests", build_guest(), vm_dir)
        self.guest.start()
        self.guest.wait_ready(120)
        wait_until(lambda: self.svc.vbs.http.get("/v1/instances").json()["instances"], 60, what="the guest's VM")

    def stop(self) -> None:
        if self.guest is not None:
            self.guest.stop()
        if self.agent2 is not None:
            stop_process(self.agent2)
        self.svc.stop()
        reap_daemons(self.svc.data_dir / "storage-state-2")

    def file_of(self, vol: str, node: str) -> Path:
        pool = self.svc.data_dir / "pool" if node == "storage-1" else self.pool2
        return pool / "volumes" / f"{vol}.raw"

    def other(self, node: str) -> str:
        return "storage-2" if node == "storage-1" else "storage-1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("migrate-files"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def volume_with_data(c: Cluster) -> tuple[str, str, str]:
    """A new 1-GiB volume with random data after the slots; its id, node and the data's sha256."""
    vol = c.svc.vbs.create_volume(size_gib=1)["volume_id"]
    node = c.svc.vbs.wait_volume(vol, "available")["storage_node"]
    data = os.urandom(PREFILL_MIB * MIB)
    with open(c.file_of(vol, node), "r+b") as f:
        f.seek(SLOTS * BLOCK)
        f.write(data)
    return vol, node, hashlib.sha256(data).hexdigest()


def prefill_sha(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(SLOTS * BLOCK)
        return hashlib.sha256(f.read(PREFILL_MIB * MIB)).hexdigest()


def migrate(c: Cluster, vol: str, node: str) -> dict[str, Any]:
    """Start the move; the operation's answer (the controller may die before sending it: None)."""
    try:
        r = c.svc.vbs.http.post(f"/v1/volumes/{vol}/migrate", json={"storage_node": node})
    except httpx.TransportError:
        return {}
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def operation(c: Cluster, op_id: str, timeout: float = 180) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        op: dict[str, Any] = c.svc.vbs.http.get(f"/v1/operations/{op_id}").json()
        return op if op["status"] in ("succeeded", "rolled-back", "failed") else None

    found: dict[str, Any] = wait_until(ended, timeout, interval=0.2, what=f"operation {op_id}")
    return found


def settled(c: Cluster, vol: str, timeout: float = 180) -> dict[str, Any]:
    """The volume once no move of it is under way any more."""
    found: dict[str, Any] = wait_until(lambda: (v := c.svc.vbs.volume(vol))["migration"] is None and v,
                                       timeout, interval=0.3, what=f"the move of {vol} to end")
    return found


def exports_of(c: Cluster, vol: str, node: str) -> list[str]:
    """The hosts (or nodes) the node's export daemon serves the volume to, as its agent lists them."""
    port = c.svc.agent_port if node == "storage-1" else c.agent2_port
    r = httpx.get(f"http://127.0.0.1:{port}/v1/exports",
                  headers={"authorization": f"Bearer {c.svc.node_env('storage', node)['VBS_AGENT_TOKEN']}"})
    assert r.status_code == 200, r.text
    return sorted(e["host"] for e in r.json()["exports"] if e["key"] == vol)


def protocol_nodes(c: Cluster, vol: str) -> list[dict[str, Any]]:
    assert c.guest is not None
    nodes = qmp_execute(c.guest.test_qmp_path, "query-named-block-nodes", {"flat": True})
    return [n for n in nodes if n["node-name"].startswith(f"vbs-{virtio_serial(vol)}-proto")]




def attach(c: Cluster, vol: str) -> str:
    assert c.guest is not None
    r = c.svc.vbs.http.post(f"/v1/volumes/{vol}/attach", json={"host": "host-1", "vm_id": "vm1"})
    assert r.status_code == 200, r.text
    c.svc.vbs.wait_volume(vol, "in-use")
    return c.guest.wait_for_disk(virtio_serial(vol), 30)


def detach(c: Cluster, vol: str) -> None:
    assert c.guest is not None
    r = c.svc.vbs.http.post(f"/v1/volumes/{vol}/detach", json={})
    assert r.status_code == 200, r.text
    c.svc.vbs.wait_volume(vol, "available", timeout=90)
    c.guest.wait_disk_gone(virtio_serial(vol), 30)


def guest_sha(c: Cluster, dev: str) -> str:
    """sha256 of the slots and the prefill as the guest reads them from its disk."""
    assert c.guest is not None
    mib = (SLOTS * BLOCK) // MIB + PREFILL_MIB
    return c.guest.checksum(dev, mib)


def file_sha(path: Path) -> str:
    mib = (SLOTS * BLOCK) // MIB + PREFILL_MIB
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(mib * MIB)).hexdigest()


# -- an available volume -----------------------------------------------------------------------------


def test_an_available_volume_is_copied_to_the_other_node_and_keeps_its_id(cluster: Cluster) -> None:
    c = cluster
    vol, node, data_sha = volume_with_data(c)
    target = c.other(node)
    before = file_sha(c.file_of(vol, node))
    move = migrate(c, vol, target)
    assert (move["source_node"], move["target_node"]) == (node, target)
    assert operation(c, move["operation_id"])["status"] == "succeeded"
    moved = c.svc.vbs.volume(vol)
    assert (moved["volume_id"], moved["storage_node"], moved["status"], moved["migration"]) == (
        vol, target, "available", None)
    assert file_sha(c.file_of(vol, target)) == before and prefill_sha(c.file_of(vol, target)) == data_sha
    assert c.file_of(vol, target).stat().st_size == 1 << 30
    assert not c.file_of(vol, node).exists(), "the old copy is deleted"
    assert exports_of(c, vol, node) == [], "the export the new node pulled through is gone"
    for state in ("storage-state", "storage-state-2"):
        pid = int((c.svc.data_dir / state / "nbd" / "qsd.pid").read_text())
        assert b"tls-creds-psk" in Path(f"/proc/{pid}/cmdline").read_bytes(), "NBD sessions are authenticated"
    # The moved volume serves a guest from its new node.
    dev = attach(c, vol)
    assert guest_sha(c, dev) == before
    detach(c, vol)
    c.svc.vbs.http.delete(f"/v1/volumes/{vol}")


# -- an attached volume, while the guest writes ---------------------------------------------------------


def test_an_attached_volume_moves_while_the_guest_writes_with_every_write_kept(cluster: Cluster) -> None:
    c = cluster
    assert c.guest is not None
    vol, node, data_sha = volume_with_data(c)
    target = c.other(node)
    dev = attach(c, vol)
    writing = c.guest.run_background(writer_script(dev), timeout=600)
    wait_until(lambda: len(blocks_in(c.file_of(vol, node))) >= 20, 120, interval=0.2, what="the first writes")
    move = migrate(c, vol, target)
    seen: list[dict[str, Any]] = []
    while (v := c.svc.vbs.volume(vol))["migration"] is not None:
        seen.append(v["migration"])
        time.sleep(0.2)
    assert operation(c, move["operation_id"])["status"] == "succeeded"
    rc, out = writing.result(600)
    assert rc == 0 and f"wrote {WRITES}" in out, out
    assert seen and seen[0]["kind"] == "migrate-volume-mirror" and seen[0]["target_node"] == target, seen[:1]
    assert blocks_in(c.file_of(vol, target)) == set(range(WRITES)), "every write, before, during and after"
    assert prefill_sha(c.file_of(vol, target)) == data_sha
    assert guest_sha(c, dev) == file_sha(c.file_of(vol, target)), "the guest reads what the new node holds"
    moved = c.svc.vbs.volume(vol)
    assert (moved["volume_id"], moved["storage_node"], moved["status"]) == (vol, target, "in-use")
    assert [a["state"] for a in moved["attachments"]] == ["attached"]
    assert not c.file_of(vol, node).exists() and exports_of(c, vol, node) == []
    assert exports_of(c, vol, target) == ["host-1"]
    assert len(protocol_nodes(c, vol)) == 1, "the old connection is closed in QEMU"
    detach(c, vol)
    assert exports_of(c, vol, target) == []
    c.svc.vbs.http.delete(f"/v1/volumes/{vol}")


def test_a_mirror_cancelled_behind_the_controllers_back_ends_the_move_with_the_volume_untouched(
        cluster: Cluster) -> None:
    """The move holds just before its switch while the mirror is cancelled in QEMU: the host says the
    disk never switched, so the operation ends ``failed`` at once (no retries for minutes) and the
    volume, recorded where it was, is what the guest reads and writes."""
    c = cluster
    assert c.guest is not None
    c.svc.restart_controller(VBS_TEST_HOOKS="1")
    hook = {"kind": "migrate-volume-mirror", "step": "pivot"}
    internal = {"authorization": f"Bearer {c.svc.agent_token}"}
    try:
        vol, node, _data_sha = volume_with_data(c)
        dev = attach(c, vol)
        written = c.guest.write_pattern(dev, "kept", 1)
        assert c.svc.vbs.http.post("/internal/v1/test/hold-step", json=hook, headers=internal).status_code == 200
        move = migrate(c, vol, c.other(node))
        wait_until(lambda: c.svc.vbs.http.post("/internal/v1/test/held-step", json=hook,
                                               headers=internal).json()["held"], 120, what="the move at its switch")
        job = f"vbs-{virtio_serial(vol)}-mirror"
        qmp_execute(c.guest.test_qmp_path, "job-cancel", {"id": job})
        wait_until(lambda: all(j["status"] == "concluded" for j in qmp_execute(c.guest.test_qmp_path, "query-jobs")
                               if j["id"] == job), 30, what="the mirror cancelled")
        c.svc.vbs.http.post("/internal/v1/test/release-step", json=hook, headers=internal)
        op = operation(c, move["operation_id"], timeout=60)
        assert op["status"] == "failed" and "no mirror to complete" in op["error"], op
        assert c.svc.vbs.volume(vol)["storage_node"] == node
        assert c.guest.checksum(dev, 1) == written
        after = c.guest.write_pattern(dev, "after", 1)
        with open(c.file_of(vol, node), "rb") as f:
            assert hashlib.sha256(f.read(MIB)).hexdigest() == after
        assert len(protocol_nodes(c, vol)) == 1
        detach(c, vol)
        c.svc.vbs.http.delete(f"/v1/volumes/{vol}")
    finally:
        c.svc.restart_controller()


# -- the controller killed at each step -------------------------------------------------------------------


def crash_during_move(c: Cluster, vol: str, target: str, point: str) -> None:
    c.svc.restart_controller(VBS_CRASH_AT=point)
    migrate(c, vol, target)
    c.svc.wait_controller_killed()
    c.svc.start_controller()


def converged_where(c: Cluster, vol: str, node: str, target: str, step: str, steps: list[str],
                    pivot: str) -> str:
    """Where the volume ended up, checked against the step the controller died at: back on ``node``
    before ``pivot``, on ``target`` from it; the other node holds nothing of it."""
    moved = settled(c, vol)
    expected = target if steps.index(step) >= steps.index(pivot) else node
    assert moved["storage_node"] == expected, (step, moved)
    assert not c.file_of(vol, c.other(expected)).exists(), f"a copy is left on {c.other(expected)}"
    return expected


def crash_points(steps: list[str], kept: set[str]) -> list[Any]:
    return [pytest.param(f"{s}:{m}", marks=() if f"{s}:{m}" in kept else pytest.mark.torture)
            for s in steps for m in ("started", "done")]


@pytest.mark.parametrize("point", crash_points(COPY_STEPS, {"copy:done"}))
def test_a_copy_interrupted_at_any_step_converges(cluster: Cluster, point: str) -> None:
    c = cluster
    vol, node, data_sha = volume_with_data(c)
    target = c.other(node)
    before = file_sha(c.file_of(vol, node))
    crash_during_move(c, vol, target, f"migrate-volume-copy:{point}")
    where = converged_where(c, vol, node, target, point.split(":")[0], COPY_STEPS, "switch")
    assert file_sha(c.file_of(vol, where)) == before and prefill_sha(c.file_of(vol, where)) == data_sha
    assert exports_of(c, vol, node) == [] and exports_of(c, vol, target) == []
    assert c.svc.vbs.volume(vol)["status"] == "available"
    c.svc.vbs.http.delete(f"/v1/volumes/{vol}")


@pytest.mark.parametrize("point", crash_points(MIRROR_STEPS, {"pivot:done"}))
def test_a_live_move_interrupted_at_any_step_converges_and_the_guest_keeps_its_data(cluster: Cluster,
                                                                                      point: str) -> None:
    c = cluster
    assert c.guest is not None
    vol, node, _data_sha = volume_with_data(c)
    target = c.other(node)
    dev = attach(c, vol)
    written = c.guest.write_pattern(dev, "before", 1)
    crash_during_move(c, vol, target, f"migrate-volume-mirror:{point}")
    where = converged_where(c, vol, node, target, point.split(":")[0], MIRROR_STEPS, "pivot")
    assert c.guest.checksum(dev, 1) == written
    # The disk still takes writes, and they land on the node the volume is recorded on.
    after = c.guest.write_pattern(dev, "after", 1)
    with open(c.file_of(vol, where), "rb") as f:
        assert hashlib.sha256(f.read(MIB)).hexdigest() == after
    assert len(protocol_nodes(c, vol)) == 1
    assert exports_of(c, vol, c.other(where)) == [] and exports_of(c, vol, where) == ["host-1"]
    moved = c.svc.vbs.volume(vol)
    assert moved["status"] == "in-use" and [a["state"] for a in moved["attachments"]] == ["attached"]
    detach(c, vol)
    c.svc.vbs.http.delete(f"/v1/volumes/{vol}")

