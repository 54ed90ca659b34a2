"""50 clients at once on a few volumes, snapshots and VMs: only legal outcomes, no 5xx, nothing left midway.

A real ``vbs up`` with two bare QEMU VMs and a real test guest on host-1, and a second host agent
(host-2) with a third bare VM. Bare VMs take hot-plugged disks and never release one, so detaches
are forced. Fifty client threads send random attach, detach, delete, snapshot, delete-snapshot,
create-from-snapshot, create and tag requests for a bounded time and count, on a handful of volumes
(one of them multi-attach). Every answer must be a 2xx or a 4xx with an EBS error code, within 30 s.
Meanwhile a sampler reads the DB (read-only, one transaction per sample: SQLite's WAL snapshot, or
PostgreSQL's REPEATABLE READ) and checks the invariants: at most one live attachment per
non-multi-attach volume, none on a deleting/deleted volume, one volume per (VM, device), ``in-use`` exactly
while attached, no deleting/deleted snapshot under a copy in progress, no deleting/deleted volume
under a pending snapshot. Afterwards the service must quiesce: no transitional state, every
operation finished, and pool files, exports, guest disks and tags agreeing with the rows and with
what the clients were told.

The module runs three times: metadata in SQLite; in PostgreSQL (READ COMMITTED, where every check
of other rows before a write must be serialised by a lock: see vbs.controller.db.locks); and in
PostgreSQL with two controllers at once (``postgresql-2``), the clients split between them, so that
operations begun on one meet requests served by the other (leases and fences: docs/architecture.md §6).

Two bugs this run found (a detach from one VM removing the export another VM of the same host
shared; a forced detach that never finished once its export was gone) have their own tests at the end.
"""

from __future__ import annotations

import collections
import random
import re
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.clouds import Cloud
from tests.conftest import DATABASES, VBS, Vbs, database_flags, free_port, wait_until
from vbs.ids import virtio_serial

pytestmark = [pytest.mark.integration,
              pytest.mark.parametrize("metadata_db", (*DATABASES, "postgresql-2"), indirect=True, scope="module")]

CLIENTS = 50
RUN_SECONDS = 40.0
MAX_REQUESTS = 6000
# The run leaves ~150 snapshots uploading to the store at once (each reads its point-in-time view through the
# NBD daemon); on a loaded 2-core machine the last of them can take minutes. Waiting costs nothing when
# they finish sooner; a stuck one is shown with its row and log lines (``unfinished``).
QUIESCE_SECONDS = 240.0
VOLUME_BUDGET = 20  # volumes ever made: each one force-detached from a bare VM leaves a PCI slot taken there
GUEST = "guest1"
VMS = {"bare1": "host-1", "bare2": "host-1", GUEST: "host-1", "bare3": "host-2"}  # vm -> host
# The multi-attach volume goes to VMs of both hosts, two of them on host-1 sharing one export.
MULTI_VMS = (GUEST, "bare1", "bare3")
DEVICES = ("vdb", "vdc", "vdd", "vde", "vdf", "vdg", "vdh")
LIVE = ("attaching", "attached", "detaching", "busy")
EBS_CODES = {
    "InvalidParameterValue", "MissingParameter", "InvalidVolume.NotFound", "InvalidSnapshot.NotFound",
    "InvalidInstanceID.NotFound", "IncorrectState", "IncorrectInstanceState", "VolumeInUse",
    "InvalidSnapshot.InUse", "IdempotentParameterMismatch", "TagLimitExceeded",
}


