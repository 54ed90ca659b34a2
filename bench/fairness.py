#!/usr/bin/env python3
"""Fairness benchmark of VBS's QoS at the data path: prints figures (it is not a test).

Volumes are served by real storage-node export daemons (``NbdExportDriver``, one qemu-storage-daemon
per storage node, unix sockets on this machine) and driven by fio's ``nbd`` engine (libnbd): the
exports themselves, not guests (eight TCG guests would measure the CPU).

The load is **mixed**: one sequential writer at queue depth 64 (on the first node's first volume)
against light readers on every other volume (4 KiB random reads, queue depth 1, ``--reader-iops``
each). Identical jobs would be fair by themselves. The writer's record size goes from 4 KiB to
1 MiB. Each shape (4 or 8 volumes, on one or two storage nodes) runs:

* ``none``: no throttle group has a limit (the volumes' throttle nodes pass everything through);
* ``equal``: every volume limited to an equal share of its node's capacity (IOPS of its own):
  equal-limit volumes, EBS's model;
* ``fair``: each storage node shares its volumes' type out round-robin: ``fair_share`` of the
  type set to the node's capacity under this very load, measured by the ``none`` run just before
  (the operations per second the node served, a request larger than 256 KiB counting as several,
  as QEMU's ``iops-size`` counts them). QEMU's throttle groups dispatch their members round-robin:
  PIOD's queue-per-target model. (QEMU keeps reads and writes in two rotations sharing the
  group's ``iops-total`` budget.)

Figures: per volume IOPS and p99 completion latency, the aggregate MiB/s, the readers' p99 next to
their p99 without the writer (measured alone in the same run), and Jain's index of the volumes'
normalised rates: each volume's rate over its max-min fair share of the node's capacity given what
it asks (a reader asks ``--reader-iops``, the writer as much as it gets), so 1.0 means every volume
got what max-min fairness entitles it to. Jain's index is taken among equal-limit volumes (all of a
node's volumes share one group with no limit of their own).

A first phase checks per-volume limits: four volumes with limits of their own (IOPS at 4 KiB, IOPS
at 1 MiB where each request counts as four, MiB/s) driven hard at once; each measured rate against
its limit.

Every daemon is stopped by its driver (by PID) in a ``finally``; only unix sockets are used.

    .venv/bin/python bench/fairness.py --quick    # 3 s per run, 2 shapes, 2 writers (about 1 minute)
    .venv/bin/python bench/fairness.py            # 8 s per run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.common import log  # noqa: E402

from vbs.pools.exports import FileSource  # noqa: E402
from vbs.storage.exports.nbd import NbdExportDriver  # noqa: E402
from vbs.wire.connection import HostIdentity, NbdConnection  # noqa: E402
from vbs.wire.qos import IOPS_SIZE, ExportLimits, QoS  # noqa: E402

MIB = 1 << 20
HOST = HostIdentity(name="bench-host", address="127.0.0.1")
TYPE = "gp3"
# none: no limit anywhere; equal: every volume limited to an equal share of its node's capacity;
# fair: no volume limit, the node's fair-share group of the type at its capacity (round-robin).
MODES = ("none", "equal", "fair")
RECORD_SIZES = {"4k": 4096, "64k": 64 << 10, "256k": 256 << 10, "1m": MIB}


def volume_id(n: int) -> str:
    return f"vol-{n:017x}"


def make_volume(path: Path, size: int) -> None:
    """Data everywhere: QEMU's NBD server answers a read of a hole from the block status, unthrottled."""
    chunk = bytes(range(256)) * (MIB // 256)
    with open(path, "wb") as f:
        for _ in range(size // MIB):
            f.write(chunk)


# -- storage nodes ---------------------------------------------------------------------------------


@dataclass
class Node:
    driver: NbdExportDriver
    exports: dict[str, NbdConnection]


@contextlib.contextmanager
def storage_nodes(work: Path, count: int, fair_iops: Sequence[int] = ()) -> Iterator[list[Node]]:
    """``count`` export daemons, each a storage node; with ``fair_iops`` node ``i`` shares its ``gp3``
    volumes round-robin within ``fair_iops[i]`` operations per second."""
    nodes: list[Node] = []
    try:
        for i in range(count):
            fair = {TYPE: QoS(iops=fair_iops[i])} if fair_iops else None
            drv = NbdExportDriver(work / f"node{i}", socket_dir=work / f"sock{i}", fair_share=fair)
            drv.start()
            nodes.append(Node(drv, {}))
        yield nodes
    finally:
        for node in nodes:
            node.driver.stop()


def export(node: Node, key: str, path: Path, limits: ExportLimits) -> NbdConnection:
    node.driver.set_limits(key, limits)
    conn = node.driver.ensure_export(key, FileSource(path), HOST)
    assert isinstance(conn, NbdConnection)
    node.exports[key] = conn
    return conn


# -- fio -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    name: str
    conn: NbdConnection
    rw: str  # fio's: write, randread, read, randwrite
    bs: int
    iodepth: int
    rate_iops: int = 0


@dataclass
class Result:
    name: str
    iops: float
    mib_s: float
    p99_ms: float
    bs: int

    def ops(self) -> float:
        """Operations as QEMU's ``iops-size`` counts them."""
        return self.iops * max(1, math.ceil(self.bs / IOPS_SIZE))


def run_fio(jobs: Sequence[Job], runtime: float, size: int) -> dict[str, Result]:
    lines = ["[global]", "ioengine=nbd", "time_based=1", f"runtime={runtime:g}", f"size={size}",
             "group_reporting=0"]
    for job in jobs:
        assert job.conn.socket is not None
        lines += [f"[{job.name}]", f"uri=nbd+unix:///{job.conn.export}?socket={job.conn.socket}", f"rw={job.rw}",
                  f"bs={job.bs}", f"iodepth={job.iodepth}"]
        if job.rate_iops:
            lines.append(f"rate_iops={job.rate_iops}")
    with tempfile.NamedTemporaryFile("w", suffix=".fio", delete=False) as f:
        f.write("\n".join(lines) + "\n")
        jobfile = f.name
    try:
        out = subprocess.run(["fio", "--output-format=json", jobfile], capture_output=True, text=True,
                             timeout=runtime + 120, check=True).stdout
    finally:
        Path(jobfile).unlink()
    found: dict[str, Result] = {}
    by_name = {j.name: j for j in jobs}
    for entry in json.loads(out[out.index("{"):])["jobs"]:
        job = by_name[entry["jobname"]]
        side = entry["write" if "write" in job.rw else "read"]
        p99 = side["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1e6
        found[job.name] = Result(job.name, side["iops"], side["bw_bytes"] / MIB, p99, job.bs)
    return found


# -- fairness ----------------------------------------------------------------------------------------


def jain(values: Sequence[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if values else 0.0


def max_min_shares(capacity: float, demands: Sequence[float]) -> list[float]:
    """Max-min fair allocation of ``capacity`` among ``demands`` (math.inf: takes whatever is left)."""
    shares = [0.0] * len(demands)
    left = sorted(range(len(demands)), key=lambda i: demands[i])
    remaining = capacity
    while left:
        even = remaining / len(left)
        i = left[0]
        if demands[i] <= even:
            shares[i] = demands[i]
            remaining -= demands[i]
            left.pop(0)
        else:
            for j in left:
                shares[j] = even
            break
    return shares


@dataclass(frozen=True)
class Shape:
    volumes: int
    nodes: int

    def label(self) -> str:
        return f"{self.volumes} vols / {self.nodes} node{'s' if self.nodes > 1 else ''}"


def mixed_jobs(shape: Shape, nodes: list[Node], files: list[Path], writer_bs: int, reader_iops: int,
               with_writer: bool = True, limits: Sequence[int] = ()) -> list[Job]:
    """``limits``: every volume of node ``i`` limited to ``limits[i]`` IOPS of its own (none: unlimited)."""
    jobs: list[Job] = []
    for i in range(shape.volumes):
        node = nodes[i % shape.nodes]
        qos = QoS(iops=limits[i % shape.nodes]) if limits else None
        conn = export(node, volume_id(i + 1), files[i], ExportLimits(qos=qos, volume_type=TYPE))
        if i == 0:
            if with_writer:
                jobs.append(Job(f"w{i}", conn, "write", writer_bs, 64))
        else:
            jobs.append(Job(f"r{i}", conn, "randread", 4096, 1, reader_iops))
    return jobs


def names_on(shape: Shape, node: int) -> list[str]:
    return [("w0" if i == 0 else f"r{i}") for i in range(shape.volumes) if i % shape.nodes == node]


def node_ops(shape: Shape, results: dict[str, Result]) -> list[float]:
    """The operations per second each node served (QEMU's counting)."""
    return [sum(results[name].ops() for name in names_on(shape, n)) for n in range(shape.nodes)]


def fairness_of(shape: Shape, results: dict[str, Result], capacity: Sequence[float], reader_iops: int,
                limits: Sequence[int] = ()) -> float:
    """Jain's index of each volume's rate over its max-min fair share of its node's ``capacity``
    given what it asks (and at most its own limit), all nodes together."""
    normalised: list[float] = []
    for n in range(shape.nodes):
        names = names_on(shape, n)
        demands = [math.inf if name == "w0" else float(reader_iops) for name in names]
        shares = [min(share, limits[n] if limits else math.inf)
                  for share in max_min_shares(capacity[n], demands)]
        normalised += [min(1.5, results[name].ops() / share) for name, share in zip(names, shares, strict=True)
                       if share > 0]
    return jain(normalised)


def limits_phase(work: Path, files: list[Path], runtime: float, size: int) -> list[dict[str, Any]]:
    """Four volumes with limits of their own, driven hard at once: each against its limit."""
    cases = [  # name, QoS, fio rw, bs, the expected rate in the unit reported
        ("iops 4k", QoS(iops=200), "randread", 4096, 200.0, "IOPS"),
        ("iops 1m", QoS(iops=200), "read", MIB, 200.0 / (MIB // IOPS_SIZE), "IOPS"),
        ("mbps 1m", QoS(mbps=20), "write", MIB, 20.0, "MiB/s"),
        ("iops+mbps 64k", QoS(iops=400, mbps=10), "randwrite", 64 << 10, 10.0, "MiB/s"),
    ]
    rows: list[dict[str, Any]] = []
    with storage_nodes(work / "limits", 1) as nodes:
        jobs = []
        for i, (_, qos, rw, bs, _, _) in enumerate(cases):
            conn = export(nodes[0], volume_id(0x100 + i), files[i], ExportLimits(qos=qos, volume_type="io2"))
            jobs.append(Job(f"l{i}", conn, rw, bs, 16))
        got = run_fio(jobs, runtime, size)
    for i, (name, qos, _, _, expected, unit) in enumerate(cases):
        res = got[f"l{i}"]
        measured = res.iops if unit == "IOPS" else res.mib_s
        rows.append({"case": name, "limit": qos.model_dump(exclude_none=True), "expected": expected, "unit": unit,
                     "measured": round(measured, 1), "error_pct": round(100 * (measured - expected) / expected, 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="3 s per run; 4 volumes on 1 node and 8 on 2; writers of 4k and 1m")
    p.add_argument("--runtime", type=float, default=None, help="seconds per run (default 8, --quick 3)")
    p.add_argument("--record-sizes", default=None,
                   help=f"the writer's, among {','.join(RECORD_SIZES)} (default all; --quick 4k,1m)")
    p.add_argument("--reader-iops", type=int, default=100, help="what each light reader asks for")
    p.add_argument("--volume-mib", type=int, default=64)
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = p.parse_args(argv)
    runtime = args.runtime or (3.0 if args.quick else 8.0)
    sizes = [s.strip() for s in (args.record_sizes or ("4k,1m" if args.quick else "4k,64k,1m")).split(",")]
    if any(s not in RECORD_SIZES for s in sizes):
        p.error(f"record sizes are among {', '.join(RECORD_SIZES)}")
    if shutil.which("fio") is None or shutil.which("qemu-storage-daemon") is None:
        print("needs fio and qemu-storage-daemon", file=sys.stderr)
        return 2
    size = args.volume_mib * MIB
    shapes = [Shape(4, 1), Shape(8, 2)] if args.quick else [Shape(4, 1), Shape(4, 2), Shape(8, 1), Shape(8, 2)]
    work = Path(tempfile.mkdtemp(prefix="vbs-fair-"))
    report: dict[str, Any] = {"runtime_s": runtime, "reader_iops": args.reader_iops, "mixed": []}
    try:
        files = []
        for i in range(8):
            files.append(work / f"v{i}.img")
            make_volume(files[-1], size)
        log("limits: four volumes with limits of their own, driven hard at once")
        report["limits"] = limits_phase(work, files, runtime, size)
        for shape in shapes:
            with storage_nodes(work / f"alone-{shape.volumes}-{shape.nodes}", shape.nodes) as nodes:
                alone = run_fio(mixed_jobs(shape, nodes, files, MIB, args.reader_iops, with_writer=False),
                                runtime, size)
            alone_p99 = max(r.p99_ms for r in alone.values())
            for sz in sizes:
                bs = RECORD_SIZES[sz]
                row: dict[str, Any] = {"shape": shape.label(), "writer_bs": sz,
                                       "readers_alone_p99_ms": round(alone_p99, 2)}
                capacity: list[float] = []
                for mode in MODES:
                    log(f"{shape.label()}, writer {sz}: {mode}")
                    # none runs first: the capacity is its figures
                    fair = [max(1, round(c)) for c in capacity] if mode == "fair" else []
                    equal = [max(1, round(c / len(names_on(shape, n)))) for n, c in enumerate(capacity)
                             ] if mode == "equal" else []
                    with storage_nodes(work / f"{mode}-{shape.volumes}-{shape.nodes}-{sz}", shape.nodes, fair) as nodes:
                        res = run_fio(mixed_jobs(shape, nodes, files, bs, args.reader_iops, limits=equal), runtime,
                                      size)
                    if mode == "none":
                        capacity = node_ops(shape, res)
                        row["capacity_ops"] = [round(c) for c in capacity]
                    readers = [r for n, r in res.items() if n != "w0"]
                    row[mode] = {
                        "writer_iops": round(res["w0"].iops), "writer_p99_ms": round(res["w0"].p99_ms, 2),
                        "reader_iops": round(sum(r.iops for r in readers) / len(readers), 1),
                        "reader_p99_ms": round(max(r.p99_ms for r in readers), 2),
                        "aggregate_mib_s": round(sum(r.mib_s for r in res.values()), 1),
                        "jain": round(fairness_of(shape, res, capacity, args.reader_iops, equal), 3),
                        "per_volume": {n: {"iops": round(r.iops, 1), "p99_ms": round(r.p99_ms, 2)}
                                       for n, r in sorted(res.items())},
                    }
                for mode in MODES[1:]:
                    row[mode]["aggregate_ratio"] = round(row[mode]["aggregate_mib_s"]
                                                         / max(row["none"]["aggregate_mib_s"], 1e-9), 3)
                report["mixed"].append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def render(report: dict[str, Any]) -> str:
    out = [f"runtime {report['runtime_s']:g} s per run; light readers ask {report['reader_iops']} IOPS each", "",
           "Per-volume limits, all four driven at once:",
           f"{'case':<16}{'limit':<26}{'expected':>10}{'measured':>10}{'error':>8}"]
    for r in report["limits"]:
        out.append(f"{r['case']:<16}{json.dumps(r['limit']):<26}{r['expected']:>8.1f} {r['unit'][:1]}"
                   f"{r['measured']:>9.1f} {r['error_pct']:>+6.1f}%")
    out += ["", "Mixed load: one QD64 sequential writer, light 4 KiB QD1 readers; none = no limit, equal = each "
            "volume limited to capacity/volumes, fair = the node's fair-share group at its capacity (ratios: to none)",
            f"{'shape':<18}{'bs':<6}{'mode':<6}{'writer IOPS':>12}{'wr p99 ms':>10}{'rd IOPS':>9}{'rd p99 ms':>10}"
            f"{'alone p99':>10}{'MiB/s':>8}{'Jain':>7}"]
    for row in report["mixed"]:
        for mode in MODES:
            m = row[mode]
            p99_ratio = m["reader_p99_ms"] / max(row["none"]["reader_p99_ms"], 1e-9)
            ratios = "" if mode == "none" else f"   x{m['aggregate_ratio']:.2f} MiB/s, x{p99_ratio:.2f} rd p99"
            out.append(f"{row['shape']:<18}{row['writer_bs']:<6}{mode:<6}{m['writer_iops']:>12}{m['writer_p99_ms']:>10}"
                       f"{m['reader_iops']:>9}{m['reader_p99_ms']:>10}{row['readers_alone_p99_ms']:>10}"
                       f"{m['aggregate_mib_s']:>8}{m['jain']:>7}{ratios}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
