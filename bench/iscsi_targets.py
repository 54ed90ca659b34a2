#!/usr/bin/env python3
"""The user-space iSCSI targets this machine runs, read through QEMU's libiscsi client: prints
figures, not a test.

One 2 GiB file of random data in a temporary directory under /var/tmp, warm in the page cache at the
start of every figure (as ``datapath.py --warm``), is read

* locally: fio ``io_uring`` through the page cache (the fastest local engine here), and
  ``qemu-img bench`` with ``-t none -i native`` (``datapath.py``'s baseline, which reads the disk)
  and with ``-t writeback -i threads`` (through the page cache);
* through tgtd (tgt 1.0.85), started by hand for each variant on a free loopback port with a
  control socket of its own: backing stores ``rdwr`` with ``bsoflags=direct`` (the export driver's)
  and without, ``aio``, ``mmap`` (where this build has it), and ``rdwr`` direct with other
  ``tgtd -t`` (``nr_iothreads``: worker threads per LUN, 16 by default); the driver's negotiation
  ``TUNING`` on every target;
* through istgt (0.4, 2011), one process per variant from a config file, with its ``QueueDepth``
  (commands it queues per LU; 32 by default) at 32, 64 and 128, the same segment lengths, and its
  LU's read and write cache options at their defaults (enabled: in this version they only set
  ``O_FSYNC`` through ``fcntl``, which Linux ignores, and the caching mode page).

Each read goes through ``qemu-img bench -f raw -t none`` on the ``iscsi://`` URL (QEMU's libiscsi
client, the code a VM's disk runs on): 4 KiB at queue depth 32 (qemu-img's stride through the file,
datapath.py's) and 1 MiB at queue depth 8, ``--runtime`` seconds each. For each figure the table
gives IOPS and MB/s, the ratio to each local baseline, and the target's CPU over the run the figure
comes from (utime + stime in ``/proc/PID/stat``, and each thread's in ``/proc/PID/task/*/stat``
sampled every 0.1 s): per request, in cores, and the busiest thread's share of one core: a busiest
thread near 100 % means the target is bound by that thread.

Then, for every target, whether a flush (SCSI SYNCHRONIZE CACHE) reaches the file: ``strace -f`` on
the target counts its fsync / fdatasync / sync_file_range / msync calls while ``qemu-io`` writes
4 KiB with ``-t unsafe`` (no flush sent: the control) and while it writes 4 KiB and flushes.

tgtd is stopped as the export driver stops it (offline, targets deleted, ``--op delete --mode
system`` on its socket; SIGKILL to its PID if it does not exit), istgt by SIGTERM to its PID; all in
a ``finally``. Only 127.0.0.1 is used. Root is needed (tgtd, strace).

    .venv/bin/python bench/iscsi_targets.py --runtime 5 --rounds 1   # about 5 minutes
    .venv/bin/python bench/iscsi_targets.py --quick                  # 2 s a figure, fewer variants
    .venv/bin/python bench/iscsi_targets.py --only istgt-32,tgtd-rdwr-direct
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.common import log, markdown_table  # noqa: E402
from bench.datapath import (  # noqa: E402
    GIB,
    WORKLOADS,
    Figure,
    Workload,
    fio,
    loadavg,
    local_fio_target,
    make_volume,
    qemu_bench,
    run_tool,
    warm_up,
)

from vbs.net.ports import free_port  # noqa: E402
from vbs.storage.exports.iscsi.control import AdmError, TgtControl  # noqa: E402
from vbs.storage.exports.iscsi.state import LiveTarget  # noqa: E402
from vbs.storage.exports.iscsi.targets import TUNING  # noqa: E402

RAND = next(w for w in WORKLOADS if w.key == "rand read 4k qd32")
SHOWN = (RAND, next(w for w in WORKLOADS if w.key == "seq read 1M qd8"))
IQN = "iqn.2026-11.org.vbs.bench:targets"
ISTGT_BASE = "iqn.2026-11.org.vbs.bench"
TICK = os.sysconf("SC_CLK_TCK")
SYNC_CALLS = re.compile(r"\b(fsync|fdatasync|sync_file_range|syncfs|msync)\(")


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    kind: str  # local | tgtd | istgt
    local: tuple[str, ...] = ()  # local: fio | the qemu-img cache and aio options
    bstype: str = "rdwr"
    direct: bool = False  # tgtd bsoflags=direct
    iothreads: int | None = None  # tgtd -t (None: its default, 16)
    queue_depth: int = 32  # istgt QueueDepth


TARGETS = (
    Target("local-fio-uring", "local file, fio io_uring (page cache)", "local", ("fio",)),
    Target("local-qemu-direct", "local file, qemu-img -t none -i native", "local", ("-t", "none", "-i", "native")),
    Target("local-qemu-cached", "local file, qemu-img -t writeback -i threads", "local",
           ("-t", "writeback", "-i", "threads")),
    Target("tgtd-rdwr-direct", "tgtd rdwr bsoflags=direct (the driver's)", "tgtd", direct=True),
    Target("tgtd-rdwr", "tgtd rdwr, page cache", "tgtd"),
    Target("tgtd-aio", "tgtd aio (O_DIRECT always)", "tgtd", bstype="aio"),
    Target("tgtd-mmap", "tgtd mmap", "tgtd", bstype="mmap"),
    Target("tgtd-rdwr-direct-t4", "tgtd rdwr direct, -t 4", "tgtd", direct=True, iothreads=4),
    Target("tgtd-rdwr-t4", "tgtd rdwr page cache, -t 4", "tgtd", iothreads=4),
    Target("tgtd-rdwr-t64", "tgtd rdwr page cache, -t 64", "tgtd", iothreads=64),
    Target("istgt-32", "istgt QueueDepth 32 (its default)", "istgt", queue_depth=32),
    Target("istgt-64", "istgt QueueDepth 64", "istgt", queue_depth=64),
    Target("istgt-128", "istgt QueueDepth 128", "istgt", queue_depth=128),
)
QUICK = ("local-fio-uring", "local-qemu-direct", "local-qemu-cached", "tgtd-rdwr-direct", "tgtd-rdwr", "tgtd-aio",
         "istgt-32")
BASELINES = ("local-fio-uring", "local-qemu-direct", "local-qemu-cached")


# -- the target's CPU ------------------------------------------------------------------------------


def process_ticks(pid: int) -> int:
    """utime + stime of the whole process, threads that ended included, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))