class World(Cloud):
    """vbs up (host-1) and a second host agent (host-2), their VMs, and the instance ids of those VMs;
    with ``controllers=2`` a second controller on the same database and data dir."""

    endpoints: list[str]  # every controller's; client i uses endpoints[i % len]
    instances: dict[str, str]  # vm name -> instance id

    def __init__(self, tmp: Path, flags: list[str], controllers: int) -> None:
        super().__init__(tmp, extra=flags, env={"VBS_CONTROLLER_DETACH_TIMEOUT_S": "2"})
        self.flags, self.controllers = flags, controllers
        self.database_url = flags[1] if flags else None  # None: SQLite in the data dir

    def start(self) -> None:
        super().start()
        self.db_path = self.vbs.data_dir / "vbs.db"
        self.agent_auth = self.storage_auth
        self.endpoints = [self.vbs.endpoint]
        if self.controllers == 2:
            # A second controller on the same database and data dir (keys, node keyring, master key).
            port = free_port()
            with (self.tmp / "controller-2.log").open("ab") as log:
                self.started(subprocess.Popen(
                    [*VBS, "controller", "--port", str(port), "--data-dir", str(self.vbs.data_dir), *self.flags],
                    env=self.process_env(), stdout=log, stderr=subprocess.STDOUT))
            self.endpoints.append(f"http://127.0.0.1:{port}")
            wait_until(lambda: _healthy(self.endpoints[1]), 60, what="the second controller")
        self.start_host_agent("host-2")
        for vm, host in VMS.items():
            if vm != GUEST:
                self.start_bare_vm(vm, host)
        self.start_guests({GUEST: VMS[GUEST]})
        self.instances = self.instance_ids(VMS)

    def read_db(self) -> Any:
        """A read-only connection with sqlite3's interface (``execute`` with ``?``, rows by name or index)."""
        if self.database_url is not None:
            return PostgresReader(self.database_url)
        db = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        return db


class Row(tuple[Any, ...]):
    """A PostgreSQL row read like a ``sqlite3.Row``: by index or by column name."""

    names: dict[str, int]

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(self.names[key] if isinstance(key, str) else key)

    def keys(self) -> list[str]:
        return sorted(self.names, key=self.names.__getitem__)


class PostgresReader:
    """What the checks below use of a sqlite3 connection, on PostgreSQL: ``BEGIN`` is REPEATABLE READ
    (one snapshot for the whole sample, as SQLite's WAL read transaction gives)."""

    def __init__(self, url: str) -> None:
        u = make_url(url)
        self.conn = psycopg.connect(dbname=u.database, user=u.username, host=str(u.query["host"]),
                                    port=int(str(u.query["port"])), autocommit=True)

    def execute(self, sql: str, params: Any = ()) -> Any:
        if sql == "BEGIN":
            sql = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
        cur = self.conn.cursor(row_factory=_rows)
        return cur.execute(sql.replace("?", "%s").encode(), params)

    def close(self) -> None:
        self.conn.close()


def _rows(cursor: Any) -> Any:
    names = {c.name: i for i, c in enumerate(cursor.description or [])}

    def make(values: Any) -> Row:
        row = Row(values)
        row.names = names
        return row

    return make



@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, metadata_db: str, request: pytest.FixtureRequest
          ) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("concurrency")
    flags = database_flags(metadata_db.removesuffix("-2"), request)
    with World(tmp, flags, 2 if metadata_db == "postgresql-2" else 1) as world:
        yield world


@dataclass
class Shared:
    """What the clients know and record; every field is guarded by ``lock``."""

    volumes: list[str]
    multi: str
    snapshots: list[str]
    lock: threading.Lock = field(default_factory=threading.Lock)
    created: int = 0
    sent: int = 0
    results: list[tuple[str, int, str, float]] = field(default_factory=list)  # action, status, code, seconds
    messages: dict[tuple[str, str], str] = field(default_factory=dict)  # (action, code) -> one message
    failures: list[str] = field(default_factory=list)
    operations: dict[str, str] = field(default_factory=dict)  # op id -> action
    tags: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    deleted_volumes: set[str] = field(default_factory=set)
    deleted_snapshots: set[str] = field(default_factory=set)
    created_volumes: set[str] = field(default_factory=set)


