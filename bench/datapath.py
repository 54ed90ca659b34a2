#!/usr/bin/env python3
"""Data-path benchmark of VBS's export drivers: prints figures (it is not a test).

One 2 GiB volume file full of random data is served on loopback by the real export drivers and
read and written through them, each figure next to the same tool on the same file locally:

* NBD (``NbdExportDriver``, qemu-storage-daemon) measured with fio's ``nbd`` engine (libnbd) against
  fio ``libaio`` with ``direct=1`` on the file, for each export tunable (aio native / threads /
  io_uring, cache.direct on / off);
* NBD and iSCSI (``IscsiExportDriver``, tgtd) measured with ``qemu-img bench``, whose client is QEMU's
  own NBD / libiscsi block driver: the code a VM's disk runs through. Compared with ``qemu-img
  bench -t none -i native`` on the file. iSCSI tunables: tgt ``bsoflags=direct`` on / off and the
  negotiated segment lengths (tgt's defaults, the driver's ``TUNING``, 1 MiB).

nbdkit (``NbdkitExportDriver``: one nbdkit per export, the ``file`` plugin, ``--threads 16``) is
measured beside them in the same run, through fio's ``nbd`` engine and through ``qemu-img bench``;
its section compares it with qemu-storage-daemon (direct I/O, the ``nbd`` driver's default, and the
page cache, as nbdkit's file plugin uses) and with the local file read by fio with ``io_uring``
(buffered) and by ``qemu-img``.

Which local engine is fastest moves with the machine (fio io_uring through the page cache on one,
libaio with O_DIRECT on another, or QEMU's thread pool reading the page cache: ``local-qemu-cached``,
``qemu-img -t writeback -i threads``). So after the per-tool tables the report names the fastest local
engine of the run for each judged read, whichever tool, and the fastest of fio's engines (the issue's
own framing), and gives each driver default's ratio to both, met or not.

The report ends with the targets of issue 15 (NBD: sequential read >= 0.9 and 4 KiB random read
at queue depth 32 >= 0.7 of the local file with the same tool; iSCSI: >= 0.8 / >= 0.5), met or not
for each path, through fio's libnbd and through QEMU's own client, with the highest load average
seen while the figures were taken (the machine may be shared: compare within one run).

Workloads: sequential read / write, 1 MiB, queue depth 8; random read / write, 4 KiB, queue depth
32; ``--runtime`` seconds each (10, ``--quick``: 3). qemu-img bench has no random mode: its "random"
requests walk the file with a stride of about 0.62 of its size in 4 KiB blocks (every block once
per pass, never two neighbours in a row). Its request count is calibrated to last ``--runtime``.

NBD transports (what the security defaults cost): plain TCP (``--insecure`` only), the unix socket
``vbs up`` uses, TLS with X.509 certificates from a throwaway CA (the default over TCP: the host
presents its certificate, the server checks it against its authz list) and TLS-PSK, all with the
default tunables. All four through QEMU's own NBD client with ``qemu-img convert`` (the whole file,
8 coroutines, to or from ``null-co``: sequential read and write only; ``qemu-img bench`` takes no
``--object`` and fio's libnbd refuses a URI naming certificate files, so neither opens a TLS
export); TCP and the socket also with fio and qemu-img bench (random I/O too). The report gives
each one's ratio to plain TCP measured in the same run with the same tool.

Variants marked "experimental" are not driver settings: they set TCP_NODELAY on the export daemon's
listening socket from outside (pidfd_getfd; accepted connections inherit it), which QEMU 7.2's NBD
server does not do itself (QEMU 8.0 does: commit bd2cd4a441 "nbd/server: push pending frames after
sending reply"). tgtd sets it on its own connections.

``--backend rbd``: the same file is imported into an RBD image of a single-node Ceph the benchmark
starts (``vbs.rigs.ceph.EmbeddedCeph``, one OSD on a sparse file, pool size 1), and ``qemu-img bench``
measures, in the same run, the local file, QEMU opening the image with its own librbd (``driver=rbd``,
``cache=none``, as a VM with ``-blockdev driver=rbd`` would; client.admin's keyring from the conf: a
benchmark's shortcut, never the product's) and the product's path, the storage agent's NBD export of
the image (qemu-storage-daemon's librbd); it prints each ratio.

Each run starts with the file evicted from the page cache (not the OSD's own cache), or with all of
it in the page cache (``--warm``; ``--nbdkit`` unless ``--cold``). Every daemon
is stopped by its driver (by PID) in a ``finally``; only 127.0.0.1 is used.

    .venv/bin/python bench/datapath.py            # one round (about 10 minutes)
    .venv/bin/python bench/datapath.py --quick    # the defaults only, 3 s per figure (about 2 minutes)
    .venv/bin/python bench/datapath.py --quick --only ...   # chosen variants, 3 s per figure (--list)
    .venv/bin/python bench/datapath.py --quick --reads-only  # the two reads the targets judge (under a minute)
    .venv/bin/python bench/datapath.py --backend rbd   # local file vs librbd vs NBD over RBD
    .venv/bin/python bench/datapath.py --nbdkit        # nbdkit vs qemu-storage-daemon vs the local file
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.common import log, markdown_table, os_name  # noqa: E402

from vbs.net.ports import free_port  # noqa: E402
from vbs.pools.exports import FileSource, RbdSource  # noqa: E402
from vbs.qemu.tls import X509Files, qemu_x509_dir  # noqa: E402
from vbs.rigs.ceph import EmbeddedCeph  # noqa: E402
from vbs.storage.exports.iscsi import IscsiExportDriver  # noqa: E402
from vbs.storage.exports.iscsi import targets as iscsi_mod  # noqa: E402
from vbs.storage.exports.nbd import NbdExportDriver  # noqa: E402
from vbs.storage.exports.nbdkit import NbdkitExportDriver  # noqa: E402
from vbs.storage.exports.nodelay import force_nodelay  # noqa: E402
from vbs.trust.pki import CertificateAuthority  # noqa: E402
from vbs.wire.connection import HostIdentity, IscsiConnection, NbdConnection  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
BLOCK = 4096
VOLUME_ID = "vol-0b0e0c0d0a7a0a7a0"
HOST = HostIdentity(name="bench", address="127.0.0.1", initiator_name="iqn.2026-11.org.vbs.bench:datapath")
WRITE_PATTERN = 0xA5  # qemu-img bench writes this byte: the file never turns to zeros
CALIBRATE_S = 0.4  # a qemu-img bench probe must last this long before its rate is trusted

# Targets of issue 15 (loopback against the local file, same tool): seq read 1 MiB qd8, rand read 4 KiB qd32.
TARGETS: dict[str, tuple[float, float]] = {"nbd": (0.9, 0.7), "nbdkit": (0.9, 0.7), "iscsi": (0.8, 0.5)}
SEQ_READ, RAND_READ = "seq read 1M qd8", "rand read 4k qd32"
NOISE = 0.10  # differences under this (relative) are not called a winner

# tgt's own defaults (no update) / the driver's TUNING / bigger PDUs: iSCSI segment-length variants.
TGT_LARGE: tuple[tuple[str, str], ...] = (
    ("MaxRecvDataSegmentLength", "1048576"),
    ("MaxXmitDataSegmentLength", "1048576"),
    ("FirstBurstLength", "1048576"),
    ("MaxBurstLength", "1048576"),
    ("InitialR2T", "No"),
)


@dataclass(frozen=True)
class Workload:
    key: str
    rw: str  # fio's name
    bs: int
    qd: int

    @property
    def write(self) -> bool:
        return "write" in self.rw

    @property
    def random(self) -> bool:
        return self.rw.startswith("rand")


WORKLOADS = (
    Workload("seq read 1M qd8", "read", MIB, 8),
    Workload("seq write 1M qd8", "write", MIB, 8),
    Workload("rand read 4k qd32", "randread", BLOCK, 32),
    Workload("rand write 4k qd32", "randwrite", BLOCK, 32),
)


@dataclass(frozen=True)
class Variant:
    """One way of serving the file (or the file itself) and the tool that measures it."""

    key: str
    label: str
    protocol: str  # local | nbd | nbdkit | iscsi | rbd
    tool: str  # fio | qemu-img
    nbd: dict[str, Any] = field(default_factory=dict)  # NbdExportDriver keyword arguments
    iscsi_direct: bool = True
    iscsi_tuning: tuple[tuple[str, str], ...] | None = None  # None: the driver's TUNING
    nodelay: bool = False  # experimental: TCP_NODELAY forced on the daemon's sockets
    default: bool = False  # the drivers' defaults
    transport: str = "tcp"  # NBD: tcp (plain) | unix | x509 | psk
    backend: str = "file"  # what is served: the volume file, or an RBD image of it (--backend rbd)
    connections: int = 1  # fio: jobs, each with its own NBD connection, sharing the workload's queue depth
    engine: str = "libaio"  # local fio: libaio with O_DIRECT, or io_uring through the page cache
    local_qemu: tuple[str, ...] = ("-t", "none", "-i", "native")  # local qemu-img: cache mode and AIO


VARIANTS = (
    Variant("local-fio", "local file, fio libaio direct", "local", "fio"),
    Variant("local-fio-uring", "local file, fio io_uring (page cache)", "local", "fio", engine="io_uring"),
    Variant("nbd-native", "NBD aio=native cache.direct (default)", "nbd", "fio",
            {"aio": "native", "cache_direct": True}, default=True),
    Variant("nbd-threads", "NBD aio=threads cache.direct", "nbd", "fio", {"aio": "threads", "cache_direct": True}),
    Variant("nbd-io_uring", "NBD aio=io_uring cache.direct", "nbd", "fio", {"aio": "io_uring", "cache_direct": True}),
    Variant("nbd-cached", "NBD aio=threads page cache", "nbd", "fio", {"aio": "threads", "cache_direct": False}),
    Variant("nbdkit", "nbdkit file plugin, 16 threads (nbdkit driver default)", "nbdkit", "fio", default=True),
    Variant("nbd-nodelay", "NBD default + TCP_NODELAY (experimental)", "nbd", "fio",
            {"aio": "native", "cache_direct": True}, nodelay=True),
    Variant("nbd-unix", "NBD unix socket (vbs up)", "nbd", "fio", {"aio": "native", "cache_direct": True},
            transport="unix"),
    Variant("nbd-2conn", "NBD default, 2 connections sharing the queue depth", "nbd", "fio",
            {"aio": "native", "cache_direct": True}, connections=2),
    Variant("local-qemu", "local file, qemu-img -t none -i native", "local", "qemu-img"),
    Variant("local-qemu-cached", "local file, qemu-img -t writeback -i threads (page cache)", "local", "qemu-img",
            local_qemu=("-t", "writeback", "-i", "threads")),
    Variant("nbd-native-q", "NBD aio=native cache.direct (default)", "nbd", "qemu-img",
            {"aio": "native", "cache_direct": True}, default=True),
    Variant("nbd-threads-q", "NBD aio=threads cache.direct", "nbd", "qemu-img",
            {"aio": "threads", "cache_direct": True}),
    Variant("nbd-io_uring-q", "NBD aio=io_uring cache.direct", "nbd", "qemu-img",
            {"aio": "io_uring", "cache_direct": True}),
    Variant("nbd-cached-q", "NBD aio=threads page cache", "nbd", "qemu-img", {"aio": "threads", "cache_direct": False}),
    Variant("nbdkit-q", "nbdkit file plugin, 16 threads (nbdkit driver default)", "nbdkit", "qemu-img",
            default=True),
    Variant("nbd-nodelay-q", "NBD default + TCP_NODELAY (experimental)", "nbd", "qemu-img",
            {"aio": "native", "cache_direct": True}, nodelay=True),
    Variant("nbd-unix-q", "NBD unix socket (vbs up)", "nbd", "qemu-img", {"aio": "native", "cache_direct": True},
            transport="unix"),
    Variant("nbd-tcp-c", "NBD plain TCP (--insecure)", "nbd", "convert", {"aio": "native", "cache_direct": True}),
    Variant("nbd-unix-c", "NBD unix socket (vbs up)", "nbd", "convert", {"aio": "native", "cache_direct": True},
            transport="unix"),
    Variant("nbd-x509-c", "NBD TLS X.509 (default over TCP)", "nbd", "convert",
            {"aio": "native", "cache_direct": True}, transport="x509"),
    Variant("nbd-psk-c", "NBD TLS-PSK", "nbd", "convert", {"aio": "native", "cache_direct": True}, transport="psk"),
    Variant("iscsi-direct", "iSCSI bsoflags=direct, driver TUNING (default)", "iscsi", "qemu-img", default=True),
    Variant("iscsi-buffered", "iSCSI page cache, driver TUNING", "iscsi", "qemu-img", iscsi_direct=False),
    Variant("iscsi-tgtdefaults", "iSCSI direct, tgt default segment lengths", "iscsi", "qemu-img",
            iscsi_tuning=()),
    Variant("iscsi-large", "iSCSI direct, 1 MiB segments", "iscsi", "qemu-img", iscsi_tuning=TGT_LARGE),
    Variant("rbd-librbd-q", "RBD, QEMU's own librbd (driver=rbd, cache=none)", "rbd", "qemu-img", backend="rbd"),
    Variant("rbd-nbd-q", "RBD over NBD (qemu-storage-daemon's librbd)", "nbd", "qemu-img",
            {"aio": "native", "cache_direct": True}, backend="rbd"),
)
# --backend rbd: the local file, QEMU on librbd, and the product's path (NBD over the daemon's librbd).
RBD_VARIANTS = ("local-qemu", "rbd-librbd-q", "rbd-nbd-q")
# --quick: the drivers' defaults and their baselines, what the targets are judged on (about 2 minutes).
QUICK_VARIANTS = ("local-fio", "nbd-native", "local-qemu", "nbd-native-q", "iscsi-direct")
# --nbdkit: nbdkit next to qemu-storage-daemon (direct and page cache) and the local file, both tools.
NBDKIT_VARIANTS = ("local-fio-uring", "local-fio", "nbd-native", "nbd-cached", "nbdkit", "local-qemu",
                   "local-qemu-cached", "nbd-native-q", "nbd-cached-q", "nbdkit-q")
RBD_POOL = "bench"


@dataclass
class Figure:
    mbps: float  # 10^6 bytes per second
    iops: float
    seconds: float
    note: str = ""
    load: float = 0.0  # 1-minute load average when the figure was taken


# -- helpers ---------------------------------------------------------------------------------------


def make_volume(path: Path, size: int) -> None:
    """``size`` bytes of random data (a 64 MiB random block repeated), on disk before returning."""
    chunk = os.urandom(min(64 * MIB, size))
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def evict(path: Path) -> None:
    """Drop this file's pages from the page cache (written back first), so each run starts cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_up(path: Path) -> None:
    """Read the whole file into the page cache (written back first): each run starts warm."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while f.read(64 * MIB):
            pass


def stride_blocks(nblocks: int) -> int:
    """A block stride near the golden ratio of the file, coprime with its block count: one pass
    touches every block once and consecutive requests land far apart."""
    p = int(nblocks * 0.6180339887) | 1
    while math.gcd(p, nblocks) != 1:
        p += 2
    return p


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def machine() -> dict[str, str]:
    info = {"cpus": str(os.cpu_count()), "kernel": platform.release(), "python": platform.python_version()}
    if (name := os_name()) is not None:
        info["os"] = name
    for name, argv in (("fio", ["fio", "--version"]), ("qemu", ["qemu-img", "--version"]),
                       ("tgt", ["tgtadm", "--version"]), ("nbdkit", ["nbdkit", "--version"])):
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout  # noqa: S603
            info[name] = out.splitlines()[0].strip() if out else "?"
        except (OSError, subprocess.SubprocessError):
            info[name] = "missing"
    return info


# -- TCP_NODELAY from outside (experimental) --------------------------------------------------------

# -- the tools -------------------------------------------------------------------------------------


def run_tool(argv: list[str], timeout: float) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)  # noqa: S603 - argv list
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc.stdout


def local_fio_target(volume: Path, engine: str = "libaio") -> list[str]:
    """fio's arguments for the local file itself, the baseline of every fio figure: libaio with
    O_DIRECT, or io_uring through the page cache (the fastest local engine here)."""
    direct = "1" if engine == "libaio" else "0"
    return [f"--filename={volume}", f"--ioengine={engine}", f"--direct={direct}", f"--size={volume.stat().st_size}"]


def fio(target: list[str], w: Workload, runtime: float, connections: int = 1) -> Figure:
    """``connections`` jobs of ``w.qd / connections`` requests in flight each (the nbd engine opens
    one connection per job), reported together."""
    argv = ["fio", "--name=vbs", f"--rw={w.rw}", f"--bs={w.bs}", f"--iodepth={max(1, w.qd // connections)}",
            f"--numjobs={connections}", "--group_reporting", f"--runtime={runtime:g}", "--time_based",
            "--norandommap", "--randrepeat=0", "--output-format=json", *target]
    out = run_tool(argv, timeout=runtime + 120)
    data = json.loads(out[out.index("{"):])  # the nbd engine prints a line before the JSON
    job = data["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}")
    side = job["write" if w.write else "read"]
    return Figure(mbps=side["bw_bytes"] / 1e6, iops=side["iops"], seconds=side["runtime"] / 1000)


_COMPLETED = re.compile(r"Run completed in ([0-9.]+) seconds")


def qemu_bench(target: list[str], w: Workload, runtime: float, size: int,
               around: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext) -> Figure:
    """``qemu-img bench`` for about ``runtime`` seconds: probe with a growing count, then scale.
    ``around`` wraps each ``qemu-img`` run; the last one it wraps is the run the figure comes from."""
    base = ["qemu-img", "bench", "-d", str(w.qd), "-s", str(w.bs)]
    if w.random:
        base += ["-S", str(stride_blocks(size // BLOCK) * BLOCK)]
    if w.write:
        base += ["-w", f"--pattern={WRITE_PATTERN}"]

    def once(count: int, timeout: float) -> float:
        with around():
            out = run_tool([*base, "-c", str(count), *target], timeout=timeout)
        m = _COMPLETED.search(out)
        if not m:
            raise RuntimeError(f"qemu-img bench: no timing in {out[-300:]!r}")
        return max(float(m.group(1)), 1e-6)

    count = max(2 * w.qd, (64 * MIB) // w.bs // 8)
    elapsed = once(count, 120)
    while elapsed < min(CALIBRATE_S, runtime / 2):
        count *= 4 if elapsed < CALIBRATE_S / 4 else 2
        elapsed = once(count, 120)
    if elapsed < runtime * 0.7:
        count = max(count, int(count * runtime / elapsed))
        elapsed = once(count, runtime * 4 + 120)
    return Figure(mbps=count * w.bs / elapsed / 1e6, iops=count / elapsed, seconds=elapsed)


def qemu_convert(target: list[str], w: Workload, size: int) -> Figure:
    """The whole file through QEMU's NBD client with ``qemu-img convert`` (8 coroutines, out of
    order), to or from QEMU's ``null-co`` driver: sequential only, but it takes ``--object``, so it
    opens TLS exports too (``qemu-img bench`` cannot)."""
    if w.random:
        raise ValueError("qemu-img convert measures sequential transfers only")
    objects = target[:target.index("--image-opts")]
    opts = target[target.index("--image-opts") + 1]
    null = f"driver=null-co,size={size}"
    source, dest = (null, opts) if w.write else (opts, null)
    start = time.monotonic()
    run_tool(["qemu-img", "convert", "-n", "-m", "8", "-W", "-S", "0", *objects, "--image-opts", source,
              "--target-image-opts", dest], timeout=600)
    elapsed = time.monotonic() - start
    return Figure(mbps=size / elapsed / 1e6, iops=size / MIB / elapsed, seconds=elapsed)


# -- exports ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_driver_logs() -> Iterator[list[str]]:
    """Collect the drivers' warnings (a refused aio / cache mode falls back with a warning)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    handler = Keep()
    loggers = [logging.getLogger(n) for n in ("vbs.storage.exports.nbd", "vbs.storage.exports.iscsi")]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
        lg.propagate = False
    try:
        yield seen
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@contextlib.contextmanager
def served(v: Variant, volume: Path, work: Path,
           rbd: RbdSource | None = None) -> Iterator[tuple[list[str], list[str], int | None]]:
    """Serve ``volume`` (or its copy in the RBD image ``rbd``) as ``v`` says; yield (fio target args,
    qemu-img target args, daemon pid)."""
    source: FileSource | RbdSource = FileSource(volume)
    if v.backend == "rbd":
        if rbd is None:
            raise ValueError(f"{v.key} needs --backend rbd")
        source = rbd
    if v.protocol == "rbd":
        # QEMU opens the image itself, as a VM started with -blockdev driver=rbd would: as client.admin,
        # its key read from the keyring the conf names (a benchmark's shortcut, never the product's).
        assert isinstance(source, RbdSource)
        yield [], ["-t", "none", "--image-opts", f"driver=raw,file.driver=rbd,file.pool={source.pool},"
                   f"file.image={source.image},file.conf={source.conf},file.user={source.user}"], None
        return
    if v.protocol == "local":
        yield local_fio_target(volume, v.engine), ["-f", "raw", *v.local_qemu, str(volume)], None
        return
    state = Path(tempfile.mkdtemp(prefix=f"{v.protocol}-", dir=work))
    if v.protocol == "nbdkit":
        kit = NbdkitExportDriver(state, "127.0.0.1", free_port(), tls="off", ports=1)
        try:
            kc = kit.ensure_export(VOLUME_ID, FileSource(volume), HOST)
            opts = (f"driver=raw,file.driver=nbd,file.server.type=inet,file.server.host={kc.host},"
                    f"file.server.port={kc.port},file.export={kc.export}")
            yield ["--ioengine=nbd", f"--uri=nbd://{kc.host}:{kc.port}/{kc.export}"], ["--image-opts", opts], \
                kit.pid(VOLUME_ID, HOST.name)
        finally:
            kit.stop()
            shutil.rmtree(state, ignore_errors=True)
        return
    if v.protocol == "nbd":
        kw: dict[str, Any] = dict(v.nbd)
        client = state / "client"
        if v.transport == "unix":
            kw["socket_dir"] = state / "sock"
        elif v.transport == "psk":
            kw["tls"] = "psk"
        elif v.transport == "x509":
            ca = CertificateAuthority(state / "ca" / "ca.pem", state / "ca" / "ca-key.pem")
            node = ca.issue_in(state / "node", "storage-1", ["127.0.0.1"])
            kw.update(tls="x509", x509=X509Files(node.cert, node.key, node.ca))
            mine = ca.issue_in(state / "host", HOST.name, [HOST.name])
            qemu_x509_dir(X509Files(mine.cert, mine.key, mine.ca), client, "client")
        nbd = NbdExportDriver(state, "127.0.0.1", free_port(), **kw)
        try:
            nbd.start()
            c = nbd.ensure_export(VOLUME_ID, source, HOST)
            assert isinstance(c, NbdConnection)
            if c.socket is not None:
                opts = (f"driver=raw,file.driver=nbd,file.server.type=unix,file.server.path={c.socket},"
                        f"file.export={c.export}")
                uri = f"nbd+unix:///{c.export}?socket={c.socket}"
            else:
                opts = (f"driver=raw,file.driver=nbd,file.server.type=inet,file.server.host={c.host},"
                        f"file.server.port={c.port},file.export={c.export}")
                uri = f"nbd://{c.host}:{c.port}/{c.export}"
            objects: list[str] = []
            if c.tls == "x509":
                # fio's libnbd refuses URIs naming local files (tls-certificates): such variants use
                # qemu-img convert, which opens the export with QEMU's own TLS client as a VM does.
                uri = f"nbds://{c.host}:{c.port}/{c.export}?tls-certificates={client}"
                objects = ["--object", f"tls-creds-x509,id=tls0,endpoint=client,dir={client}"]
            elif c.tls == "psk":
                assert c.tls_psk_key is not None
                client.mkdir(mode=0o700)
                (client / "keys.psk").write_text(f"{c.tls_psk_identity}:{c.tls_psk_key.get_secret_value()}\n")
                uri = f"nbds://{c.tls_psk_identity}@{c.host}:{c.port}/{c.export}?tls-psk-file={client}/keys.psk"
                objects = ["--object", f"tls-creds-psk,id=tls0,endpoint=client,dir={client},"
                           f"username={c.tls_psk_identity}"]
            if objects:
                opts += ",file.tls-creds=tls0"
            yield ["--ioengine=nbd", f"--uri={uri}"], [*objects, "--image-opts", opts], nbd.pid
        finally:
            nbd.stop()
            shutil.rmtree(state, ignore_errors=True)
        return
    saved = iscsi_mod.TUNING
    if v.iscsi_tuning is not None:
        iscsi_mod.TUNING = v.iscsi_tuning  # read by the driver when it creates a target
    port = free_port()
    drv = IscsiExportDriver(state, "127.0.0.1", port, control_port=port % 32768, direct_io=v.iscsi_direct)
    try:
        drv.start()
        c = drv.ensure_export(VOLUME_ID, FileSource(volume), HOST)
        assert isinstance(c, IscsiConnection) and c.chap_secret is not None
        # qemu-img bench takes no --object: the CHAP secret goes in the options (a loopback throwaway).
        # The initiator name is the host's, as the iSCSI connector gives QEMU: the target's ACL binds it.
        opts = (f"driver=raw,file.driver=iscsi,file.transport=tcp,file.portal={c.host}:{c.port},"
                f"file.target={c.iqn},file.lun={c.lun},file.user={c.chap_user},"
                f"file.password={c.chap_secret.get_secret_value()},file.initiator-name={c.initiator_name}")
        yield [], ["--image-opts", opts], drv.pid
    finally:
        iscsi_mod.TUNING = saved
        try:
            drv.remove_export(VOLUME_ID, HOST.name)
        finally:
            drv.stop()
            shutil.rmtree(state, ignore_errors=True)


