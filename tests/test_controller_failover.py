"""Two controllers on one PostgreSQL database: one dies (SIGKILL) or hangs (SIGSTOP) in the middle of
a workflow, and the other carries on (docs/architecture.md §6).

Real processes throughout: two ``vbs controller`` on a PostgreSQL the tests start, a storage agent
and a host agent (both reporting to the survivor), a bare QEMU VM. Leases are 3 s here.

* The crash matrix with two controllers: controller A SIGKILLs itself at a step of a workflow
  (``VBS_CRASH_AT``); controller B adopts the operation once its lease expired and finishes or rolls
  it back within lease + 5 s; then the world agrees: no unfinished operation, no transitional state,
  pool files exactly those of live rows, exports exactly those of live attachments, and the
  survivor's own check finds nothing.
* Fencing: A is held just before its storage call and frozen (SIGSTOP); B adopts the create and rolls
  it back; A is thawed and let go: its call reaches the storage agent with the old fence and is
  refused, so no volume file appears behind B's back, and A writes nothing more.
* A Recycle Bin expiry: A, holding the housekeeping lease, dies between the transaction that begins an
  expired snapshot's delete and the delete's run; B adopts the delete and frees the snapshot once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from tests.conftest import (
    VBS,
    Services,
    Vbs,
    free_port,
    node_token,
    start_bare_vm,
    stop_bare_vm,
    stop_process,
    wait_until,
)
from tests.postgres_cluster import PostgresForTests
from vbs.controller.db import Database, Operation

pytestmark = pytest.mark.integration

LEASE_S = 3.0
TAKEOVER_LIMIT_S = LEASE_S + 5


@dataclass
class Pair:
    svc: Services
    url: str  # the PostgreSQL database both controllers use
    db: Database  # the test's own view of it
    b: Vbs  # the survivor
    a_port: int
    vm_dir: Path
    a: subprocess.Popen[bytes] | None = None

    def env(self, **extra: str) -> dict[str, str]:
        return {**self.svc.env, "VBS_CONTROLLER_OPERATION_LEASE_S": f"{LEASE_S:g}",
                "VBS_CONTROLLER_RECONCILE_INTERVAL_S": "86400", "VBS_CONTROLLER_DETACH_TIMEOUT_S": "2",
                "VBS_CONTROLLER_RETRY_INTERVAL_S": "0.5", **extra}

    def controller(self, cid: str, port: int, log: str, **env: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*VBS, "controller", "--port", str(port), "--data-dir", str(self.svc.data_dir), "--database-url",
             self.url, "--controller-id", cid], env=self.env(**env),
            stdout=(self.svc.tmp / log).open("ab"), stderr=subprocess.STDOUT)

    def start_a(self, **env: str) -> Vbs:
        self.a = self.controller("ctl-a", self.a_port, "controller-a.log", **env)
        a = Vbs(f"http://127.0.0.1:{self.a_port}", self.svc.data_dir, self.svc.key)
        wait_until(lambda: _healthy(a) or self.a.poll() is not None, 60, what="controller A")  # type: ignore[union-attr]
        assert self.a.poll() is None, "controller A did not start"  # type: ignore[union-attr]
        return a

    def operations(self) -> dict[str, Operation]:
        with self.db.read() as s:
            return {op.id: op for op in s.scalars(select(Operation))}


def _healthy(v: Vbs) -> bool:
    try:
        return bool(v.http.get("/health").status_code == 200)
    except httpx.HTTPError:
        return False


@pytest.fixture
def pair(services: Services, postgres: PostgresForTests, tmp_path: Path) -> Iterator[Pair]:
    url = postgres.upgraded_database()
    db = Database(url)
    p = Pair(services, url, db, services.vbs, free_port(), tmp_path)
    b = p.controller("ctl-b", services.port, "controller-b.log")
    services.controller = b  # stopped by the services fixture
    wait_until(lambda: _healthy(services.vbs), 60, what="controller B")
    services.start_agent()
    p.vm_dir = services.start_host_agent()
    vm = start_bare_vm(p.vm_dir, "vm1", tmp_path / "vm1.log")
    try:
        wait_until(lambda: services.vbs.http.get("/v1/instances").json()["instances"], 30, what="instance")
        yield p
    finally:
        if p.a is not None:
            os.kill(p.a.pid, signal.SIGCONT)
            stop_process(p.a)
        stop_bare_vm(vm)
        db.dispose()


def world_agrees(p: Pair) -> None:
    """The DB, the pool and the exports agree, and the survivor's own check finds nothing."""
    ops = p.operations()
    unfinished = {i: (o.kind, o.status) for i, o in ops.items() if o.status in ("running", "rolling-back")}
    assert not unfinished, unfinished
    vols = {v["volume_id"]: v for v in p.b.all_volumes()}
    assert not [v for v in vols.values() if v["status"] in ("creating", "deleting")], vols
    files = {f.name.removesuffix(".raw") for f in (p.svc.data_dir / "pool" / "volumes").iterdir()}
    live = {i for i, v in vols.items() if v["status"] in ("available", "in-use")}
    assert files == live, f"pool files {files} vs live volumes {live}"
    with httpx.Client(base_url=f"http://127.0.0.1:{p.svc.agent_port}",
                      headers={"authorization": f"Bearer {p.svc.agent_token}"}) as agent:
        exported = {e["key"] for e in agent.get("/v1/exports").json()["exports"]}
    attached = {i for i, v in vols.items() if any(a["status"] in ("attached", "busy") for a in v["attachments"])}
    assert exported == attached, f"exports {exported} vs attached {attached}"
    # A bare QEMU never acknowledges an unplug: a forced one leaves its device (storage cut), which the
    # check reports as an orphan disk of a volume that is not attached there; nothing else may show.
    report = p.b.http.get("/v1/admin/check").json()
    other = [f for f in report["findings"] if not (f["kind"] == "orphan-disk" and f["resource_id"] not in attached)]
    assert not other, other


