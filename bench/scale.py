#!/usr/bin/env python3
"""Scale curves of VBS's control plane: prints figures and a table, and plots them (it is not a test).

Five curves, each from one ``vbs up`` (SQLite, file backend) this script starts on loopback:

1. create-volume POST p50/p99, describe-volumes page (1,000 a page) p50/p99, the controller's RSS and
   one reconciliation pass (``GET /v1/admin/check``: every agent's inventory against the DB), at each
   number of volumes in the DB (``--levels``; the DB grows from one level to the next);
2. attach latency (POST to the guest seeing the disk) with 1, 5, 20 disks already in the VM (QEMU TCG
   test guest, NBD export; ``bench/attach.py``'s cycle), on the QEMU driver's disk buses
   (``--disk-buses``: virtio-blk, the default, and virtio-scsi);
3. snapshot time vs volume size on the copy path (the root ext4) and on reflink (xfs on a loop
   device): each volume is filled with non-zero data over its whole size before it is snapshotted
   (``bench/control_plane.py``'s snapshot round; page cache dropped before each copy), and the copy
   slope is fitted in MiB/s.

How the DB is filled: the first ``--api-volumes`` volumes go through the REST API (8 client threads,
the real create workflow, files made by the storage agent); the rest are written straight into the
controller's SQLite through VBS's own DB layer (``vbs.controller.db``: the same ``Volume`` rows the
create path inserts, status ``available``, ids from ``vbs.ids``), each with a sparse 1 GiB file in the
pool as the storage agent would make it, while the controller runs (SQLite lets a second writer in
between its transactions). That is fair for what is measured at each level: describe reads those rows,
a create counts and sums them (quota and placement), the heartbeat lists and stats those files and a
reconciliation pass compares both; only the create workflows' own operation rows are missing for
them (describe does not read those, beyond an indexed lookup by volume id).

    .venv/bin/python bench/scale.py --quick     # 1k and 10k volumes, 1/5 disks, snapshots of 1 and 2 GiB
    .venv/bin/python bench/scale.py             # 1k, 10k and 100k; 1/5/20 disks; 1-64 GiB
    .venv/bin/python bench/scale.py --parts volumes --levels 1000,20000   # one curve only

Needs root for the xfs loop device and for dropping the page cache; processes are stopped by their
PID, the loop device is unmounted and the files removed at the end. matplotlib (``pip install -e
'.[bench]'``) draws ``docs/scale.png``; without it the table is still printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])

from bench.common import log, pct, text_table  # noqa: E402
from bench.control_api import BENCH_LIMITS, Api, VbsUp  # noqa: E402
from bench.control_plane import bench_snapshot, free_gib, git_revision, machine, workdir  # noqa: E402

from vbs import ids  # noqa: E402
from vbs.controller.db import Database, Volume  # noqa: E402
from vbs.controller.db.tables import utcnow  # noqa: E402
from vbs.host.hypervisors.qemu_disk_bus import DISK_BUSES  # noqa: E402
from vbs.rigs.testguest.guest import MAX_ROOT_PORTS  # noqa: E402

GIB = 1 << 30
PAGE = 1000
TARGET_CREATE_P50_MS, TARGET_CREATE_P99_MS = 10.0, 50.0
TARGET_PAGE_P50_MS, TARGET_PAGE_P99_MS = 50.0, 150.0
TARGET_RSS_MIB = 300.0
INSERT_BATCH = 2000


def load() -> float:
    return os.getloadavg()[0]


# -- the DB, filled ----------------------------------------------------------------------------------


def insert_volumes(db_path: Path, pool_dir: Path, like: dict[str, Any], count: int) -> float:
    """``count`` available 1 GiB volumes on ``like``'s node and pool: rows through VBS's DB layer, sparse
    files where the file backend keeps them. Seconds taken."""
    t0 = time.monotonic()
    db = Database(f"sqlite:///{db_path}")
    volumes_dir = pool_dir / "volumes"
    try:
        done = 0
        while done < count:
            batch = min(INSERT_BATCH, count - done)
            now = utcnow()
            rows = [Volume(id=ids.new_id("volume"), size_gib=1, volume_type=like["volume_type"],
                           placement="shared", storage_node=like["storage_node"], pool=like["pool"],
                           status="available", progress=100, tenant=like["tenant"], created_at=now, updated_at=now)
                    for _ in range(batch)]
            for row in rows:  # the file first: a row without its file would be a finding of its own
                with (volumes_dir / f"{row.id}.raw").open("wb") as fh:
                    fh.truncate(GIB)
            with db.session() as s:
                s.add_all(rows)
            done += batch
    finally:
        db.dispose()
    return time.monotonic() - t0


def api_fill(api: Api, count: int, threads: int = 8) -> float:
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: api.post("/v1/volumes", {"size_gib": 1}), range(count)))
    api.wait_none_creating(1800)
    return time.monotonic() - t0


def volume_count(db_path: Path) -> int:
    db = Database(f"sqlite:///{db_path}")
    try:
        from sqlalchemy import func, select

        with db.read() as s:
            return int(s.scalar(select(func.count()).select_from(Volume)) or 0)
    finally:
        db.dispose()


# -- one level -----------------------------------------------------------------------------------


def time_ms(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def creates(api: Api, n: int) -> list[float]:
    """``n`` sequential create POSTs (one client: the latency a user sees); their volumes stay."""
    return [time_ms(lambda: api.post("/v1/volumes", {"size_gib": 1})) for _ in range(n)]


def creates_during_passes(api: Api, endpoint: str, headers: dict[str, str], n: int) -> tuple[list[float], int]:
    """``n`` sequential creates while another client runs read-only reconciliation passes back to
    back: what a create meets when the controller's periodic pass falls among them. Returns their
    latencies and how many passes ran meanwhile."""
    stop = threading.Event()
    passes = 0

    def checking() -> None:
        nonlocal passes
        other = Api(endpoint, headers)
        try:
            while not stop.is_set():
                other.get("/v1/admin/check")
                passes += 1
        finally:
            other.close()

    worker = threading.Thread(target=checking, name="passes", daemon=True)
    worker.start()
    try:
        return creates(api, n), passes
    finally:
        stop.set()
        worker.join()


def describe_pages(api: Api, pages: int) -> list[float]:
    """Latency of ``pages`` full pages of 1,000: walks from the first page on, with the next tokens
    the API hands out, until enough were timed (keyset pages: a deep page costs what the first does)."""
    lat: list[float] = []
    token: str | None = None
    while len(lat) < pages:
        params: dict[str, Any] = {"max_results": PAGE}
        if token:
            params["next_token"] = token
        t = time.perf_counter()
        body = api.get("/v1/volumes", **params)
        ms = (time.perf_counter() - t) * 1000
        if len(body["volumes"]) == PAGE:
            lat.append(ms)
        token = body.get("next_token")
        if not token:
            token = None
            if len(body["volumes"]) < PAGE and not lat:
                raise RuntimeError("fewer than 1,000 volumes: no full page to time")
    return lat


def controller_pid(data_dir: Path) -> int:
    services = json.loads((data_dir / "up.json").read_text())
    services = services["services"] if isinstance(services, dict) else services
    return int(next(s["pid"] for s in services if s["role"] == "controller"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reconcile_passes(api: Api, rounds: int) -> tuple[list[float], int]:
    """``rounds`` read-only reconciliation passes (``GET /v1/admin/check``): ms each, findings of the last."""
    lat: list[float] = []
    findings = 0
    for _ in range(rounds):
        t = time.perf_counter()
        report = api.get("/v1/admin/check")
        lat.append((time.perf_counter() - t) * 1000)
        findings = len(report["findings"])
    if findings:  # what they are, in the log (a pass that met creates in flight, or a real mismatch)
        log(f"  findings of the last pass: {json.dumps(report['findings'])[:2000]}")
    return lat, findings


def run_levels(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    data_dir = work / "var"
    data_dir.mkdir(parents=True)
    up = VbsUp(data_dir, work / "vbs-up.log")
    out: list[dict[str, Any]] = []
    api: Api | None = None
    try:
        up.start()
        api = Api(up.endpoint, up.headers())
        pid = controller_pid(data_dir)
        log(f"volumes: vbs up on port {up.port}, controller pid {pid}")
        db_path = data_dir / "vbs.db"
        first = min(args.api_volumes, args.levels[0])
        api_s = api_fill(api, first)
        log(f"volumes: {first} volumes through the API in {api_s:.1f} s ({first / api_s:.0f}/s)")
        like = api.get("/v1/volumes", max_results=5)["volumes"][0]
        like = {**like, "tenant": tenant_of(db_path, like["volume_id"])}
        for level in args.levels:
            have = volume_count(db_path)
            if have < level:
                secs = insert_volumes(db_path, data_dir / "pool", like, level - have)
                log(f"volumes: {level - have} rows and files written in {secs:.1f} s")
            time.sleep(args.settle)  # a heartbeat or two with the new files, as in steady state
            rec: dict[str, Any] = {"volumes": volume_count(db_path), "load_before": load()}
            c = creates(api, args.creates)
            d = describe_pages(api, args.pages)
            r, findings = reconcile_passes(api, args.reconcile_rounds)
            during, passes = creates_during_passes(api, up.endpoint, up.headers(), max(args.creates // 2, 20))
            rec.update({
                "create_p50_ms": pct(c, 50), "create_p99_ms": pct(c, 99), "create_max_ms": max(c), "creates": len(c),
                "page_p50_ms": pct(d, 50), "page_p99_ms": pct(d, 99), "pages": len(d),
                "reconcile_ms": statistics.median(r), "reconcile_rounds": len(r), "findings": findings,
                "pass_create_p50_ms": pct(during, 50), "pass_create_p99_ms": pct(during, 99),
                "pass_create_max_ms": max(during), "pass_creates": len(during), "passes_during": passes,
                "rss_mib": rss_mib(pid), "load_after": load(),
            })
            log(f"volumes: {rec['volumes']}: create p50 {rec['create_p50_ms']:.1f} / p99 {rec['create_p99_ms']:.1f} "
                f"ms, page p50 {rec['page_p50_ms']:.1f} / p99 {rec['page_p99_ms']:.1f} ms, reconcile "
                f"{rec['reconcile_ms']:.0f} ms, RSS {rec['rss_mib']:.0f} MiB (load {rec['load_after']:.1f})")
            out.append(rec)
    finally:
        if api is not None:
            api.close()
        up.stop()
    return out


def tenant_of(db_path: Path, volume_id: str) -> str:
    db = Database(f"sqlite:///{db_path}")
    try:
        with db.read() as s:
            vol = s.get(Volume, volume_id)
            assert vol is not None
            return vol.tenant
    finally:
        db.dispose()


# -- attach with N disks in the VM --------------------------------------------------------------------


def run_attach(work: Path, args: argparse.Namespace, machine_type: str,
               bus: str = "virtio-blk") -> list[dict[str, Any]]:
    """Attach and detach latency of one more volume with N disks already in the guest, a ``pc`` or a
    ``q35`` guest (the latter with a PCIe root port for each of those disks and the probe), the disks on
    the QEMU driver's ``bus`` (``[host_agent.options.qemu] disk_bus``, through a ``VBS_CONFIG`` file)."""
    from bench.attach import HOST, VM, attach_once, attachment_state, detach_once, wait_for, wait_instance
    from tests.conftest import VbsUp as TestVbsUp

    from vbs.ids import virtio_serial
    from vbs.rigs.testguest import TestGuest, build_guest

    name = f"attach-{machine_type}-{bus}"
    data_dir = work / f"{name}-var"
    config = work / f"{name}.toml"
    config.write_text(f'[host_agent.options.qemu]\ndisk_bus = "{bus}"\n')
    up = TestVbsUp(data_dir, work / f"{name}-up.log", extra=["--export", "nbd", *BENCH_LIMITS],
                   env={"VBS_CONFIG": str(config)})
    ports = max(args.disks) + 1 if machine_type == "q35" else 0
    guest = TestGuest(VM, work / f"guest-{name}", build_guest(), data_dir / "vms", machine=machine_type,
                      root_ports=ports)
    out: list[dict[str, Any]] = []
    try:
        vbs = up.start()
        guest.start()
        boot = guest.wait_ready(180)
        wait_instance(vbs)
        log(f"attach ({machine_type}, {bus}): guest up in {boot:.1f} s")
        probe = vbs.create_volume(size_gib=1)["volume_id"]
        vbs.wait_volume(probe, "available")
        resident: list[str] = []
        for n in args.disks:
            while len(resident) < n:  # the probe takes vdb (the default device), these vdc, vdd, ...
                vid = vbs.create_volume(size_gib=1)["volume_id"]
                vbs.wait_volume(vid, "available")
                device = "vd" + chr(ord("c") + len(resident))
                r = vbs.http.post(f"/v1/volumes/{vid}/attach", json={"host": HOST, "vm_id": VM, "device": device})
                if r.status_code != 200:
                    raise RuntimeError(f"attach {vid} as {device}: {r.status_code} {r.text[:300]}")
                guest.wait_for_disk(virtio_serial(vid), 120)
                wait_for(lambda v=vid: attachment_state(vbs, v) == "attached", 60, "attachment attached")
                resident.append(vid)
            serial = virtio_serial(probe)
            attach_once(vbs, guest, probe, serial)  # warm-up at this level
            detach_once(vbs, guest, probe, serial)
            att, det = [], []
            for _ in range(args.attach_rounds):
                att.append(attach_once(vbs, guest, probe, serial).guest * 1000)
                det.append(detach_once(vbs, guest, probe, serial).guest * 1000)
            rec = {"machine": machine_type, "bus": bus, "disks": n, "attach_p50_ms": statistics.median(att),
                   "attach_max_ms": max(att), "detach_p50_ms": statistics.median(det), "rounds": len(att),
                   "load": load()}
            log(f"attach ({machine_type}, {bus}): {n} disks in the VM: attach p50 {rec['attach_p50_ms']:.0f} ms, "
                f"detach p50 {rec['detach_p50_ms']:.0f} ms (load {rec['load']:.1f})")
            out.append(rec)
    finally:
        guest.stop()
        up.stop()
    return out


