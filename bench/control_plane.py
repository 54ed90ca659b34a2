#!/usr/bin/env python3
"""Control-plane benchmark of VBS: prints figures (it is not a test).

For each pool -- the ext4 root (the copy path) and a loop-mounted xfs with reflink -- it starts
``vbs up`` as a child process on a free port and measures, through the REST API:

1. create-volume: API latency of the POST and volumes/s, sequential and with concurrent clients;
2. describe-volumes: one page of 1,000 with many volumes in the database;
3. snapshot and create-from-snapshot of volumes full of data, and (copy path) ``cp`` on the same file.

Needs root for the loop device and to drop the page cache. Everything it makes (processes, mounts,
files) is removed at the end; processes are stopped by their PID, never by name.

    .venv/bin/python bench/control_plane.py            # the full run (several minutes)
    .venv/bin/python bench/control_plane.py --quick    # a short run
    .venv/bin/python bench/control_plane.py --backend rbd   # snapshot/clone on RBD (bench/rbd_control.py)
    .venv/bin/python bench/control_plane.py --completion --quick  # snapshot seen completed: long-poll vs polling
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import drop_caches, log, pct, text_table  # noqa: E402
from bench.control_api import (  # noqa: E402
    POLL_S,
    Api,
    VbsUp,
    concurrent_creates,
    server_ms,
)
from tests.loopfs import loop_filesystem  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
WRITE_CHUNK = 64 * MIB
MARGIN_GIB = 4  # left free on the host filesystem whatever happens
XFS_MIN_IMAGE_GIB = 40

# Targets, and OpenStack Cinder's published Rally averages (create-and-wait, snapshot-and-wait).
TARGET_CREATE_P50_MS = 10.0
TARGET_CREATE_P99_MS = 50.0
TARGET_DESCRIBE_PAGE_P50_MS = 50.0
TARGET_DESCRIBE_PAGE_P99_MS = 150.0
TARGET_REFLINK_SNAPSHOT_MS = 100.0
TARGET_COPY_VS_CP = 0.80
CINDER_CREATE_S = 3.4
CINDER_SNAPSHOT_S = 3.0



# -- small helpers ---------------------------------------------------------------------------------


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "?"
    target = str(path.resolve())
    with open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / GIB


def cpu_speed_ms(rounds: int = 5) -> float:
    """How fast one core runs Python right now: the median ms of a fixed loop (1,000,000 additions).
    The shared machine's speed changes by half within a day; figures of runs far apart compare only
    after dividing by this."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def machine() -> dict[str, str]:
    info = {"cpus": str(os.cpu_count()), "kernel": platform.release(), "python": platform.python_version(),
            "python_loop_ms": f"{cpu_speed_ms():.1f}"}
    with contextlib.suppress(OSError):
        info["debian"] = Path("/etc/debian_version").read_text().strip()
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = f"{int(line.split()[1]) / (1 << 20):.1f}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    return info


