#!/usr/bin/env python3
"""VBS's data path seen from inside a guest, against a local disk of the same guest: prints figures.

One test guest of the bench flavour (``build_guest(bench=True)``: fio on a read-only disk of its own,
``vbs.rigs.testguest.fio``; QEMU TCG with ``--cpus`` vCPUs, 2 by default: multi-threaded TCG, so that
fio's submitting and completing and the guest's virtio interrupts do not queue behind one emulated CPU)
gets its disks one after the other, each 1 GiB:

* ``local-image``: a raw file on the host opened as QEMU's ``cache=none,aio=native`` would (O_DIRECT,
  native AIO), hot-plugged over QMP: the baseline;
* ``nbd``, ``nbdkit``, ``iscsi``: a volume of ``vbs up --export nbd`` (qemu-storage-daemon),
  ``--export nbdkit`` or ``--export iscsi`` (tgtd) attached through VBS's API (its host agent hot-plugs
  it; QEMU's NBD or libiscsi client). One install has one export driver, so each disk has its own
  ``vbs up`` whose host agent finds the same guest (bench/bonnie.py's ``start_install``), stopped
  after its volume is detached.

Each disk is written end to end first (a read of a hole costs an export nothing), then fio runs in the
guest on the raw device (no filesystem), ``direct=1`` and the same engine (libaio) on every disk:
``randread bs=4k iodepth=32`` and ``read bs=1M iodepth=8``, ``--runtime`` seconds each (and one
second of ramp), ``--rounds`` times; the median is printed with its ratio to local-image and the
1-minute load average (the machine is shared: compare figures of one run only), and where the CPU
went meanwhile: the machine's busy cores and the guest's QEMU process's (the rest is the export's
daemon, VBS and anything else running). Every process is
stopped by its PID in a ``finally``; only 127.0.0.1 is used. Run as root (tgtd).

    .venv/bin/python bench/guest_datapath.py            # 10 s per figure, 3 rounds
    .venv/bin/python bench/guest_datapath.py --quick    # 3 s per figure, one round
    .venv/bin/python bench/guest_datapath.py --only local-image,nbdkit
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.attach import VM  # noqa: E402
from bench.bonnie import attach_volume, detach_volume, plug_local_file, start_install  # noqa: E402
from bench.common import cpu_seconds, log, machine_busy_seconds, markdown_table  # noqa: E402
from tests.conftest import VbsUp  # noqa: E402

from vbs.ids import virtio_serial  # noqa: E402
from vbs.rigs.testguest import TestGuest, build_guest  # noqa: E402
from vbs.rigs.testguest.fio import ENGINE, FioJob, FioResult, fill, mount_fio, run_fio  # noqa: E402

BASELINE = "local-image"
DISKS = ("local-image", "nbd", "nbdkit", "iscsi")
MIB = 1024 * 1024


@dataclass(frozen=True)
class CpuShare:
    machine: float  # cores busy on the whole machine
    guest: float  # of which the guest's QEMU process (its vCPUs, its I/O, the disk's client)

    @staticmethod
    def median(shares: list[CpuShare]) -> str:
        return (f"{statistics.median(c.machine for c in shares):.2f} / "
                f"{statistics.median(c.guest for c in shares):.2f}")


def run_measured(guest: TestGuest, dev: str, job: FioJob) -> tuple[FioResult, CpuShare]:
    """``run_fio``, with the cores the machine and the guest's QEMU were busy meanwhile."""
    pid = guest.pid
    assert pid is not None
    machine0, guest0, t0 = machine_busy_seconds(), cpu_seconds([pid], descendants=False), time.monotonic()
    result = run_fio(guest, dev, job)
    took = time.monotonic() - t0
    return result, CpuShare((machine_busy_seconds() - machine0) / took,
                            (cpu_seconds([pid], descendants=False) - guest0) / took)


@dataclass
class DiskFigures:
    name: str
    fill: FioResult | None = None
    rand: list[FioResult] = field(default_factory=list)
    seq: list[FioResult] = field(default_factory=list)
    load: list[float] = field(default_factory=list)  # 1-minute load average after each round
    # Cores busy during each figure: the machine's and the guest's QEMU's (CpuShare).
    rand_cpu: list[CpuShare] = field(default_factory=list)
    seq_cpu: list[CpuShare] = field(default_factory=list)

    def rand_iops(self) -> float:
        return statistics.median(r.iops for r in self.rand)

    def seq_mb_s(self) -> float:
        return statistics.median(r.bytes_s for r in self.seq) / 1e6


