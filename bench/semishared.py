#!/usr/bin/env python3
"""Semi-shared storage benchmark (OpenNebula's claim): prints figures (it is not a test).

8 clients, k of them on local volumes (the host's own disk) and 8 - k on shared volumes (the storage
node's disk, over NBD), for k = 0..8, with 1 and 2 hosts (the local clients spread round-robin over
the hosts). The claim under test: a mix beats both extremes (all shared: the storage node's disk is
the bottleneck; all local on one host: that host's disk is).

This machine has one disk, so each "disk" is emulated as its own device by a per-pool throttle: one
QEMU throttle group (``--bps``, ``--iops``) in a qemu-storage-daemon per pool, as VBS's export daemon
enforces QoS. The storage node's daemon serves the shared volumes over NBD on TCP (loopback: the
network hop); each host's daemon serves its local volumes on a unix socket (no network hop), the way a
local volume is a file on the host. Every client is fio with the ``nbd`` engine (libnbd), the same
tool on both paths; the volume files are raw files in a temporary directory, written once first.

Printed per (hosts, k): the aggregate throughput of the 8 clients, the storage node's load (the bytes
its daemon served per second and the CPU time it used, from /proc), and the ratio of the aggregate to
the better extreme (k = 0 or k = 8) measured in the same run.

    .venv/bin/python bench/semishared.py --quick       # 4 s per point (about 3 minutes)
    .venv/bin/python bench/semishared.py --runtime 20 --bps 50

Every daemon is stopped by its PID in a ``finally``; only 127.0.0.1 and unix sockets are used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
CLIENTS = 8
TICKS = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


@dataclass
class Disk:
    """One emulated device: a qemu-storage-daemon whose volumes share one throttle group."""

    name: str
    proc: subprocess.Popen[bytes]
    uris: list[str]


@contextmanager
def disk(name: str, files: list[Path], *, bps: int, iops: int, tcp: bool, sock_dir: Path) -> Iterator[Disk]:
    """Serve ``files`` through one throttle group over NBD (TCP on loopback, or a unix socket)."""
    argv = ["qemu-storage-daemon", "--object", f"throttle-group,id=tg,x-bps-total={bps},x-iops-total={iops}"]
    if tcp:
        port = free_port()
        argv += ["--nbd-server", f"addr.type=inet,addr.host=127.0.0.1,addr.port={port}"]
    else:
        sock = sock_dir / f"{name}.sock"
        argv += ["--nbd-server", f"addr.type=unix,addr.path={sock}"]
    uris = []
    for i, f in enumerate(files):
        argv += ["--blockdev", f"driver=file,node-name=f{i},filename={f},cache.direct=on,aio=native",
                 "--blockdev", f"driver=throttle,node-name=t{i},throttle-group=tg,file=f{i}",
                 "--export", f"type=nbd,id=e{i},node-name=t{i},name=v{i},writable=on"]
        uris.append(f"nbd://127.0.0.1:{port}/v{i}" if tcp else f"nbd+unix:///v{i}?socket={sock}")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    def ready() -> bool:
        return _listening(port) if tcp else (sock_dir / f"{name}.sock").exists()

    try:
        deadline = time.monotonic() + 10
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"qemu-storage-daemon {name} did not start: "
                                   f"{proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.05)
        yield Disk(name, proc, uris)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Point:
    hosts: int
    local: int
    aggregate_mbps: float
    storage_mbps: float
    storage_cpu_pct: float


def measure(hosts: int, local: int, storage: Disk, host_disks: list[Disk], runtime: int, size_mib: int) -> Point:
    shared_uris = storage.uris[:CLIENTS - local]
    local_uris = [host_disks[i % hosts].uris[i // hosts] for i in range(local)]
    cpu0, t0 = cpu_seconds(storage.proc.pid), time.monotonic()
    # One fio runs all 8 clients at once; the storage node's share is that of the shared ones.
    total, per_uri = fio_per_uri(shared_uris + local_uris, runtime, size_mib)
    cpu1, t1 = cpu_seconds(storage.proc.pid), time.monotonic()
    storage_mbps = sum(per_uri[u] for u in shared_uris)
    return Point(hosts, local, total, storage_mbps, 100 * (cpu1 - cpu0) / (t1 - t0))


def fio_per_uri(uris: list[str], runtime: int, size_mib: int) -> tuple[float, dict[str, float]]:
    """One fio client per URI, all at once: their aggregate throughput and each one's (MB/s, 10^6 bytes)."""
    lines = ["[global]", "ioengine=nbd", "rw=randrw", "rwmixread=50", "bs=64k", "iodepth=4", f"runtime={runtime}",
             "time_based=1", f"size={size_mib}m", "group_reporting=0"]
    for i, uri in enumerate(uris):
        lines += [f"[client{i}]", f"uri={uri}"]
    out = subprocess.run(["fio", "--output-format=json", "-"], input="\n".join(lines) + "\n", text=True,
                         capture_output=True, timeout=runtime + 60)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr[-600:]}")
    per_uri: dict[str, float] = {}
    # fio may print notes before its JSON document.
    for job in json.loads(out.stdout[out.stdout.find("{"):])["jobs"]:
        uri = uris[int(job["jobname"].removeprefix("client"))]
        per_uri[uri] = (job["read"]["bw_bytes"] + job["write"]["bw_bytes"]) / 1e6
    return sum(per_uri.values()), per_uri


