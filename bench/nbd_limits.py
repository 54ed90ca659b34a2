#!/usr/bin/env python3
"""What bounds NBD through QEMU's own client (the one a VM's disk runs on): prints figures, not a test.

Two probes, each next to a baseline measured in the same run (the machine may be shared):

* **queue depth**: 4 KiB random reads with ``qemu-img bench`` at queue depths 8 / 16 / 32 / 64
  through ``NbdExportDriver``'s default export and on the local file (``-t none -i native``).
  QEMU's NBD client and server both keep at most 16 requests in flight per connection
  (``MAX_NBD_REQUESTS``), so past 16 the NBD figure should stay flat while the local one may grow.
* **export iothread and throttle node**: a qemu-storage-daemon started here (not by the driver,
  which has no iothread option) with ``--object iothread`` and the export's ``iothread``, against
  the same daemon without it, and with the driver's throttle node (a group without limits: every
  export of the driver has one, so that QoS limits can be set live) between the raw node and the
  export. Each figure is one ``qemu-img bench`` run with a fixed request count on a fresh daemon, because
  QEMU 7.2's daemon aborts when a client of an export in an iothread disconnects; the probe reports
  whether the daemon survived the client's disconnect (the day it does, the option is worth adding
  to the driver). Each of those daemons is measured twice, each time fresh: through QEMU's client and
  through fio's ``nbd`` engine (libnbd), next to fio on the local file.

``--daemon PATH`` runs the hand-started daemons from another qemu-storage-daemon binary (a newer
QEMU, say, unpacked beside the system's), so that the iothread can be re-measured there; the queue
depth probe always runs the driver's own daemon.

Every daemon is stopped by its PID (or QMP ``quit``) in a ``finally``; only 127.0.0.1 is used.

    .venv/bin/python bench/nbd_limits.py --quick    # 1 round, 1 GiB, about 1 minute
    .venv/bin/python bench/nbd_limits.py --rounds 3
    .venv/bin/python bench/nbd_limits.py --quick --daemon /opt/qemu-10/usr/bin/qemu-storage-daemon
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from datapath import (  # noqa: E402
    BLOCK,
    GIB,
    HOST,
    VOLUME_ID,
    Workload,
    evict,
    fio,
    free_port,
    loadavg,
    local_fio_target,
    log,
    make_volume,
    run_tool,
    stride_blocks,
)
from vbs.pools.exports import FileSource  # noqa: E402
from vbs.qemu.qmp import QmpClient, connect_until  # noqa: E402
from vbs.storage.exports.nbd import NbdExportDriver  # noqa: E402
from vbs.storage.exports.nodelay import force_nodelay  # noqa: E402
from vbs.wire.connection import NbdConnection  # noqa: E402

DEPTHS = (8, 16, 32, 64)
EXPORT = "probe"
RAND_READ = Workload("rand read 4k qd32", "randread", BLOCK, 32)
TOOLS = ("QEMU's client", "fio")


def rand_read_iops(target: list[str], size: int, depth: int, count: int) -> float:
    """One ``qemu-img bench`` of ``count`` 4 KiB reads striding through the file, ``depth`` in flight."""
    out = run_tool(["qemu-img", "bench", "-d", str(depth), "-s", str(BLOCK), "-S",
                    str(stride_blocks(size // BLOCK) * BLOCK), "-c", str(count), *target], timeout=600)
    seconds = float(out.rsplit("Run completed in ", 1)[1].split()[0])
    return count / max(seconds, 1e-6)


def local_target(volume: Path) -> list[str]:
    return ["-f", "raw", "-t", "none", "-i", "native", str(volume)]


def nbd_target(host: str, port: int, export: str) -> list[str]:
    return ["--image-opts", f"driver=raw,file.driver=nbd,file.server.type=inet,file.server.host={host},"
            f"file.server.port={port},file.export={export}"]


@contextlib.contextmanager
def driver_export(volume: Path, work: Path) -> Iterator[list[str]]:
    """The product's export (plain TCP on loopback, the driver's defaults)."""
    state = Path(tempfile.mkdtemp(prefix="nbd-", dir=work))
    drv = NbdExportDriver(state, "127.0.0.1", free_port())
    try:
        drv.start()
        c = drv.ensure_export(VOLUME_ID, FileSource(volume), HOST)
        assert isinstance(c, NbdConnection) and c.host is not None and c.port is not None
        yield nbd_target(c.host, c.port, c.export)
    finally:
        drv.stop()


@contextlib.contextmanager
def hand_daemon(volume: Path, work: Path, iothread: bool, throttle: bool,
                daemon: str) -> Iterator[tuple[subprocess.Popen[bytes], list[str], list[str]]]:
    """A qemu-storage-daemon serving ``volume`` as the driver does (file cache.direct aio=native, raw,
    TCP_NODELAY), with the driver's throttle node (a group without limits) on the raw node or not, the
    export in an iothread or not. Yields the process, ``qemu-img`` target arguments and fio's."""
    state = Path(tempfile.mkdtemp(prefix="qsd-", dir=work))
    qmp_path, port = state / "qmp.sock", free_port()
    argv = [daemon, "--chardev", f"socket,path={qmp_path},server=on,wait=off,id=m",
            "--monitor", "chardev=m", "--nbd-server", f"addr.type=inet,addr.host=127.0.0.1,addr.port={port}"]
    if iothread:
        argv += ["--object", "iothread,id=io0"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,  # noqa: S603
                            stderr=subprocess.DEVNULL, start_new_session=True)
    qmp: QmpClient | None = None
    try:
        qmp = connect_until(qmp_path, time.monotonic() + 15, alive=lambda: proc.poll() is None, name="probe")
        qmp.execute("blockdev-add", {"driver": "file", "node-name": "f", "filename": str(volume),
                                     "cache": {"direct": True}, "aio": "native"})
        qmp.execute("blockdev-add", {"driver": "raw", "node-name": "r", "file": "f"})
        top = "r"
        if throttle:
            qmp.execute("object-add", {"qom-type": "throttle-group", "id": "g", "limits": {}})
            qmp.execute("blockdev-add", {"driver": "throttle", "node-name": "t", "throttle-group": "g", "file": "r"})
            top = "t"
        export = {"type": "nbd", "id": "e", "node-name": top, "name": EXPORT, "writable": False}
        if iothread:
            export["iothread"] = "io0"
        qmp.execute("block-export-add", export)
        force_nodelay(proc.pid)
        yield proc, nbd_target("127.0.0.1", port, EXPORT), ["--ioengine=nbd", f"--uri=nbd://127.0.0.1:{port}/{EXPORT}"]
    finally:
        if qmp is not None:
            with contextlib.suppress(Exception):
                if proc.poll() is None:
                    qmp.execute("quit", timeout=5.0)
            qmp.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def calibrated_count(target: list[str], size: int, depth: int, runtime: float) -> int:
    """A request count that lasts about ``runtime`` seconds on ``target`` now."""
    count = 4000
    elapsed = count / rand_read_iops(target, size, depth, count)
    return max(count, int(count * runtime / max(elapsed, 1e-3)))


