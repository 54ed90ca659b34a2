"""``bench/control_plane.py --cluster``: creates through one and two controllers (docs/architecture.md §6).

In one run, on the same machine and client load, three installs, each new:

* ``sqlite-1``: ``vbs up`` on its embedded SQLite (one controller, the only kind SQLite allows);
* ``postgresql-1``: ``vbs up --database-url`` on a PostgreSQL 15 cluster this benchmark starts (the
  baseline of the cluster figures);
* ``postgresql-2``: the same plus a second ``vbs controller`` on the same database and data dir;
  the client threads alternate between the two endpoints.

Each install gets a warm-up, then sequential creates (one client: the create p50 a user sees), then
``creates`` concurrent creates from ``threads`` clients: API p50/p99, volumes accepted per second and
available per second. The CPU seconds the controllers and PostgreSQL used during the concurrent run
say where the time went. Processes are stopped by PID; the PostgreSQL cluster and data are removed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import cpu_seconds, log, machine_busy_seconds, pct, text_table, with_descendants
from bench.control_api import BENCH_LIMITS, VBS, Api, VbsUp, concurrent_creates, free_port
from tests.postgres_cluster import PostgresForTests

TARGET_SPEEDUP = 1.3
TARGET_CREATE_P50_MS = 30.0


def _controller_pids(up: VbsUp) -> list[int]:
    """vbs up's controller child (found by its parent and argv, not by name)."""
    assert up.proc is not None
    found = []
    for pid in with_descendants([up.proc.pid]):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"controller" in argv and b"-m" in argv:
            found.append(pid)
    return found


