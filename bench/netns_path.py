#!/usr/bin/env python3
"""NBD reads across a bridge of network namespaces against the same over loopback: prints figures (it is
not a test). Run as root.

Two machines of a namespace cluster (``vbs.rigs.netns``, docs/install.md "Trying it in network
namespaces"): ``stor-1`` serves a file of random data with ``qemu-storage-daemon`` (the export daemon
of VBS's nbd driver: ``cache.direct``, ``aio=native``; plaintext: fio's libnbd refuses a TLS-PSK key file
named in a URI), and fio's ``nbd`` engine reads it, from ``stor-1`` itself over its loopback
(the baseline) and from ``hv-1`` across the bridge (veth pairs on a bridge in a switch namespace, as the
cluster test's machines are). Workloads: sequential 1 MiB reads at queue depth 8 and random 4 KiB reads
at depth 32, each ``--seconds`` long, the paths interleaved round by round so that the load of a shared
machine falls on both alike. Prints the median of the rounds per path and the ratio of the bridge to
loopback. The daemon is stopped by its PID and the namespaces are removed at the end.

    .venv/bin/python bench/netns_path.py --quick     # 1 round of 3 s per case (about 15 s)
    .venv/bin/python bench/netns_path.py             # 3 rounds of 5 s (about a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO))

from bench.common import log  # noqa: E402

from vbs.rigs.netns import NetnsCluster, wait_listening  # noqa: E402

PORT = 10809
FILE_MIB = 256
PATH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
MODES = ("plain",)  # TLS: to do (fio's libnbd takes no PSK file from a URI; qemu-img bench would)
WORKLOADS = {"seq read 1M qd8": ("read", "1M", 8), "rand read 4k qd32": ("randread", "4k", 32)}


def fio(cluster: NetnsCluster, machine: str, uri: str, rw: str, bs: str, depth: int, seconds: int) -> float:
    """fio's nbd engine on ``machine`` against ``uri``: MiB/s for 1M blocks, IOPS for 4k ones."""
    argv = ["fio", "--name=r", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}",
            f"--runtime={seconds}", "--time_based", f"--size={FILE_MIB}M", "--output-format=json"]
    proc = cluster.run(cluster.machines[machine], argv, env=PATH_ENV, timeout=seconds + 120)
    if proc.returncode != 0:
        raise SystemExit(f"fio on {machine} ({uri}) failed: {proc.stderr.strip()[-600:]}")
    read = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]["read"]
    return float(read["bw_bytes"]) / (1 << 20) if bs == "1M" else float(read["iops"])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 3
    if os.geteuid() != 0:
        raise SystemExit("bench/netns_path.py makes network namespaces: run it as root")
    for tool in ("qemu-storage-daemon", "fio"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed")
    work = Path(tempfile.mkdtemp(prefix="vbsbp", dir="/tmp"))
    try:
        data = work / "data.raw"
        with data.open("wb") as f:
            for _ in range(FILE_MIB):
                f.write(os.urandom(1 << 20))
        results: dict[tuple[str, str, str], list[float]] = {}
        with NetnsCluster(f"vbsbp{os.getpid() % 100000}") as cluster:
            stor = cluster.add("stor-1", 20)
            cluster.add("hv-1", 30)
            paths = {"loopback": ("stor-1", "127.0.0.1"), "bridge": ("hv-1", stor.address)}
            for mode in MODES:
                nbd = f"addr.type=inet,addr.host=0.0.0.0,addr.port={PORT}"
                argv = ["qemu-storage-daemon",
                        "--blockdev", f"driver=file,node-name=f,filename={data},cache.direct=on,aio=native",
                        "--blockdev", "driver=raw,node-name=r,file=f", "--nbd-server", nbd,
                        "--export", "type=nbd,id=e,node-name=r,name=vol"]
                server = cluster.start(stor, argv, log=work / f"qsd-{mode}.log", env=PATH_ENV)
                wait_listening(cluster, stor, PORT, 60)
                for r in range(args.rounds):
                    for label, (rw, bs, depth) in WORKLOADS.items():
                        for path, (machine, host) in paths.items():
                            value = fio(cluster, machine, f"nbd://{host}:{PORT}/vol", rw, bs, depth, args.seconds)
                            results.setdefault((mode, label, path), []).append(value)
                            log(f"round {r + 1} {mode} {label} {path}: {value:.0f}")
                server.terminate()  # it exits on SIGTERM; the cluster's close checks it by its PID
                server.wait(60)
        print(f"\nNBD reads, qemu-storage-daemon on stor-1, fio's nbd engine; median of {args.rounds} round(s) of "
              f"{args.seconds} s; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"{'mode':8} {'workload':18} {'loopback':>10} {'bridge':>10} {'ratio':>6}")
        for mode in MODES:
            for label in WORKLOADS:
                unit = "MiB/s" if "1M" in label else "IOPS"
                lo = statistics.median(results[(mode, label, "loopback")])
                br = statistics.median(results[(mode, label, "bridge")])
                print(f"{mode:8} {label:18} {lo:10.0f} {br:10.0f} {br / lo:6.2f}  ({unit})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
