#!/usr/bin/env python3
"""Remote block access against RTT: prints figures (it is not a test) and the crossovers of placement.

This kernel has no netem: a **delay proxy** stands between host and storage node, an asyncio TCP
proxy that releases each chunk it reads at its arrival + RTT/2, in each direction, and reads on
while earlier chunks wait (the pipe stays full: it delays, it does not stop-and-wait). Its loop
runs on a ``select`` selector, whose timeout has microsecond resolution (epoll's is a millisecond).
Its own ceiling is measured at 0 ms against a direct connection, and the RTT it really adds is
measured at each setting (an echo through it) and reported next to the nominal one.

Measured, at each RTT (default 0, 1, 2, 4, 8, 16, 50 ms), through the real export drivers of a
volume file (bench/datapath.py's ``served``: qemu-storage-daemon's NBD, tgtd's iSCSI) and QEMU's own
clients (``qemu-img bench``, the code a VM's disk runs through):

- NBD and iSCSI throughput, sequential read 1 MiB at queue depth 8, and 4 KiB random-read IOPS at
  queue depth 32;
- the paper's (docs/architecture.md §1) two jobs, run remote through the proxy (NBD) and local (direct, 0 ms): an
  **I/O-bound** job (read the whole volume ``--passes`` times: ``qemu-img convert`` to ``null-co``)
  and a **CPU-bound** job (read 16 MiB of it, then hash it over and over: about ``--cpu-seconds``
  of this process's CPU time, so that other tenants of the machine do not add their share).

Measured at each RTT, both moves of the paper's experiment, through the proxy with VBS's own code
(bench/rtt_moves.py):

- **migrate-volume**: the new node's ``FileBackend.pull_volume`` (``qemu-img convert`` from the NBD
  export, ``vbs.storage.pull``) pulls the volume through the proxy, until the copy is ready (and then
  compared with the source, off the clock);
- **migrate-instance**: QEMU's live migration (``QemuDriver.listen_for_migration`` / ``migrate``) of a
  bare VM of ``--memory-mib`` MiB whose RAM maps a file of random data (no zero page to skip), to a
  twin waiting with ``-incoming defer``, the stream through a proxy of its own, until the destination
  runs; the bytes sent are QEMU's (``query-migrate``).

Each job after a move = the move, measured + the job measured local (direct, 0 ms): after either
move the VM and its data are on one side. The crossovers: the RTT from which each move beats staying
(where least-squares lines through the rows cross). ``--computed`` skips the moves and computes them
as earlier versions did (the memory at the measured NBD sequential rate; one whole-volume read).

``--calibration-out FILE`` writes the NBD and iSCSI points (measured RTT, MiB/s, IOPS) and the copy
throughput for the controller's advice model (``rtt_calibration_file``). Every daemon is stopped by
its driver, each VM by its PID, in a ``finally``; only 127.0.0.1 is used. MiB = 2^20 bytes.

    .venv/bin/python bench/rtt.py --quick                     # 64 MiB volume, 128 MiB VM, 1 s per figure
    .venv/bin/python bench/rtt.py --rtts 0,1,2,4,8,16,50 --calibration-out var/rtt-calibration.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import re
import selectors
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import datapath  # noqa: E402
import rtt_moves  # noqa: E402
from datapath import MIB, Figure, Workload, log, make_volume, qemu_bench, qemu_convert, run_tool  # noqa: E402
from rtt_moves import Move  # noqa: E402
from vbs.wire.connection import NbdConnection  # noqa: E402

SEQ = Workload("seq read 1M qd8", "read", MIB, 8)
RAND = Workload("rand read 4k qd32", "randread", 4096, 32)
CHUNK = 1 << 20
# What one direction of a proxied connection may hold in flight by default (the "link's" window): the
# proxy ends TCP on each side, so the sender's own window never sees the RTT; this one does.
PROXY_BUFFER = 64 << 20
VARIANT = {"nbd": "nbd-native-q", "iscsi": "iscsi-direct"}
CPU_JOB_MIB = 16


# -- the delay proxy --------------------------------------------------------------------------------


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that delays each direction by ``rtt_ms / 2``, in a thread of its own.

    ``rtt_ms`` may change between connections (``set_rtt``); 0 forwards at once (its own ceiling).
    ``window``: the bytes each direction holds in flight at most (a TCP window over the delayed link:
    a chunk's room comes back a full RTT after it arrived, as the ack of its delivery would).
    """

    def __init__(self, target_port: int, rtt_ms: float = 0.0, window: int = PROXY_BUFFER) -> None:
        self.target_port = target_port
        self.rtt_ms = rtt_ms
        self.window = window
        self.port = 0
        self._loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def set_rtt(self, rtt_ms: float) -> None:
        self.rtt_ms = rtt_ms

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def shut() -> None:
            assert self._server is not None
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        delay = self.rtt_ms / 2000
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        for w in (writer, up_w):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(self._pipe(reader, up_w, delay), self._pipe(up_r, writer, delay))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, up_w):
                w.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
        """Forward ``reader`` to ``writer``, each chunk released ``delay`` s after it arrived."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        room = asyncio.Event()
        room.set()
        held = 0

        def release(size: int) -> None:
            nonlocal held
            held -= size
            if held < self.window:
                room.set()

        async def pump_in() -> None:
            nonlocal held
            while True:
                while held >= self.window:
                    room.clear()
                    await room.wait()
                data = await reader.read(min(CHUNK, self.window - held))
                queue.put_nowait((loop.time() + delay, data))
                if not data:
                    return
                held += len(data)

        async def pump_out() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                # The window opens again when the receiver's ack would arrive: one more RTT/2.
                loop.call_later(delay, release, len(data))

        await asyncio.gather(pump_in(), pump_out())


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A one-byte echo on 127.0.0.1 (threads): what the proxy's real RTT is measured against."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(64):
                conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        srv.close()


def measured_rtt_ms(port: int, samples: int = 21) -> float:
    """Median round trip of one byte through ``port`` (to an echo behind it)."""
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(samples):
            start = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


# -- measurements -----------------------------------------------------------------------------------

_PORT = re.compile(r"(file\.server\.port=|@127\.0\.0\.1:)(\d+)")


def daemon_port(target: list[str]) -> int:
    for arg in target:
        m = _PORT.search(arg)
        if m:
            return int(m.group(2))
    raise RuntimeError(f"no port in {target}")


def via(target: list[str], port: int) -> list[str]:
    """``target`` (qemu-img arguments) pointed at ``port`` instead of the daemon's."""
    return [_PORT.sub(lambda m: f"{m.group(1)}{port}", a) for a in target]