def thread_ticks(pid: int) -> dict[int, int]:
    """utime + stime of each live thread of ``pid``, in clock ticks."""
    out: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = int(fields[11]) + int(fields[12])
    return out


class CpuMeter:
    """The CPU a process spent while a ``qemu-img`` run lasted, the last run it wrapped kept: seconds
    in all threads (the process's own count, which keeps the time of threads that ended), and the
    busiest thread's. Threads are sampled every ``SAMPLE_S`` while the run lasts, because istgt's
    connection threads end with the client's session: the last interval of such a thread is lost."""

    SAMPLE_S = 0.1

    def __init__(self, pid: int | None) -> None:
        self.pid, self.total, self.top = pid, 0.0, 0.0

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        if self.pid is None:
            yield
            return
        pid = self.pid
        total, before = process_ticks(pid), thread_ticks(pid)
        seen = dict(before)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(self.SAMPLE_S):
                seen.update(thread_ticks(pid))

        sampler = threading.Thread(target=sample, name="cpu-sampler", daemon=True)
        sampler.start()
        try:
            yield
        finally:
            done.set()
            sampler.join()
        seen.update(thread_ticks(pid))
        self.total = (process_ticks(pid) - total) / TICK
        self.top = max((t - before.get(tid, 0) for tid, t in seen.items()), default=0) / TICK