def depth_probe(volume: Path, work: Path, runtime: float) -> dict[str, dict[int, float]]:
    size = volume.stat().st_size
    out: dict[str, dict[int, float]] = {"local": {}, "nbd": {}}
    local = local_target(volume)
    with driver_export(volume, work) as nbd:
        for name, target in (("nbd", nbd), ("local", local)):
            count = calibrated_count(target, size, 16, runtime)
            for depth in DEPTHS:
                evict(volume)
                out[name][depth] = rand_read_iops(target, size, depth, count)
                log(f"  depth {name:5} qd{depth:<3} {out[name][depth]:9.0f} IOPS  (load {loadavg()})")
    return out


DAEMONS = (("main loop", False, False), ("main loop, throttle node", False, True), ("iothread", True, False))


Probe = tuple[dict[tuple[str, str], float], dict[str, bool], dict[str, float]]


def daemon_probe(volume: Path, work: Path, runtime: float, daemon: str) -> Probe:
    """IOPS at queue depth 32 through each tool for each of ``DAEMONS`` (a fresh daemon per figure),
    whether every daemon outlived its client, and the local file's IOPS through each tool."""
    size = volume.stat().st_size
    iops: dict[tuple[str, str], float] = {}
    survived: dict[str, bool] = {}
    evict(volume)
    local_qemu = local_target(volume)
    local = {TOOLS[0]: rand_read_iops(local_qemu, size, 32, calibrated_count(local_qemu, size, 32, runtime))}
    evict(volume)
    local[TOOLS[1]] = fio(local_fio_target(volume), RAND_READ, runtime).iops
    count = 0
    for name, iothread, throttle in DAEMONS:
        for tool in TOOLS:
            with hand_daemon(volume, work, iothread, throttle, daemon) as (proc, target, fio_target):
                evict(volume)
                failed: RuntimeError | None = None
                try:
                    if tool == "fio":
                        iops[name, tool] = fio(fio_target, RAND_READ, runtime).iops
                    else:
                        if not count:  # calibrated once, on the main-loop daemon (its client may leave safely)
                            count = calibrated_count(target, size, 32, runtime)
                        iops[name, tool] = rand_read_iops(target, size, 32, count)
                except RuntimeError as e:
                    failed, iops[name, tool] = e, math.nan
                time.sleep(0.5)  # the disconnect is handled asynchronously
                alive = proc.poll() is None
                if failed is not None:
                    # fio's nbd engine connects once to learn the size, then again for the job: a daemon
                    # that aborts when a client leaves is gone before the job starts. Nothing to measure.
                    if alive:
                        raise failed
                    log(f"  daemon {name:24} {tool:13} no figure: {str(failed)[:160]}")
                survived[name] = survived.get(name, True) and alive
                log(f"  daemon {name:24} {tool:13} {iops[name, tool]:9.0f} IOPS "
                    f"({iops[name, tool] / local[tool]:.2f} of local), daemon {'alive' if alive else 'ABORTED'} "
                    f"after the client left  (load {loadavg()})")
    return iops, survived, local