def cpu_rounds(data: bytes, seconds: float) -> int:
    """How many SHA-256 passes over ``data`` take about ``seconds`` here."""
    start = time.process_time()
    for _ in range(5):
        hashlib.sha256(data).digest()
    one = max((time.process_time() - start) / 5, 1e-6)
    return max(1, round(seconds / one))


def io_job(target: list[str], size: int, passes: int) -> tuple[float, float]:
    """Seconds to read the whole volume ``passes`` times (qemu-img convert to null-co, 8 coroutines),
    and the first pass alone (what copying the volume over the same link takes)."""
    times = [qemu_convert(target, SEQ, size).seconds for _ in range(passes)]
    return sum(times), times[0]


def cpu_job(target: list[str], work: Path, rounds: int) -> float:
    """Seconds to read the first 16 MiB (wall clock) and hash them ``rounds`` times (this process's CPU
    time: the other tenants of a shared machine do not add their share)."""
    opts = target[target.index("--image-opts") + 1].replace("driver=raw,", f"driver=raw,size={CPU_JOB_MIB * MIB},", 1)
    out = work / "cpu-input.raw"
    start = time.perf_counter()
    run_tool(["qemu-img", "convert", "--image-opts", opts, "-O", "raw", str(out)], timeout=600)
    data = out.read_bytes()
    read_s = time.perf_counter() - start
    cpu_start = time.process_time()
    for _ in range(rounds):
        hashlib.sha256(data).digest()
    out.unlink()
    return read_s + time.process_time() - cpu_start


