#!/usr/bin/env python3
"""NBD reads across a bridge of network namespaces against the same over loopback: prints figures (it is
not a test). Run as root.

Two machines of a namespace cluster (``vbs.rigs.netns``, docs/install.md "Trying it in network
namespaces"): ``stor-1`` serves a file of random data with ``qemu-storage-daemon`` (the export daemon
of VBS's nbd driver: ``cache.direct``, ``aio=native``, TCP_NODELAY forced as the driver
forces it; plaintext: fio's libnbd refuses a TLS-PSK key file
named in a URI), and fio's ``nbd`` engine reads it, from ``stor-1`` itself over its loopback
(the baseline) and from ``hv-1`` across the bridge (veth pairs on a bridge in a switch namespace, as the
cluster test's machines are). Workloads: sequential 1 MiB reads at queue depth 8 and random 4 KiB reads
at depth 32, each ``--seconds`` long, the paths interleaved round by round so that the load of a shared
machine falls on both alike. Prints the median of the rounds per path and the ratio of the bridge to
loopback. The daemon is stopped by its PID and the namespaces are removed at the end.

Then the same reads through QEMU's own clients, as a VM's disk reads (``qemu-img bench``, its NBD
client and its libiscsi one; fio has no libiscsi engine here): the NBD export above, and ``tgtd`` on
``stor-1`` serving the same file as an iSCSI LUN (``bstype=rdwr``, ``bsoflags=direct``, as VBS's iscsi
driver makes it), set up on tgtd's management socket as the driver does. ``qemu-img bench`` reads at a
stride coprime with the file's block count (one pass touches every block once, consecutive reads far
apart), as bench/datapath.py does.

    .venv/bin/python bench/netns_path.py --quick     # 1 round of 3 s per case (about half a minute)
    .venv/bin/python bench/netns_path.py             # 3 rounds of 5 s (about two minutes)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO))

from bench.common import log  # noqa: E402

from vbs.rigs.netns import Machine, NetnsCluster, wait_listening  # noqa: E402
from vbs.storage.exports.iscsi.control import TgtControl  # noqa: E402
from vbs.storage.exports.iscsi.state import LiveTarget  # noqa: E402
from vbs.storage.exports.nodelay import force_nodelay  # noqa: E402

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


ISCSI_PORT = 3260
IQN = "iqn.2026-11.org.vbs.bench:netns-path"
_COMPLETED = re.compile(r"Run completed in ([0-9.]+) seconds")
QEMU_WORKLOADS = {"seq read 1M qd8": (1 << 20, 8, False), "rand read 4k qd32": (4096, 32, True)}


def stride_blocks(nblocks: int) -> int:
    """A block stride near the golden ratio of the file, coprime with its block count (bench/datapath.py's)."""
    p = int(nblocks * 0.6180339887) | 1
    while math.gcd(p, nblocks) != 1:
        p += 2
    return p


def qemu_img(cluster: NetnsCluster, machine: str, url: str, bs: int, depth: int, spread: bool,
             seconds: int) -> float:
    """``qemu-img bench`` on ``machine`` reading ``url`` for about ``seconds``: MiB/s for 1M blocks, IOPS for
    4k ones (a short run sizes the count of the measured one)."""
    base = ["qemu-img", "bench", "-f", "raw", "-d", str(depth), "-s", str(bs)]
    if spread:
        nblocks = FILE_MIB * (1 << 20) // bs
        base += ["-S", str(stride_blocks(nblocks) * bs)]

    def once(count: int) -> float:
        proc = cluster.run(cluster.machines[machine], [*base, "-c", str(count), url], env=PATH_ENV,
                           timeout=seconds * 10 + 120)
        found = _COMPLETED.search(proc.stdout)
        if proc.returncode != 0 or found is None:
            raise SystemExit(f"qemu-img bench on {machine} failed: {(proc.stderr or proc.stdout).strip()[-600:]}")
        return max(float(found.group(1)), 1e-6)

    count = 4 * depth
    elapsed = once(count)
    while elapsed < 0.5:
        count *= 4
        elapsed = once(count)
    count = max(count, int(count * seconds / elapsed))
    elapsed = once(count)
    return count * bs / elapsed / (1 << 20) if bs == 1 << 20 else count / elapsed


def serve_iscsi(cluster: NetnsCluster, stor: Machine, data: Path, work: Path
                ) -> tuple[subprocess.Popen[bytes], TgtControl]:
    """tgtd in ``stor``'s namespace serving ``data`` as LUN 1 of IQN to any address, made on its
    management socket (a file path, reached from this namespace) as VBS's iscsi driver makes a LUN."""
    control_port = 20000 + os.getpid() % 10000
    socket_base = work / "tgt"
    server = cluster.start(stor, ["tgtd", "-f", "-C", str(control_port), "--iscsi", f"portal=0.0.0.0:{ISCSI_PORT}"],
                           log=work / "tgtd.log", env={**PATH_ENV, "TGT_IPC_SOCKET": str(socket_base)})
    wait_listening(cluster, stor, ISCSI_PORT, 60)
    tgt = TgtControl(control_port, socket_base, 30.0)
    live = LiveTarget(tid=1, iqn=IQN)
    tgt.new_target(1, IQN)
    tgt.new_lun(live, 1, (("path", str(data)), ("bstype", "rdwr"), ("bsoflags", "direct")))
    tgt.bind_acl(live, "initiator-address", "ALL")
    return server, tgt


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
    for tool in ("qemu-storage-daemon", "fio", "tgtd", "qemu-img"):
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
                # As VBS's nbd driver does: QEMU 7.2's NBD server sets no TCP_NODELAY, and QEMU's NBD client
                # then stalls on delayed ACKs over loopback (about 360 IOPS for 4 KiB reads; fio's libnbd
                # is not hurt). The option passes from the listening socket to every connection.
                force_nodelay(server.pid)
                for r in range(args.rounds):
                    for label, (rw, bs, depth) in WORKLOADS.items():
                        for path, (machine, host) in paths.items():
                            value = fio(cluster, machine, f"nbd://{host}:{PORT}/vol", rw, bs, depth, args.seconds)
                            results.setdefault((mode, label, path), []).append(value)
                            log(f"round {r + 1} {mode} {label} {path}: {value:.0f}")
                    for label, (size, depth, spread) in QEMU_WORKLOADS.items():
                        for path, (machine, host) in paths.items():
                            value = qemu_img(cluster, machine, f"nbd://{host}:{PORT}/vol", size, depth, spread,
                                             args.seconds)
                            results.setdefault(("nbd qemu", label, path), []).append(value)
                            log(f"round {r + 1} nbd qemu-img {label} {path}: {value:.0f}")
                server.terminate()  # it exits on SIGTERM; the cluster's close checks it by its PID
                server.wait(60)
            tgtd, _tgt = serve_iscsi(cluster, stor, data, work)
            try:
                for r in range(args.rounds):
                    for label, (size, depth, spread) in QEMU_WORKLOADS.items():
                        for path, (machine, host) in paths.items():
                            url = f"iscsi://{host}:{ISCSI_PORT}/{IQN}/1"
                            value = qemu_img(cluster, machine, url, size, depth, spread, args.seconds)
                            results.setdefault(("iscsi", label, path), []).append(value)
                            log(f"round {r + 1} iscsi qemu-img {label} {path}: {value:.0f}")
            finally:
                tgtd.kill()  # tgtd ignores SIGTERM; by its PID
                tgtd.wait(60)
        print(f"\nNBD reads, qemu-storage-daemon on stor-1, fio's nbd engine; median of {args.rounds} round(s) of "
              f"{args.seconds} s; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print("(rows 'nbd qemu' and 'iscsi': qemu-img bench, QEMU's NBD and libiscsi clients; tgtd for iSCSI)")
        print(f"{'mode':8} {'workload':18} {'loopback':>10} {'bridge':>10} {'ratio':>6}")
        for mode in (*MODES, "nbd qemu", "iscsi"):
            for label in (WORKLOADS if mode in MODES else QEMU_WORKLOADS):
                unit = "MiB/s" if "1M" in label else "IOPS"
                lo = statistics.median(results[(mode, label, "loopback")])
                br = statistics.median(results[(mode, label, "bridge")])
                print(f"{mode:8} {label:18} {lo:10.0f} {br:10.0f} {br / lo:6.2f}  ({unit})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