@dataclass
class Sample:
    fig: Figure
    cpu: float  # seconds of the target's CPU over the figure's run
    top: float  # of which the busiest thread's


# -- the targets -----------------------------------------------------------------------------------


def last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return lines[-1] if lines else "(nothing logged)"


def wait_port(port: int, proc: subprocess.Popen[bytes], name: str, log_path: Path, timeout: float = 15.0) -> None:
    """Until the daemon ``proc`` accepts connections on ``port``; its log's last line if it exits."""
    def why() -> str:
        return f": {last_line(log_path)}"

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}) before it listened on {port}{why()}")
        with socket.socket() as s, contextlib.suppress(OSError):
            s.settimeout(0.5)
            s.connect(("127.0.0.1", port))
            return
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not listen on {port} within {timeout:g} s")


def reap(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for ``proc`` to exit, then SIGKILL it by its PID."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def tgtd(t: Target, volume: Path, work: Path) -> Iterator[tuple[str, int]]:
    """A tgtd of its own serving ``volume`` as LUN 1 of one target; yields (URL, PID)."""
    state = Path(tempfile.mkdtemp(prefix="tgtd-", dir=work))
    port = free_port()
    control = port % 32768
    ctl = TgtControl(control, state / "tgtd.sock", timeout=10.0)
    argv = ["tgtd", "-f", "-C", str(control), "--iscsi", f"portal=127.0.0.1:{port}"]
    if t.iothreads is not None:
        argv += ["-t", str(t.iothreads)]
    with open(state / "tgtd.log", "wb") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,  # noqa: S603
                                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "TGT_IPC_SOCKET": str(ctl.socket_base)},
                                start_new_session=True)
    live = LiveTarget(tid=1, iqn=IQN)
    made = False
    try:
        wait_port(port, proc, "tgtd", state / "tgtd.log")
        ctl.probe()
        ctl.new_target(live.tid, IQN)
        made = True
        for name, value in TUNING:
            ctl.set_param(live, name, value)
        store: tuple[tuple[str, str], ...] = (("path", str(volume)), ("bstype", t.bstype))
        if t.direct:
            store += (("bsoflags", "direct"),)
        try:
            ctl.new_lun(live, 1, store)
        except AdmError as exc:
            raise RuntimeError(f"tgtd refused a {t.bstype} LUN: {exc.detail} (its log: "
                               f"{last_line(state / 'tgtd.log')})") from exc
        ctl.bind_acl(live, "initiator-address", "127.0.0.1")
        yield f"iscsi://127.0.0.1:{port}/{IQN}/1", proc.pid
    finally:
        try:
            if proc.poll() is None:
                ctl.go_offline()
                if made:
                    ctl.delete_target(live, force=True)
                ctl.shut_down()
        except AdmError as exc:
            log(f"  tgtd did not stop on request ({exc.detail}): SIGKILL")
        reap(proc, 10.0)
        shutil.rmtree(state, ignore_errors=True)


def istgt_config(t: Target, volume: Path, state: Path, port: int) -> str:
    # The segment lengths of the tgtd export's TUNING; InitialR2T is Yes (istgt takes no other).
    tuning = dict(TUNING)
    return f"""[Global]
  NodeBase "{ISTGT_BASE}"
  PidFile {state}/istgt.pid
  AuthFile {state}/auth.conf
  MediaDirectory {state}
  Timeout 30
  NopInInterval 20
  DiscoveryAuthMethod None
  MaxSessions 16
  MaxConnections 4
  MaxR2T 32
  MaxOutstandingR2T 16
  DefaultTime2Wait 2
  DefaultTime2Retain 60
  FirstBurstLength {tuning['FirstBurstLength']}
  MaxBurstLength {tuning['MaxBurstLength']}
  MaxRecvDataSegmentLength {tuning['MaxRecvDataSegmentLength']}
  InitialR2T Yes
  ImmediateData Yes
  DataPDUInOrder Yes
  DataSequenceInOrder Yes
  ErrorRecoveryLevel 0

[UnitControl]
  AuthMethod None
  AuthGroup None

[PortalGroup1]
  Portal DA1 127.0.0.1:{port}

[InitiatorGroup1]
  InitiatorName ALL
  Netmask 127.0.0.1/32

[LogicalUnit1]
  TargetName targets
  Mapping PortalGroup1 InitiatorGroup1
  AuthMethod None
  AuthGroup None
  UseDigest Auto
  ReadOnly No
  UnitType Disk
  UnitOnline Yes
  QueueDepth {t.queue_depth}
  LUN0 Storage {volume} Auto
  LUN0 Option ReadCache Enable
  LUN0 Option WriteCache Enable
"""