def bench_disk(guest: TestGuest, serial: str, name: str, runtime: int, rounds: int) -> DiskFigures:
    dev = guest.wait_for_disk(serial, 120)
    figures = DiskFigures(name)
    t0 = time.monotonic()
    figures.fill = fill(guest, dev)
    log(f"{name} ({dev}): filled in {time.monotonic() - t0:.0f} s ({figures.fill.bytes_s / 1e6:.0f} MB/s)")
    for i in range(rounds):
        rand, rand_cpu = run_measured(guest, dev, FioJob("randread", 4096, 32, runtime))
        seq, seq_cpu = run_measured(guest, dev, FioJob("read", MIB, 8, runtime))
        figures.rand.append(rand)
        figures.rand_cpu.append(rand_cpu)
        figures.seq.append(seq)
        figures.seq_cpu.append(seq_cpu)
        figures.load.append(os.getloadavg()[0])
        log(f"{name}: round {i + 1}/{rounds}: 4k randread QD32 {rand.iops:,.0f} IOPS (cores busy "
            f"{rand_cpu.machine:.2f}, guest {rand_cpu.guest:.2f}), 1M read QD8 {seq.bytes_s / 1e6:,.1f} MB/s "
            f"(cores busy {seq_cpu.machine:.2f}, guest {seq_cpu.guest:.2f}), load {figures.load[-1]:.2f}")
    return figures


def report(results: list[DiskFigures], runtime: int, rounds: int, guest_ram: int, cpus: int,
           load_before: float, iothreads: bool = False) -> str:
    base = next((r for r in results if r.name == BASELINE), None)

    def ratio(mine: float, ref: float | None) -> str:
        return f"{mine / ref:.2f}" if ref else "-"

    rows = []
    for r in results:
        rows.append([
            r.name,
            f"{r.rand_iops():,.0f}", ratio(r.rand_iops(), base.rand_iops() if base else None),
            f"{r.seq_mb_s():,.1f}", ratio(r.seq_mb_s(), base.seq_mb_s() if base else None),
            f"{r.fill.bytes_s / 1e6:,.0f}" if r.fill else "-",
            CpuShare.median(r.rand_cpu), CpuShare.median(r.seq_cpu),
            f"{statistics.median(r.load):.2f}",
        ])  # fmt: skip
    head = (f"fio {ENGINE} direct=1 on the raw disk inside a {guest_ram} MiB TCG guest ({cpus} vCPU), {runtime} s per "
            f"figure, median of {rounds} round(s); 1 GiB disks written end to end first; load average before: "
            f"{load_before:.2f}; each disk's device in {'an I/O thread of its own' if iothreads else 'the main loop'}")
    table = markdown_table(["disk", "4k randread QD32 IOPS", f"ratio to {BASELINE}", "1M read QD8 MB/s",
                            f"ratio to {BASELINE}", "fill 1M write MB/s", "cores busy / guest QEMU: randread",
                            "the same: 1M read", "load"], rows)
    return f"{head}\n\n{table}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="3 s per figure, one round")
    ap.add_argument("--runtime", type=int, default=10, help="seconds of each fio figure (default 10)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(DISKS), help=f"disks, comma-separated, of {','.join(DISKS)}")
    ap.add_argument("--guest-ram", type=int, default=256, help="MiB of guest RAM")
    ap.add_argument("--cpus", type=int, default=2, help="vCPUs of the guest (default 2)")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--iothreads", choices=("on", "off"), default="on",
                    help="every disk in an I/O thread of its own or in QEMU's main loop: the QEMU driver's "
                         "[host_agent.options.qemu] iothreads (default on, as the driver's), and the same for "
                         "local-image")
    args = ap.parse_args()
    runtime, rounds = (3, 1) if args.quick else (args.runtime, args.rounds)
    if not (1 <= runtime <= 600 and 1 <= rounds <= 20):
        ap.error("--runtime is 1-600 s and --rounds 1-20")
    disks = [d for d in args.only.split(",") if d]
    if unknown := set(disks) - set(DISKS):
        ap.error(f"unknown disks {sorted(unknown)}")
    disks = [d for d in DISKS if d in disks]  # the baseline first

    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="guest-datapath-", dir=args.work))
    log(f"work dir {tmp}; load average {load_before:.2f}; building the bench guest")
    image = build_guest(bench=True)
    guest = TestGuest(VM, tmp / "guest", image, tmp / "guest-vms", memory_mib=args.guest_ram,
                      cpus=args.cpus)
    ups: list[VbsUp] = []
    results: list[DiskFigures] = []
    finished = False
    try:
        guest.start()
        log(f"guest up in {guest.wait_ready(300):.1f} s")
        mount_fio(guest)
        for name in disks:
            if name == BASELINE:
                serial = plug_local_file(guest, tmp / "local-image.raw", BASELINE, host_cache=False,
                                         iothread=args.iothreads == "on")
                results.append(bench_disk(guest, serial, name, runtime, rounds))
                continue
            up, vbs = start_install(tmp, name, guest, f"iothreads = {str(args.iothreads == 'on').lower()}")
            ups.append(up)
            volume_id = attach_volume(vbs, guest)
            results.append(bench_disk(guest, virtio_serial(volume_id), name, runtime, rounds))
            detach_volume(vbs, guest, volume_id)
            up.stop()  # the next install takes the guest's monitor
        finished = True
    finally:
        guest.stop()
        for u in ups:
            u.stop()
        if finished and args.work is None:
            shutil.rmtree(tmp)  # a GiB per disk
        else:
            log(f"work dir {tmp} kept (logs of the installs in */up.log, the guest's in guest/)")
    if results:
        print(report(results, runtime, rounds, args.guest_ram, args.cpus, load_before, args.iothreads == "on"))
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