def new_volume(p: Pair) -> str:
    vol = p.b.create_volume(size_gib=1)["volume_id"]
    p.b.wait_volume(vol, "available")
    return str(vol)


def attach(p: Pair, vol: str, device: str) -> None:
    r = p.b.http.post(f"/v1/volumes/{vol}/attach", json={"host": "host-1", "vm_id": "vm1", "device": device})
    assert r.status_code == 200, r.text
    p.b.wait_volume(vol, "in-use")


# (workflow, step, moment): where controller A dies.
POINTS = [
    ("create-volume", "storage-create", "started"), ("create-volume", "storage-create", "done"),
    ("create-volume", "mark-available", "started"),
    ("attach-volume", "storage-export", "done"), ("attach-volume", "host-attach", "started"),
    ("attach-volume", "host-attach", "done"),
    ("detach-volume", "host-detach", "started"), ("detach-volume", "storage-unexport", "done"),
    ("delete-volume", "storage-delete", "started"),
    ("create-snapshot", "storage-snapshot", "done"),
    ("modify-volume", "storage-grow", "done"),
]


def test_the_survivor_finishes_or_rolls_back_what_a_killed_controller_left(pair: Pair) -> None:
    p = pair
    devices = iter(f"vd{c}" for c in "bcdefghijklmnopqrstuvwxyz")
    timings: list[str] = []
    for kind, step, moment in POINTS:
        vol = new_volume(p) if kind != "create-volume" else None
        if kind == "detach-volume":
            attach(p, vol, next(devices))  # type: ignore[arg-type]
        known = set(p.operations())
        a = p.start_a(VBS_CRASH_AT=f"{kind}:{step}:{moment}")
        request = {
            "create-volume": ("POST", "/v1/volumes", {"size_gib": 1}),
            "attach-volume": ("POST", f"/v1/volumes/{vol}/attach",
                              {"host": "host-1", "vm_id": "vm1", "device": next(devices)}),
            "detach-volume": ("POST", f"/v1/volumes/{vol}/detach", {"force": True}),
            "delete-volume": ("DELETE", f"/v1/volumes/{vol}", None),
            "create-snapshot": ("POST", "/v1/snapshots", {"volume_id": vol}),
            "modify-volume": ("POST", f"/v1/volumes/{vol}/modify", {"size_gib": 2}),
        }[kind]
        try:
            a.http.request(request[0], request[1], json=request[2])
        except httpx.HTTPError:
            pass  # A may die before it answers
        assert p.a is not None
        p.a.wait(60)
        died = time.monotonic()
        assert p.a.returncode == -signal.SIGKILL, f"{kind}:{step}:{moment}: A did not crash there"
        op_id = next(i for i, o in p.operations().items() if i not in known and o.kind == kind)

        def finished(op_id: str = op_id) -> Operation | None:
            op = p.operations()[op_id]
            return op if op.status not in ("running", "rolling-back") else None

        op: Operation = wait_until(finished, TAKEOVER_LIMIT_S + 30, interval=0.2, what=f"{kind}:{step}:{moment}")
        took = time.monotonic() - died
        timings.append(f"{kind}:{step}:{moment} -> {op.status} in {took:.1f}s")
        assert op.owner == "ctl-b", op.owner
        assert took <= TAKEOVER_LIMIT_S, f"{kind}:{step}:{moment}: the survivor took {took:.1f}s"
        # Creates and attach roll back (even at their closing step: it never committed), the rest roll forward.
        expected = "rolled-back" if kind in ("create-volume", "attach-volume", "create-snapshot") else "succeeded"
        assert op.status == expected, (kind, step, moment, op.status, op.error)
        wait_until(lambda: _quiet(p), 30, what="the world settles")
        world_agrees(p)
        p.a = None
    print("\n" + "\n".join(timings))