@contextlib.contextmanager
def istgt(t: Target, volume: Path, work: Path) -> Iterator[tuple[str, int]]:
    """An istgt of its own serving ``volume`` as LUN 0; yields (URL, PID)."""
    state = Path(tempfile.mkdtemp(prefix="istgt-", dir=work))
    port = free_port()
    conf = state / "istgt.conf"
    conf.write_text(istgt_config(t, volume, state, port))
    conf.chmod(0o600)
    (state / "auth.conf").write_text("")
    with open(state / "istgt.log", "wb") as logf:
        # -D: stays in the foreground, so its PID is ours.
        proc = subprocess.Popen(["istgt", "-c", str(conf), "-D"], stdin=subprocess.DEVNULL,  # noqa: S603
                                stdout=logf, stderr=logf, start_new_session=True)
    try:
        wait_port(port, proc, "istgt", state / "istgt.log")
        yield f"iscsi://127.0.0.1:{port}/{ISTGT_BASE}:targets/0", proc.pid
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)  # it shuts its LUs down and exits (a few seconds)
        reap(proc, 15.0)
        shutil.rmtree(state, ignore_errors=True)


@contextlib.contextmanager
def served(t: Target, volume: Path, work: Path) -> Iterator[tuple[str, int]]:
    with (tgtd if t.kind == "tgtd" else istgt)(t, volume, work) as got:
        yield got


# -- measuring -------------------------------------------------------------------------------------


def local_figure(t: Target, volume: Path, w: Workload, runtime: float) -> Figure:
    if t.local == ("fio",):
        return fio(local_fio_target(volume, "io_uring"), w, runtime)
    return qemu_bench(["-f", "raw", *t.local, str(volume)], w, runtime, volume.stat().st_size)


def measure(t: Target, volume: Path, work: Path, runtime: float) -> dict[str, Sample]:
    out: dict[str, Sample] = {}
    if t.kind == "local":
        for w in SHOWN:
            warm_up(volume)
            load = loadavg()
            fig = local_figure(t, volume, w, runtime)
            fig.load = float(load.split()[0])
            out[w.key] = Sample(fig, 0.0, 0.0)
            log(f"  {t.key:20} {w.key:18} {fig.mbps:8.1f} MB/s {fig.iops:8.0f} IOPS  (load {load})")
        return out
    with served(t, volume, work) as (url, pid):
        for w in SHOWN:
            warm_up(volume)
            load = loadavg()
            meter = CpuMeter(pid)
            fig = qemu_bench(["-f", "raw", "-t", "none", url], w, runtime, volume.stat().st_size,
                             around=meter.around)
            fig.load = float(load.split()[0])
            out[w.key] = Sample(fig, meter.total, meter.top)
            log(f"  {t.key:20} {w.key:18} {fig.mbps:8.1f} MB/s {fig.iops:8.0f} IOPS, target CPU "
                f"{meter.total / fig.seconds:.2f} cores, busiest thread {meter.top / fig.seconds:.0%}  (load {load})")
    return out