# -- snapshot time vs size ------------------------------------------------------------------------------


def run_snapshots(work: Path, args: argparse.Namespace, *, reflink: bool) -> list[dict[str, Any]]:
    label = "reflink" if reflink else "copy"
    root = work / f"snap-{label}"
    root.mkdir()
    data_dir = root / "var"
    data_dir.mkdir()
    up = VbsUp(data_dir, root / "vbs-up.log")
    api: Api | None = None
    out: list[dict[str, Any]] = []
    dropped: list[bool] = []
    try:
        up.start()
        api = Api(up.endpoint, up.headers())
        method = api.clone_method()
        log(f"snapshots ({label}): clone method {method}")
        for size in args.sizes:
            need = size * (1 if reflink else 3) + 2
            if free_gib(data_dir) < need:
                log(f"snapshots ({label}): {size} GiB skipped, {free_gib(data_dir):.0f} GiB free, {need} needed")
                continue
            r = bench_snapshot(api, data_dir / "pool", size, not reflink, 1, dropped)
            rec = {"size_gib": size, "snapshot_s": r["snapshot_s"], "clone_s": r["clone_s"],
                   "write_mb_s": r["write_mb_s"], "verified": r["verified"], "clone_method": method, "load": load()}
            log(f"snapshots ({label}): {size} GiB: snapshot {rec['snapshot_s']:.3f} s (load {rec['load']:.1f})")
            out.append(rec)
    finally:
        if api is not None:
            api.close()
        up.stop()
    if dropped and not all(dropped):
        log("snapshots: the page cache could not be dropped (not root): copies may read from memory")
    return out