@dataclass
class Point:
    nominal_ms: float
    rtt_ms: float  # through the proxy, measured (0 for the direct connection)
    seq: Figure | None = None
    rand: Figure | None = None
    io_job_s: float | None = None
    copy_s: float | None = None  # one pass: the volume copied over this link
    cpu_job_s: float | None = None
    moved_volume: Move | None = None  # migrate-volume: FileBackend.pull_volume through the proxy
    moved_instance: Move | None = None  # migrate-instance: QEMU live migration through the proxy


_EXPORT = re.compile(r"file\.export=([^,]+)")


def nbd_export(target: list[str], port: int) -> NbdConnection:
    """The plain-TCP NBD export ``target`` (qemu-img arguments) opens, dialled at ``port`` instead."""
    found = _EXPORT.search(target[target.index("--image-opts") + 1])
    assert found is not None, target
    return NbdConnection(host="127.0.0.1", port=port, export=found.group(1))


@contextlib.contextmanager
def moving_memory(memory_mib: int, work: Path) -> Iterator[Path]:
    """The file of random data a migrated VM's RAM maps (see rtt_moves.migrate_instance)."""
    memory = work / "vm-memory.raw"
    make_volume(memory, memory_mib * MIB)
    try:
        yield memory
    finally:
        memory.unlink(missing_ok=True)


def measure_moves(p: Point, export: NbdConnection, volume: Path, memory: Path, memory_mib: int, work: Path,
                  window: int) -> None:
    """Both moves at ``p``'s RTT: the pull through the export's proxy, the migration through one of its own."""
    p.moved_volume = rtt_moves.migrate_volume(export, volume, work)
    with contextlib.ExitStack() as stack:

        def link(port: int) -> int:
            return stack.enter_context(DelayProxy(port, p.nominal_ms, window)).port  # closed after the VMs stop

        p.moved_instance = rtt_moves.migrate_instance(memory, memory_mib, work, link)
    v, m = p.moved_volume, p.moved_instance
    log(f"        moves: volume pulled in {v.seconds:.2f} s; VM migrated in {m.seconds:.2f} s "
        f"({m.bytes_sent / MIB:.0f} MiB sent, QEMU {m.qemu_ms} ms, downtime {m.downtime_ms} ms)")


def measure_protocol(protocol: str, volume: Path, work: Path, rtts: list[float], runtime: float,
                     rounds: int, passes: int, memory: Path | None = None, memory_mib: int = 0,
                     window: int = PROXY_BUFFER) -> tuple[Point, list[Point]]:
    """The direct connection, then the proxy at each RTT; the jobs for NBD only (qemu-img convert
    takes --image-opts, which the iSCSI URL form does not need), and with ``memory`` (the migrated
    VM's RAM) both moves at each RTT."""
    size = volume.stat().st_size
    variant = next(v for v in datapath.VARIANTS if v.key == VARIANT[protocol])
    jobs = protocol == "nbd"

    def one(target: list[str], nominal: float, rtt: float) -> Point:
        p = Point(nominal, rtt)
        datapath.evict(volume)
        p.seq = qemu_bench(target, SEQ, runtime, size)
        p.rand = qemu_bench(target, RAND, runtime, size)
        if jobs:
            p.io_job_s, p.copy_s = io_job(target, size, passes)
            p.cpu_job_s = cpu_job(target, work, rounds)
        log(f"  {protocol:5} {'direct' if nominal < 0 else f'{nominal:g} ms':>7} (measured {rtt:6.2f} ms): "
            f"{p.seq.mbps * 1e6 / MIB:8.1f} MiB/s {p.rand.iops:8.0f} IOPS"
            + (f"  io job {p.io_job_s:.2f} s  cpu job {p.cpu_job_s:.2f} s" if jobs else ""))
        return p

    with datapath.served(variant, volume, work) as (_fio, target, _pid):
        direct = one(target, -1, 0.0)
        points = []
        with (DelayProxy(daemon_port(target), window=window) as proxy, echo_server() as echo,
              DelayProxy(echo) as echo_proxy):
            for rtt in rtts:
                proxy.set_rtt(rtt)
                echo_proxy.set_rtt(rtt)
                points.append(one(via(target, proxy.port), rtt, measured_rtt_ms(echo_proxy.port)))
                if jobs and memory is not None:
                    measure_moves(points[-1], nbd_export(target, proxy.port), volume, memory, memory_mib, work,
                                  window)
    return direct, points