def measure(v: Variant, volume: Path, work: Path, runtime: float, rbd: RbdSource | None = None,
            workloads: tuple[Workload, ...] = WORKLOADS, warm: bool = False) -> dict[str, Any]:
    """Each of ``workloads`` through one export of ``v``, the file cold (evicted) or ``warm`` (all of
    it in the page cache) at the start of each."""
    size = volume.stat().st_size
    figures: dict[str, Figure] = {}
    notes: list[str] = []
    with quiet_driver_logs() as warnings, served(v, volume, work, rbd) as (fio_target, qemu_target, pid):
        if v.nodelay and pid is not None:
            try:
                notes.append(f"TCP_NODELAY set on {force_nodelay(pid)} socket(s) of the daemon (its listener: "
                             "every connection inherits it)")
            except OSError as exc:
                notes.append(f"TCP_NODELAY not set: {exc}")
        for w in workloads:
            (warm_up if warm else evict)(volume)
            load = loadavg()
            try:
                if v.tool == "convert" and w.random:
                    continue
                if v.tool == "fio":
                    fig = fio(fio_target, w, runtime, v.connections)
                elif v.tool == "convert":
                    fig = qemu_convert(qemu_target, w, size)
                else:
                    fig = qemu_bench(qemu_target, w, runtime, size)
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                log(f"  {v.key} {w.key}: FAILED {exc}")
                notes.append(f"{w.key}: failed: {str(exc)[:200]}")
                continue
            fig.load = float(load.split()[0]) if load != "?" else 0.0
            figures[w.key] = fig
            log(f"  {v.key:18} {w.key:20} {fig.mbps:9.1f} MB/s {fig.iops:9.0f} IOPS  (load {load})")
        notes += [f"driver: {m}" for m in warnings if "refused" in m or "serving with" in m]
    return {"figures": figures, "notes": notes}


