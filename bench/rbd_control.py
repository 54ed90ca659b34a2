"""``bench/control_plane.py --backend rbd``: snapshot and create-from-snapshot on the rbd backend.

It starts its own single-node Ceph (``vbs.rigs.ceph.EmbeddedCeph``, one OSD on a sparse file, a pool of
size 1) in the work dir, a controller and a storage agent ``--backend rbd`` as processes (the tests'
``Services``), and for each size (default 1, 4 and 16 GiB) makes one volume, writes
``--rbd-data-mib`` MiB of data spread over it (``rbd bench --io-type write --io-pattern rand``, 4 MiB
writes at random offsets), then ``--rbd-rounds`` times: POST a snapshot and poll it until
``completed``, POST a volume from it and poll until ``available`` (both through the REST API, every
10 ms), then delete both. The baseline, in the same run: the same operations with the ``rbd`` tool alone
(``snap create``, ``clone``, and the ``ls -l`` the backend lists the pool with). Figures: p50/p95
of what the client saw and of the server-side time (the
operation's row, from the POST's commit to its end). RBD snapshots and clones are metadata
operations, so the figures should not grow with the size: the ratio of the largest size's p50 to the
smallest's says how flat they are. Then, in the same run, the agent is started again with
``--no-rbd-worker`` and the smallest size's rounds are run once more: the snapshot path through the
agent's long-lived rbd worker against a tool process per call (``rbd_worker``). Every process is
stopped by its PID; the cluster is removed.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import log, pct, text_table
from bench.control_api import Api, server_ms
from tests.conftest import Services

from vbs.rigs.ceph import EmbeddedCeph
from vbs.system.processes import stop_children

TARGET_MS = 200.0
POOL = "vbs"
POLL_S = 0.01
OSD_SIZE_GIB = 64  # sparse: only the data written takes room


def _wait(api: Api, path: str, target: str, timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        body = api.get(path)
        now = time.monotonic()
        if body["status"] == target:
            return now
        if body["status"] == "error" or now > deadline:
            raise RuntimeError(f"{path}: {body['status']} ({body.get('status_reason')}), not {target}")
        time.sleep(POLL_S)


def _wait_gone(api: Api, path: str, timeout: float = 120.0) -> None:
    """Until ``path`` answers 404 (a deleted snapshot is not listed) or ``deleted``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if api.get(path)["status"] == "deleted":
                return
        except RuntimeError as exc:
            if "HTTP 404" in str(exc):
                return
            raise
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path}: not deleted within {timeout:g}s")
        time.sleep(POLL_S)


def _write_data(conf: Path, volume_id: str, mib: int) -> float:
    """``mib`` MiB of 4 MiB writes at random offsets of the image; MB/s."""
    t0 = time.monotonic()
    subprocess.run(["rbd", "--conf", str(conf), "bench", "--io-type", "write", "--io-size", "4M",  # noqa: S603
                    "--io-threads", "4", "--io-total", f"{mib}M", "--io-pattern", "rand", f"{POOL}/{volume_id}"],
                   capture_output=True, check=True, timeout=1800)
    return mib * (1 << 20) / 1e6 / (time.monotonic() - t0)


def _used_mib(conf: Path, volume_id: str) -> float:
    out = subprocess.run(["rbd", "--conf", str(conf), "du", "--format", "json", f"{POOL}/{volume_id}"],  # noqa: S603
                         capture_output=True, text=True, check=True, timeout=120).stdout
    images = json.loads(out).get("images", [])
    return sum(i.get("used_size", 0) for i in images if not i.get("snapshot")) / (1 << 20)