# -- the paper's experiment: placement crossovers ---------------------------------------------------


def move_seconds(p: Point, memory_mib: int, size_mib: float) -> tuple[float, float, str]:
    """(moving the VM, moving the volume) at ``p``'s RTT: measured when the moves ran, else computed
    (the memory at the measured NBD sequential rate; one whole-volume read at that RTT)."""
    if p.moved_instance is not None and p.moved_volume is not None:
        return p.moved_instance.seconds, p.moved_volume.seconds, "measured"
    assert p.seq is not None
    seq_mib_s = p.seq.mbps * 1e6 / MIB
    return memory_mib / seq_mib_s, p.copy_s or size_mib / seq_mib_s, "computed"


def placements(direct: Point, points: list[Point], memory_mib: int, size_mib: float) -> dict[str, Any]:
    """For each job and RTT: remote (measured), after migrate-instance and after migrate-volume (the move,
    see ``move_seconds``, + the job measured local, direct)."""
    out: dict[str, Any] = {}
    for job in ("io_job_s", "cpu_job_s"):
        local = getattr(direct, job)
        rows = []
        for p in points:
            remote = getattr(p, job)
            assert remote is not None and local is not None
            vm_s, data_s, how = move_seconds(p, memory_mib, size_mib)
            move_vm, move_data = vm_s + local, data_s + local
            best = min((remote, "stay-remote"), (move_vm, "migrate-instance"), (move_data, "migrate-volume"))[1]
            rows.append({"nominal_ms": p.nominal_ms, "rtt_ms": round(p.rtt_ms, 3), "remote_s": round(remote, 3),
                         "migrate_instance_s": round(move_vm, 3), "migrate_volume_s": round(move_data, 3),
                         "best": best, "moves": how})
        out[job] = {"local_s": local, "rows": rows,
                    "crossover_ms": {k: crossover(rows, k) for k in ("migrate_instance_s", "migrate_volume_s")}}
    return out


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - b * mx, b


def crossover(rows: list[dict[str, Any]], move: str) -> float | None:
    """The RTT from which ``move`` costs less than staying remote: where the least-squares lines of
    both against the measured RTT cross (single points are too noisy on a shared machine to compare
    one by one). 0.0 if moving is cheaper already at 0 ms; None if it never gets cheaper."""
    xs = [float(r["rtt_ms"]) for r in rows]
    a_stay, b_stay = line(xs, [float(r["remote_s"]) for r in rows])
    a_move, b_move = line(xs, [float(r[move]) for r in rows])
    if a_move < a_stay:
        return 0.0
    if b_stay <= b_move:
        return None
    return round((a_move - a_stay) / (b_stay - b_move), 2)


# -- report ----------------------------------------------------------------------------------------