def _healthy(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _client(vbs: Vbs, endpoint: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=endpoint or vbs.endpoint, timeout=60,
                        headers={"authorization": f"Bearer {vbs.key.bearer}"})


def _request(world: World, shared: Shared, rng: random.Random) -> tuple[str, str, str, dict[str, Any] | None]:
    """One random request: (action, method, path, json body)."""
    with shared.lock:
        vol = rng.choice(shared.volumes + [shared.multi] * 2)
        # Clones come mostly from the oldest snapshots: those are completed, the newest still copying.
        snaps = shared.snapshots[:4] if shared.snapshots and rng.random() < 0.7 else shared.snapshots
        snap = rng.choice(snaps) if snaps else None
        can_create = shared.created < VOLUME_BUDGET
    vm = rng.choice(MULTI_VMS if vol == shared.multi else list(VMS))
    inst = world.instances[vm]
    roll = rng.random()
    if roll < 0.30:
        body: dict[str, Any] = ({"instance_id": inst} if rng.random() < 0.5 else {"host": VMS[vm], "vm_id": vm})
        body["device"] = rng.choice(DEVICES)
        return "attach", "POST", f"/v1/volumes/{vol}/attach", body
    if roll < 0.60:
        body = {"force": True}
        if vol == shared.multi or rng.random() < 0.1:
            body["instance_id"] = inst
        return "detach", "POST", f"/v1/volumes/{vol}/detach", body
    if roll < 0.67:
        return "delete-volume", "DELETE", f"/v1/volumes/{vol}", None
    if roll < 0.72:
        return "create-snapshot", "POST", "/v1/snapshots", {"volume_id": vol}
    if roll < 0.79 and snap:
        return "delete-snapshot", "DELETE", f"/v1/snapshots/{snap}", None
    if roll < 0.85 and snap and can_create:
        return "create-from-snapshot", "POST", "/v1/volumes", {"snapshot_id": snap}
    if roll < 0.87 and can_create:
        return "create-volume", "POST", "/v1/volumes", {"size_gib": 1}
    if roll < 0.90:
        key = f"k{threading.get_ident() % 10000}-{rng.randrange(10**9)}"
        return "create-tags", "POST", "/v1/tags", {"resource_ids": [vol], "tags": {key: "v"}}
    return "describe", "GET", f"/v1/volumes/{vol}", None


def _client_loop(world: World, shared: Shared, deadline: float, seed: int) -> None:
    rng = random.Random(seed)
    with _client(world.vbs, world.endpoints[seed % len(world.endpoints)]) as http:
        while time.monotonic() < deadline:
            with shared.lock:
                if shared.sent >= MAX_REQUESTS:
                    return
                shared.sent += 1
            action, method, path, body = _request(world, shared, rng)
            if action in ("create-volume", "create-from-snapshot"):
                with shared.lock:
                    if shared.created >= VOLUME_BUDGET:
                        continue
                    shared.created += 1
            t0 = time.monotonic()
            try:
                r = http.request(method, path, json=body)
            except httpx.HTTPError as exc:
                with shared.lock:
                    shared.failures.append(f"{action} {path} {body}: transport error {type(exc).__name__}: {exc}")
                    shared.results.append((action, 0, type(exc).__name__, time.monotonic() - t0))
                continue
            elapsed = time.monotonic() - t0
            if action in ("create-volume", "create-from-snapshot") and r.status_code != 200:
                with shared.lock:
                    shared.created -= 1  # the budget counts volumes made, not attempts
            _record(shared, action, body, r, elapsed)


def _record(shared: Shared, action: str, body: dict[str, Any] | None, r: httpx.Response, elapsed: float) -> None:
    code = ""
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if r.status_code >= 300:
        err = answer.get("error") if isinstance(answer, dict) else None
        code = str(err.get("code", "")) if isinstance(err, dict) else ""
    with shared.lock:
        shared.results.append((action, r.status_code, code, elapsed))
        if code and isinstance(answer, dict):
            shared.messages.setdefault((action, code), str(answer["error"].get("message", ""))[:100])
        if r.status_code >= 500 or (r.status_code >= 300 and code not in EBS_CODES) or r.status_code < 200:
            shared.failures.append(f"{action} {r.request.method} {r.request.url.path} {body}: "
                                   f"{r.status_code} {r.text[:300]}")
            return
        if r.status_code >= 300 or not isinstance(answer, dict):
            return
        if answer.get("operation_id"):
            shared.operations[answer["operation_id"]] = action
        if action in ("create-volume", "create-from-snapshot"):
            shared.volumes.append(answer["volume_id"])
            shared.created_volumes.add(answer["volume_id"])
        elif action == "create-snapshot":
            shared.snapshots.append(answer["snapshot_id"])
        elif action == "delete-volume":
            shared.deleted_volumes.add(answer["volume_id"])
            if answer["volume_id"] in shared.volumes:
                shared.volumes.remove(answer["volume_id"])
        elif action == "delete-snapshot":
            shared.deleted_snapshots.add(answer["snapshot_id"])
            if answer["snapshot_id"] in shared.snapshots:
                shared.snapshots.remove(answer["snapshot_id"])
        elif action == "create-tags":
            assert body is not None
            shared.tags[body["resource_ids"][0]].update(body["tags"])


# --- invariants on a consistent snapshot of the DB --------------------------------------------------------------


def check_invariants(db: Any) -> list[str]:
    db.execute("BEGIN")
    try:
        volumes = {r["id"]: r for r in db.execute("SELECT id, status, multi_attach, snapshot_id FROM volumes")}
        snapshots = {r["id"]: r for r in db.execute("SELECT id, status, volume_id FROM snapshots")}
        live = list(db.execute(f"SELECT id, volume_id, host, vm_id, device, status FROM attachments "
                               f"WHERE status IN ({','.join('?' * len(LIVE))})", LIVE))
    finally:
        db.execute("COMMIT")
    bad: list[str] = []
    per_volume: dict[str, list[Any]] = collections.defaultdict(list)
    per_device: dict[tuple[str, str, str], list[str]] = collections.defaultdict(list)
    for a in live:
        per_volume[a["volume_id"]].append(a)
        per_device[(a["host"], a["vm_id"], a["device"])].append(a["volume_id"])
    for vid, v in volumes.items():
        atts = per_volume.get(vid, [])
        if not v["multi_attach"] and len(atts) > 1:
            bad.append(f"{vid} (not multi-attach) has {len(atts)} live attachments: {[a['id'] for a in atts]}")
        if v["status"] in ("deleting", "deleted") and atts:
            bad.append(f"{vid} is {v['status']} with live attachments {[(a['id'], a['status']) for a in atts]}")
        if (v["status"] == "in-use") != bool(atts):
            bad.append(f"{vid} is {v['status']} with {len(atts)} live attachments")
        if v["status"] == "creating" and v["snapshot_id"]:
            src = snapshots.get(v["snapshot_id"])
            if src is None or src["status"] in ("deleting", "deleted"):
                bad.append(f"{vid} copies {v['snapshot_id']}, which is {src['status'] if src else 'missing'}")
    for sid, s in snapshots.items():
        vol = volumes.get(s["volume_id"])
        if s["status"] == "pending" and (vol is None or vol["status"] in ("deleting", "deleted")):
            bad.append(f"{sid} is pending on {s['volume_id']}, which is {vol['status'] if vol else 'missing'}")
    for where, vols in per_device.items():
        if len(vols) > 1:
            bad.append(f"device {where} holds {vols}")
    return bad


def _sampler(world: World, stop: threading.Event, seen: list[str], count: list[int]) -> None:
    db = world.read_db()
    try:
        while not stop.is_set():
            problems = check_invariants(db)
            count[0] += 1
            if problems:
                seen.extend(problems)
            time.sleep(0.05)
    finally:
        db.close()


# --- the end state ----------------------------------------------------------------------------------------------


def unfinished(world: World) -> list[str]:
    """Each operation still running, with its resource's row and the last log lines (of every controller and
    agent) that name it: what it waits for."""
    logs = [world.up.log_path, world.tmp / "controller-2.log"]
    text = [line for path in logs if path.exists() for line in path.read_text(errors="replace").splitlines()]
    out: list[str] = []
    with closing(world.read_db()) as db:
        ops = list(db.execute("SELECT * FROM operations WHERE status IN ('running', 'rolling-back')"))
        for r in ops:
            out.append(f"{r['id']} {r['kind']} {r['resource_id']} {r['status']} attempts={r['attempts']}: "
                       f"{r['error']} {r['params']}")
            table = "snapshots" if r["resource_id"].startswith("snap-") else "volumes"
            row = db.execute(f"SELECT * FROM {table} WHERE id = ?", (r["resource_id"],)).fetchone()
            out.append(f"    row: {dict(zip(row.keys(), row, strict=True)) if row is not None else None}")
            out.extend(f"    {line}" for line in [x for x in text if r["resource_id"] in x][-6:])
    return out


def quiesced(world: World) -> bool:
    with closing(world.read_db()) as db:
        running = db.execute("SELECT count(*) FROM operations WHERE status IN ('running', 'rolling-back')")
        return running.fetchone()[0] == 0


def exports(world: World) -> set[tuple[str, str]]:
    return {(e["key"], e["host"]) for e in world.exports()}


def vm_disks(world: World, vm: str) -> set[str]:
    return {d["serial"] for d in world.host_disks(vm, VMS[vm])}


def _summary(shared: Shared, samples: int, elapsed: float) -> str:
    by_outcome = collections.Counter((a, s, c) for a, s, c, _ in shared.results)
    lat = sorted(t for *_, t in shared.results)
    lines = [f"{len(shared.results)} requests by {CLIENTS} clients in {elapsed:.1f}s "
             f"({len(shared.results) / elapsed:.0f}/s); latency p50 {lat[len(lat) // 2] * 1000:.0f} ms, "
             f"p99 {lat[int(len(lat) * 0.99)] * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms; "
             f"{samples} invariant samples"]
    by_status = collections.Counter(s for _, s, _, _ in shared.results)
    lines.append("by status: " + ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items())))
    for (action, status, code), n in sorted(by_outcome.items()):
        lines.append(f"  {action:22} {status} {code:28} {n:5}  {shared.messages.get((action, code), '')}")
    return "\n".join(lines)