def daemon_version(daemon: str) -> str:
    return run_tool([daemon, "--version"], timeout=30).splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, 1 GiB, 2 s per figure")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3, --quick 1); figures are medians")
    p.add_argument("--runtime", type=float, default=None, help="seconds per figure (default 5, --quick 2)")
    p.add_argument("--size-gib", type=int, default=None, help="volume file size (default 2, --quick 1)")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--daemon", default="qemu-storage-daemon",
                   help="the qemu-storage-daemon binary of the hand-started daemons (default: the one on PATH)")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    runtime = args.runtime or (2.0 if args.quick else 5.0)
    size_gib = args.size_gib or (1 if args.quick else 2)
    missing = [t for t in ("qemu-img", "qemu-storage-daemon", "fio", args.daemon) if shutil.which(t) is None]
    if missing:
        print(f"missing tools: {', '.join(missing)}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="vbs-nbdlim-", dir=args.work_dir))
    depths: list[dict[str, dict[int, float]]] = []
    threads: list[Probe] = []
    loads: list[str] = []
    try:
        volume = work / "volume.img"
        log(f"writing {size_gib} GiB of random data to {volume}")
        make_volume(volume, size_gib * GIB)
        for rnd in range(rounds):
            log(f"round {rnd + 1}/{rounds}")
            loads.append(loadavg())
            depths.append(depth_probe(volume, work, runtime))
            threads.append(daemon_probe(volume, work, runtime, args.daemon))
            loads.append(loadavg())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"# NBD limits through QEMU's client ({rounds} round(s), {runtime:g} s per figure, {size_gib} GiB, "
          f"4 KiB random reads; load average during the run: {', '.join(loads)})\n")
    print("## Queue depth (median IOPS; ratio NBD / local at the same depth)\n")
    print("| depth | local | NBD (driver default) | ratio |\n|---|---|---|---|")
    for depth in DEPTHS:
        local = statistics.median(r["local"][depth] for r in depths)
        nbd = statistics.median(r["nbd"][depth] for r in depths)
        print(f"| {depth} | {local:.0f} | {nbd:.0f} | {nbd / local:.2f} |")
    print(f"\n## qemu-storage-daemon started by hand: {daemon_version(args.daemon)} "
          "(queue depth 32, one connection per fresh daemon)\n")
    print("| export on | tool | IOPS per round | of local (same tool and round; median) | daemon outlived its "
          "client |\n|---|---|---|---|---|")
    for tool in TOOLS:
        local_per = " / ".join(f"{t[2][tool]:.0f}" for t in threads)
        print(f"| (local file) | {tool} | {local_per} | 1 | |")
        for name, _, _ in DAEMONS:
            per = " / ".join("none" if math.isnan(t[0][name, tool]) else f"{t[0][name, tool]:.0f}" for t in threads)
            ratios = [t[0][name, tool] / t[2][tool] for t in threads if not math.isnan(t[0][name, tool])]
            ratio = f"{statistics.median(ratios):.2f}" if ratios else "none"
            alive = all(t[1][name] for t in threads)
            print(f"| {name} | {tool} | {per} | {ratio} | "
                  f"{'yes' if alive else 'NO: aborted when the client disconnected'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