# -- report ----------------------------------------------------------------------------------------


def combine(runs: list[dict[str, Any]]) -> dict[str, Figure]:
    """Median of each figure across rounds."""
    keys = {k for r in runs for k in r["figures"]}
    out: dict[str, Figure] = {}
    for k in keys:
        figs = [r["figures"][k] for r in runs if k in r["figures"]]
        out[k] = Figure(mbps=statistics.median(f.mbps for f in figs), iops=statistics.median(f.iops for f in figs),
                        seconds=statistics.median(f.seconds for f in figs), load=max(f.load for f in figs))
    return out


def ratio(fig: Figure | None, base: Figure | None) -> float | None:
    if fig is None or base is None or base.mbps <= 0:
        return None
    return fig.mbps / base.mbps


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}"


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    if not vals or len(vals) != len(values):
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, info: dict[str, str]) -> str:
    lines = [f"# VBS data path ({args.runtime:g} s per figure, {args.rounds} round(s), "
             f"{args.size_gib} GiB file {'warm' if args.warm else 'cold'}, MB = 10^6 bytes)", ""]
    lines.append("Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    lines.append("")
    figs = {k: combine(r["runs"]) for k, r in results.items()}
    shown: tuple[Workload, ...] = args.workloads
    baseline = {"fio": figs.get("local-fio") or figs.get("local-fio-uring", {}), "qemu-img": figs.get("local-qemu", {})}
    baseline["convert"] = {}
    for tool, title in (("fio", "fio (NBD through libnbd) vs local fio libaio direct"),
                        ("qemu-img", "qemu-img bench (QEMU's NBD / iSCSI client, as in a VM) vs local qemu-img"),
                        ("convert", "qemu-img convert (QEMU's NBD client, whole file, sequential only)")):
        rows = []
        for v in VARIANTS:
            if v.tool != tool or v.key not in figs:
                continue
            row = [v.label + (" *" if v.default else "")]
            for w in shown:
                f = figs[v.key].get(w.key)
                if f is None:
                    row.append("n/a" if v.tool == "convert" and w.random else "failed")
                    continue
                cell = f"{f.mbps:.0f} MB/s, {f.iops:.0f} IOPS"
                r = ratio(f, baseline[tool].get(w.key))
                if v.protocol != "local" and r is not None:
                    cell += f" ({r:.2f})"
                row.append(cell)
            rows.append(row)
        if rows:
            lines += [f"## {title}", "", markdown_table(["variant", *[w.key for w in shown]], rows),
                      "", "(ratio to the local file, same tool, in brackets; * = driver default)", ""]
    notes = [f"- {v.key}: {n}" for v in VARIANTS if v.key in results for n in results[v.key]["notes"]]
    if notes:
        lines += ["Notes:", *notes, ""]
    lines += transports(figs, shown)
    lines += nbdkit_beside(figs, shown)
    lines += against_fastest(figs)
    lines += rbd_paths(figs, shown)
    lines += verdicts(figs, baseline, shown)
    return "\n".join(lines)


def rbd_paths(figs: dict[str, dict[str, Figure]], shown: tuple[Workload, ...]) -> list[str]:
    """What serving an RBD image over NBD costs against QEMU opening it with librbd, same run and tool."""
    librbd, nbd, local = figs.get("rbd-librbd-q"), figs.get("rbd-nbd-q"), figs.get("local-qemu")
    if librbd is None or nbd is None:
        return []
    rows = [["RBD over NBD / QEMU's librbd", *[fmt_ratio(ratio(nbd.get(w.key), librbd.get(w.key)))
                                                for w in shown]]]
    if local is not None:
        rows += [["QEMU's librbd / local file", *[fmt_ratio(ratio(librbd.get(w.key), local.get(w.key)))
                                                  for w in shown]],
                 ["RBD over NBD / local file", *[fmt_ratio(ratio(nbd.get(w.key), local.get(w.key)))
                                                 for w in shown]]]
    return ["## RBD: the NBD path vs QEMU's own librbd (qemu-img bench, same run)", "",
            markdown_table(["ratio", *[w.key for w in shown]], rows), ""]


def nbdkit_beside(figs: dict[str, dict[str, Figure]], shown: tuple[Workload, ...]) -> list[str]:
    """nbdkit, qemu-storage-daemon and the local file in the same run: each ratio to the local file
    (fio: io_uring through the page cache; qemu-img: its own local run), and nbdkit's to the daemon."""
    rows = []
    for tool, local, keys in (("fio", "local-fio-uring", ("nbd-native", "nbd-cached", "nbdkit")),
                              ("qemu-img", "local-qemu", ("nbd-native-q", "nbd-cached-q", "nbdkit-q"))):
        base = figs.get(local)
        if base is None or not any(k in figs for k in keys):
            continue
        for key in keys:
            if key in figs:
                v = next(x for x in VARIANTS if x.key == key)
                rows.append([f"{v.label} / local [{tool}]",
                             *[fmt_ratio(ratio(figs[key].get(w.key), base.get(w.key))) for w in shown]])
        kit, qsd = figs.get(keys[2]), figs.get(keys[0])
        if kit is not None and qsd is not None:
            rows.append([f"nbdkit / qemu-storage-daemon default [{tool}]",
                         *[fmt_ratio(ratio(kit.get(w.key), qsd.get(w.key))) for w in shown]])
    if not rows:
        return []
    return ["## nbdkit beside qemu-storage-daemon and the local file (same run)", "",
            markdown_table(["ratio", *[w.key for w in shown]], rows),
            "", "(fio's local baseline: io_uring through the page cache; qemu-img's: -t none -i native)", ""]


def against_fastest(figs: dict[str, dict[str, Figure]]) -> list[str]:
    """The issue's own measure: each export's two judged reads against the fastest local engine of this
    run, whichever tool it was (named, with its figure), and against the fastest of fio's engines alone
    (the issue's framing: fio io_uring was the fastest the day it was written). Which engine is fastest
    moves with the machine: on one, io_uring through the page cache; on another, libaio with O_DIRECT, or
    QEMU's thread pool reading the page cache, which no socket protocol can match (a memory copy)."""
    locals_ = [v for v in VARIANTS if v.protocol == "local" and v.key in figs]
    exports = [v for v in judged(figs) if v.default]
    if not locals_ or not exports:
        return []
    heads, rows = [], []
    fastest: dict[tuple[str, str], tuple[Figure, Variant] | None] = {}
    for wkey in (SEQ_READ, RAND_READ):
        for scope, pool in (("any", locals_), ("fio", [v for v in locals_ if v.tool == "fio"])):
            found = [(figs[v.key][wkey], v) for v in pool if wkey in figs[v.key]]
            best = max(found, key=lambda t: t[0].mbps) if found else None
            fastest[(wkey, scope)] = best
            if best is not None:
                heads.append(f"- {wkey}, fastest local {'engine' if scope == 'any' else 'fio engine'}: "
                             f"{best[1].label} [{best[1].tool}], {best[0].mbps:.0f} MB/s, {best[0].iops:.0f} IOPS")
    for v in exports:
        cells = []
        for scope in ("any", "fio"):
            for wkey, target in zip((SEQ_READ, RAND_READ), TARGETS[v.protocol], strict=True):
                best = fastest[(wkey, scope)]
                r = ratio(figs[v.key].get(wkey), best[0] if best else None)
                cells.append(f"{fmt_ratio(r)} / {target:g}: " + ("—" if r is None else "met" if r >= target
                                                                    else "NOT met"))
        rows.append([f"{v.label} [{v.tool}]", *cells])
    return ["## The drivers' defaults against the fastest local engine of this run", "", *heads, "",
            markdown_table(["export", f"{SEQ_READ} / fastest", f"{RAND_READ} / fastest",
                            f"{SEQ_READ} / fastest fio", f"{RAND_READ} / fastest fio"], rows), ""]


def transports(figs: dict[str, dict[str, Figure]], shown: tuple[Workload, ...]) -> list[str]:
    """What each NBD transport costs against plain TCP measured in the same run."""
    rows = []
    for base_key, keys in (("nbd-native", ("nbd-unix",)), ("nbd-native-q", ("nbd-unix-q",)),
                           ("nbd-tcp-c", ("nbd-unix-c", "nbd-x509-c", "nbd-psk-c"))):
        base = figs.get(base_key)
        if base is None:
            continue
        for key in keys:
            if key not in figs:
                continue
            v = next(x for x in VARIANTS if x.key == key)
            rows.append([f"{v.label} [{v.tool}]",
                         *[fmt_ratio(ratio(figs[key].get(w.key), base.get(w.key))) for w in shown]])
    if not rows:
        return []
    return ["## NBD transports vs plain TCP (same run, same tool)", "",
            markdown_table(["transport", *[w.key for w in shown]], rows), ""]


def judged(figs: dict[str, dict[str, Figure]]) -> list[Variant]:
    """The measured variants the targets judge: file-backed NBD and iSCSI exports read by fio or qemu-img."""
    return [v for v in VARIANTS if v.protocol in TARGETS and v.tool != "convert" and v.backend == "file"
            and v.key in figs]


def target_rows(figs: dict[str, dict[str, Figure]], baseline: dict[str, dict[str, Figure]]) -> list[list[str]]:
    """Every measured file-backed NBD / iSCSI variant against its protocol's targets (issue 15): the ratio
    of sequential and random reads to the local file with the same tool, met or not, and the highest
    load average seen while its figures and the baseline's were taken."""
    rows = []
    for v in judged(figs):
        seq_target, rand_target = TARGETS[v.protocol]
        cells = []
        loads = []
        for wkey, target in ((SEQ_READ, seq_target), (RAND_READ, rand_target)):
            fig, base = figs[v.key].get(wkey), baseline[v.tool].get(wkey)
            r = ratio(fig, base)
            loads += [f.load for f in (fig, base) if f is not None]
            cells.append(f"{fmt_ratio(r)} / {target:g}: " + ("—" if r is None else "met" if r >= target else "NOT met"))
        rows.append([f"{v.label}{' *' if v.default else ''} [{v.tool}]", *cells,
                     f"{max(loads):.1f}" if loads else "?"])
    return rows


def verdicts(figs: dict[str, dict[str, Figure]], baseline: dict[str, dict[str, Figure]],
             shown: tuple[Workload, ...]) -> list[str]:
    out: list[str] = []
    rows = target_rows(figs, baseline)
    if rows:
        out += ["## Targets (ratio to the local file, same tool / target; NBD 0.9 / 0.7, iSCSI 0.8 / 0.5)", "",
                markdown_table(["path", SEQ_READ, RAND_READ, "load (max)"], rows),
                "", "(* = driver default; [qemu-img] is QEMU's own client, the one a VM's disk runs on)", ""]

    tunables = [f"## Best tunables (geometric mean of the {len(shown)} ratios; experimental variants excluded)", ""]
    out += tunables
    for protocol, tool in (("nbd", "fio"), ("nbd", "qemu-img"), ("iscsi", "qemu-img")):
        scored = []
        for v in VARIANTS:
            if (v.protocol != protocol or v.tool != tool or v.nodelay or v.key not in figs or v.transport != "tcp"
                    or v.backend != "file" or v.connections != 1):
                continue
            g = geomean([ratio(figs[v.key].get(w.key), baseline[tool].get(w.key)) or 0 for w in shown])
            if g is not None:
                scored.append((g, v))
        if not scored:
            continue
        scored.sort(key=lambda t: t[0], reverse=True)
        best_g, best = scored[0]
        default = next(((g, v) for g, v in scored if v.default), None)
        out.append(f"- {protocol} [{tool}]: " + ", ".join(f"{v.label} {g:.2f}" for g, v in scored))
        for w in shown:
            per = [(ratio(figs[v.key].get(w.key), baseline[tool].get(w.key)) or 0, v) for _, v in scored]
            top = max(per, key=lambda t: t[0])
            out.append(f"  - best for {w.key}: {top[1].label} ({top[0]:.2f})")
        if default is not None:
            if best.default or best_g <= default[0] * (1 + NOISE):
                out.append(f"  - the default ({default[1].label}) is best or within {NOISE:.0%} of the best: keep it")
            else:
                out.append(f"  - {best.label} beats the default by {best_g / default[0] - 1:.0%}: consider it")
    if out[-len(tunables):] == tunables:  # nothing to compare (--backend rbd)
        del out[-len(tunables):]
    return out + [""]


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"3 s per figure instead of 10, only {', '.join(QUICK_VARIANTS)} unless --only says")
    p.add_argument("--runtime", type=float, default=None, help="seconds per figure (default 10, --quick 3)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole matrix; figures are medians (default 1)")
    p.add_argument("--size-gib", type=int, default=2, help="volume file size (default 2)")
    p.add_argument("--reads-only", action="store_true",
                   help="only the two reads the targets are judged on (1 MiB sequential, 4 KiB random)")
    p.add_argument("--only", default=None, help="comma-separated variant keys (default: all)")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp"), help="where the file goes (default /var/tmp)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures to this file")
    p.add_argument("--list", action="store_true", help="list the variant keys and exit")
    p.add_argument("--nbdkit", action="store_true",
                   help=f"nbdkit beside qemu-storage-daemon and the local file ({', '.join(NBDKIT_VARIANTS)}); "
                        "the file warm unless --cold")
    p.add_argument("--warm", action="store_true", help="each figure starts with the whole file in the page cache")
    p.add_argument("--cold", action="store_true", help="each figure starts with the file evicted (the default)")
    p.add_argument("--backend", choices=("file", "rbd"), default="file",
                   help="rbd: the file copied into an RBD image of a Ceph this starts, read and written by QEMU's "
                        f"librbd and over NBD, next to the local file ({', '.join(RBD_VARIANTS)})")
    args = p.parse_args(argv)
    if args.runtime is None:
        args.runtime = 3.0 if args.quick else 10.0
    args.workloads = tuple(w for w in WORKLOADS if not (args.reads_only and w.write))
    # nbdkit's file plugin and fio's io_uring baseline read through the page cache: compare them warm.
    args.warm = args.warm or (args.nbdkit and not args.cold)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for v in VARIANTS:
            print(f"{v.key:18} {v.tool:9} {v.label}")
        return 0
    only = (args.only.split(",") if args.only else list(RBD_VARIANTS) if args.backend == "rbd"
            else list(NBDKIT_VARIANTS) if args.nbdkit else list(QUICK_VARIANTS) if args.quick else None)
    chosen = [v for v in VARIANTS if (v.key in only if only is not None else v.backend == "file")]
    need = {"fio", "qemu-img"} | ({"qemu-storage-daemon"} if any(v.protocol == "nbd" for v in chosen) else set()) | (
        {"nbdkit"} if any(v.protocol == "nbdkit" for v in chosen) else set()) | (
        {"tgtd", "tgtadm"} if any(v.protocol == "iscsi" for v in chosen) else set())
    missing = sorted(t for t in need if shutil.which(t) is None)
    if missing:
        print(f"missing tools: {', '.join(missing)}", file=sys.stderr)
        return 2
    info = machine()
    work = Path(tempfile.mkdtemp(prefix="vbs-dp-", dir=args.work_dir))
    results: dict[str, dict[str, Any]] = {v.key: {"runs": [], "notes": []} for v in chosen}
    rbd: RbdSource | None = None
    try:
        with contextlib.ExitStack() as stack:
            volume = work / "volume.img"
            log(f"writing {args.size_gib} GiB of random data to {volume}")
            make_volume(volume, args.size_gib * GIB)
            if any(v.backend == "rbd" for v in chosen):
                ceph = EmbeddedCeph(work / "cluster", osds=1, osd_size_gib=max(16, 3 * args.size_gib))
                stack.callback(ceph.stop)
                log("starting a single-node Ceph and importing the file into an RBD image")
                ceph.start()
                ceph.create_pool(RBD_POOL, 1)
                run_tool(["rbd", "--conf", str(ceph.conf_path), "import", "--image-feature",
                          "layering,exclusive-lock,object-map,fast-diff,deep-flatten", str(volume),
                          f"{RBD_POOL}/{VOLUME_ID}"], timeout=1800)
                rbd = RbdSource(pool=RBD_POOL, image=VOLUME_ID, conf=ceph.conf_path, user="admin")
                info["ceph"] = "1 OSD (bluestore on a sparse file of the same disk), pool size 1"
            for rnd in range(args.rounds):
                for v in chosen:
                    log(f"round {rnd + 1}/{args.rounds}: {v.key} ({v.label}, {v.tool})")
                    try:
                        res = measure(v, volume, work, args.runtime, rbd, args.workloads, args.warm)
                    except Exception as exc:  # one broken variant must not lose the others' figures
                        log(f"  {v.key}: FAILED {type(exc).__name__}: {exc}")
                        results[v.key]["notes"].append(f"failed: {type(exc).__name__}: {str(exc)[:300]}")
                        continue
                    results[v.key]["runs"].append(res)
                    results[v.key]["notes"] += [n for n in res["notes"] if n not in results[v.key]["notes"]]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(results, args, info)
    print(text)
    if args.json:
        raw = {k: {"notes": r["notes"], "runs": [{w: vars(f) for w, f in run["figures"].items()} for run in r["runs"]]}
               for k, r in results.items()}
        args.json.write_text(json.dumps({"machine": info, "runtime_s": args.runtime, "rounds": args.rounds,
                                         "results": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