def git_revision() -> str:
    """HEAD and how many files differ from it (the benchmark measures the working tree)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"],  # noqa: S603,S607
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],  # noqa: S603,S607
                               capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return f"{head[:70]}" + (f" + {len(dirty)} uncommitted file(s)" if dirty else "")


# -- the measurements ------------------------------------------------------------------------------


def bench_create_sequential(api: Api, n: int) -> dict[str, Any]:
    lat: list[float] = []
    t0 = time.monotonic()
    for _ in range(n):
        t = time.perf_counter()
        api.post("/v1/volumes", {"size_gib": 1})
        lat.append((time.perf_counter() - t) * 1000)
    t_accepted = time.monotonic()
    t_available = api.wait_none_creating(600)
    return {
        "n": n, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "mean_ms": statistics.fmean(lat),
        "max_ms": max(lat),
        "accepted_per_s": n / (t_accepted - t0), "available_per_s": n / (t_available - t0),
        "available_after_s": t_available - t0,
    }


def bench_create_concurrent(api: Api, n: int, threads: int) -> dict[str, Any]:
    t0 = time.monotonic()
    lat = concurrent_creates([api], n, threads)
    t_accepted = time.monotonic()
    t_available = api.wait_none_creating(600)
    return {
        "n": n, "threads": threads, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
        "accepted_per_s": n / (t_accepted - t0), "available_per_s": n / (t_available - t0),
    }


def bench_create_and_wait(api: Api, n: int, db: Path) -> dict[str, Any]:
    """Rally-style ``create_volume``: POST and poll until available, one at a time."""
    times: list[float] = []
    posts: list[float] = []
    vids: list[str] = []
    for _ in range(n):
        t0 = time.monotonic()
        vol = api.post("/v1/volumes", {"size_gib": 1})
        posts.append((time.monotonic() - t0) * 1000)
        t1, _ = api.wait_status(f"/v1/volumes/{vol['volume_id']}", "available", 60)
        times.append((t1 - t0) * 1000)
        vids.append(vol["volume_id"])
    server = [ms for ms in (server_ms(db, v) for v in vids) if ms is not None]
    return {"n": n, "p50_ms": pct(times, 50), "p99_ms": pct(times, 99), "mean_ms": statistics.fmean(times),
            "post_p50_ms": pct(posts, 50), "server_p50_ms": pct(server, 50) if server else None}


def fill_volumes(api: Api, total: int, threads: int) -> dict[str, Any]:
    have = api.count_volumes()
    missing = max(0, total - have)
    t0 = time.monotonic()
    if missing:
        log(f"  inserting {missing} more volumes ({threads} client threads) to reach {total}")
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: api.post("/v1/volumes", {"size_gib": 1}), range(missing)))
        api.wait_none_creating(3600)
    return {"inserted": missing, "seconds": time.monotonic() - t0, "total": api.count_volumes()}


def bench_describe(api: Api, walks: int) -> dict[str, Any]:
    lat: list[float] = []
    sizes: list[int] = []
    pages = 0
    for _ in range(walks):
        token = None
        while True:
            params: dict[str, Any] = {"max_results": 1000}
            if token:
                params["next_token"] = token
            t = time.perf_counter()
            resp = api.http.get("/v1/volumes", params=params)
            body = resp.json()
            lat.append((time.perf_counter() - t) * 1000)
            if resp.status_code != 200:
                raise RuntimeError(f"describe-volumes: HTTP {resp.status_code} {resp.text[:300]}")
            sizes.append(len(resp.content))
            pages += 1
            token = body.get("next_token")
            if not token:
                break
    full = [ms for ms, size in zip(lat, sizes, strict=True) if size == max(sizes)] or lat
    return {
        "walks": walks, "pages": pages, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": max(lat),
        "full_page_p50_ms": pct(full, 50), "page_kib": max(sizes) / 1024,
    }


def write_pattern(path: Path, size: int) -> float:
    """Fill ``path`` with non-zero data in large sequential writes, then fsync; returns MB/s."""
    block = bytearray(os.urandom(WRITE_CHUNK))
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    t0 = time.monotonic()
    try:
        off = 0
        while off < size:
            n = min(WRITE_CHUNK, size - off)
            block[:16] = off.to_bytes(16, "little")  # every chunk differs
            view = memoryview(block)[:n]
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], off + done)
            off += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return size / MIB / (time.monotonic() - t0)


def sample_digest(path: Path, size: int, samples: int = 16) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for i in range(samples):
            h.update(os.pread(fd, MIB, (size - MIB) * i // (samples - 1)))
    finally:
        os.close(fd)
    return h.hexdigest()


def wait_gone(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while path.exists() or path.with_name(path.name + ".partial").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} still there after {timeout:g}s")
        time.sleep(POLL_S)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def _cp(src: Path, dst: Path, *flags: str) -> float:
    return timed(lambda: subprocess.run(["cp", *flags, str(src), str(dst)], check=True))  # noqa: S603 - argv list


def snapshot_round(api: Api, pool_dir: Path, vid: str, size: int, digest: str, copy_path: bool,
                   cache_dropped: list[bool]) -> dict[str, Any]:
    """One snapshot, one create-from-snapshot, then cp of the same volume file; all removed again."""
    vols, snaps = pool_dir / "volumes", pool_dir / "snapshots"
    src = vols / f"{vid}.raw"
    out: dict[str, Any] = {}
    cache_dropped.append(drop_caches())
    t0 = time.monotonic()
    snap = api.post("/v1/snapshots", {"volume_id": vid})
    out["snapshot_post_ms"] = (time.monotonic() - t0) * 1000
    sid = snap["snapshot_id"]
    t1, _ = api.wait_status(f"/v1/snapshots/{sid}", "completed", 3600)
    out["snapshot_s"] = t1 - t0

    cache_dropped.append(drop_caches())
    t0 = time.monotonic()
    clone = api.post("/v1/volumes", {"snapshot_id": sid})
    cid = clone["volume_id"]
    t1, _ = api.wait_status(f"/v1/volumes/{cid}", "available", 3600)
    out["clone_s"] = t1 - t0
    out["verified"] = (sample_digest(snaps / f"{sid}.raw", size) == digest
                       and sample_digest(vols / f"{cid}.raw", size) == digest)

    # Make room for cp's copy first (the clone is not needed any more).
    api.delete(f"/v1/volumes/{cid}")
    wait_gone(vols / f"{cid}.raw")
    dst = pool_dir / f"cp-{vid}.raw"
    try:
        if copy_path:
            cache_dropped.append(drop_caches())
            out["cp_s"] = _cp(src, dst, "--sparse=always")
            fd = os.open(dst, os.O_RDONLY | os.O_CLOEXEC)
            try:
                out["cp_fsync_s"] = out["cp_s"] + timed(lambda: os.fsync(fd))
            finally:
                os.close(fd)
        else:
            out["cp_reflink_ms"] = 1000 * _cp(src, dst, "--reflink=always")
    finally:
        dst.unlink(missing_ok=True)
    api.delete(f"/v1/snapshots/{sid}")
    wait_gone(snaps / f"{sid}.raw")
    db = pool_dir.parent / "vbs.db"
    out["snapshot_server_ms"], out["clone_server_ms"] = server_ms(db, sid), server_ms(db, cid)
    return out


def bench_snapshot(api: Api, pool_dir: Path, size_gib: int, copy_path: bool, rounds: int,
                   cache_dropped: list[bool]) -> dict[str, Any]:
    """Snapshot and create-from-snapshot of a volume full of data, ``rounds`` times: medians and spread."""
    size = size_gib * GIB
    vol = api.post("/v1/volumes", {"size_gib": size_gib})
    vid = vol["volume_id"]
    api.wait_status(f"/v1/volumes/{vid}", "available", 60)
    src = pool_dir / "volumes" / f"{vid}.raw"
    log(f"  writing {size_gib} GiB of non-zero data into {src.name}")
    out: dict[str, Any] = {"size_gib": size_gib, "rounds": rounds, "write_mb_s": write_pattern(src, size)}
    digest = sample_digest(src, size)
    runs = []
    for i in range(rounds):
        run = snapshot_round(api, pool_dir, vid, size, digest, copy_path, cache_dropped)
        runs.append(run)
        log(f"  round {i + 1}/{rounds}: snapshot {run['snapshot_s']:.3f} s, create-from-snapshot "
            f"{run['clone_s']:.3f} s" + (f", cp {run['cp_s']:.3f} s" if "cp_s" in run else "")
            + f" (load {os.getloadavg()[0]:.1f})")
    api.delete(f"/v1/volumes/{vid}")
    wait_gone(src)
    out["runs"] = runs
    out["verified"] = all(r["verified"] for r in runs)
    for key in ("snapshot_s", "clone_s", "snapshot_post_ms", "snapshot_server_ms", "clone_server_ms", "cp_s",
                "cp_fsync_s", "cp_reflink_ms"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
            out[key + "_min"], out[key + "_max"] = min(values), max(values)
    mb = size / MIB
    out["snapshot_mb_s"] = mb / out["snapshot_s"]
    out["clone_mb_s"] = mb / out["clone_s"]
    if "cp_s" in out:
        out["cp_mb_s"] = mb / out["cp_s"]
        out["cp_fsync_mb_s"] = mb / out["cp_fsync_s"]
        # Ratios of the medians, and per round (same data, back to back) for the spread.
        out["snapshot_vs_cp"] = out["cp_s"] / out["snapshot_s"]
        out["clone_vs_cp"] = out["cp_s"] / out["clone_s"]
        out["snapshot_vs_cp_fsync"] = out["cp_fsync_s"] / out["snapshot_s"]
        out["clone_vs_cp_fsync"] = out["cp_fsync_s"] / out["clone_s"]
        out["snapshot_vs_cp_rounds"] = [r["cp_s"] / r["snapshot_s"] for r in runs]
        out["clone_vs_cp_rounds"] = [r["cp_s"] / r["clone_s"] for r in runs]
    return out


# -- a whole pool ----------------------------------------------------------------------------------


def plan_size(want_gib: int, pool_root: Path, copy_path: bool, room_gib: float | None = None) -> tuple[int, str]:
    """The size to run for ``want_gib`` given the free space (0 = skip), and a message if scaled."""
    free = free_gib(pool_root) if room_gib is None else room_gib
    factor = 3 if copy_path else 1  # volume + snapshot + (clone or cp's copy) on ext4; reflinks share
    fits = int((free - MARGIN_GIB) // factor)
    if fits >= want_gib:
        return want_gib, ""
    if fits >= 1:
        return fits, (f"only {free:.1f} GiB free on {pool_root}: the {want_gib} GiB case is scaled down to "
                      f"{fits} GiB (needs about {factor} x {want_gib} + {MARGIN_GIB} GiB)")
    return 0, f"only {free:.1f} GiB free on {pool_root}: the {want_gib} GiB case is skipped"


def run_pool(label: str, root: Path, args: argparse.Namespace, *, copy_path: bool,
             room_gib: float | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"label": label, "fs": fs_type(root), "notes": []}
    data_dir = root / "var"
    data_dir.mkdir(parents=True, exist_ok=True)
    up = VbsUp(data_dir, root / "vbs-up.log")
    api: Api | None = None
    try:
        synced = time.monotonic()
        os.sync()  # the pool before's copies are not written back while this one's creates fsync
        log(f"{label}: starting vbs up in {data_dir} (fs {res['fs']}; sync took {time.monotonic() - synced:.1f} s)")
        up.start()
        api = Api(up.endpoint, up.headers())
        res["clone_method"] = api.clone_method()
        log(f"{label}: up on port {up.port}, clone method {res['clone_method']}")

        log(f"{label}: create-volume x{args.creates}, sequential")
        res["create_seq"] = bench_create_sequential(api, args.creates)
        log(f"{label}: create-volume x{args.creates}, {args.threads} threads")
        res["create_conc"] = bench_create_concurrent(api, args.creates, args.threads)
        log(f"{label}: create-and-wait x{args.create_wait}")
        res["create_wait"] = bench_create_and_wait(api, args.create_wait, data_dir / "vbs.db")

        res["fill"] = fill_volumes(api, args.describe_volumes, args.threads)
        log(f"{label}: describe-volumes over {res['fill']['total']} volumes, {args.describe_walks} walks")
        res["describe"] = bench_describe(api, args.describe_walks)

        res["snapshots"] = []
        cache_dropped: list[bool] = []
        for want in args.sizes:
            size, note = plan_size(want, root, copy_path, room_gib)
            if note:
                log(f"{label}: {note}")
                res["notes"].append(note)
            if size == 0:
                continue
            log(f"{label}: snapshot and clone of a full {size} GiB volume")
            res["snapshots"].append(bench_snapshot(api, data_dir / "pool", size, copy_path, args.copy_rounds,
                                                   cache_dropped))
        if cache_dropped:
            res["cache_dropped"] = all(cache_dropped)
    except Exception as exc:  # report what was measured, and why the rest is missing
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{label}: FAILED: {res['error']}\n--- vbs up log (tail) ---\n{up.log_tail()}")
    finally:
        if api is not None:
            api.close()
        up.stop()
        res["vbs_up_restarts"] = up.log_tail(100000).count("restarting")
    return res


# -- report ----------------------------------------------------------------------------------------


def fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:  # NaN
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "MISSED")


def report(results: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, str]) -> str:
    lines: list[str] = []
    lines.append("VBS control-plane benchmark")
    lines.append(f"machine: {info.get('cpus')} CPUs ({info.get('cpu', '?')}), {info.get('memory_gib', '?')} GiB RAM, "
                 f"Debian {info.get('debian', '?')}, kernel {info.get('kernel')}, Python {info.get('python')}")
    lines.append(f"code: {info.get('git', '?')}")
    lines.append(f"run: {args.creates} creates, {args.threads} client threads, {args.describe_volumes} volumes "
                 f"for describe ({args.describe_walks} walks), snapshot sizes "
                 f"{' and '.join(f'{s} GiB' for s in args.sizes) or 'none'} ({args.copy_rounds} round(s) each)")
    if info.get("load"):
        lines.append(f"1-min load average during the run: {info['load']} (2 = both CPUs busy; other work on the "
                     "machine inflates latencies)")
    for r in results:
        cache = ("dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before each copy" if r.get("cache_dropped")
                 else "NOT dropped (not root?)" if "cache_dropped" in r else "n/a")
        lines.append(f"pool {r['label']}: fs {r['fs']}, clone method {r.get('clone_method', '?')}; page cache {cache}")
        for note in r["notes"]:
            lines.append(f"  note: {note}")
        if r.get("vbs_up_restarts"):
            lines.append(f"  note: vbs up restarted a crashed child {r['vbs_up_restarts']} time(s) during the run")
        if r.get("error"):
            lines.append(f"  FAILED (figures below are partial): {r['error'][:500]}")
    lines.append("")
    cols = [r["label"] for r in results]

    def row(name: str, get: Callable[[dict[str, Any]], Any], spec: str = ".1f") -> list[str]:
        vals = []
        for r in results:
            try:
                vals.append(fmt(get(r), spec))
            except (KeyError, IndexError, TypeError):
                vals.append("-")
        return [name, *vals]

    lines.append("1. create-volume (1 GiB, POST latency and rates)")
    rows = [
        row(f"sequential: POST p50 ms (n={args.creates})", lambda r: r["create_seq"]["p50_ms"], ".2f"),
        row("sequential: POST p99 ms", lambda r: r["create_seq"]["p99_ms"], ".2f"),
        row("sequential: accepted volumes/s", lambda r: r["create_seq"]["accepted_per_s"]),
        row("sequential: available volumes/s", lambda r: r["create_seq"]["available_per_s"]),
        row(f"{args.threads} threads: POST p50 ms", lambda r: r["create_conc"]["p50_ms"], ".2f"),
        row(f"{args.threads} threads: POST p99 ms", lambda r: r["create_conc"]["p99_ms"], ".2f"),
        row(f"{args.threads} threads: accepted volumes/s", lambda r: r["create_conc"]["accepted_per_s"]),
        row(f"{args.threads} threads: available volumes/s", lambda r: r["create_conc"]["available_per_s"]),
        row(f"create+wait available p50 ms (n={args.create_wait})", lambda r: r["create_wait"]["p50_ms"]),
        row("create+wait available mean ms", lambda r: r["create_wait"]["mean_ms"]),
        row("create+wait: POST p50 ms (idle controller)", lambda r: r["create_wait"]["post_p50_ms"], ".2f"),
        row("create+wait: server-side p50 ms (DB times)", lambda r: r["create_wait"]["server_p50_ms"]),
    ]
    lines.append(text_table(["metric", *cols], rows))
    lines.append("")
    lines.append("2. describe-volumes (GET /v1/volumes?max_results=1000, all pages walked)")
    rows = [
        row("volumes in the DB", lambda r: r["fill"]["total"], "d"),
        row("pages timed", lambda r: r["describe"]["pages"], "d"),
        row("page p50 ms", lambda r: r["describe"]["p50_ms"]),
        row("page p99 ms", lambda r: r["describe"]["p99_ms"]),
        row("page of 1000: size KiB", lambda r: r["describe"]["page_kib"], ".0f"),
    ]
    lines.append(text_table(["metric", *cols], rows))
    lines.append("")
    lines.append("3. snapshot / create-from-snapshot of a volume full of data (POST until completed/available, "
                 "polled every 50 ms; page cache dropped before each copy)")
    sizes = sorted({s["size_gib"] for r in results for s in r.get("snapshots", [])})
    rows = []
    for size in sizes:
        def snap(r: dict[str, Any], key: str, size: int = size) -> Any:
            return next(s[key] for s in r["snapshots"] if s["size_gib"] == size)

        def spread(r: dict[str, Any], key: str, size: int = size, spec: str = ".3f") -> str:
            return f"{snap(r, key + '_min', size):{spec}}-{snap(r, key + '_max', size):{spec}}"

        rows += [
            row(f"{size} GiB: data written MB/s (fsync)", lambda r, s=size: snap(r, "write_mb_s", s), ".0f"),
            row(f"{size} GiB: rounds (medians below)", lambda r, s=size: snap(r, "rounds", s), "d"),
            row(f"{size} GiB: snapshot POST ms", lambda r, s=size: snap(r, "snapshot_post_ms", s), ".1f"),
            row(f"{size} GiB: snapshot s", lambda r, s=size: snap(r, "snapshot_s", s), ".3f"),
            row(f"{size} GiB:   min-max s", lambda r, s=size: spread(r, "snapshot_s", s), ""),
            row(f"{size} GiB:   server-side ms (DB times)", lambda r, s=size: snap(r, "snapshot_server_ms", s), ".0f"),
            row(f"{size} GiB: create-from-snapshot s", lambda r, s=size: snap(r, "clone_s", s), ".3f"),
            row(f"{size} GiB:   min-max s", lambda r, s=size: spread(r, "clone_s", s), ""),
            row(f"{size} GiB:   server-side ms (DB times)", lambda r, s=size: snap(r, "clone_server_ms", s), ".0f"),
            row(f"{size} GiB: snapshot MB/s", lambda r, s=size: snap(r, "snapshot_mb_s", s), ".0f"),
            row(f"{size} GiB: create-from-snapshot MB/s", lambda r, s=size: snap(r, "clone_mb_s", s), ".0f"),
            row(f"{size} GiB: cp --sparse=always s", lambda r, s=size: snap(r, "cp_s", s), ".3f"),
            row(f"{size} GiB:   min-max s", lambda r, s=size: spread(r, "cp_s", s), ""),
            row(f"{size} GiB: cp --sparse=always MB/s", lambda r, s=size: snap(r, "cp_mb_s", s), ".0f"),
            row(f"{size} GiB: cp + fsync MB/s", lambda r, s=size: snap(r, "cp_fsync_mb_s", s), ".0f"),
            row(f"{size} GiB: snapshot / cp throughput", lambda r, s=size: snap(r, "snapshot_vs_cp", s), ".0%"),
            row(f"{size} GiB:   per round", lambda r, s=size: " ".join(
                f"{x:.0%}" for x in snap(r, "snapshot_vs_cp_rounds", s)), ""),
            row(f"{size} GiB: create-from-snap / cp", lambda r, s=size: snap(r, "clone_vs_cp", s), ".0%"),
            row(f"{size} GiB:   per round", lambda r, s=size: " ".join(
                f"{x:.0%}" for x in snap(r, "clone_vs_cp_rounds", s)), ""),
            row(f"{size} GiB: snapshot / (cp + fsync)", lambda r, s=size: snap(r, "snapshot_vs_cp_fsync", s), ".0%"),
            row(f"{size} GiB: create-from-snap / (cp + fsync)", lambda r, s=size: snap(r, "clone_vs_cp_fsync", s),
                ".0%"),
            row(f"{size} GiB: cp --reflink=always ms", lambda r, s=size: snap(r, "cp_reflink_ms", s), ".1f"),
            row(f"{size} GiB:   min-max ms", lambda r, s=size: spread(r, "cp_reflink_ms", s, ".1f"), ""),
            row(f"{size} GiB: data verified (16 samples)", lambda r, s=size: snap(r, "verified", s), ""),
        ]
    lines.append(text_table(["metric", *cols], rows) if rows else "(not run)")
    lines.append("")
    lines.append("Targets")
    lines.append(text_table(["target", "pool", "figure", "verdict"], targets(results)))
    lines.append("")
    lines.append("Compared with OpenStack Cinder's published Rally averages (create 3.4 s, snapshot 3.0 s, both "
                 "until available)")
    rows = []
    for r in results:
        cw = r.get("create_wait", {}).get("mean_ms")
        if cw:
            rows.append([r["label"], "create+wait (mean)", f"{cw:.1f} ms", ratio_text(CINDER_CREATE_S, cw / 1000)])
        for s in r.get("snapshots", []):
            rows.append([r["label"], f"snapshot of a full {s['size_gib']} GiB", f"{s['snapshot_s'] * 1000:.0f} ms",
                         ratio_text(CINDER_SNAPSHOT_S, s["snapshot_s"])])
    lines.append(text_table(["pool", "operation", "VBS", "vs Cinder"], rows))
    return "\n".join(lines)


def ratio_text(theirs_s: float, ours_s: float) -> str:
    return f"{theirs_s / ours_s:.1f}x faster" if ours_s <= theirs_s else f"{ours_s / theirs_s:.1f}x slower"


def targets(results: list[dict[str, Any]]) -> list[list[str]]:
    rows: list[list[str]] = []
    for r in results:
        if "create_seq" in r:
            p50, p99 = r["create_seq"]["p50_ms"], r["create_seq"]["p99_ms"]
            rows.append([f"create POST p50 <= {TARGET_CREATE_P50_MS:g} ms, p99 <= {TARGET_CREATE_P99_MS:g} ms "
                         "(sequential)", r["label"], f"{p50:.2f} / {p99:.2f} ms",
                         verdict(p50 <= TARGET_CREATE_P50_MS) + (
                             "" if p99 <= TARGET_CREATE_P99_MS else " (p99 over)")])
    for r in results:
        if "describe" in r:
            d = r["describe"]
            rows.append([f"describe page p50 <= {TARGET_DESCRIBE_PAGE_P50_MS:g} ms, p99 <= "
                         f"{TARGET_DESCRIBE_PAGE_P99_MS:g} ms", r["label"], f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f} ms",
                         verdict(d["p50_ms"] <= TARGET_DESCRIBE_PAGE_P50_MS) + (
                             "" if d["p99_ms"] <= TARGET_DESCRIBE_PAGE_P99_MS else " (p99 over)")])
    for r in results:
        if r.get("clone_method") == "reflink":
            for s in r.get("snapshots", []):
                ms = s["snapshot_s"] * 1000
                rows.append([f"reflink snapshot of {s['size_gib']} GiB < {TARGET_REFLINK_SNAPSHOT_MS:g} ms",
                             r["label"], f"{ms:.0f} ms (server-side {fmt(s.get('snapshot_server_ms'), '.0f')} ms; "
                             f"clone {s['clone_s'] * 1000:.0f} ms)",
                             verdict(ms < TARGET_REFLINK_SNAPSHOT_MS) if s["size_gib"] >= 16
                             else "(target is for 16 GiB)"])
    for r in results:
        for s in r.get("snapshots", []):
            if "snapshot_vs_cp" in s:
                worst = min(s["snapshot_vs_cp"], s["clone_vs_cp"])
                rows.append([f"copy >= {TARGET_COPY_VS_CP:.0%} of cp ({s['size_gib']} GiB)", r["label"],
                             f"snapshot {s['snapshot_vs_cp']:.0%}, clone {s['clone_vs_cp']:.0%}",
                             verdict(worst >= TARGET_COPY_VS_CP)])
                durable = min(s["snapshot_vs_cp_fsync"], s["clone_vs_cp_fsync"])
                rows.append([f"  same, against cp + fsync ({s['size_gib']} GiB)", r["label"],
                             f"snapshot {s['snapshot_vs_cp_fsync']:.0%}, clone {s['clone_vs_cp_fsync']:.0%}",
                             verdict(durable >= TARGET_COPY_VS_CP)])
    return rows


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a short run: 100 creates, 1,000 volumes for describe, 1 GiB only")
    p.add_argument("--sizes", default=None,
                   help="volume sizes in GiB for snapshot/clone (default 1,16; 0 skips that part)")
    p.add_argument("--creates", type=int, default=None, help="volumes per create run (default 1000)")
    p.add_argument("--threads", type=int, default=8, help="client threads for the concurrent runs (default 8)")
    p.add_argument("--create-wait", type=int, default=None, help="create-and-wait samples (default 50)")
    p.add_argument("--describe-volumes", type=int, default=None, help="volumes in the DB for describe (default 10000)")
    p.add_argument("--describe-walks", type=int, default=None, help="walks through all pages (default 5)")
    p.add_argument("--copy-rounds", type=int, default=None,
                   help="snapshot/clone/cp rounds per size, medians reported (default 3; --quick 1)")
    p.add_argument("--skip-xfs", action="store_true", help="only the ext4 (copy) pool")
    p.add_argument("--skip-ext4", action="store_true", help="only the xfs (reflink) pool")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp"),
                   help="where the temporary pools go; must be on the root ext4 (default /var/tmp)")
    p.add_argument("--xfs-image-gib", type=int, default=XFS_MIN_IMAGE_GIB, help="sparse xfs image size (default 40)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures to this file")
    p.add_argument("--cluster", action="store_true",
                   help="only the cluster mode: creates through 1 and 2 controllers on PostgreSQL vs 1 on SQLite")
    p.add_argument("--backend", choices=("file", "rbd"), default="file",
                   help="rbd: only snapshot/clone on the rbd backend, on a Ceph this starts (bench/rbd_control.py)")
    p.add_argument("--rbd-sizes", default="1,4,16", help="rbd: volume sizes in GiB (default 1,4,16)")
    p.add_argument("--rbd-rounds", type=int, default=None, help="rbd: rounds per size (default 30; --quick 5)")
    p.add_argument("--completion", action="store_true",
                   help="only: a 16 GiB reflink snapshot seen completed, long-poll vs 50 ms polling "
                        "(bench/completion_mode.py)")
    p.add_argument("--completion-rounds", type=int, default=None, help="completion: rounds per mode "
                                                                       "(default 30; --quick 10)")
    p.add_argument("--rbd-data-mib", type=int, default=256, help="rbd: MiB written over each volume (default 256)")
    p.add_argument("--rbd-snapshot-store", default=None, metavar="SPEC",
                   help="rbd: the storage agent's --snapshot-store (default: its dir store; 'none': snapshots stay "
                        "in the pool, so 'completed' is the pool's snapshot, as before the snapshot store)")
    args = p.parse_args(argv)
    quick = args.quick
    args.rbd_sizes = [int(s) for s in args.rbd_sizes.split(",") if s.strip() and int(s) > 0]
    args.rbd_rounds = args.rbd_rounds if args.rbd_rounds is not None else (5 if quick else 30)
    args.completion_rounds = args.completion_rounds if args.completion_rounds is not None else (10 if quick else 30)
    args.sizes = [int(s) for s in (args.sizes or ("1" if quick else "1,16")).split(",") if s.strip() and int(s) > 0]
    args.creates = args.creates if args.creates is not None else (100 if quick else 1000)
    args.create_wait = args.create_wait if args.create_wait is not None else (20 if quick else 50)
    args.describe_volumes = args.describe_volumes if args.describe_volumes is not None else (
        1000 if quick else 10000)
    args.copy_rounds = args.copy_rounds if args.copy_rounds is not None else (1 if quick else 3)
    args.describe_walks = args.describe_walks if args.describe_walks is not None else (2 if quick else 5)
    return args


@contextlib.contextmanager
def workdir(parent: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vbs-bench-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)



def finish_mode(args: argparse.Namespace, info: dict[str, Any], loads: list[float], sampling: threading.Event,
                name: str, figures: Any, report: str) -> int:
    """The end of a mode run by its own module: the machine (with the load seen), its report, the json."""
    sampling.set()
    if loads:
        info["load"] = f"min {min(loads):.1f}, median {statistics.median(loads):.1f}, max {max(loads):.1f}"
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    print(report)
    if args.json:
        args.json.write_text(json.dumps({"machine": info, name: figures}, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine()
    root_user = os.geteuid() == 0
    if not root_user:
        log("not root: the page cache cannot be dropped and the xfs loop pool is skipped")
    info["git"] = git_revision()
    results: list[dict[str, Any]] = []
    t_start = time.monotonic()
    loads: list[float] = []
    sampling = threading.Event()

    def sample_load() -> None:
        while not sampling.wait(5.0):
            loads.append(os.getloadavg()[0])

    threading.Thread(target=sample_load, name="load-sampler", daemon=True).start()
    if args.completion:
        from bench import completion_mode

        with workdir(args.work_dir) as work:
            completion = completion_mode.run(work, args)
        return finish_mode(args, info, loads, sampling, "completion", completion, completion_mode.report(completion))
    if args.backend == "rbd" or args.cluster:
        # A mode of its own: its module runs it and reports it.
        from bench import cluster_mode, rbd_control

        name, mode = ("rbd", rbd_control) if args.backend == "rbd" else ("cluster", cluster_mode)
        with workdir(args.work_dir) as work:
            figures = mode.run(work, args)
        summary = rbd_control.report(figures, args) if name == "rbd" else cluster_mode.report(figures)
        return finish_mode(args, info, loads, sampling, name, figures, summary)
    with workdir(args.work_dir) as work:
        log(f"work dir {work} ({fs_type(work)}, {free_gib(work):.1f} GiB free)")
        if not args.skip_ext4:
            ext4 = work / "ext4-pool"
            try:
                results.append(run_pool(f"{fs_type(work)} (copy)", ext4, args, copy_path=True))
            finally:
                shutil.rmtree(ext4, ignore_errors=True)
        if not args.skip_xfs and root_user:
            biggest = max(args.sizes, default=1)
            image_gib = max(args.xfs_image_gib, biggest + 8)
            # The image is sparse: what it needs behind it is the data written into the pool.
            room = min(free_gib(work), image_gib - 2.0)
            log(f"xfs: making a {image_gib} GiB sparse image on a loop device")
            with loop_filesystem(work, "xfs", size_mib=image_gib * 1024) as mnt:
                try:
                    results.append(run_pool("xfs (reflink)", mnt / "pool-root", args, copy_path=False,
                                            room_gib=room))
                finally:
                    shutil.rmtree(mnt / "pool-root", ignore_errors=True)
    sampling.set()
    elapsed = time.monotonic() - t_start
    if loads:
        info["load"] = f"min {min(loads):.1f}, median {statistics.median(loads):.1f}, max {max(loads):.1f}"
    text = report(results, args, info)
    print(text)
    print(f"\n(total run time {elapsed / 60:.1f} min; everything removed: vbs up stopped, loop device "
          f"unmounted, data deleted)")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                   for k, v in vars(args).items()},
                                         "results": results, "elapsed_s": elapsed}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