def test_fifty_clients_at_once_leave_only_legal_outcomes(world: World) -> None:
    vbs = world.vbs
    volumes = [vbs.create_volume(size_gib=1)["volume_id"] for _ in range(5)]
    multi = vbs.create_volume(size_gib=4, volume_type="io2", iops=4000, multi_attach=True)["volume_id"]
    for v in [*volumes, multi]:
        vbs.wait_volume(v, "available")
    snapshots = []
    for v in volumes[:2]:
        snap = vbs.http.post("/v1/snapshots", json={"volume_id": v}).json()["snapshot_id"]
        snapshots.append(vbs.wait_snapshot(snap, "completed")["snapshot_id"])
    shared = Shared(volumes=list(volumes), multi=multi, snapshots=snapshots, created=6)
    shared.created_volumes.update([*volumes, multi])

    stop = threading.Event()
    violations: list[str] = []
    samples = [0]
    sampler = threading.Thread(target=_sampler, args=(world, stop, violations, samples), daemon=True)
    sampler.start()
    t0 = time.monotonic()
    deadline = t0 + RUN_SECONDS
    clients = [threading.Thread(target=_client_loop, args=(world, shared, deadline, 1000 + i), daemon=True)
               for i in range(CLIENTS)]
    for c in clients:
        c.start()
    for c in clients:
        # A client's request may be under way at the deadline: it has 60 s (its timeout) to be answered.
        c.join(RUN_SECONDS + 90)
    elapsed = time.monotonic() - t0
    assert not any(c.is_alive() for c in clients), "a client is still waiting for an answer"
    print("\n" + _summary(shared, samples[0], elapsed))
    # Let the workflows finish, with the sampler still watching.
    try:
        wait_until(lambda: quiesced(world), QUIESCE_SECONDS, interval=0.5, what="every operation finished")
    except AssertionError:
        pass
    finally:
        stop.set()
        sampler.join(30)
    assert quiesced(world), "operations still unfinished:\n" + "\n".join(unfinished(world))
    # A busy detach whose guest has let the disk go since is finished by a reconciliation pass (released-disk):
    # one now, and its detaches ended, so that none starts during the checks below.
    r = vbs.http.post("/v1/admin/reconcile")
    assert r.status_code == 200, r.text
    wait_until(lambda: quiesced(world), QUIESCE_SECONDS, interval=0.5, what="the reconciliation's detaches")
    if len(world.endpoints) == 2:
        ctrls = vbs.http.get("/v1/controllers").json()["controllers"]
        assert [c["state"] for c in ctrls] == ["up", "up"] and all(c["operations_held"] == 0 for c in ctrls), ctrls

    assert not shared.failures, f"{len(shared.failures)} bad answers, e.g.:\n" + "\n".join(shared.failures[:20])
    assert not violations, f"{len(violations)} invariant violations, e.g.:\n" + "\n".join(violations[:20])
    assert samples[0] > 50
    assert len(shared.results) > 500, "the run did too little to prove anything"
    assert max(t for *_, t in shared.results) < 30, "an answer took more than 30 s"

    # Every operation a client started finished: succeeded, rolled back, or failed (a busy detach).
    op_states: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for op_id, action in shared.operations.items():
        r = vbs.http.get(f"/v1/operations/{op_id}")
        assert r.status_code == 200, r.text
        op = r.json()
        op_states[(action, op["status"], re.sub(r"\b(vol|i|att)-?[0-9a-f]{17}\b", "…", op["error"] or "")[:90])] += 1
        assert op["status"] in ("succeeded", "rolled-back", "failed"), op
    print("operations:\n" + "\n".join(f"  {a:8} {s:12} {n:4}  {e}" for (a, s, e), n in sorted(op_states.items())))

    with closing(world.read_db()) as db:
        assert check_invariants(db) == []
        vol_rows = {r["id"]: r["status"] for r in db.execute("SELECT id, status FROM volumes")}
        snap_rows = {r["id"]: r["status"] for r in db.execute("SELECT id, status FROM snapshots")}
        # A copy pool gives a stored snapshot's copy up: it lives in the snapshot store only (issue 33).
        in_pool = {r["id"] for r in db.execute("SELECT id FROM snapshots WHERE pool_copy")}
        att_rows = list(db.execute("SELECT volume_id, host, vm_id, status FROM attachments"))
        ops = {r["id"]: r["status"] for r in db.execute("SELECT id, status FROM operations")}
        tag_rows = {(r["resource_id"], r["key"]) for r in db.execute("SELECT resource_id, key FROM tags")}
    transitional = {k: s for k, s in {**vol_rows, **snap_rows}.items() if s in ("creating", "deleting", "pending")}
    assert not transitional, f"stuck in a transitional state: {transitional}"
    stuck_atts = [tuple(a) for a in att_rows if a["status"] in ("attaching", "detaching")]
    assert not stuck_atts, f"attachments stuck: {stuck_atts}"
    assert not [o for o, s in ops.items() if s in ("running", "rolling-back")]

    # No lost update: whatever a client was told happened, happened.
    for vid in shared.deleted_volumes:
        assert vol_rows[vid] == "deleted", (vid, vol_rows[vid])
    for sid in shared.deleted_snapshots:
        assert snap_rows[sid] == "deleted", (sid, snap_rows[sid])
    for vid in shared.created_volumes - shared.deleted_volumes:
        assert vol_rows[vid] in ("available", "in-use"), (vid, vol_rows[vid])
    for rid, keys in shared.tags.items():
        if vol_rows.get(rid) != "deleted":
            missing = {k for k in keys if (rid, k) not in tag_rows}
            assert not missing, f"tags acknowledged on {rid} but lost: {missing}"

    # The pool holds exactly the live volumes and completed snapshots; exports exactly the attachments.
    pool = vbs.data_dir / "pool"
    snap_files = {rid: s for rid, s in snap_rows.items() if rid in in_pool}
    for kind, rows, live in (("volumes", vol_rows, {"available", "in-use"}), ("snapshots", snap_files, {"completed"})):
        files = {p.name for p in (pool / kind).iterdir()}
        assert files == {f"{rid}.raw" for rid, s in rows.items() if s in live}, f"{kind}: pool and rows differ"
    attached = {(a["volume_id"], a["host"]) for a in att_rows if a["status"] in ("attached", "busy")}
    assert exports(world) == attached
    for vm in VMS:
        # A ``busy`` attachment is a detach the guest did not confirm in time: QEMU's unplug request stays
        # with the guest, which may still let the disk go later (a loaded machine's guest often does).
        # Only an ``attached`` one must be in its VM.
        in_db = {virtio_serial(a["volume_id"]) for a in att_rows if a["vm_id"] == vm and a["status"] == "attached"}
        plugged = vm_disks(world, vm)
        assert in_db <= plugged, (f"{vm}: attached in the DB but not plugged in: {sorted(in_db - plugged)}; "
                                  f"its attachments: {[tuple(a) for a in att_rows if a['vm_id'] == vm]}")
    print(f"final: {collections.Counter(vol_rows.values())} volumes, {collections.Counter(snap_rows.values())} "
          f"snapshots, {len(attached)} attachments, {len(ops)} operations")