def step_end_ms(db: Path, resource_id: str, step: str) -> float | None:
    """From the create operation's start to the end of its ``step`` (the storage agent's call), from the
    controller's DB (read-only)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        row = con.execute("SELECT o.created_at, s.updated_at FROM operations o JOIN operation_steps s "
                          "ON s.operation_id = o.id WHERE o.resource_id = ? AND o.kind LIKE 'create-%' "
                          "AND s.name = ? AND s.state = 'done'", (resource_id, step)).fetchone()
    finally:
        con.close()
    if not row:
        return None
    start, end = (datetime.fromisoformat(str(v)) for v in row)
    return (end - start).total_seconds() * 1000


def _rbd_ms(conf: Path, *args: str) -> float:
    t0 = time.monotonic()
    subprocess.run(["rbd", "--conf", str(conf), *args], capture_output=True, check=True, timeout=120)  # noqa: S603
    return (time.monotonic() - t0) * 1000


def direct_calls(conf: Path, volume_id: str, rounds: int) -> dict[str, dict[str, float]]:
    """The baseline: the same operations with the rbd tool alone, no VBS (one process per call, as the
    backend runs them): ``snap create``, ``clone`` of that snapshot, and ``ls -l`` of the pool."""
    snap, clone, listing = [], [], []
    spec = f"{POOL}/{volume_id}"
    for i in range(rounds):
        snap.append(_rbd_ms(conf, "snap", "create", f"{spec}@bench-{i}"))
        clone.append(_rbd_ms(conf, "clone", "--image-feature", "layering,exclusive-lock,object-map,fast-diff,"
                             "deep-flatten", f"{spec}@bench-{i}", f"{POOL}/bench-clone-{i}"))
        listing.append(_rbd_ms(conf, "ls", "-l", "--format", "json", POOL))
        _rbd_ms(conf, "rm", "--no-progress", f"{POOL}/bench-clone-{i}")
        _rbd_ms(conf, "snap", "rm", "--no-progress", f"{spec}@bench-{i}")
    return {"snap_create_ms": _summary(snap), "clone_ms": _summary(clone), "ls_l_ms": _summary(listing)}


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50": pct(values, 50), "p95": pct(values, 95), "min": min(values), "max": max(values),
            "mean": statistics.mean(values)}


def backend_calls(conf: Path, rounds: int) -> dict[str, dict[str, float]]:
    """The backend's snapshot calls alone, in this process: ``ensure_snapshot`` and ``remove_snapshot``
    through the rbd worker and through a tool process per call, alternated round by round."""
    from vbs import ids
    from vbs.storage.backends.rbd import RbdBackend

    backends = {way: RbdBackend("bench", conf, rbd_pool=POOL, worker=way == "worker", maintenance_interval_s=3600)
                for way in ("worker", "tool")}
    times: dict[str, list[float]] = {f"{way}_{op}": [] for way in backends for op in ("create", "delete")}
    try:
        vol = ids.new_id("volume")
        backends["tool"].ensure_volume(vol, 1 << 30)
        backends["worker"].ensure_snapshot(ids.new_id("snapshot"), vol)  # the worker's start, not timed
        for _ in range(rounds):
            for way, backend in backends.items():
                snap = ids.new_id("snapshot")
                t0 = time.monotonic()
                backend.ensure_snapshot(snap, vol)
                t1 = time.monotonic()
                backend.remove_snapshot(snap)
                times[f"{way}_create"].append((t1 - t0) * 1000)
                times[f"{way}_delete"].append((time.monotonic() - t1) * 1000)
    finally:
        for backend in backends.values():
            backend.close()
    return {k: _summary(v) for k, v in times.items()}


def bench_size(api: Api, svc: Services, conf: Path, size_gib: int, rounds: int, data_mib: int) -> dict[str, Any]:
    vid = api.post("/v1/volumes", {"size_gib": size_gib})["volume_id"]
    _wait(api, f"/v1/volumes/{vid}", "available")
    log(f"  {size_gib} GiB: writing {data_mib} MiB at random offsets of {vid}")
    out: dict[str, Any] = {"size_gib": size_gib, "rounds": rounds, "write_mb_s": _write_data(conf, vid, data_mib)}
    out["used_mib"] = _used_mib(conf, vid)
    db = svc.data_dir / "vbs.db"
    snap_ms, clone_ms, snap_srv, clone_srv, snap_call, clone_call = [], [], [], [], [], []
    for i in range(rounds):
        t0 = time.monotonic()
        sid = api.post("/v1/snapshots", {"volume_id": vid})["snapshot_id"]
        snap_ms.append((_wait(api, f"/v1/snapshots/{sid}", "completed") - t0) * 1000)
        t0 = time.monotonic()
        cid = api.post("/v1/volumes", {"snapshot_id": sid})["volume_id"]
        clone_ms.append((_wait(api, f"/v1/volumes/{cid}", "available") - t0) * 1000)
        for ms, v in ((snap_srv, server_ms(db, sid)), (clone_srv, server_ms(db, cid)),
                      (snap_call, step_end_ms(db, sid, "storage-snapshot")),
                      (clone_call, step_end_ms(db, cid, "storage-create"))):
            if v is not None:
                ms.append(v)
        api.delete(f"/v1/volumes/{cid}")
        _wait(api, f"/v1/volumes/{cid}", "deleted")
        api.delete(f"/v1/snapshots/{sid}")
        # Its deletion (an ``rbd snap rm`` and the store's copy) ends before the next round's snapshot, as
        # the clone's does: otherwise the next snapshot queues behind it on the agent and its rbd worker.
        _wait_gone(api, f"/v1/snapshots/{sid}")
        if (i + 1) % 5 == 0 or i + 1 == rounds:
            log(f"  {size_gib} GiB: round {i + 1}/{rounds}: snapshot {snap_ms[-1]:.0f} ms, clone {clone_ms[-1]:.0f} ms")
    out["direct"] = direct_calls(conf, vid, min(rounds, 10))
    api.delete(f"/v1/volumes/{vid}")
    out["snapshot_ms"], out["clone_ms"] = _summary(snap_ms), _summary(clone_ms)
    if snap_srv:
        out["snapshot_server_ms"] = _summary(snap_srv)
    if clone_srv:
        out["clone_server_ms"] = _summary(clone_srv)
    if snap_call:
        out["snapshot_call_ms"] = _summary(snap_call)
    if clone_call:
        out["clone_call_ms"] = _summary(clone_call)
    return out


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"sizes": [], "notes": []}
    ceph = EmbeddedCeph(work / "cluster", osds=1, osd_size_gib=OSD_SIZE_GIB)
    svc = Services(work / "vbs")
    try:
        log("rbd: starting a single-node Ceph")
        ceph.start()
        ceph.create_pool(POOL, 1)
        svc.start_controller(VBS_CONTROLLER_OVERCOMMIT_RATIO="1000")
        agent = ("--backend", "rbd", "--export", "nbd", "--ceph-conf", str(ceph.conf_path),
                 "--ceph-user", "admin", "--rbd-pool", POOL)
        if args.rbd_snapshot_store:
            agent += ("--snapshot-store", args.rbd_snapshot_store)
        svc.start_agent(*agent)
        api = Api(svc.vbs.endpoint, {"authorization": f"Bearer {svc.vbs.key.bearer}"})
        try:
            for size in args.rbd_sizes:
                res["sizes"].append(bench_size(api, svc, ceph.conf_path, size, args.rbd_rounds, args.rbd_data_mib))
            # The same rounds at the smallest size with the agent's rbd worker off: every call a tool process.
            log("rbd: the agent again with --no-rbd-worker (the rbd tool for every call)")
            stop_children([svc.agent] if svc.agent is not None else [], timeout=20.0)
            svc.start_agent(*agent, "--no-rbd-worker")
            res["tool_only"] = bench_size(api, svc, ceph.conf_path, args.rbd_sizes[0], args.rbd_rounds,
                                          args.rbd_data_mib)
            log("rbd: the backend's snapshot calls alone, worker and tool alternated")
            res["backend_calls"] = backend_calls(ceph.conf_path, args.rbd_rounds)
        finally:
            api.close()
    except Exception as exc:  # report what was measured, and why the rest is missing
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"rbd: FAILED: {res['error']}")
    finally:
        svc.stop()
        ceph.stop()
    return res


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"RBD backend: snapshot and create-from-snapshot of a volume with {args.rbd_data_mib} MiB of data spread "
             f"over it, {args.rbd_rounds} rounds per size (POST until completed / available, polled every "
             f"{POLL_S * 1000:.0f} ms; server-side = the operation's row in the DB; snapshot store: "
             f"{args.rbd_snapshot_store or 'the agent default (dir)'})"]
    if res.get("error"):
        lines.append(f"FAILED (figures below are partial): {res['error'][:500]}")
    rows = []
    for s in res["sizes"]:
        for what in ("snapshot", "clone"):
            api_ms, srv, call = s[f"{what}_ms"], s.get(f"{what}_server_ms", {}), s.get(f"{what}_call_ms", {})
            rows.append([f"{s['size_gib']} GiB", what, f"{api_ms['p50']:.0f}", f"{api_ms['p95']:.0f}",
                         f"{api_ms['min']:.0f}-{api_ms['max']:.0f}",
                         f"{srv.get('p50', float('nan')):.0f}", f"{srv.get('p95', float('nan')):.0f}",
                         f"{call.get('p50', float('nan')):.0f}",
                         f"{s['used_mib']:.0f}",
                         "met" if api_ms["p50"] <= TARGET_MS and api_ms["p95"] <= TARGET_MS else "MISSED"])
    lines.append(text_table(["size", "operation", "p50 ms", "p95 ms", "min-max ms", "server p50", "server p95",
                        "to agent call end p50", "data MiB", f"<= {TARGET_MS:g} ms"], rows))
    lines.append("")
    lines.append("Baseline, same run: the rbd tool alone (one process per call, no VBS), p50 ms")
    rows = [[f"{s['size_gib']} GiB", f"{s['direct']['snap_create_ms']['p50']:.0f}",
             f"{s['direct']['clone_ms']['p50']:.0f}", f"{s['direct']['ls_l_ms']['p50']:.0f}",
             f"{s['snapshot_ms']['p50'] / s['direct']['snap_create_ms']['p50']:.1f}",
             f"{s['clone_ms']['p50'] / s['direct']['clone_ms']['p50']:.1f}"] for s in res["sizes"] if "direct" in s]
    lines.append(text_table(["size", "rbd snap create", "rbd clone", "rbd ls -l", "VBS snapshot / snap create",
                        "VBS clone / rbd clone"], rows))
    tool = res.get("tool_only")
    if tool and res["sizes"]:
        worker = res["sizes"][0]
        lines.append("")
        lines.append(f"Same run, {tool['size_gib']} GiB: the agent's rbd worker (one rados connection) vs the rbd "
                     "tool for every call (--no-rbd-worker), p50 / p95 ms")
        rows = [[what, f"{worker[f'{what}_ms']['p50']:.0f} / {worker[f'{what}_ms']['p95']:.0f}",
                 f"{tool[f'{what}_ms']['p50']:.0f} / {tool[f'{what}_ms']['p95']:.0f}",
                 f"{worker.get(f'{what}_call_ms', {}).get('p50', float('nan')):.0f} / "
                 f"{tool.get(f'{what}_call_ms', {}).get('p50', float('nan')):.0f}",
                 f"{worker[f'{what}_ms']['p50'] / tool[f'{what}_ms']['p50']:.2f}"] for what in ("snapshot", "clone")]
        lines.append(text_table(["operation", "worker", "tool only", "to agent call end p50 (worker / tool)",
                                 "p50 worker / tool"], rows))
    calls = res.get("backend_calls")
    if calls:
        lines.append("")
        lines.append("Same run: the backend's calls alone (in the bench's process, worker and tool alternated), "
                     "p50 / p95 ms")
        rows = [[op, f"{calls[f'worker_{op}']['p50']:.0f} / {calls[f'worker_{op}']['p95']:.0f}",
                 f"{calls[f'tool_{op}']['p50']:.0f} / {calls[f'tool_{op}']['p95']:.0f}",
                 f"{calls[f'worker_{op}']['p50'] / calls[f'tool_{op}']['p50']:.2f}"]
                for op in ("create", "delete")]
        lines.append(text_table(["snapshot", "worker", "tool", "p50 worker / tool"], rows))
    if len(res["sizes"]) >= 2:
        small, big = res["sizes"][0], res["sizes"][-1]
        for what in ("snapshot", "clone"):
            lines.append(f"{what}: p50 at {big['size_gib']} GiB / p50 at {small['size_gib']} GiB = "
                         f"{big[f'{what}_ms']['p50'] / small[f'{what}_ms']['p50']:.2f} (1.00 = flat in size)")
    return "\n".join(lines)