def slope_mb_s(points: list[dict[str, Any]]) -> float | None:
    """Throughput of the copy, from a least-squares line through (size, seconds): MiB/s."""
    if len(points) < 2:
        return None
    fit = statistics.linear_regression([p["size_gib"] * 1024 for p in points], [p["snapshot_s"] for p in points])
    return 1 / fit.slope if fit.slope > 0 else None


# -- report and plot -------------------------------------------------------------------------------


def during_passes(r: dict[str, Any]) -> str:
    if "pass_create_p50_ms" not in r:  # figures of a run before this was measured
        return "-"
    return (f"{r['pass_create_p50_ms']:.1f}/{r['pass_create_p99_ms']:.1f}/{r['pass_create_max_ms']:.0f} "
            f"({r['passes_during']} passes)")


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(res: dict[str, Any]) -> str:
    lines = ["# VBS scale curves", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in res["machine"].items()), ""]
    if res.get("volumes"):
        rows = [[f"{r['volumes']:,}", f"{r['create_p50_ms']:.1f}", f"{r['create_p99_ms']:.1f}",
                 f"{r['page_p50_ms']:.1f}", f"{r['page_p99_ms']:.1f}", f"{r['reconcile_ms']:.0f}",
                 str(r["findings"]), during_passes(r), f"{r['rss_mib']:.0f}",
                 f"{r['load_before']:.1f}/{r['load_after']:.1f}"]
                for r in res["volumes"]]
        lines += ["## Volumes in the DB (one storage node, one pool)", "",
                  text_table(["volumes", "create p50 ms", "create p99 ms", "page p50 ms", "page p99 ms",
                         "reconcile pass ms", "findings", "create p50/p99/max ms during passes",
                         "controller RSS MiB", "load before/after"], rows), "",
                  f"({res['volumes'][0]['creates']} sequential creates and {res['volumes'][0]['pages']} pages of "
                  f"{PAGE} a level; reconcile: median of {res['volumes'][0]['reconcile_rounds']} passes.)", ""]
        rows = []
        for r in res["volumes"]:
            rows.append([f"{r['volumes']:,}",
                         f"create p50 <= {TARGET_CREATE_P50_MS:g} / p99 <= {TARGET_CREATE_P99_MS:g} ms",
                         verdict(r["create_p50_ms"] <= TARGET_CREATE_P50_MS) + " / "
                         + verdict(r["create_p99_ms"] <= TARGET_CREATE_P99_MS)])
            rows.append([f"{r['volumes']:,}",
                         f"page p50 <= {TARGET_PAGE_P50_MS:g} / p99 <= {TARGET_PAGE_P99_MS:g} ms",
                         verdict(r["page_p50_ms"] <= TARGET_PAGE_P50_MS) + " / "
                         + verdict(r["page_p99_ms"] <= TARGET_PAGE_P99_MS)])
            rows.append([f"{r['volumes']:,}", f"controller RSS <= {TARGET_RSS_MIB:g} MiB",
                         verdict(r["rss_mib"] <= TARGET_RSS_MIB)])
        lines += [text_table(["volumes", "target", "verdict"], rows), ""]
    if res.get("attach"):
        rows = [[r.get("machine", "pc"), r.get("bus", "virtio-blk"), str(r["disks"]), f"{r['attach_p50_ms']:.0f}",
                 f"{r['attach_max_ms']:.0f}", f"{r['detach_p50_ms']:.0f}", str(r["rounds"]), f"{r['load']:.1f}"]
                for r in res["attach"]]
        lines += ["## Attach with N disks already in the VM (QEMU TCG, NBD; API call to the guest seeing it)", "",
                  text_table(["guest", "disk bus", "disks in the VM", "attach p50 ms", "attach max ms",
                              "detach p50 ms", "rounds", "load"], rows), ""]
    for label in ("copy", "reflink"):
        pts = res.get(f"snapshots_{label}") or []
        if not pts:
            continue
        rows = [[str(p["size_gib"]), f"{p['snapshot_s']:.3f}", f"{p['clone_s']:.3f}", f"{p['write_mb_s']:.0f}",
                 str(p["verified"]), f"{p['load']:.1f}"] for p in pts]
        slope = slope_mb_s(pts)
        lines += [f"## Snapshot of a volume full of data: {label} ({pts[0]['clone_method']})", "",
                  text_table(["GiB", "snapshot s", "create-from-snapshot s", "data written MB/s", "data verified",
                         "load"], rows), "",
                  f"Least-squares slope: {slope:.0f} MiB/s of volume copied" if slope
                  else "Slope: flat (or one point)", ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is missing (pip install -e '.[bench]'): no plot")
        return False
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    vols = res.get("volumes") or []
    x = [r["volumes"] for r in vols]

    def curve(ax: Any, ys: list[tuple[str, str]], title: str, ylabel: str, targets: list[float]) -> None:
        ax.set_title(title)
        if not vols:
            return
        for key, name in ys:
            ax.plot(x, [r[key] for r in vols], marker="o", label=name)
        for t in targets:
            ax.axhline(t, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("volumes in the DB")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)

    curve(axes[0][0], [("create_p50_ms", "p50"), ("create_p99_ms", "p99")], "create-volume POST", "ms",
          [TARGET_CREATE_P50_MS, TARGET_CREATE_P99_MS])
    curve(axes[0][1], [("page_p50_ms", "p50"), ("page_p99_ms", "p99")], "describe-volumes, page of 1,000", "ms",
          [TARGET_PAGE_P50_MS, TARGET_PAGE_P99_MS])
    curve(axes[0][2], [("rss_mib", "controller RSS")], "controller memory", "MiB", [TARGET_RSS_MIB])
    curve(axes[1][2], [("reconcile_ms", "one pass")], "reconciliation (volumes per storage node)", "ms", [])
    ax = axes[1][0]
    for machine_type, bus in [(m, b) for m in ("pc", "q35") for b in DISK_BUSES]:
        att = [r for r in res.get("attach") or []
               if r.get("machine", "pc") == machine_type and r.get("bus", "virtio-blk") == bus]
        if att:
            shown = machine_type if bus == "virtio-blk" else f"{machine_type}, {bus}"
            ax.plot([r["disks"] for r in att], [r["attach_p50_ms"] for r in att], marker="o",
                    label=f"attach p50 ({shown})")
            ax.plot([r["disks"] for r in att], [r["detach_p50_ms"] for r in att], marker="s",
                    label=f"detach p50 ({shown})")
    ax.set_title("attach with N disks already in the VM (TCG)")
    ax.set_xlabel("disks in the VM")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for label in ("copy", "reflink"):
        pts = res.get(f"snapshots_{label}") or []
        ax.plot([p["size_gib"] for p in pts], [p["snapshot_s"] for p in pts], marker="o", label=label)
    ax.set_title("snapshot time vs volume size (full of data)")
    ax.set_xlabel("GiB")
    ax.set_ylabel("s")
    ax.legend(fontsize=8)
    fig.suptitle(f"VBS scale curves ({res['machine'].get('git', '?')[:60]}; shared 2-core machine, "
                 f"load {res['machine'].get('load', '?')})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def guarded(part: str, run: Callable[[], list[dict[str, Any]]], res: dict[str, Any]) -> list[dict[str, Any]]:
    """One curve; a failure is reported and the other curves still run."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - the figures of the other parts are worth keeping
        log(f"{part}: FAILED {type(exc).__name__}: {exc}")
        res.setdefault("failed", []).append(f"{part}: {type(exc).__name__}: {exc}")
        return []


# -- main ------------------------------------------------------------------------------------------


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1k/10k volumes, 1/5 disks, 1-4 GiB snapshots")
    p.add_argument("--parts", default="volumes,attach,snapshots",
                   help="which curves: volumes, attach, snapshots (comma-separated)")
    p.add_argument("--levels", type=ints, default=None, help="volumes in the DB (default 1000,10000,100000)")
    p.add_argument("--api-volumes", type=int, default=1000, help="volumes made through the API first (1000)")
    p.add_argument("--creates", type=int, default=None, help="timed creates a level (default 300; --quick 100)")
    p.add_argument("--pages", type=int, default=None, help="timed pages a level (default 30; --quick 10)")
    p.add_argument("--reconcile-rounds", type=int, default=3, help="reconciliation passes a level (3)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds after filling, before timing (5)")
    p.add_argument("--disks", type=ints, default=None, help="disks already in the VM (default 1,5,20)")
    p.add_argument("--attach-machines", type=lambda t: t.split(","), default=["pc", "q35"],
                   help="the guest's machine types for the attach curve (default pc,q35)")
    p.add_argument("--disk-buses", type=lambda t: t.split(","), default=["virtio-blk"],
                   help="the QEMU driver's disk buses for the attach curve: virtio-blk (default), virtio-scsi")
    p.add_argument("--attach-rounds", type=int, default=None, help="attaches a level (default 5; --quick 3)")
    p.add_argument("--sizes", type=ints, default=None, help="snapshot sizes GiB (default 1,4,16,64; quick 1,2)")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp"), help="on the root ext4 (default /var/tmp)")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "scale.png", help="the PNG (docs/scale.png)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures to this file")
    p.add_argument("--from-json", type=Path, nargs="+", default=None,
                   help="measure nothing: report and plot these runs' figures (--json), merged in order")
    args = p.parse_args(argv)
    q = args.quick
    args.levels = args.levels or ([1000, 10000] if q else [1000, 10000, 100000])
    args.creates = args.creates or (100 if q else 300)
    args.pages = args.pages or (10 if q else 30)
    args.disks = args.disks or ([1, 5] if q else [1, 5, 20])
    args.attach_rounds = args.attach_rounds or (3 if q else 5)
    args.sizes = args.sizes or ([1, 2] if q else [1, 4, 16, 64])
    args.parts = set(args.parts.split(","))
    if not set(args.attach_machines) <= {"pc", "q35"}:
        p.error("--attach-machines: some of pc, q35")
    if not set(args.disk_buses) <= set(DISK_BUSES):
        p.error(f"--disk-buses: some of {', '.join(DISK_BUSES)}")
    if "q35" in args.attach_machines and max(args.disks) + 1 > MAX_ROOT_PORTS:
        p.error(f"--disks: a q35 guest takes at most {MAX_ROOT_PORTS - 1} disks besides the probe")
    return args


def replot(args: argparse.Namespace) -> int:
    """The report and plot of earlier runs (``--json``), the later file's curves replacing the earlier's."""
    res: dict[str, Any] = {}
    for path in args.from_json:
        figures = json.loads(path.read_text())
        machine_info = {**res.get("machine", {}), **figures.pop("machine", {})}
        res.update({k: v for k, v in figures.items() if v})
        res["machine"] = machine_info
    print(report(res))
    if plot(res, args.plot):
        print(f"\nplot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return replot(args)
    info = machine()
    info["git"] = git_revision()
    res: dict[str, Any] = {"machine": info}
    loads: list[float] = [load()]
    t0 = time.monotonic()
    with workdir(args.work_dir) as work:
        for part, run in (("volumes", lambda: run_levels(work / "levels", args)),
                          ("attach", lambda: [rec for m in args.attach_machines for b in args.disk_buses
                                              for rec in guarded(f"attach ({m}, {b})",
                                                                 partial(run_attach, work, args, m, b),
                                                                 res)]),
                          ("snapshots", lambda: run_snapshots(work, args, reflink=False))):
            if part in args.parts:
                res[part if part != "snapshots" else "snapshots_copy"] = guarded(part, run, res)
                loads.append(load())
        if "snapshots" in args.parts and os.geteuid() == 0:
            from tests.loopfs import loop_filesystem

            with loop_filesystem(work, "xfs", size_mib=(max(args.sizes) + 8) * 1024) as mnt:
                res["snapshots_reflink"] = guarded(
                    "snapshots (reflink)", lambda: run_snapshots(mnt, args, reflink=True), res)
            loads.append(load())
    info["load"] = f"{min(loads):.1f}-{max(loads):.1f}"
    info["run"] = f"{(time.monotonic() - t0) / 60:.1f} min"
    print(report(res))
    for failure in res.get("failed", []):
        print(f"FAILED: {failure}")
    if plot(res, args.plot):
        print(f"\nplot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