# --- what the run above steers around ---------------------------------------------------------------------------


def _wait_op(world: World, op_id: str, timeout: float) -> dict[str, Any]:
    return wait_until(lambda: (op := world.vbs.http.get(f"/v1/operations/{op_id}").json())["status"] != "running"
                      and op, timeout, interval=0.5, what=f"operation {op_id} finished")  # type: ignore[no-any-return]


def _attach(world: World, vol: str, vm: str) -> None:
    inst = world.instances[vm]
    taken = {a["device"] for i in world.vbs.http.get("/v1/instances").json()["instances"] if i["instance_id"] == inst
             for a in i["volumes"]}
    device = next(f"vd{c}" for c in "bcdefghijklmnopqrstuvwxyz" if f"vd{c}" not in taken)
    r = world.vbs.http.post(f"/v1/volumes/{vol}/attach", json={"instance_id": inst, "device": device})
    assert r.status_code == 200, r.text
    assert _wait_op(world, r.json()["operation_id"], 60)["status"] == "succeeded"


def test_multi_attach_detach_from_one_vm_keeps_the_other_vms_export(world: World) -> None:
    vol = world.vbs.create_volume(size_gib=4, volume_type="io2", iops=4000, multi_attach=True)["volume_id"]
    world.vbs.wait_volume(vol, "available")
    _attach(world, vol, "bare1")
    _attach(world, vol, "bare2")
    r = world.vbs.http.post(f"/v1/volumes/{vol}/detach", json={"instance_id": world.instances["bare1"], "force": True})
    assert r.status_code == 200, r.text
    assert _wait_op(world, r.json()["operation_id"], 60)["status"] == "succeeded"
    assert [a["vm_id"] for a in world.vbs.volume(vol)["attachments"]] == ["bare2"]
    assert (vol, "host-1") in exports(world), "bare2 still has the volume attached, but its export is gone"


def test_forced_detach_finishes_when_the_export_is_already_gone(world: World) -> None:
    """The storage side lost the export (node down, daemon lost it, or a shared export removed): force must end it."""
    vol = world.vbs.create_volume(size_gib=1)["volume_id"]
    world.vbs.wait_volume(vol, "available")
    _attach(world, vol, "bare3")
    url = world.agent_url("storage", "storage-1")
    assert httpx.delete(f"{url}/v1/exports/{vol}/hosts/host-2", headers=world.agent_auth, timeout=10).status_code == 200
    r = world.vbs.http.post(f"/v1/volumes/{vol}/detach", json={"force": True})
    assert r.status_code == 200, r.text
    # The guest's NBD client waits 15 s for its server before giving up; a forced detach may take that long.
    op = _wait_op(world, r.json()["operation_id"], 45)
    assert op["status"] == "succeeded", op
    assert world.vbs.volume(vol)["status"] == "available"