def strace_syncs(pid: int, work: Path, io_argv: list[str]) -> list[str]:
    """The sync calls (fsync, fdatasync, sync_file_range, syncfs, msync) the process ``pid`` makes,
    in any thread, while ``io_argv`` (a qemu-io) runs."""
    trace = work / "strace.out"
    trace.unlink(missing_ok=True)
    with open(work / "strace.err", "wb") as err:
        tracer = subprocess.Popen(["strace", "-f", "-e", "trace=fsync,fdatasync,sync_file_range,syncfs,msync",  # noqa: S603
                                   "-o", str(trace), "-p", str(pid)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 10
        while b"attached" not in (work / "strace.err").read_bytes():
            if tracer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"strace did not attach: {(work / 'strace.err').read_text(errors='replace')[-200:]}")
            time.sleep(0.05)
        run_tool(io_argv, timeout=60)
        time.sleep(0.3)  # a flush the target answers after qemu-io left
    finally:
        tracer.send_signal(signal.SIGINT)  # strace detaches and exits
        reap(tracer, 10.0)
    return SYNC_CALLS.findall(trace.read_text(errors="replace")) if trace.exists() else []


def flush_check(t: Target, volume: Path, work: Path) -> str:
    """Whether a flush makes the target sync the file: sync calls without a flush (qemu-io -t unsafe
    never sends one) and with one."""
    with served(t, volume, work) as (url, pid):
        write = ["-c", "write -P 0xa5 0 4k"]
        quiet = strace_syncs(pid, work, ["qemu-io", "-f", "raw", "-t", "unsafe", *write, url])
        flushed = strace_syncs(pid, work, ["qemu-io", "-f", "raw", "-t", "writeback", *write, "-c", "flush", url])
    verdict = "yes" if len(flushed) > len(quiet) else "NO"
    return (f"{verdict} (sync calls: {len(quiet)} for a write without flush, {len(flushed)} for a write and a "
            f"flush{': ' + ', '.join(flushed) if flushed else ''})")


# -- report ----------------------------------------------------------------------------------------


def median_sample(samples: list[Sample]) -> Sample:
    return sorted(samples, key=lambda s: s.fig.iops)[len(samples) // 2]


def report(results: dict[str, dict[str, list[Sample]]], flushes: dict[str, str], notes: dict[str, str],
           args: argparse.Namespace, loads: tuple[str, str]) -> str:
    chosen = [t for t in TARGETS if t.key in results or t.key in notes]
    lines = [f"# User-space iSCSI targets through QEMU's libiscsi ({args.runtime:g} s a figure, {args.rounds} "
             f"round(s), medians; {args.size_gib} GiB file warm in the page cache; MB = 10^6 bytes)", "",
             f"Load average (1 / 5 / 15 min): {loads[0]} at the start, {loads[1]} at the end; "
             f"{os.cpu_count()} CPUs. Every iSCSI figure: qemu-img bench -f raw -t none on the iscsi:// URL.", ""]
    base = {b: {k: median_sample(v).fig for k, v in results[b].items()} for b in BASELINES if b in results}
    short = {"local-fio-uring": "× fio", "local-qemu-direct": "× qemu direct", "local-qemu-cached": "× qemu cached"}
    for w in SHOWN:
        rows = []
        for t in chosen:
            if t.key in notes and t.key not in results:
                rows.append([t.label, notes[t.key], *([""] * (len(base) + 3))])
                continue
            samples = results[t.key].get(w.key)
            if not samples:
                rows.append([t.label, "failed", *([""] * (len(base) + 3))])
                continue
            s = median_sample(samples)
            f = s.fig
            ratios = [f"{f.iops / base[b][w.key].iops:.2f}" if w.key in base[b] else "—" for b in base]
            if t.kind == "local":
                cpu = ["", "", ""]
            else:
                cpu = [f"{s.cpu / (f.iops * f.seconds) * 1e6:.0f}", f"{s.cpu / f.seconds:.2f}",
                       f"{s.top / f.seconds:.0%}"]
            rows.append([t.label, f"{f.iops:,.0f} / {f.mbps:,.0f}", *ratios, *cpu])
        lines += [f"## {w.key}", "", markdown_table(
            ["target", "IOPS / MB/s", *[short[b] for b in base], "target CPU µs/request", "target cores",
             "busiest thread"], rows), ""]
    if flushes:
        lines += ["## Does a flush (SYNCHRONIZE CACHE) reach the file? (strace -f on the target)", "",
                  markdown_table(["target", "flushes"],
                                 [[t.label, flushes[t.key]] for t in chosen if t.key in flushes]), ""]
    if args.rounds > 1:
        lines += ["Per round, 4 KiB random IOPS: " + "; ".join(
            f"{t.key} " + " / ".join(f"{s.fig.iops:.0f}" for s in results[t.key].get(RAND.key, []))
            for t in chosen if t.key in results), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"2 s a figure, only {', '.join(QUICK)}")
    p.add_argument("--runtime", type=float, default=None, help="seconds per figure (default 5, --quick 2)")
    p.add_argument("--rounds", type=int, default=1, help="rounds; figures are medians (default 1)")
    p.add_argument("--size-gib", type=int, default=2, help="file size (default 2)")
    p.add_argument("--only", default=None, help="comma-separated target keys (--list)")
    p.add_argument("--list", action="store_true", help="list the target keys and exit")
    p.add_argument("--no-flush-check", action="store_true", help="skip the strace check of flushes")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp"), help="where the file goes (default /var/tmp)")
    args = p.parse_args(argv)
    if args.list:
        for t in TARGETS:
            print(f"{t.key:22} {t.label}")
        return 0
    if args.runtime is None:
        args.runtime = 2.0 if args.quick else 5.0
    only = args.only.split(",") if args.only else list(QUICK) if args.quick else None
    chosen = [t for t in TARGETS if only is None or t.key in only]
    need = {"fio", "qemu-img", "qemu-io"} | ({"tgtd"} if any(t.kind == "tgtd" for t in chosen) else set()) | (
        {"istgt"} if any(t.kind == "istgt" for t in chosen) else set()) | (
        set() if args.no_flush_check else {"strace"})
    missing = sorted(x for x in need if shutil.which(x) is None)
    if missing:
        print(f"missing tools: {', '.join(missing)}", file=sys.stderr)
        return 2
    results: dict[str, dict[str, list[Sample]]] = {}
    notes: dict[str, str] = {}
    flushes: dict[str, str] = {}
    start_load = loadavg()
    work = Path(tempfile.mkdtemp(prefix="vbs-isct-", dir=args.work_dir))
    try:
        volume = work / "volume.img"
        log(f"writing {args.size_gib} GiB of random data to {volume} (load {start_load})")
        make_volume(volume, args.size_gib * GIB)
        for rnd in range(args.rounds):
            for t in chosen:
                if t.key in notes:
                    continue
                log(f"round {rnd + 1}/{args.rounds}: {t.key} ({t.label})")
                try:
                    got = measure(t, volume, work, args.runtime)
                except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                    log(f"  {t.key}: FAILED {type(exc).__name__}: {exc}")
                    notes[t.key] = f"failed: {str(exc)[:160]}"
                    continue
                for k, s in got.items():
                    results.setdefault(t.key, {}).setdefault(k, []).append(s)
        if not args.no_flush_check:
            for t in chosen:
                if t.kind == "local" or t.key not in results or (t.kind == "tgtd" and t.iothreads is not None):
                    continue  # the worker count does not change the backing store's flush
                log(f"flush check: {t.key}")
                try:
                    flushes[t.key] = flush_check(t, volume, work)
                except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                    flushes[t.key] = f"not checked: {str(exc)[:160]}"
                log(f"  {t.key}: {flushes[t.key]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(results, flushes, notes, args, (start_load, loadavg())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