class Install:
    def __init__(self, label: str, work: Path, database_url: str | None, controllers: int) -> None:
        self.label = label
        self.dir = work / label
        self.dir.mkdir()
        extra = ["--database-url", database_url] if database_url else []
        self.up = VbsUp(self.dir / "var", self.dir / "up.log", extra=extra)
        self.database_url = database_url
        self.controllers = controllers
        self.extra: list[subprocess.Popen[bytes]] = []
        self.endpoints: list[str] = []

    def start(self) -> list[Api]:
        self.up.start()
        self.endpoints = [self.up.endpoint]
        for _ in range(self.controllers - 1):
            port = free_port()
            assert self.database_url is not None
            with (self.dir / f"controller-{port}.log").open("ab") as out:
                self.extra.append(subprocess.Popen(  # noqa: S603 - argv list
                    [*VBS, "controller", "--port", str(port), "--data-dir", str(self.up.data_dir),
                     "--database-url", self.database_url, *BENCH_LIMITS],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            self.endpoints.append(f"http://127.0.0.1:{port}")
        apis = [Api(e, self.up.headers()) for e in self.endpoints]
        deadline = time.monotonic() + 60
        for api in apis:
            while True:
                try:
                    api.get("/v1/volumes", max_results=5)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        return apis

    def controller_pids(self) -> list[int]:
        return _controller_pids(self.up) + [p.pid for p in self.extra]

    def other_pids(self) -> list[int]:
        """vbs up's processes but its controller: itself, the agents and their daemons."""
        assert self.up.proc is not None
        ctl = set(_controller_pids(self.up))
        return sorted(with_descendants([self.up.proc.pid]) - ctl)

    def stop(self) -> None:
        for proc in self.extra:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.up.stop()


def measure(install: Install, apis: list[Api], creates: int, threads: int, sequential: int,
            pg_pids: list[int]) -> dict[str, Any]:
    for i in range(20):  # warm-up: connections, caches
        apis[i % len(apis)].post("/v1/volumes", {"size_gib": 1})
    apis[0].wait_none_creating(300)
    seq: list[float] = []
    for i in range(sequential):
        t = time.perf_counter()
        apis[i % len(apis)].post("/v1/volumes", {"size_gib": 1})
        seq.append((time.perf_counter() - t) * 1000)
    apis[0].wait_none_creating(300)

    ctl = install.controller_pids()
    rest = install.other_pids()

    def cpu() -> tuple[float, ...]:
        return (cpu_seconds(ctl), cpu_seconds(pg_pids), machine_busy_seconds(), time.process_time(),
                cpu_seconds(rest, descendants=False))

    cpu0 = cpu()
    t0 = time.monotonic()
    lat = concurrent_creates(apis, creates, threads)
    accepted = time.monotonic()
    available = apis[0].wait_none_creating(600)
    cpu1 = cpu()
    wall = available - t0
    return {
        "label": install.label, "controllers": len(apis), "creates": creates, "threads": threads,
        "seq_p50_ms": pct(seq, 50), "seq_p99_ms": pct(seq, 99),
        "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "mean_ms": statistics.fmean(lat),
        "accepted_per_s": creates / (accepted - t0), "available_per_s": creates / wall,
        "controller_cpu_s": cpu1[0] - cpu0[0], "postgres_cpu_s": cpu1[1] - cpu0[1], "wall_s": wall,
        "machine_cpu_s": cpu1[2] - cpu0[2], "client_cpu_s": cpu1[3] - cpu0[3], "agents_cpu_s": cpu1[4] - cpu0[4],
    }


def run(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    creates = args.creates or (200 if args.quick else 1000)
    sequential = 50 if args.quick else 200
    pg = PostgresForTests(free_port())
    pg.start()
    results = []
    try:
        pg_pids = [pg.cluster.pid] if pg.cluster.pid else []
        for label, kind, controllers in (("sqlite-1", "sqlite", 1), ("postgresql-1", "postgresql", 1),
                                         ("postgresql-2", "postgresql", 2)):
            url = pg.upgraded_database() if kind == "postgresql" else None
            install = Install(label, work, url, controllers)
            log(f"cluster: {label}: {creates} creates from {args.threads} clients")
            try:
                apis = install.start()
                results.append(measure(install, apis, creates, args.threads, sequential,
                                       pg_pids if url else []))
                for api in apis:
                    api.close()
            finally:
                install.stop()
    finally:
        pg.stop()
    return results


def report(results: list[dict[str, Any]]) -> str:
    rows = [[r["label"], str(r["controllers"]), f"{r['seq_p50_ms']:.1f}", f"{r['p50_ms']:.1f}",
             f"{r['p99_ms']:.1f}", f"{r['accepted_per_s']:.0f}", f"{r['available_per_s']:.0f}",
             f"{r['controller_cpu_s']:.1f}", f"{r['postgres_cpu_s']:.1f}"] for r in results]
    out = ["## Cluster: creates through one and two controllers",
           text_table(["install", "controllers", "1-client p50 ms", "p50 ms", "p99 ms", "accepted/s", "available/s",
                  "controller CPU s", "PostgreSQL CPU s"], rows)]
    by = {r["label"]: r for r in results}
    if "postgresql-1" in by and "postgresql-2" in by:
        base, two = by["postgresql-1"], by["postgresql-2"]
        ratio = two["available_per_s"] / base["available_per_s"]
        out.append(f"\n2 controllers vs 1 on the same PostgreSQL: {ratio:.2f}x volumes/s "
                   f"(target >= {TARGET_SPEEDUP}x: {'met' if ratio >= TARGET_SPEEDUP else 'NOT met'}); "
                   f"accepted {two['accepted_per_s'] / base['accepted_per_s']:.2f}x.")
        busy = [(r["label"], (r["controller_cpu_s"] + r["postgres_cpu_s"]) / r["wall_s"]) for r in (base, two)]
        out.append("CPU busy during the concurrent run (cores of 2): "
                   + ", ".join(f"{label} {cores:.2f}" for label, cores in busy)
                   + "; the whole machine (the storage agent, the clients and the rest too): "
                   + ", ".join(f"{r['label']} {r['machine_cpu_s'] / r['wall_s']:.2f}" for r in (base, two)))
        out.append("Of which the benchmark's own client threads: "
                   + ", ".join(f"{r['label']} {r['client_cpu_s'] / r['wall_s']:.2f}" for r in (base, two))
                   + "; vbs up's agents and daemons: "
                   + ", ".join(f"{r['label']} {r['agents_cpu_s'] / r['wall_s']:.2f}" for r in (base, two)))
    for r in results:
        ok = r["seq_p50_ms"] <= TARGET_CREATE_P50_MS
        out.append(f"{r['label']}: create p50 (one client) {r['seq_p50_ms']:.1f} ms "
                   f"(target <= {TARGET_CREATE_P50_MS:g} ms: {'met' if ok else 'NOT met'})")
    return "\n".join(out)
