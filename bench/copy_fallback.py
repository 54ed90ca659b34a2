#!/usr/bin/env python3
"""Copy-fallback benchmark: VBS's copy engine and point-in-time copies against ``cp`` (prints figures).

On the work directory's file system (ext4 here: no reflink), in the same run and round after round:

* ``engine``: ``vbs.storage.copy.sparse_copy``, the copy every copy pool makes of a volume nobody
  writes to (snapshots of detached volumes, volumes from snapshots), with its one fdatasync;
* ``cp --sparse=always`` and ``cp --reflink=never``, each followed by an fsync of the copy;
* ``pit-daemon``: the point-in-time snapshot of a volume exported to a host (attached), taken by the
  storage node's real NBD export daemon (``FileBackend`` + ``NbdExportDriver``: qemu-storage-daemon's
  ``blockdev-backup``, then the backend's finishing pass that gives zero ranges back), from the
  ``ensure_snapshot`` call until the snapshot is published;
* ``pit-vm``: the hypervisor's copy (the QEMU driver's ``blockdev-backup`` with the same arguments)
  in a real QEMU (TCG, paused: no guest runs) whose virtio-blk disk is the volume, into a local
  target file opened as the storage daemon opens it (cache.direct, aio native); until the job
  concluded and the target is on disk.

Two sources: ``data`` (the whole file random data) and ``sparse`` (one 1 MiB extent of data every
8 MiB, the rest holes). Root drops the page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``)
before each copy. Figures are medians over ``--rounds`` (MB/s = 10^6 bytes of apparent size per
second), each with the load average when it was taken; ratios are against ``cp --sparse=always``
measured in the same round. Targets (issue 15): engine >= 90 % of cp, point-in-time >= 80 % of cp.

    .venv/bin/python bench/copy_fallback.py            # 4 GiB, 3 rounds (about 10 minutes here)
    .venv/bin/python bench/copy_fallback.py --quick    # 1 GiB, 3 rounds, no sparse pit (about 2 minutes)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.common import drop_caches  # noqa: E402

from vbs import ids  # noqa: E402
from vbs.qemu.qmp import QmpClient, connect_until  # noqa: E402
from vbs.storage.backends.file import FileBackend  # noqa: E402
from vbs.storage.copy import sparse_copy  # noqa: E402
from vbs.storage.exports.nbd import NbdExportDriver  # noqa: E402
from vbs.system.files import fsync_path  # noqa: E402
from vbs.wire.connection import HostIdentity  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
SPARSE_EVERY = 8 * MIB  # the sparse source: 1 MiB of data at the start of every 8 MiB
TARGET_ENGINE = 0.90
TARGET_PIT = 0.80
HOST = HostIdentity(name="bench", address="127.0.0.1", initiator_name="iqn.2026-11.org.vbs.bench:copy")
BASELINE = "cp --sparse=always"
CPS = (BASELINE, "cp --reflink=never")

Method = Callable[[Path, Path], None]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def loadavg() -> float:
    return os.getloadavg()[0]


def make_source(path: Path, size: int, sparse: bool) -> None:
    block = os.urandom(64 * MIB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        step, length = (SPARSE_EVERY, MIB) if sparse else (len(block), len(block))
        for offset in range(0, size, step):
            os.pwrite(fd, memoryview(block)[:min(length, size - offset)], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the methods ---------------------------------------------------------------------------------


def engine(src: Path, dst: Path) -> None:
    src_fd = os.open(src, os.O_RDONLY)
    try:
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            sparse_copy(src_fd, dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def cp(option: str) -> Method:
    def run(src: Path, dst: Path) -> None:
        subprocess.run(["cp", option, str(src), str(dst)], check=True)
        fsync_path(dst)
    return run


class DaemonSnapshot:
    """A copy pool whose NBD export daemon takes point-in-time copies; the volume is exported to a host."""

    def __init__(self, work: Path, port: int) -> None:
        self.pool_dir = work / "pool"
        self.pool_dir.mkdir(parents=True)
        self.nbd = NbdExportDriver(work / "nbd", "127.0.0.1", port, socket_dir=work / "sock")
        self.nbd.start()
        self.pool = FileBackend("bench", self.pool_dir, exports=self.nbd, clone_method="copy")
        self.volumes: dict[Path, str] = {}
        self.done: list[str] = []

    def attach(self, sources: list[Path]) -> None:
        """Every source as a volume of the pool (a hard link: no copy), exported to a host."""
        for src in sources:
            volume_id = ids.new_id("volume")
            os.link(src, self.pool_dir / "volumes" / f"{volume_id}.raw")
            self.pool.connection_for(volume_id, HOST)  # attached: a host may write to it meanwhile
            self.volumes[src] = volume_id

    def copy(self, src: Path, dst: Path) -> None:
        snapshot_id = ids.new_id("snapshot")
        volume_id = self.volumes[src]
        status = self.pool.ensure_snapshot(snapshot_id, volume_id)
        while status.state not in ("ready", "error"):
            time.sleep(0.02)
            status = self.pool.ensure_snapshot(snapshot_id, volume_id)
        if status.state == "error":
            raise RuntimeError(f"snapshot failed: {status.error}")
        # Published (renamed after its fsync): moved out, its record is forgotten outside the timing.
        os.rename(self.pool_dir / "snapshots" / f"{snapshot_id}.raw", dst)
        self.done.append(snapshot_id)

    def tidy(self) -> None:
        while self.done:
            self.pool.remove_snapshot(self.done.pop())

    def close(self) -> None:
        try:
            self.pool.close()
        finally:
            self.nbd.stop()


class VmCopy:
    """A paused TCG QEMU with the source as its virtio-blk disk; blockdev-backup as the QEMU driver does."""

    def __init__(self, work: Path) -> None:
        self.sock = work / "vm.qmp"
        self.proc = subprocess.Popen(
            ["qemu-system-x86_64", "-machine", "pc", "-accel", "tcg", "-S", "-m", "128", "-nodefaults",
             "-display", "none", "-qmp", f"unix:{self.sock},server=on,wait=off"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.qmp: QmpClient = connect_until(self.sock, time.monotonic() + 30, alive=lambda: self.proc.poll() is None)
        self.disks: dict[Path, str] = {}

    def attach(self, sources: list[Path]) -> None:
        """Every source as a disk of the VM from the start: a paused guest cannot answer an unplug.
        Their files are opened without locks, so the storage daemon may open them too."""
        for n, src in enumerate(sources):
            self.qmp.execute("blockdev-add", {"driver": "file", "node-name": f"disk{n}-proto", "filename": str(src),
                                              "cache": {"direct": True}, "aio": "native", "locking": "off"})
            self.qmp.execute("blockdev-add", {"driver": "raw", "node-name": f"disk{n}", "file": f"disk{n}-proto"})
            self.qmp.execute("device_add", {"driver": "virtio-blk-pci", "id": f"dev{n}", "drive": f"disk{n}"})
            self.disks[src] = f"disk{n}"

    def copy(self, src: Path, dst: Path) -> None:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, src.stat().st_size)
        finally:
            os.close(fd)
        self.qmp.execute("blockdev-add", {"driver": "file", "node-name": "target", "filename": str(dst),
                                          "cache": {"direct": True}, "aio": "native"})
        mark = self.qmp.event_mark()
        self.qmp.execute("blockdev-backup", {"job-id": "copy", "device": self.disks[src], "target": "target",
                                             "sync": "full", "auto-dismiss": False, "filter-node-name": "cbw"})
        self.qmp.wait_event("JOB_STATUS_CHANGE", lambda e: e["data"].get("id") == "copy"
                            and e["data"].get("status") == "concluded", since=mark, timeout=3600)
        job = next(j for j in self.qmp.execute("query-jobs") if j["id"] == "copy")
        self.qmp.execute("job-dismiss", {"id": "copy"})
        self.qmp.execute("blockdev-del", {"node-name": "target"})
        if job.get("error"):
            raise RuntimeError(f"backup failed: {job['error']}")
        fsync_path(dst)

    def close(self) -> None:
        try:
            self.qmp.execute("quit")
        except Exception:  # noqa: BLE001 - it may be gone already; the wait below decides
            pass
        self.qmp.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the run -------------------------------------------------------------------------------------


@contextmanager
def methods(work: Path, sources: list[Path], with_pit: bool,
            tidies: list[Callable[[], None]]) -> Iterator[dict[str, Method]]:
    found: dict[str, Method] = {BASELINE: cp("--sparse=always"), CPS[1]: cp("--reflink=never"),
                                "engine": engine}
    daemon: DaemonSnapshot | None = None
    vm: VmCopy | None = None
    try:
        if with_pit:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            daemon = DaemonSnapshot(work / "daemon", port)
            vm = VmCopy(work)
            vm.attach(sources)
            daemon.attach(sources)
            tidies.append(daemon.tidy)
            found["pit-daemon"] = daemon.copy
            found["pit-vm"] = vm.copy
        yield found
    finally:
        if vm is not None:
            vm.close()
        if daemon is not None:
            daemon.close()


def measure(method: Method, src: Path, dst: Path, tidies: list[Callable[[], None]]) -> tuple[float, float, int]:
    """Seconds, load average and bytes allocated by the copy."""
    dst.unlink(missing_ok=True)
    drop_caches()
    load = loadavg()
    start = time.perf_counter()
    method(src, dst)
    seconds = time.perf_counter() - start
    allocated = dst.stat().st_blocks * 512
    dst.unlink()
    for tidy in tidies:
        tidy()
    return seconds, load, allocated


def check_identical(method: Method, name: str, src: Path, dst: Path, tidies: list[Callable[[], None]]) -> None:
    dst.unlink(missing_ok=True)
    method(src, dst)
    if subprocess.run(["cmp", "-s", str(src), str(dst)]).returncode != 0:
        raise SystemExit(f"{name}: the copy differs from its source")
    dst.unlink()
    for tidy in tidies:
        tidy()


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="vbs-bench-copy-", dir=args.work_dir))
    size = args.size_gib * GIB
    cache_dropped = os.geteuid() == 0
    try:
        sources = {"data": work / "data.raw", "sparse": work / "sparse.raw"}
        for kind, path in sources.items():
            log(f"writing the {kind} source ({args.size_gib} GiB)")
            make_source(path, size, sparse=kind == "sparse")
        dst = work / "copy.raw"
        tidies: list[Callable[[], None]] = []
        with methods(work, list(sources.values()), not args.no_pit, tidies) as found:
            results: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
            for kind, src in sources.items():
                names = [n for n in found if not (args.quick and kind == "sparse" and n.startswith("pit"))]
                if args.verify:
                    for name in names:
                        check_identical(found[name], name, src, dst, tidies)
                for r in range(args.rounds):
                    for name in names:
                        sec, load, alloc = measure(found[name], src, dst, tidies)
                        results.setdefault((kind, name), []).append((sec, load, alloc))
                        log(f"{kind:6s} round {r + 1} {name:20s} {size / sec / 1e6:7.0f} MB/s  load {load:.2f}  "
                            f"allocated {alloc // MIB} MiB")
        report(results, args, size, cache_dropped)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(results: dict[tuple[str, str], list[tuple[float, float, int]]], args: argparse.Namespace,
           size: int, cache_dropped: bool) -> None:
    print(f"\nCopy fallback, {args.size_gib} GiB, {args.rounds} round(s), page cache "
          f"{'dropped' if cache_dropped else 'NOT dropped (not root)'} before each copy; "
          f"kernel {os.uname().release}; medians; ratio = median of per-round ratios to {BASELINE}\n")
    print("| source | method | MB/s (median) | per round | load | allocated | ratio to cp | ratio of medians to "
          "the faster cp | target |")
    print("|---|---|---:|---|---|---:|---:|---:|---|")
    for (kind, name), runs in results.items():
        base = results[(kind, BASELINE)]
        ratios = [b[0] / r[0] for r, b in zip(runs, base, strict=True)]
        ratio = statistics.median(ratios)
        fastest_cp = min(statistics.median(s for s, _, _ in results[(kind, n)]) for n in CPS)
        strict = fastest_cp / statistics.median(s for s, _, _ in runs)
        target = TARGET_PIT if name.startswith("pit") else TARGET_ENGINE if name == "engine" else None
        verdict = "" if target is None else f"{'met' if ratio >= target else 'NOT met'} (>= {target:.0%})"
        rates = [size / s / 1e6 for s, _, _ in runs]
        print(f"| {kind} | {name} | {statistics.median(rates):.0f} | {' / '.join(f'{x:.0f}' for x in rates)} | "
              f"{' / '.join(f'{ld:.1f}' for _, ld, _ in runs)} | {runs[-1][2] // MIB} MiB | {ratio:.2f} | "
              f"{strict:.2f} | {verdict} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 GiB, no point-in-time copy of the sparse source")
    p.add_argument("--size-gib", type=int, default=None, help="source size (default 4, --quick 1)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    p.add_argument("--no-pit", action="store_true", help="leave out the point-in-time copies (no QEMU)")
    p.add_argument("--verify", action="store_true", help="first check that every method's copy is identical")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp"), help="where the files go (default /var/tmp)")
    args = p.parse_args(argv)
    if args.size_gib is None:
        args.size_gib = 1 if args.quick else 4
    return args


if __name__ == "__main__":
    sys.exit(run(parse_args()))