def report(results: dict[str, tuple[Point, list[Point]]], paper: dict[str, Any], args: argparse.Namespace,
           ceiling: dict[str, float]) -> str:
    lines = [f"# Remote block access against RTT ({args.size_mib} MiB volume, {args.runtime:g} s per figure, "
             f"{args.window_mib} MiB in flight per direction at most, MiB/s = 2^20 bytes/s)", ""]
    if ceiling:  # measured only when 0 ms is one of the RTTs
        lines += ["## The delay proxy's own ceiling (0 ms) against a direct connection", "",
                  datapath.markdown_table(["protocol", "seq read (proxy / direct)", "4k IOPS (proxy / direct)"],
                                 [[k, f"{ceiling[k + '_seq']:.2f}", f"{ceiling[k + '_rand']:.2f}"]
                                  for k in results if k + "_seq" in ceiling]), ""]
    for protocol, (direct, points) in results.items():
        assert direct.seq is not None and direct.rand is not None
        rows = [["direct", "0", f"{direct.seq.mbps * 1e6 / MIB:.1f}", "1.00", f"{direct.rand.iops:.0f}", "1.00"]]
        for p in points:
            assert p.seq is not None and p.rand is not None
            rows.append([f"{p.nominal_ms:g}", f"{p.rtt_ms:.2f}", f"{p.seq.mbps * 1e6 / MIB:.1f}",
                         f"{p.seq.mbps / direct.seq.mbps:.2f}", f"{p.rand.iops:.0f}",
                         f"{p.rand.iops / direct.rand.iops:.2f}"])
        lines += [f"## {protocol.upper()} (qemu-img bench through the proxy)", "",
                  datapath.markdown_table(["RTT ms (nominal)", "measured", "seq read 1M qd8 MiB/s", "/direct",
                                  "rand read 4k qd32 IOPS", "/direct"], rows), ""]
    nbd_points = results["nbd"][1] if "nbd" in results else []
    moved = [p for p in nbd_points if p.moved_volume is not None and p.moved_instance is not None]
    how = "measured" if moved else "computed"
    if moved:
        rows = []
        for p in moved:
            v, m = p.moved_volume, p.moved_instance
            assert v is not None and m is not None
            rows.append([f"{p.nominal_ms:g}", f"{p.rtt_ms:.2f}", f"{v.seconds:.2f}",
                         f"{v.bytes_sent / MIB / v.seconds:.1f}", f"{m.seconds:.2f}", f"{m.bytes_sent / MIB:.1f}",
                         f"{m.bytes_sent / MIB / m.seconds:.1f}",
                         f"{m.qemu_ms}", f"{m.downtime_ms}"])
        lines += [f"## The moves, measured through the proxy ({args.size_mib} MiB volume, {args.memory_mib} MiB VM)",
                  "", datapath.markdown_table(["RTT ms", "measured", "migrate-volume s (pull)", "MiB/s",
                                      "migrate-instance s (to running)", "MiB sent", "MiB/s", "QEMU total ms",
                                      "downtime ms"], rows), ""]
    for job, title in (("io_job_s", f"I/O-bound job: read the whole volume {args.passes} times"),
                       ("cpu_job_s", f"CPU-bound job: read {CPU_JOB_MIB} MiB, hash ~{args.cpu_seconds:g} s")):
        j = paper[job]
        rows = [[f"{r['nominal_ms']:g}", f"{r['rtt_ms']:.2f}", f"{r['remote_s']:.2f}", f"{r['migrate_instance_s']:.2f}",
                 f"{r['migrate_volume_s']:.2f}", r["best"]] for r in j["rows"]]
        top = max(float(r["rtt_ms"]) for r in j["rows"])
        cross = ", ".join(f"{k.removesuffix('_s').replace('_', '-')} from "
                          + ("never" if v is None else f"{v:g} ms" + (" (beyond the measured RTTs)" if v > top else ""))
                          for k, v in j["crossover_ms"].items())
        lines += [f"## {title} (local, direct: {j['local_s']:.2f} s)", "",
                  datapath.markdown_table(["RTT ms", "measured", "remote s (measured)",
                                           f"migrate-instance s ({how} + local)", f"migrate-volume s ({how} + local)",
                                           "best"], rows), "",
                  f"Crossovers (where least-squares lines through the rows cross): {cross}.", ""]
    if moved:
        lines += [f"migrate-instance = a QEMU live migration of a bare VM whose {args.memory_mib} MiB of RAM hold "
                  "random data, through the proxy, until the destination runs + the job local; migrate-volume = "
                  "FileBackend.pull_volume of the volume from its NBD export through the proxy, until ready + "
                  "the job local. The moves, the remote jobs and the local (direct) jobs are all measured.", ""]
    else:
        lines += [f"migrate-instance = {args.memory_mib} MiB of memory at the measured NBD sequential rate + the job "
                  "local; migrate-volume = one whole-volume read measured at that RTT (the copy) + the job local. "
                  "Remote and local job times are measured; the moves' times are computed (--computed).", ""]
    return "\n".join(lines)