def _quiet(p: Pair) -> bool:
    try:
        world_agrees(p)
        return True
    except AssertionError:
        return False


def test_a_frozen_controller_that_wakes_after_its_lease_cannot_undo_the_survivors_work(pair: Pair) -> None:
    p = pair
    a = p.start_a(VBS_TEST_HOOKS="1")
    hook = {"kind": "create-volume", "step": "storage-create"}
    internal = {"authorization": f"Bearer {p.svc.agent_token}"}  # the internal API takes a node's token
    assert a.http.post("/internal/v1/test/hold-step", json=hook, headers=internal).status_code == 200
    r = a.http.post("/v1/volumes", json={"size_gib": 1})
    assert r.status_code == 200, r.text
    vol = r.json()["volume_id"]
    wait_until(lambda: a.http.post("/internal/v1/test/held-step", json=hook, headers=internal).json()["held"], 30,
               what="A holds just before its storage call")
    assert p.a is not None
    os.kill(p.a.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    op_id = next(i for i, o in p.operations().items() if o.resource_id == vol)
    first_fence = p.operations()[op_id].fence

    def rolled_back() -> Operation | None:
        op = p.operations()[op_id]
        return op if op.status == "rolled-back" else None

    op = wait_until(rolled_back, TAKEOVER_LIMIT_S + 30, interval=0.2, what="B adopts and rolls back")
    assert time.monotonic() - frozen <= TAKEOVER_LIMIT_S
    assert op.owner == "ctl-b" and op.fence > first_fence
    after_b = (op.status, op.fence, op.updated_at)

    os.kill(p.a.pid, signal.SIGCONT)
    assert a.http.post("/internal/v1/test/release-step", json=hook, headers=internal).status_code == 200
    log = p.svc.tmp / "controller-a.log"
    wait_until(lambda: b"refused the fence" in log.read_bytes(), 30,
               what="A is told it lost the operation")
    time.sleep(1)
    assert not (p.svc.data_dir / "pool" / "volumes" / f"{vol}.raw").exists(), \
        "the stale create reached the storage agent after the rollback"
    op = p.operations()[op_id]
    assert (op.status, op.fence, op.updated_at) == after_b, "A wrote after it lost the operation"
    assert p.b.volume(vol)["status"] in ("error", "deleted")
    world_agrees(p)
    # A is healthy and serves on: a new create through it works.
    r = a.http.post("/v1/volumes", json={"size_gib": 1})
    assert r.status_code == 200, r.text
    p.b.wait_volume(r.json()["volume_id"], "available")


def test_a_host_agent_remembers_fences_across_its_restart(services: Services, tmp_path: Path) -> None:
    """The host agent, with a state dir, refuses a lower fence for a volume also after a restart."""
    port = free_port()
    token = node_token(services.data_dir, "host", "host-9")
    argv = [*VBS, "host-agent", "--node-name", "host-9", "--port", str(port), "--controller-url",
            services.vbs.endpoint, "--vm-dir", str(tmp_path / "vms"), "--state-dir", str(tmp_path / "host-state")]
    url = f"http://127.0.0.1:{port}/v1/vms/vm1/disks"
    vol = "vol-0123456789abcdef0"

    def call(fence: int) -> httpx.Response:
        return httpx.get(url, headers={"authorization": f"Bearer {token}", "x-vbs-fence": f"{vol} {fence}"})

    for attempt in range(2):
        proc = subprocess.Popen(argv, env={**services.env, "VBS_AGENT_TOKEN": token},
                                stdout=(tmp_path / "host-9.log").open("ab"), stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, 60,
                       what="host agent")
            if attempt == 0:
                assert call(7).status_code != 409
            r = call(6)
            assert r.status_code == 409 and r.json()["error"]["code"] == "StaleFence", r.text
            assert call(7).status_code != 409
        finally:
            stop_process(proc)
    fences = tmp_path / "host-state" / "fences.json"
    assert fences.stat().st_mode & 0o777 == 0o600 and (tmp_path / "host-state").stat().st_mode & 0o777 == 0o700


def test_a_recycle_bin_expiry_whose_controller_dies_after_its_commit_is_finished_by_the_other(pair: Pair) -> None:
    """The Recycle Bin (docs/recycle-bin.md) with two controllers: A runs the housekeeping (its singleton
    lease given to it, so B's first pass cannot take it) and SIGKILLs itself between the transaction that
    takes an expired snapshot out of the bin and begins its delete, and the delete's run
    (``VBS_CRASH_AT=recycle-bin:expire:done``). B adopts the recorded delete once its lease expired: the
    snapshot's store manifest and pool copy are gone, by one operation, B's; nothing is left in the bin."""
    from vbs.controller.db import LeaseRecord, RecycleBinEntry

    p = pair
    with p.db.session() as s:  # A holds the housekeeping lease, as if it had taken it first
        until = p.db.clock(s) + timedelta(seconds=180)
        row = s.get(LeaseRecord, "housekeeping", with_for_update=True)
        if row is None:
            s.add(LeaseRecord(name="housekeeping", owner="ctl-a", lease_until=until, fence=p.db.next_fence(s)))
        else:
            row.owner, row.lease_until, row.fence = "ctl-a", until, p.db.next_fence(s)
    a = p.start_a(VBS_CRASH_AT="recycle-bin:expire:done", VBS_CONTROLLER_RECYCLE_BIN_DAY_S="2")
    a.aws("rbin").create_rule(ResourceType="EBS_SNAPSHOT", RetentionPeriod={"RetentionPeriodValue": 1,
                                                                           "RetentionPeriodUnit": "DAYS"})
    vol = new_volume(p)
    with (p.svc.data_dir / "pool" / "volumes" / f"{vol}.raw").open("r+b") as f:
        f.write(b"r" * (4 << 20))
    snap = p.b.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
    p.b.wait_snapshot(snap, "completed", timeout=120)
    manifest = p.svc.data_dir / "storage-state" / "snapshots" / "manifests" / snap
    assert manifest.is_file()
    a.ec2().delete_snapshot(SnapshotId=snap)  # through A: a retention of A's two-second "day"
    assert p.a is not None
    p.a.wait(120)
    assert p.a.returncode == -signal.SIGKILL, "A did not crash at the expiry"
    p.a = None
    wait_until(lambda: p.b.http.get(f"/v1/snapshots/{snap}").status_code == 404 and not manifest.exists(),
               TAKEOVER_LIMIT_S + 60, interval=0.5, what="B finished the delete")
    def deletes() -> list[tuple[str | None, str]]:
        return [(o.owner, o.status) for o in p.operations().values()
                if o.resource_id == snap and o.kind == "delete-snapshot"]

    wait_until(lambda: all(status == "succeeded" for _, status in deletes()), 30, what="the delete ended")
    assert deletes() == [("ctl-b", "succeeded")]
    assert not (p.svc.data_dir / "pool" / "snapshots" / f"{snap}.raw").exists()
    with p.db.read() as s:
        assert list(s.scalars(select(RecycleBinEntry.resource_id))) == []
    world_agrees(p)