def prepare(files: list[Path], size_mib: int) -> None:
    for f in files:
        with f.open("wb") as out:
            block = os.urandom(MIB)
            for _ in range(size_mib):
                out.write(block)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10, help="seconds per point")
    ap.add_argument("--quick", action="store_true", help="4 s per point, 64 MiB volumes")
    ap.add_argument("--bps", type=int, default=40, help="each emulated disk's throughput limit, MB/s")
    ap.add_argument("--iops", type=int, default=1000, help="each emulated disk's IOPS limit")
    ap.add_argument("--size-mib", type=int, default=128, help="each volume's size")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    runtime, size_mib = (4, 64) if args.quick else (args.runtime, args.size_mib)
    for tool in ("qemu-storage-daemon", "fio"):
        if shutil.which(tool) is None:
            log(f"{tool} is missing")
            return 2
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="vbs-semishared-", dir="/var/tmp") as tmp_name:
        tmp = Path(tmp_name)
        shared_files = [tmp / f"shared-{i}.raw" for i in range(CLIENTS)]
        host_files = [[tmp / f"host{h}-{i}.raw" for i in range(CLIENTS)] for h in range(2)]
        log(f"writing {CLIENTS * 3} volumes of {size_mib} MiB")
        prepare(shared_files + host_files[0] + host_files[1], size_mib)
        limits = {"bps": args.bps * 1_000_000, "iops": args.iops, "sock_dir": tmp}
        with disk("storage", shared_files, tcp=True, **limits) as storage, \
                disk("host0", host_files[0], tcp=False, **limits) as host0, \
                disk("host1", host_files[1], tcp=False, **limits) as host1:
            for hosts in (1, 2):
                for local in range(CLIENTS + 1):
                    point = measure(hosts, local, storage, [host0, host1], runtime, size_mib)
                    log(f"hosts={hosts} local={local}: {point.aggregate_mbps:.1f} MB/s, storage node "
                        f"{point.storage_mbps:.1f} MB/s, {point.storage_cpu_pct:.0f}% CPU")
                    points.append(point)
    print(f"\nSemi-shared: 8 clients (fio nbd, randrw 50/50 64 KiB qd4, {runtime} s per point); every disk "
          f"throttled to {args.bps} MB/s and {args.iops} IOPS\n")
    for hosts in (1, 2):
        print("| hosts | local k | shared 8-k | aggregate MB/s | storage node MB/s | storage daemon CPU | "
              "vs best extreme |")
        print("|---|---|---|---|---|---|---|")
        row = [p for p in points if p.hosts == hosts]
        best_extreme = max(row[0].aggregate_mbps, row[-1].aggregate_mbps)
        for p in row:
            print(f"| {hosts} | {p.local} | {CLIENTS - p.local} | {p.aggregate_mbps:.1f} | {p.storage_mbps:.1f} | "
                  f"{p.storage_cpu_pct:.0f}% | {p.aggregate_mbps / best_extreme:.2f}x |")
        best = max(row, key=lambda p: p.aggregate_mbps)
        verdict = "beats" if best.local not in (0, CLIENTS) and best.aggregate_mbps > best_extreme * 1.1 else \
            "does not clearly beat"
        print(f"\n{hosts} host(s): the best mix (k={best.local}, {best.aggregate_mbps:.1f} MB/s) {verdict} both "
              f"extremes (k=0: {row[0].aggregate_mbps:.1f}, k=8: {row[-1].aggregate_mbps:.1f} MB/s).\n")
    if args.json is not None:
        args.json.write_text(json.dumps([p.__dict__ for p in points], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