def calibration(results: dict[str, tuple[Point, list[Point]]], size_mib: int) -> dict[str, Any]:
    """What the controller's advice model reads (vbs.controller.placement.rtt_model.Calibration)."""
    protos: dict[str, list[dict[str, float]]] = {}
    for protocol, (direct, points) in results.items():
        rows = []
        for p in [direct, *points]:
            assert p.seq is not None and p.rand is not None
            rows.append({"rtt_ms": round(p.rtt_ms, 4), "mbps": round(p.seq.mbps * 1e6 / MIB, 3),
                         "iops": round(p.rand.iops, 1)})
        protos[protocol] = rows
    nbd_direct = results["nbd"][0] if "nbd" in results else None
    copy = None
    if nbd_direct is not None and nbd_direct.copy_s:
        copy = round(size_mib / nbd_direct.copy_s, 3)
    return {"protocols": protos, **({"copy_mbps": copy} if copy else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtts", default=None,
                    help="RTTs in ms, comma-separated (default 0,1,2,4,8,16,50; --quick 0,4,16)")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runtime", type=float, default=3.0, help="seconds per qemu-img bench figure")
    ap.add_argument("--protocols", default="nbd,iscsi")
    ap.add_argument("--memory-mib", type=int, default=512, help="the VM's memory (what migrate-instance sends)")
    ap.add_argument("--passes", type=int, default=4, help="how many times the I/O-bound job reads the volume")
    ap.add_argument("--cpu-seconds", type=float, default=2.0, help="the CPU-bound job's hashing")
    ap.add_argument("--window-mib", type=int, default=PROXY_BUFFER // MIB,
                    help="bytes in flight per direction through the proxy (a TCP window over the delayed link)")
    ap.add_argument("--computed", action="store_true",
                    help="compute the moves' times from the measured rates instead of moving (no VM started)")
    ap.add_argument("--quick", action="store_true", help="64 MiB volume, 1 s per figure, 1 s of CPU, RTTs 0, 4, 16 ms")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--calibration-out", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.size_mib, args.runtime, args.cpu_seconds, args.memory_mib = 64, 1.0, 1.0, 128
    rtts = [float(x) for x in (args.rtts or ("0,4,16" if args.quick else "0,1,2,4,8,16,50")).split(",")]
    protocols = [p for p in args.protocols.split(",") if p]
    for tool in ("qemu-img", "qemu-storage-daemon", "tgtd", "qemu-system-x86_64"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is missing")
    work = Path(tempfile.mkdtemp(prefix="vbs-rtt-"))
    try:
        volume = work / "volume.raw"
        make_volume(volume, args.size_mib * MIB)
        rounds = cpu_rounds(volume.read_bytes()[:CPU_JOB_MIB * MIB], args.cpu_seconds)
        results: dict[str, tuple[Point, list[Point]]] = {}
        with contextlib.ExitStack() as stack:
            memory = None if args.computed else stack.enter_context(moving_memory(args.memory_mib, work))
            for protocol in protocols:
                log(f"{protocol}: direct, then through the proxy at {rtts} ms")
                results[protocol] = measure_protocol(protocol, volume, work, rtts, args.runtime, rounds, args.passes,
                                                     memory, args.memory_mib, args.window_mib * MIB)
        ceiling = {}
        for protocol, (direct, points) in results.items():
            zero = next((p for p in points if p.nominal_ms == 0), None)
            if zero is not None and zero.seq and zero.rand and direct.seq and direct.rand:
                ceiling[protocol + "_seq"] = zero.seq.mbps / direct.seq.mbps
                ceiling[protocol + "_rand"] = zero.rand.iops / direct.rand.iops
        paper = placements(*results["nbd"], args.memory_mib, args.size_mib) if "nbd" in results else {}
        print(report(results, paper, args, ceiling))
        if args.json_out:
            moves = [{"nominal_ms": p.nominal_ms, "rtt_ms": round(p.rtt_ms, 3),
                      "migrate_volume": vars(p.moved_volume), "migrate_instance": vars(p.moved_instance)}
                     for p in results.get("nbd", (None, []))[1] if p.moved_volume and p.moved_instance]
            args.json_out.write_text(json.dumps({"paper": paper, "moves": moves, "ceiling": ceiling, "calibration":
                                                 calibration(results, args.size_mib)}, indent=1))
        if args.calibration_out:
            args.calibration_out.parent.mkdir(parents=True, exist_ok=True)
            args.calibration_out.write_text(json.dumps(calibration(results, args.size_mib), indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
