#!/usr/bin/env python3
"""Semi-shared storage benchmark (OpenNebula's claim) through VBS's own data path: prints figures (it is not a test).

8 clients, k of them on local volumes (the host's own disk) and 8 - k on shared volumes (the storage
node's disk, over NBD), for k = 0..8, with 1 and 2 hosts (the local clients spread round-robin over
the hosts). The claim under test: a mix beats both extremes (all shared: the storage node's disk is
the bottleneck; all local on one host: that host's disk is).

The shared side is VBS's: a storage node of a ``file`` pool (``FileBackend``) whose volumes are served
by its ``NbdExportDriver`` over TCP on loopback (the network hop; TLS off, as ``--insecure``). This
machine has one disk, so the storage node's own "disk" is the driver's per-type ``fair_share``: one
QEMU throttle group that all of the node's volumes of the type share, dispatched round-robin (a
per-pool device limit). Each volume has no limit of its own.

The local side is VBS's local pools (``build_local_pools`` / ``LocalPools``, the ``file`` backend):
each host's volumes are files its pool made. VBS has no throttle of a host's local disk (a local
attach only hands the volume's own limits to the hypervisor), so each host's "disk" is emulated by
the bench: one qemu-storage-daemon per host whose volumes share one throttle group with the same
limits as the storage node's (``throttle_limits`` of the same ``QoS``), served on a unix socket (no
network hop), as a local volume is a file on its host. Every client is fio with the ``nbd`` engine
(libnbd), the same tool and the same QEMU block layer on both paths; volumes hold random data,
written once first (a hole would be answered unthrottled).

Printed per (hosts, k): the aggregate throughput of the 8 clients, the storage node's load (what
its clients got, and the CPU time its export daemon used, from /proc), and the ratio of the
aggregate to the better extreme (k = 0 or k = 8) measured in the same run. MiB/s = 2^20 bytes/s,
EBS's unit and VBS's ``mbps``.

    .venv/bin/python bench/semishared.py --quick       # 4 s per point, k = 0, 2, 4, 8 (about 40 s)
    .venv/bin/python bench/semishared.py --runtime 20 --mibps 50

Every daemon is stopped by its PID in a ``finally`` (the storage node's by its driver); only
127.0.0.1 and unix sockets are used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.common import cpu_seconds, log  # noqa: E402

from vbs.config import HostAgentConfig, PoolConfig  # noqa: E402
from vbs.host.local_pools import CopyCredentials, LocalPools, build_local_pools  # noqa: E402
from vbs.net.ports import free_port  # noqa: E402
from vbs.storage.backends.file import FileBackend  # noqa: E402
from vbs.storage.exports.nbd import NbdExportDriver  # noqa: E402
from vbs.wire.connection import HostIdentity, NbdConnection  # noqa: E402
from vbs.wire.qos import MIB, ExportLimits, QoS, throttle_limits  # noqa: E402

CLIENTS = 8
TYPE = "gp3"
POOL = "local"
HOST = HostIdentity(name="bench-host", address="127.0.0.1")


def volume_id(n: int) -> str:
    return f"vol-{n:017x}"


def fill(path: Path, size_mib: int) -> None:
    """Random data everywhere (QEMU's NBD server answers a read of a hole unthrottled)."""
    block = os.urandom(MIB)
    with path.open("r+b") as out:
        for _ in range(size_mib):
            out.write(block)


# -- the storage node: VBS's file pool and NBD export driver ------------------------------------------


@dataclass
class StorageNode:
    driver: NbdExportDriver
    uris: list[str]

    def pid(self) -> int:
        assert self.driver.pid is not None
        return self.driver.pid


@contextmanager
def storage_node(tmp: Path, count: int, size_mib: int, disk: QoS) -> Iterator[StorageNode]:
    """A storage node: ``count`` volumes of a file pool exported over NBD on TCP (loopback); the
    node's volumes of ``TYPE`` share ``disk`` round-robin (the driver's ``fair_share``)."""
    pool = tmp / "storage-pool"
    pool.mkdir()
    driver = NbdExportDriver(tmp / "storage-state", listen_host="127.0.0.1", port=free_port(), tls="off",
                             fair_share={TYPE: disk})
    backend = FileBackend("shared", pool, exports=driver)
    try:
        driver.start()
        uris = []
        for i in range(count):
            vid = volume_id(0x100 + i)
            backend.ensure_volume(vid, size_mib * MIB)
            fill(backend.volume_path(vid), size_mib)
            driver.set_limits(vid, ExportLimits(volume_type=TYPE))  # no limit of its own: the node's disk only
            conn = backend.connection_for(vid, HOST)
            assert isinstance(conn, NbdConnection) and conn.host and conn.port
            uris.append(f"nbd://{conn.host}:{conn.port}/{conn.export}")
        yield StorageNode(driver, uris)
    finally:
        driver.stop()
        backend.close()


# -- the hosts: VBS's local pools, each host's disk one throttle group --------------------------------


@contextmanager
def local_pool_files(tmp: Path, host: int, count: int, size_mib: int) -> Iterator[list[Path]]:
    """``count`` volumes made by the host's local pool (the host agent's own ``build_local_pools``)."""
    pool_dir = tmp / f"host{host}-pool"
    pool_dir.mkdir()
    cfg = HostAgentConfig(node_name=f"host-{host}", local_pools=[PoolConfig(name=POOL, path=pool_dir)])
    pools = LocalPools(build_local_pools(cfg), CopyCredentials(tmp / f"host{host}-secrets"))
    try:
        files = []
        for i in range(count):
            vid = volume_id(0x200 + 0x10 * host + i)
            pools.pool(POOL).ensure_volume(vid, size_mib * MIB)
            files.append(pools.path_of(POOL, vid))
            fill(files[-1], size_mib)
        yield files
    finally:
        pools.close()


@dataclass
class HostDisk:
    proc: subprocess.Popen[bytes]
    uris: list[str]


@contextmanager
def host_disk(name: str, files: list[Path], disk: QoS, sock_dir: Path) -> Iterator[HostDisk]:
    """One emulated host disk: a qemu-storage-daemon serving ``files`` on a unix socket through one
    throttle group (the same limits a storage node's fair-share group of ``disk`` has)."""
    sock = sock_dir / f"{name}.sock"
    group = {"qom-type": "throttle-group", "id": "disk", "limits": throttle_limits(disk)}
    argv = ["qemu-storage-daemon", "--object", json.dumps(group),
            "--nbd-server", f"addr.type=unix,addr.path={sock}"]
    uris = []
    for i, f in enumerate(files):
        argv += ["--blockdev", f"driver=file,node-name=f{i},filename={f},cache.direct=on,aio=native",
                 "--blockdev", f"driver=throttle,node-name=t{i},throttle-group=disk,file=f{i}",
                 "--export", f"type=nbd,id=e{i},node-name=t{i},name=v{i},writable=on"]
        uris.append(f"nbd+unix:///v{i}?socket={sock}")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"qemu-storage-daemon {name} did not start: "
                                   f"{proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.05)
        yield HostDisk(proc, uris)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- measuring ------------------------------------------------------------------------------------------


@dataclass
class Point:
    hosts: int
    local: int
    aggregate_mib_s: float
    storage_mib_s: float
    storage_cpu_pct: float


def measure(hosts: int, local: int, storage: StorageNode, host_disks: list[HostDisk], runtime: int,
            size_mib: int) -> Point:
    shared_uris = storage.uris[:CLIENTS - local]
    local_uris = [host_disks[i % hosts].uris[i // hosts] for i in range(local)]
    cpu0, t0 = cpu_seconds([storage.pid()], descendants=False), time.monotonic()
    # One fio runs all 8 clients at once; the storage node's share is that of the shared ones.
    total, per_uri = fio_per_uri(shared_uris + local_uris, runtime, size_mib)
    cpu1, t1 = cpu_seconds([storage.pid()], descendants=False), time.monotonic()
    storage_mib_s = sum(per_uri[u] for u in shared_uris)
    return Point(hosts, local, total, storage_mib_s, 100 * (cpu1 - cpu0) / (t1 - t0))


def fio_per_uri(uris: list[str], runtime: int, size_mib: int) -> tuple[float, dict[str, float]]:
    """One fio client per URI, all at once: their aggregate throughput and each one's (MiB/s)."""
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
        per_uri[uri] = (job["read"]["bw_bytes"] + job["write"]["bw_bytes"]) / MIB
    return sum(per_uri.values()), per_uri


def run(args: argparse.Namespace, ks: list[int], runtime: int, size_mib: int, tmp: Path) -> list[Point]:
    disk = QoS(iops=args.iops, mbps=args.mibps)
    # Host 0 holds up to 8 local clients (1 host), host 1 up to 4 (2 hosts, round-robin).
    per_host = [CLIENTS, CLIENTS // 2]
    log(f"writing {CLIENTS + sum(per_host)} volumes of {size_mib} MiB (storage node's pool, hosts' local pools)")
    points: list[Point] = []
    with ExitStack() as stack:
        storage = stack.enter_context(storage_node(tmp, CLIENTS, size_mib, disk))
        hosts = [stack.enter_context(host_disk(f"host{h}", stack.enter_context(local_pool_files(tmp, h, n, size_mib)),
                                               disk, tmp))
                 for h, n in enumerate(per_host)]
        for n_hosts in (1, 2):
            for local in ks:
                point = measure(n_hosts, local, storage, hosts, runtime, size_mib)
                log(f"hosts={n_hosts} local={local}: {point.aggregate_mib_s:.1f} MiB/s, storage node "
                    f"{point.storage_mib_s:.1f} MiB/s, {point.storage_cpu_pct:.0f}% CPU")
                points.append(point)
    return points


def render(points: list[Point], runtime: int, args: argparse.Namespace) -> str:
    out = [f"Semi-shared: 8 clients (fio nbd, randrw 50/50 64 KiB qd4, {runtime} s per point); every disk "
           f"{args.mibps} MiB/s and {args.iops} IOPS (storage node: its NbdExportDriver's fair_share of {TYPE}; "
           "hosts: one throttle group each over their local pool)", ""]
    for hosts in (1, 2):
        out += ["| hosts | local k | shared 8-k | aggregate MiB/s | storage node MiB/s | storage daemon CPU | "
                "vs best extreme |", "|---|---|---|---|---|---|---|"]
        row = [p for p in points if p.hosts == hosts]
        best_extreme = max(row[0].aggregate_mib_s, row[-1].aggregate_mib_s)
        for p in row:
            out.append(f"| {hosts} | {p.local} | {CLIENTS - p.local} | {p.aggregate_mib_s:.1f} | "
                       f"{p.storage_mib_s:.1f} | {p.storage_cpu_pct:.0f}% | {p.aggregate_mib_s / best_extreme:.2f}x |")
        best = max(row, key=lambda p: p.aggregate_mib_s)
        verdict = "beats" if best.local not in (0, CLIENTS) and best.aggregate_mib_s > best_extreme * 1.1 else \
            "does not clearly beat"
        out += ["", f"{hosts} host(s): the best mix (k={best.local}, {best.aggregate_mib_s:.1f} MiB/s) {verdict} both "
                f"extremes (k=0: {row[0].aggregate_mib_s:.1f}, k=8: {row[-1].aggregate_mib_s:.1f} MiB/s).", ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10, help="seconds per point")
    ap.add_argument("--quick", action="store_true", help="4 s per point, 64 MiB volumes, k = 0, 2, 4, 8")
    ap.add_argument("--mibps", type=int, default=40, help="each emulated disk's throughput limit, MiB/s")
    ap.add_argument("--iops", type=int, default=1000, help="each emulated disk's IOPS limit")
    ap.add_argument("--size-mib", type=int, default=128, help="each volume's size")
    ap.add_argument("--ks", default="", help="the k to measure besides 0 and 8 (default: all; --quick 2,4), e.g. 2,4")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    runtime, size_mib = (4, 64) if args.quick else (args.runtime, args.size_mib)
    try:
        ks_given = args.ks or ("2,4" if args.quick else "")
        chosen = {int(k) for k in ks_given.split(",") if k.strip()} if ks_given else set(range(CLIENTS + 1))
    except ValueError:
        ap.error("--ks: numbers from 0 to 8, comma-separated")
    if not chosen <= set(range(CLIENTS + 1)):
        ap.error("--ks: numbers from 0 to 8")
    ks = sorted(chosen | {0, CLIENTS})  # the extremes: every ratio is to the better of them
    for tool in ("qemu-storage-daemon", "fio"):
        if shutil.which(tool) is None:
            log(f"{tool} is missing")
            return 2
    with tempfile.TemporaryDirectory(prefix="vbs-semishared-", dir="/var/tmp") as tmp_name:
        points = run(args, ks, runtime, size_mib, Path(tmp_name))
    print("\n" + render(points, runtime, args))
    if args.json is not None:
        args.json.write_text(json.dumps([p.__dict__ for p in points], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
