#!/usr/bin/env python3
"""Every benchmark of VBS in one run: ``make bench`` (the whole set) or ``make bench-quick``.

Each benchmark runs as its own child process, one after the other (never two at once: each measures
its baseline in the same run, and two would share the CPU). Their output goes to the terminal and to
``<log-dir>/<name>.log``; the run starts with what the figures depend on (UTC date, commit, load
average, CPUs, kernel) and ends with a table of what each took and whether it ran to the end.

    .venv/bin/python bench/run_all.py --quick              # the five-minute set (each target once)
    .venv/bin/python bench/run_all.py --only datapath,rtt  # some of them, in their full mode
    .venv/bin/python bench/run_all.py --quick --only rtt   # some of them, in their own short mode
    .venv/bin/python bench/run_all.py --list

Needs root, like the benchmarks it runs (loop devices, tgtd, Ceph, page-cache drops). Exits non-zero
if any benchmark failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]  # its own short mode: ``--quick --only NAME``
    # Its part of the five-minute set (``--quick`` alone), or None where the set leaves it out.
    # ``{log_dir}`` stands for the directory of the logs.
    five: tuple[str, ...] | None = None


# In the order they run: the control plane first (its figures suffer most from a warm machine).
#
# The five-minute set measures each target of the performance issue once, and little more: the
# create and page latency at 1,000 and 10,000 volumes, attach in both guests and the snapshot curve
# come from ``scale``, which is why ``control_plane`` and ``attach`` sit out; the data path measures
# only the two reads its targets are judged on. QoS, locality, migration and the NBD request limits
# belong to other work and run in the full set.
BENCHES = (
    Bench("cli_startup", "cli_startup.py", (), ("--quick",), ("--quick", "--rounds", "10")),
    Bench("control_plane", "control_plane.py", (), ("--quick",)),
    Bench("scale", "scale.py", (), ("--quick",),
          ("--quick", "--api-volumes", "200", "--settle", "1", "--disks", "1", "--plot", "{log_dir}/scale.png")),
    Bench("control_plane_rbd", "control_plane.py", ("--backend", "rbd"), ("--backend", "rbd", "--quick"),
          ("--backend", "rbd", "--quick", "--rbd-sizes", "1,16", "--rbd-rounds", "3")),
    # 100 concurrent creates (its own short mode) take a second: too short to compare one and two controllers.
    Bench("cluster", "control_plane.py", ("--cluster",), ("--cluster", "--quick"),
          ("--cluster", "--quick", "--creates", "400")),
    # Three rounds, not two: its baseline, cp --sparse=always, is 1.6-1.9x faster in its first round than
    # in the later ones in every run (cp --reflink=never is not; the cause is not known), and only a
    # median of three leaves that round out.
    Bench("copy_fallback", "copy_fallback.py", (), ("--quick",), ("--quick",)),
    Bench("snapshot_store", "snapshot_store.py", (), ("--quick",)),
    Bench("datapath", "datapath.py", (), ("--quick",),
          ("--quick", "--reads-only", "--size-gib", "1", "--runtime", "2.5")),
    Bench("datapath_rbd", "datapath.py", ("--backend", "rbd"), ("--backend", "rbd", "--quick"),
          ("--backend", "rbd", "--quick", "--reads-only", "--size-gib", "1", "--runtime", "2.5")),
    Bench("nbd_limits", "nbd_limits.py", (), ("--quick",)),
    # NBD reads across a bridge of network namespaces against loopback (root; the cluster's link).
    Bench("netns_path", "netns_path.py", (), ("--quick",)),
    Bench("netns_attach", "netns_attach.py", (), ("--quick",)),
    Bench("attach", "attach.py", (), ("--quick",)),
    # What one iSCSI export costs the storage agent, against the last driver that ran tgtadm.
    Bench("iscsi_control", "iscsi_control.py", (), ("--keys", "5", "--rounds", "1")),
    # tgtd's backing stores and worker counts beside istgt, 4 KiB random and 1 MiB sequential reads.
    Bench("iscsi_targets", "iscsi_targets.py", (), ("--quick",)),
    Bench("completion", "control_plane.py", ("--completion",), ("--completion", "--quick"),
          ("--completion", "--quick")),
    Bench("fairness", "fairness.py", (), ("--quick",)),
    Bench("semishared", "semishared.py", (), ("--quick",)),
    Bench("migrate", "migrate.py", (), ("--mib", "64")),
    Bench("rtt", "rtt.py", (), ("--quick",)),
    Bench("bonnie", "bonnie.py", (), ("--quick",), ("--quick",)),
    # fio inside the bench guest on VBS's NBD, nbdkit and iSCSI volumes against a local disk of that guest.
    Bench("guest_datapath", "guest_datapath.py", (), ("--quick",)),
)


def plan(quick: bool, only: list[str] | None) -> list[tuple[Bench, tuple[str, ...]]]:
    """The benches to run and their arguments: ``--only`` names run in their full or quick mode; without
    it, the whole set or the five-minute one."""
    if only is not None:
        return [(b, b.quick if quick else b.full) for b in BENCHES if b.name in only]
    if not quick:
        return [(b, b.full) for b in BENCHES]
    return [(b, b.five) for b in BENCHES if b.five is not None]


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def header(quick: bool) -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join([
        f"# VBS benchmarks ({'quick' if quick else 'full'} set)",
        f"date:    {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"commit:  {git_commit()}",
        f"load:    {load} (1, 5, 15 min)",
        f"cpus:    {os.cpu_count()}",
        f"kernel:  {platform.release()}",
    ])


def run_one(bench: Bench, args: tuple[str, ...], log_dir: Path) -> tuple[int, float]:
    argv = [sys.executable, str(ROOT / "bench" / bench.script), *(a.replace("{log_dir}", str(log_dir)) for a in args)]
    # The bench before may leave GiBs of dirty pages (its copies, its volumes' data): written back while
    # this one measures, they would slow every fsync of its creates. Out first, and said how long it took.
    synced = time.monotonic()
    os.sync()
    print(f"\n## {bench.name}: {' '.join(argv[1:])}  (load {os.getloadavg()[0]:.2f}, "
          f"sync {time.monotonic() - synced:.1f} s)", flush=True)
    started = time.monotonic()
    fd = os.open(log_dir / f"{bench.name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
    return rc, time.monotonic() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="the five-minute set (with --only: those benches in their short mode)")
    ap.add_argument("--only", default=None, help="comma-separated names (see --list)")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "var" / "bench", help="one log per bench")
    ap.add_argument("--list", action="store_true", help="list the benches and exit")
    args = ap.parse_args()
    if args.list:
        for b in BENCHES:
            five = "not in the five-minute set" if b.five is None else f"five-minute set: {' '.join(b.five)}"
            print(f"{b.name:18} bench/{b.script} {' '.join(b.full)}  (quick: {' '.join(b.quick)}; {five})")
        return 0
    names = None
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - {b.name for b in BENCHES})
        if unknown:
            ap.error(f"unknown bench(es): {', '.join(unknown)} (see --list)")
    args.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    print(header(args.quick), flush=True)
    results = [(b, *run_one(b, bench_args, args.log_dir)) for b, bench_args in plan(args.quick, names)]
    print(f"\n## Summary (logs in {args.log_dir})")
    print(f"{'bench':18} {'exit':>4} {'minutes':>8}")
    for b, rc, took in results:
        print(f"{b.name:18} {rc:>4} {took / 60:>8.1f}")
    print(f"total {sum(t for _, _, t in results) / 60:.1f} min; load now {os.getloadavg()[0]:.2f}")
    return 1 if any(rc != 0 for _, rc, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
