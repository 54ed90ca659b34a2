"""The world check: what the controller's DB says against what really exists, read from each thing itself.

``assert_world_agrees(svc)`` is the short check the crash-recovery tests use: DB rows against pool files,
and no operation left unfinished.

``world_disagreements(spec)`` is the full check of the torture tests. Each source is read directly,
never through the agent that manages it, except where noted:

* the DB: the SQLite file itself (volumes, snapshots, attachments, operations, modifications);
* the pool: the directory listing and file sizes; the storage agent's ``/v1/inventory`` too, which
  also lists copies still running;
* the export daemon, as clients see it: for NBD the export names the NBD server itself lists
  (``qemu-nbd -L``, the protocol's own ``NBD_OPT_LIST``), for iSCSI ``tgtadm --op show`` on the
  daemon's control socket (targets, LUNs and their backing files, bound CHAP accounts, ACLs); the
  files the daemon process really holds open (``/proc/<pid>/fd``); exactly one daemon process for
  this storage agent; the agent's own ``/v1/exports`` and its persisted desired state too;
* each VM, over a second QMP monitor that only the test uses (the host agent has the first): its
  ``vbs-*`` devices, named block nodes, the block graph (which node the disk's raw node reads from)
  and ``vbs-*`` objects;
* the controller's own read-only reconciliation check (``GET /v1/admin/check``).

What must hold (``expected`` = attachments ``attached`` or ``busy``):

* no operation ``running`` or ``rolling-back``; no volume ``creating``/``deleting``, no snapshot
  ``pending``/``deleting``, no attachment ``attaching``/``detaching``, no modification in progress;
  a volume is ``in-use`` exactly when it has an expected attachment;
* the pool holds exactly ``volumes/<id>.raw`` of each ``available``/``in-use`` volume and
  ``snapshots/<id>.raw`` of each ``completed`` snapshot, each of its recorded size: no orphan, no
  missing file, no ``.partial``, nothing else;
* the export daemon serves exactly one export per expected (volume, host), of that volume's file,
  and holds no other pool file open;
* each VM has, for each expected attachment to it, the disk ``vbs-<serial>-dev`` whose raw node reads
  from a protocol node connected to the very export the daemon serves for it, of the volume's size.
  Any other ``vbs-`` disk in a VM must be the remnant of a forced unplug that a guest never
  acknowledged (a bare QEMU never does): the device is still there, but its raw node reads from the
  always-failing ``vbs-<serial>-dead`` node, no protocol node and no secret or TLS object of that
  serial is left (the storage connection is closed, I/O fails), and the DB knows the volume and has
  no live attachment of it to that VM. Block nodes of a serial without its device are orphans;
* ``/v1/admin/check`` finds nothing, except ``orphan-disk`` for exactly those remnants.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Services, wait_until
from vbs.qemu.qmp import QmpClient
from vbs.storage.exports.iscsi import IscsiExportDriver, parse_targets
from vbs.storage.exports.iscsi.access import Access

GIB = 1 << 30
IQN_PREFIX = "iqn.2026-11.org.vbs"
LIVE_ATTACHMENT = ("attached", "busy")


# -- the short check (crash-recovery tests) ---------------------------------------------------------


def pool_items(pool: Path) -> dict[str, set[str]]:
    """Every file in the pool, final or partial, by kind: nothing may hide from the check."""
    out: dict[str, set[str]] = {"volumes": set(), "snapshots": set()}
    for kind in out:
        for p in (pool / kind).iterdir():
            out[kind].add(p.name)
    return out


def db_rows(data_dir: Path) -> dict[str, dict[str, str]]:
    with sqlite3.connect(data_dir / "vbs.db", timeout=10) as db:
        return {
            "volumes": dict(db.execute("SELECT id, status FROM volumes").fetchall()),
            # A snapshot whose copy pool gave its copy up lives in the snapshot store only: no pool file.
            "snapshots": dict(db.execute("SELECT id, CASE WHEN pool_copy OR status != 'completed' THEN status "
                                         "ELSE 'stored' END FROM snapshots").fetchall()),
            "operations": dict(db.execute("SELECT id, status FROM operations").fetchall()),
        }


def assert_world_agrees(svc: Services) -> None:
    # The resource reaches its final state a moment before its operation is marked finished.
    wait_until(lambda: not any(s in ("running", "rolling-back") for s in db_rows(svc.data_dir)["operations"].values()),
               30, what="operations finished")
    rows = db_rows(svc.data_dir)
    files = pool_items(svc.data_dir / "pool")
    for kind, live in (("volumes", {"available", "in-use"}), ("snapshots", {"completed"})):
        expected = {f"{rid}.raw" for rid, status in rows[kind].items() if status in live}
        assert files[kind] == expected, f"{kind}: files {files[kind]} vs rows {rows[kind]}"
        transitional = {rid: s for rid, s in rows[kind].items() if s in ("creating", "deleting", "pending")}
        assert not transitional, f"{kind} stuck in a transitional state: {transitional}"
    running = {op: s for op, s in rows["operations"].items() if s in ("running", "rolling-back")}
    assert not running, f"unfinished operations: {running}"


def storage_request(flow: str, volume_id: str | None,
                    snapshot_id: str | None) -> tuple[str, str, dict[str, Any] | None]:
    """The REST request (method, path, body) that starts a storage workflow: ``create-volume``,
    ``create-volume-from-snapshot``, ``create-snapshot``, ``delete-volume`` or ``delete-snapshot``."""
    return {
        "create-volume": ("POST", "/v1/volumes", {"size_gib": 1}),
        "create-volume-from-snapshot": ("POST", "/v1/volumes", {"snapshot_id": snapshot_id}),
        "create-snapshot": ("POST", "/v1/snapshots", {"volume_id": volume_id}),
        "delete-volume": ("DELETE", f"/v1/volumes/{volume_id}", None),
        "delete-snapshot": ("DELETE", f"/v1/snapshots/{snapshot_id}", None),
    }[flow]


def send_request(http: httpx.Client, method: str, path: str, body: dict[str, Any] | None, *,
                 crashing: bool) -> None:
    """Ask for a workflow. A controller armed to crash (``crashing``) may die before it answers: that is fine."""
    try:
        r = http.request(method, path, json=body)
    except httpx.HTTPError:
        if crashing:
            return
        raise
    if crashing and r.status_code >= 500:
        # A crash mid-request answers 5xx through no handler; printed, so that a refusal shows in the
        # output of a test that then finds no operation.
        print(f"{method} {path} answered {r.status_code} while armed to crash: {r.text}")
        return
    assert r.status_code == 200, f"{method} {path}: {r.status_code} {r.text}"


def new_operation(data_dir: Path, kind: str, known: set[str]) -> dict[str, Any]:
    """The operation of ``kind`` that is not in ``known``, once the controller has recorded it."""
    def find() -> dict[str, Any] | None:
        ops = [o for i, o in read_db(data_dir).operations.items() if i not in known and o["kind"] == kind]
        return ops[-1] if ops else None

    return wait_until(find, 30, what=f"a new {kind} operation")  # type: ignore[no-any-return]


def step_state(data_dir: Path, op_id: str, step: str) -> str | None:
    """The state of one step of an operation, as the DB records it."""
    with sqlite3.connect(f"file:{data_dir / 'vbs.db'}?mode=ro", uri=True, timeout=10) as db:
        row = db.execute("SELECT state FROM operation_steps WHERE operation_id = ? AND name = ?",
                         (op_id, step)).fetchone()
    return row[0] if row else None


# -- the full check ---------------------------------------------------------------------------------


@dataclass
class WorldSpec:
    """Where everything of one install is, for ``world_disagreements``."""

    data_dir: Path  # holds vbs.db and pool/
    controller: httpx.Client  # authenticated, on the controller's endpoint
    agent_url: str
    agent_token: str
    protocol: str  # nbd | iscsi
    state_dir: Path  # the storage agent's --state-dir
    export_host: str = "127.0.0.1"
    nbd_port: int | None = None
    iscsi_control: int | None = None
    # (host, vm_id) -> the test's own QMP socket of each running VM
    vms: dict[tuple[str, str], Path] = field(default_factory=dict)

    @property
    def pool(self) -> Path:
        return self.data_dir / "pool"


@dataclass
class Db:
    volumes: dict[str, dict[str, Any]]
    snapshots: dict[str, dict[str, Any]]
    attachments: list[dict[str, Any]]
    operations: dict[str, dict[str, Any]]
    modifications: dict[str, dict[str, Any]]

    def expected_attachments(self) -> list[dict[str, Any]]:
        return [a for a in self.attachments if a["status"] in LIVE_ATTACHMENT]


def stored_snapshot_sha(data_dir: Path, store: Path, snapshot_id: str, mib: int) -> str:
    """The sha256 of the first ``mib`` MiB of a snapshot as the snapshot store holds it (``store``: a dir
    store), restored with the controller's store key (from its database, opened with its master key) into a
    scratch file beside the DB, every chunk checked."""
    import hashlib

    from vbs.controller.auth.keys import MasterKey
    from vbs.controller.auth.store_key import store_key
    from vbs.controller.db import Database
    from vbs.snapshot_store import DirStore, StoreKey, load_manifest, restore_snapshot

    db = Database.for_data_dir(data_dir)
    try:
        secret = store_key(db, MasterKey(data_dir / "master.key")).get_secret_value()
    finally:
        db.dispose()
    dir_store = DirStore(store)
    manifest = load_manifest(dir_store, snapshot_id)
    scratch = data_dir / f".restored-{snapshot_id}"
    try:
        restore_snapshot(dir_store, manifest, scratch,
                         tenant_key=StoreKey(bytes.fromhex(secret)).tenant_key(manifest.tenant))
        h = hashlib.sha256()
        with scratch.open("rb") as fh:
            for _ in range(mib):
                h.update(fh.read(1 << 20))
        return h.hexdigest()
    finally:
        scratch.unlink(missing_ok=True)


def read_db(data_dir: Path) -> Db:
    with sqlite3.connect(f"file:{data_dir / 'vbs.db'}?mode=ro", uri=True, timeout=10) as db:
        db.row_factory = sqlite3.Row

        def rows(sql: str) -> list[dict[str, Any]]:
            return [dict(r) for r in db.execute(sql).fetchall()]

        return Db(
            volumes={r["id"]: r for r in rows("SELECT id, status, size_gib, status_reason FROM volumes")},
            snapshots={r["id"]: r for r in rows("SELECT id, status, volume_id, volume_size_gib, pool_copy, "
                                                "store_state, status_reason FROM snapshots")},
            attachments=rows("SELECT id, volume_id, host, vm_id, status, mode FROM attachments ORDER BY created_at"),
            operations={r["id"]: r for r in rows(
                "SELECT id, kind, resource_id, status, error, params FROM operations ORDER BY created_at")},
            modifications={r["id"]: r for r in rows(
                "SELECT id, volume_id, state, target_size_gib FROM volume_modifications")},
        )


def serial_of(volume_id: str) -> str:
    return volume_id.replace("-", "", 1)


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _argv(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def _environ(pid: int, name: str) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(name.encode() + b"="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return None


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def qsd_pids(state_dir: Path) -> list[int]:
    """Live qemu-storage-daemon processes of this storage agent (their pidfile is in its state dir)."""
    mark = str(state_dir)
    return sorted(pid for pid in _all_pids() if (argv := _argv(pid)) and Path(argv[0]).name == "qemu-storage-daemon"
                  and mark in " ".join(argv) and _pid_alive(pid))


def tgtd_pids(control: int) -> list[int]:
    """Live tgtd processes on this control number."""
    return sorted(pid for pid in _all_pids() if (argv := _argv(pid)) and Path(argv[0]).name == "tgtd"
                  and argv[1:4] == ["-f", "-C", str(control)] and _pid_alive(pid))


def open_pool_files(pid: int, pool: Path) -> set[str]:
    """The pool files a process holds open, as ``volumes/<name>`` / ``snapshots/<name>``."""
    out: set[str] = set()
    root = str(pool.resolve()) + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root):
            out.add(target[len(root):])
    return out


def nbd_server_exports(host: str, port: int) -> dict[str, int]:
    """Export name -> size, as the NBD server itself lists them to a client (NBD_OPT_LIST)."""
    proc = subprocess.run(["qemu-nbd", "-L", "-b", host, "-p", str(port)], capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        raise AssertionError(f"qemu-nbd -L {host}:{port} failed: {proc.stderr.strip()}")
    out: dict[str, int] = {}
    name: str | None = None
    for line in proc.stdout.splitlines():
        s = line.strip()
        if s.startswith("export: '"):
            name = s[len("export: '"):-1]
            out[name] = -1
        elif s.startswith("size:") and name is not None:
            out[name] = int(s.split()[1])
    return out


def tgtadm(control: int, socket_base: str, *args: str) -> str:
    proc = subprocess.run(["tgtadm", "-C", str(control), "--lld", "iscsi", *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "TGT_IPC_SOCKET": socket_base})
    if proc.returncode != 0 or "tgtadm:" in proc.stderr:
        raise AssertionError(f"tgtadm {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def qmp_many(socket: Path, commands: list[tuple[str, dict[str, Any] | None]], timeout: float = 10.0) -> list[Any]:
    """Run several QMP commands in one session on a monitor socket (a VM's test monitor: the host agent
    holds its main one)."""
    with QmpClient(socket, name="vbs-world-check", connect_timeout=timeout, timeout=timeout) as client:
        return [client.execute(cmd, args) for cmd, args in commands]


@dataclass
class VmView:
    devices: set[str]  # every qdev id under /machine/peripheral
    nodes: dict[str, dict[str, Any]]  # named block nodes
    children: dict[str, dict[str, str]]  # node name -> {child role: child node name}
    objects: set[str]
    inserted: dict[str, str]  # device id -> the node name its backend uses


def vm_view(socket: Path) -> VmView:
    peripheral, nodes, graph, objects, block = qmp_many(socket, [
        ("qom-list", {"path": "/machine/peripheral"}),
        ("query-named-block-nodes", {"flat": True}),
        ("x-debug-query-block-graph", None),
        ("qom-list", {"path": "/objects"}),
        ("query-block", None),
    ])
    names = {n["id"]: n["name"] for n in graph["nodes"]}
    children: dict[str, dict[str, str]] = {}
    for edge in graph["edges"]:
        parent, child = names.get(edge["parent"], ""), names.get(edge["child"], "")
        children.setdefault(parent, {})[edge["name"]] = child
    inserted = {}
    for blk in block:
        parts = blk.get("qdev", "").split("/")
        if len(parts) > 3 and parts[1:3] == ["machine", "peripheral"] and "inserted" in blk:
            inserted[parts[3]] = blk["inserted"].get("node-name", "")
    return VmView(
        devices={c["name"] for c in peripheral if c["type"].startswith("child<")},
        nodes={n["node-name"]: n for n in nodes if n.get("node-name")},
        children=children,
        objects={c["name"] for c in objects if c["type"].startswith("child<")},
        inserted=inserted,
    )


def _serials_in_vm(view: VmView) -> set[str]:
    out = set()
    for name in (*view.devices, *view.nodes, *view.objects):
        if name.startswith("vbs-"):
            out.add(name.split("-")[1])
    return out


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    remnants: set[tuple[str, str, str]] = field(default_factory=set)  # (host, vm_id, volume_id)

    def add(self, problem: str) -> None:
        self.problems.append(problem)


def world_disagreements(spec: WorldSpec) -> Verdict:
    """Everything that disagrees with the DB (see the module docstring); an empty list means agreement."""
    v = Verdict()
    db = read_db(spec.data_dir)
    _check_db(db, v)
    _check_pool(spec, db, v)
    exports = _check_exports(spec, db, v)
    for (host, vm_id), socket in sorted(spec.vms.items()):
        _check_vm(spec, db, host, vm_id, socket, exports, v)
    _check_reconciler(spec, v)
    return v


def _check_db(db: Db, v: Verdict) -> None:
    for op in db.operations.values():
        if op["status"] in ("running", "rolling-back"):
            v.add(f"operation {op['id']} ({op['kind']} of {op['resource_id']}) is still {op['status']}: {op['error']}")
    for vol in db.volumes.values():
        if vol["status"] in ("creating", "deleting"):
            v.add(f"volume {vol['id']} stuck {vol['status']}")
    for snap in db.snapshots.values():
        if snap["status"] in ("pending", "deleting"):
            v.add(f"snapshot {snap['id']} stuck {snap['status']}")
    for att in db.attachments:
        if att["status"] in ("attaching", "detaching"):
            v.add(f"attachment {att['id']} of {att['volume_id']} stuck {att['status']}")
    for mod in db.modifications.values():
        if mod["state"] not in ("completed", "failed"):
            v.add(f"modification {mod['id']} of {mod['volume_id']} stuck {mod['state']}")
    live = Counter(a["volume_id"] for a in db.expected_attachments())
    for vol in db.volumes.values():
        if vol["status"] == "in-use" and not live[vol["id"]]:
            v.add(f"volume {vol['id']} is in-use without a live attachment")
        if vol["status"] != "in-use" and live[vol["id"]]:
            v.add(f"volume {vol['id']} is {vol['status']} but has a live attachment")


def _check_pool(spec: WorldSpec, db: Db, v: Verdict) -> None:
    root = sorted(p.name for p in spec.pool.iterdir())
    if root != ["snapshots", "volumes"]:
        v.add(f"pool root holds {root}, expected only snapshots/ and volumes/")
    want = {
        "volumes": {f"{i}.raw": r["size_gib"] * GIB for i, r in db.volumes.items()
                    if r["status"] in ("available", "in-use")},
        # A copy pool gives a stored snapshot's copy up (it lives in the snapshot store only).
        "snapshots": {f"{i}.raw": r["volume_size_gib"] * GIB for i, r in db.snapshots.items()
                      if r["status"] == "completed" and r["pool_copy"]},
    }
    for kind, files in want.items():
        have = {p.name: p.stat().st_size for p in (spec.pool / kind).iterdir()}
        for name in sorted(set(have) - set(files)):
            item = name.split(".")[0]
            row = db.volumes.get(item) or db.snapshots.get(item)
            v.add(f"orphan file {kind}/{name} (row: {row['status'] if row else 'none'})")
        for name in sorted(set(files) - set(have)):
            item = name.split(".")[0]
            row = db.volumes.get(item) or db.snapshots.get(item)
            v.add(f"missing file {kind}/{name} of a {row['status'] if row else '?'} row")
        for name in sorted(set(files) & set(have)):
            if files[name] != have[name]:
                v.add(f"{kind}/{name} has {have[name]} bytes, the DB says {files[name]}")
    try:
        inv = httpx.get(f"{spec.agent_url}/v1/inventory", headers={"authorization": f"Bearer {spec.agent_token}"},
                        timeout=30).json()["pools"]
    except httpx.HTTPError as exc:
        v.add(f"storage agent inventory unreadable: {exc!r}")
        return
    for kind in ("volumes", "snapshots"):
        agent_has = {i for pool in inv.values() for i in pool.get(kind, [])}
        if agent_has != {n.split(".")[0] for n in want[kind]}:
            v.add(f"storage agent inventory of {kind} {sorted(agent_has)} differs from the DB's "
                  f"{sorted(n.split('.')[0] for n in want[kind])}")


@dataclass
class Exports:
    """What the export daemon serves, by (volume, host): the NBD export name or the iSCSI (iqn, user, luns)."""

    nbd_names: dict[tuple[str, str], str] = field(default_factory=dict)
    iscsi: dict[str, Any] = field(default_factory=dict)  # iqn -> live target


def _check_exports(spec: WorldSpec, db: Db, v: Verdict) -> Exports:
    out = Exports()
    expected = {(a["volume_id"], a["host"]) for a in db.expected_attachments()}
    want_files = {f"volumes/{vol}.raw" for vol, _ in expected}
    try:
        agent = httpx.get(f"{spec.agent_url}/v1/exports", headers={"authorization": f"Bearer {spec.agent_token}"},
                          timeout=30).json()["exports"]
        agent_view = {(e["key"], e["host"]) for e in agent}
        if agent_view != expected:
            v.add(f"storage agent lists exports {sorted(agent_view)}, expected {sorted(expected)}")
    except httpx.HTTPError as exc:
        v.add(f"storage agent exports unreadable: {exc!r}")
    if spec.protocol == "nbd":
        assert spec.nbd_port is not None
        pids = qsd_pids(spec.state_dir)
        if len(pids) != 1:
            v.add(f"{len(pids)} qemu-storage-daemon processes for this agent: {pids}")
        for pid in pids:
            held = open_pool_files(pid, spec.pool)
            if held != want_files:
                v.add(f"qemu-storage-daemon {pid} holds {sorted(held)} open, expected {sorted(want_files)}")
        served = nbd_server_exports(spec.export_host, spec.nbd_port)
        by_volume = Counter(name[:21] for name in served)
        for vol, n in by_volume.items():
            if n != 1 or vol not in {x for x, _ in expected}:
                v.add(f"the NBD server serves {n} export(s) of {vol}; expected {'1' if n else '0'} "
                      f"({sorted(x for x in served if x.startswith(vol))})")
        for vol, _host in sorted(expected):
            if not by_volume[vol]:
                v.add(f"the NBD server serves no export of attached volume {vol}")
        try:
            items = json.loads((spec.state_dir / "nbd" / "exports.json").read_text())["items"]
        except FileNotFoundError:
            items = []
        state = [(item["key"], e["host"], e["gen"], e["name"]) for item in items for e in item["exports"]]
        desired = {(key, host): name for key, host, _gen, name in state}
        if set(desired) != expected or len(state) != len(desired):
            v.add(f"the agent's desired NBD exports {sorted(x[:3] for x in state)} differ from {sorted(expected)}")
        for key, name in desired.items():
            if name not in served:
                v.add(f"desired NBD export {name} of {key} is not served")
            else:
                out.nbd_names[key] = name
                size = db.volumes.get(key[0], {}).get("size_gib", 0) * GIB
                if served[name] != size:
                    v.add(f"NBD export {name} reports {served[name]} bytes, the volume has {size}")
    else:
        assert spec.iscsi_control is not None
        pids = tgtd_pids(spec.iscsi_control)
        if len(pids) != 1:
            v.add(f"{len(pids)} tgtd processes on control {spec.iscsi_control}: {pids}")
            return out
        pid = pids[0]
        held = open_pool_files(pid, spec.pool)
        if held != want_files:
            v.add(f"tgtd {pid} holds {sorted(held)} open, expected {sorted(want_files)}")
        socket_base = _environ(pid, "TGT_IPC_SOCKET")
        if socket_base is None:
            v.add(f"tgtd {pid} has no TGT_IPC_SOCKET")
            return out
        targets = {iqn: t for iqn, t in parse_targets(
            tgtadm(spec.iscsi_control, socket_base, "--mode", "target", "--op", "show")).items()
            if iqn.startswith(IQN_PREFIX + ":")}
        accounts_out = tgtadm(spec.iscsi_control, socket_base, "--mode", "account", "--op", "show")
        accounts = {line.strip() for line in accounts_out.splitlines()[1:] if line.strip()}
        want_targets = {_target_names(spec).iqn(vol) for vol, _ in expected}
        if set(targets) != want_targets:
            v.add(f"tgtd has targets {sorted(targets)}, expected {sorted(want_targets)}")
        want_users = {IscsiExportDriver.chap_user(vol, host) for vol, host in expected}
        if accounts != want_users:
            v.add(f"tgtd has CHAP accounts {sorted(accounts)}, expected {sorted(want_users)}")
        for vol, host in sorted(expected):
            t = targets.get(_target_names(spec).iqn(vol))
            if t is None:
                continue
            luns = {n: lun for n, lun in t.luns.items() if n != 0}
            path = str((spec.pool / "volumes" / f"{vol}.raw").resolve())
            if len(luns) != 1 or any(lun.path != path for lun in luns.values()):
                v.add(f"target of {vol} has LUNs {[(n, lun.path) for n, lun in luns.items()]}, expected one on {path}")
            if IscsiExportDriver.chap_user(vol, host) not in t.accounts:
                v.add(f"target of {vol} does not bind the account of {host}: {t.accounts}")
            if not t.acl:
                v.add(f"target of {vol} has no ACL entry")
        out.iscsi = targets
    return out


def _check_vm(spec: WorldSpec, db: Db, host: str, vm_id: str, socket: Path, exports: Exports, v: Verdict) -> None:
    try:
        view = vm_view(socket)
    except Exception as exc:  # noqa: BLE001 - a VM that does not answer is a finding
        v.add(f"VM {vm_id}: QMP failed: {exc!r}")
        return
    mine = [a for a in db.attachments if a["host"] == host and a["vm_id"] == vm_id]
    expected = {serial_of(a["volume_id"]): a for a in mine if a["status"] in LIVE_ATTACHMENT}
    known = {serial_of(vol): vol for vol in db.volumes}
    for serial in sorted(_serials_in_vm(view)):
        p = f"vbs-{serial}"
        dev, raw, dead = f"{p}-dev", f"{p}-raw", f"{p}-dead"
        protos = [n for n in (f"{p}-proto", f"{p}-proto2") if n in view.nodes]
        objects = sorted(o for o in view.objects if o.startswith(p + "-"))
        volume_id = known.get(serial, "?")
        if serial in expected:
            if dev not in view.devices:
                v.add(f"VM {vm_id}: attached volume {volume_id} has no device {dev}")
                continue
            if view.inserted.get(dev) not in (raw, f"{p}-thr"):
                v.add(f"VM {vm_id}: {dev} uses node {view.inserted.get(dev)!r}, not {raw}")
            if dead in view.nodes:
                v.add(f"VM {vm_id}: attached volume {volume_id} has its I/O cut ({dead} present)")
            child = view.children.get(raw, {}).get("file")
            if len(protos) != 1 or child != protos[0]:
                v.add(f"VM {vm_id}: {raw} reads from {child!r}; protocol nodes {protos}")
                continue
            node = view.nodes[protos[0]]
            size = db.volumes[volume_id]["size_gib"] * GIB
            if view.nodes.get(raw, {}).get("image", {}).get("virtual-size") != size:
                v.add(f"VM {vm_id}: {raw} has {view.nodes.get(raw, {}).get('image', {}).get('virtual-size')} bytes, "
                      f"the volume {size}")
            _check_connection(spec, vm_id, volume_id, host, node, exports, v)
            extra = set(objects) - {f"{p}-sec", f"{p}-tls", f"{p}-sec2", f"{p}-tls2", f"{p}-tg", f"{p}-io"}
            if extra:
                v.add(f"VM {vm_id}: unexpected objects {sorted(extra)}")
            continue
        # Not attached here: only the remnant of a forced unplug is acceptable.
        if dev not in view.devices:
            left = sorted(n for n in view.nodes if n.startswith(p + "-")) + objects
            v.add(f"VM {vm_id}: block nodes/objects of {volume_id} without a device or attachment: {left}")
            continue
        why = []
        if volume_id == "?":
            why.append("no volume of that serial in the DB")
        if any(a["status"] not in ("detached",) for a in mine if serial_of(a["volume_id"]) == serial):
            why.append("the DB has a live attachment of it here")
        if view.children.get(raw, {}).get("file") != dead or view.nodes.get(dead, {}).get("drv") != "blkdebug":
            why.append(f"{raw} reads from {view.children.get(raw, {}).get('file')!r}, not the failing {dead}")
        if protos:
            why.append(f"protocol nodes {protos} still open")
        # The device's own I/O thread stays with it (the QEMU driver's iothreads); nothing else may.
        if left := [o for o in objects if o != f"{p}-io"]:
            why.append(f"objects {left} left")
        if why:
            v.add(f"VM {vm_id}: device {dev} of {volume_id} without a live attachment: {'; '.join(why)}")
        else:
            v.remnants.add((host, vm_id, volume_id))


def _target_names(spec: WorldSpec) -> Access:
    """The storage agent's iSCSI target names: a volume id sealed under its node's key (iscsi/iqn.key)."""
    return Access(None, IQN_PREFIX, spec.state_dir / "iscsi")  # type: ignore[arg-type]


def _check_connection(spec: WorldSpec, vm_id: str, volume_id: str, host: str, node: dict[str, Any],
                      exports: Exports, v: Verdict) -> None:
    filename = str(node.get("file", ""))
    if spec.protocol == "nbd":
        name = exports.nbd_names.get((volume_id, host))
        want = f"nbd://{spec.export_host}:{spec.nbd_port}/{name}"
        if node.get("drv") != "nbd" or name is None or filename != want:
            v.add(f"VM {vm_id}: disk of {volume_id} is connected to {filename!r}, the daemon serves {want!r}")
        return
    opts = json.loads(filename[5:]) if filename.startswith("json:") else {}
    iqn = _target_names(spec).iqn(volume_id)
    target = exports.iscsi.get(iqn)
    ok = (node.get("drv") == "iscsi" and opts.get("target") == iqn and target is not None
          and int(opts.get("lun", -1)) in target.luns and opts.get("user") in target.accounts)
    if not ok:
        v.add(f"VM {vm_id}: disk of {volume_id} is connected to {filename!r}, tgtd has "
              f"{(sorted(target.luns), target.accounts) if target else 'no target'}")


def _check_reconciler(spec: WorldSpec, v: Verdict) -> None:
    try:
        r = spec.controller.get("/v1/admin/check", timeout=60)
    except httpx.HTTPError as exc:
        v.add(f"GET /v1/admin/check failed: {exc!r}")
        return
    if r.status_code != 200:
        v.add(f"GET /v1/admin/check: HTTP {r.status_code} {r.text[:300]}")
        return
    accepted = {vol for _h, _vm, vol in v.remnants}
    for f in r.json()["findings"]:
        if f["kind"] == "orphan-disk" and f["resource_id"] in accepted:
            continue
        v.add(f"reconciliation check: {f['kind']} {f['resource_id']} on {f['node']}: {f['detail']}")


def converge(spec: WorldSpec, timeout: float = 60.0, interval: float = 0.25) -> tuple[float, Verdict]:
    """Wait until the world agrees with the DB; returns (seconds it took, last verdict). Raises if it never does."""
    start = time.monotonic()
    verdict = Verdict(problems=["not checked"])
    while True:
        try:
            db = read_db(spec.data_dir)
            unfinished = [o for o in db.operations.values() if o["status"] in ("running", "rolling-back")]
            if not unfinished:
                verdict = world_disagreements(spec)
                if not verdict.problems:
                    return time.monotonic() - start, verdict
            else:
                verdict = Verdict(problems=[f"operation {o['id']} ({o['kind']} of {o['resource_id']}) still "
                                            f"{o['status']}: {o['error']}" for o in unfinished])
        except (sqlite3.Error, OSError, AssertionError, httpx.HTTPError) as exc:
            verdict = Verdict(problems=[f"check failed: {exc!r}"])
        if time.monotonic() - start > timeout:
            try:
                verdict = world_disagreements(spec)  # everything that disagrees, not only the first finding
            except (sqlite3.Error, OSError, AssertionError, httpx.HTTPError) as exc:
                verdict.problems.append(f"check failed: {exc!r}")
            raise AssertionError(f"the world did not converge within {timeout:g}s:\n  " +
                                 "\n  ".join(verdict.problems))
        time.sleep(interval)


# -- RBD: a Ceph pool's images, snapshots and trash against the DB ------------------------------------


RETIRED = "vbs-retired-"


def rbd_disagreements(data_dir: Path, controller: httpx.Client, conf: Path, pool: str) -> list[str]:
    """Everything of an rbd-backend pool that disagrees with the DB, read from Ceph with its own tools.

    * ``rbd ls``: exactly the image of each ``available``/``in-use`` volume, of its recorded size;
      every image listed opens (``rbd ls -l``), and no ``rbd_id.*`` object names an image the pool
      does not list (the remnant of a create cut short);
    * ``rbd trash ls``: only images of volumes the DB says are gone (deleted, or a create rolled back),
      among them each deleted volume that still has a completed snapshot (its image waits there);
    * ``rbd snap ls`` of each image, listed or trashed: exactly the completed snapshots of its volume;
    * the DB: nothing transitional (``_check_db``), and the controller's ``/v1/admin/check`` is clean.
    """
    from tests.rbd_cloud import rbd_json  # the rbd tool as the RBD tests run it

    v = Verdict()
    db = read_db(data_dir)
    _check_db(db, v)
    live = {i: r for i, r in db.volumes.items() if r["status"] in ("available", "in-use")}
    completed = {i: r for i, r in db.snapshots.items() if r["status"] == "completed"}
    # Where each volume's snapshots must be: its image, or (deleted) its image in the trash.
    image_of = {vol: vol if vol in live else f"trash:{vol}" for vol in {s["volume_id"] for s in completed.values()}}
    want = set(live)
    names = set(rbd_json(conf, "ls", pool))
    long = rbd_json(conf, "ls", "-l", pool)
    sizes = {e["image"]: e["size"] for e in long if "snapshot" not in e}
    for name in sorted(names - want):
        row = db.volumes.get(name.removeprefix(RETIRED))
        v.add(f"orphan image {pool}/{name} (volume row: {row['status'] if row else 'none'})")
    for name in sorted(want - names):
        v.add(f"missing image {pool}/{name}")
    for name in sorted(names - set(sizes)):
        v.add(f"image {pool}/{name} is listed but does not open")
    for vol, row in live.items():
        if vol in sizes and sizes[vol] != row["size_gib"] * GIB:
            v.add(f"image {pool}/{vol} has {sizes[vol]} bytes, the DB says {row['size_gib']} GiB")
    snaps: dict[str, str] = {}
    for name in sorted(names & set(sizes)):
        for s in rbd_json(conf, "snap", "ls", f"{pool}/{name}"):
            snaps[s["name"]] = name
    trash = rbd_json(conf, "trash", "ls", "--all", pool)
    for entry in trash:
        volume = str(entry.get("name", "")).removeprefix(RETIRED)
        for s in rbd_json(conf, "snap", "ls", "--pool", pool, "--image-id", str(entry["id"])):
            snaps[s["name"]] = f"trash:{volume}"
    for vol in sorted(v for v, where in image_of.items() if where.startswith("trash:")):
        if not any(str(e.get("name", "")).removeprefix(RETIRED) == vol for e in trash):
            v.add(f"deleted volume {vol} has completed snapshots but no image in the trash of {pool}")
    for snap in sorted(set(snaps) - set(completed)):
        row = db.snapshots.get(snap)
        v.add(f"orphan snapshot {pool}/{snaps[snap]}@{snap} (row: {row['status'] if row else 'none'})")
    for snap, row in sorted(completed.items()):
        if snaps.get(snap) != image_of[row["volume_id"]]:
            v.add(f"completed snapshot {snap} is on {snaps.get(snap)!r}, not {image_of[row['volume_id']]}")
    for entry in trash:
        row = db.volumes.get(str(entry.get("name", "")).removeprefix(RETIRED))
        if row is None or row["status"] not in ("deleted", "error"):
            v.add(f"image {entry} in the trash of {pool} (volume row: {row['status'] if row else 'none'})")
    proc = subprocess.run(["rados", "--conf", str(conf), "-p", pool, "ls"], capture_output=True, text=True,
                          timeout=120, check=True)
    for obj in sorted(o for o in proc.stdout.split() if o.startswith("rbd_id.")):
        if obj.removeprefix("rbd_id.") not in names | {str(e.get("name")) for e in trash}:
            v.add(f"object {pool}/{obj} of an image rbd does not list")
    spec = WorldSpec(data_dir=data_dir, controller=controller, agent_url="", agent_token="", protocol="nbd",
                     state_dir=data_dir)
    _check_reconciler(spec, v)
    return v.problems


def converge_rbd(data_dir: Path, controller: httpx.Client, conf: Path, pool: str,
                 timeout: float = 90.0, also: Callable[[], list[str]] | None = None) -> float:
    """Wait until ``rbd_disagreements`` (and ``also``, more checks of the caller's) finds nothing; the
    seconds it took. Raises with the findings if never."""
    start = time.monotonic()
    problems = ["not checked"]
    while time.monotonic() - start < timeout:
        try:
            problems = rbd_disagreements(data_dir, controller, conf, pool)
            if not problems and also is not None:
                problems = also()
        except (sqlite3.Error, OSError, AssertionError, httpx.HTTPError, subprocess.SubprocessError) as exc:
            problems = [f"check failed: {exc!r}"]
        if not problems:
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"the RBD world did not converge within {timeout:g}s:\n  " + "\n  ".join(problems))


ATTACHMENT_USER_PREFIX = "client.vbs."


def cephx_user_disagreements(data_dir: Path, conf: Path, pool: str) -> list[str]:
    """The attachments' cephx users of ``pool`` (``ceph auth ls``: ``client.vbs.<host>.<volume>`` whose
    OSD caps name the pool) against the DB: exactly one user per live attachment of a volume, none other."""
    proc = subprocess.run(["ceph", "--conf", str(conf), "auth", "ls", "--format", "json"], capture_output=True,
                          text=True, timeout=120, check=True)  # holds keys: read here, never printed
    users: Counter[str] = Counter()
    for entry in json.loads(proc.stdout)["auth_dump"]:
        name = str(entry.get("entity", ""))
        if name.startswith(ATTACHMENT_USER_PREFIX) and f"pool={pool}" in str(entry.get("caps", {}).get("osd", "")):
            users[name] += 1
    live = Counter(f"{ATTACHMENT_USER_PREFIX}{a['host']}.{a['volume_id']}"
                   for a in read_db(data_dir).expected_attachments())
    problems = [f"stray cephx user {u} (no live attachment)" for u in sorted(set(users) - set(live))]
    problems += [f"live attachment without its cephx user {u}" for u in sorted(set(live) - set(users))]
    problems += [f"{n} live attachments share the cephx user {u}" for u, n in sorted(live.items()) if n > 1]
    return problems


def children(pid: int) -> list[int]:
    """The PIDs of the children of every thread of ``pid``."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return out


def runs(argv: list[str], tool: str, sub: tuple[str, ...]) -> bool:
    """Whether ``argv`` is ``tool`` running the subcommand ``sub`` (its words in a row, options anywhere);
    ``tool`` may be a script its interpreter runs (``python3 /usr/bin/ceph ...``)."""
    if not any(Path(a).name == tool for a in argv[:2]):
        return False
    n = len(sub)
    return any(tuple(argv[i:i + n]) == sub for i in range(1, len(argv) - n + 1))


def kill_mid_tool(proc: subprocess.Popen[bytes], tool: str, sub: tuple[str, ...], timeout: float = 60.0) -> bool:
    """SIGKILL ``proc`` and its child the moment that child runs ``tool sub``, as a service manager kills
    a whole unit; whether the tool was still at work (not an exited child waiting to be reaped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children(proc.pid):
            if runs(_argv(child), tool, sub):
                os.kill(proc.pid, signal.SIGKILL)
                working = bool(_argv(child))  # a zombie has no command line any more
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    working = False
                proc.wait(30)
                return working
        time.sleep(0.001)
    raise AssertionError(f"{proc.pid} never ran {tool} {' '.join(sub)}")
