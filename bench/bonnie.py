#!/usr/bin/env python3
"""The paper's Bonnie++ experiment in a guest: prints figures (it is not a test).

One test guest (the bench flavour: Debian's bonnie++ and ext2, ``build_guest(bench=True)``; QEMU,
TCG) gets four disks one after the other, and bonnie++ runs on an ext2 filesystem made on each:

* ``vbs-nbd``: a VBS volume of ``vbs up --export nbd`` attached through VBS's API (the host agent
  hot-plugs it over QMP; qemu-storage-daemon serves it with ``cache.direct``);
* ``vbs-iscsi``: the same with ``vbs up --export iscsi`` (tgtd; QEMU's libiscsi client). One VBS
  install has one export driver: the NBD one is stopped and an iSCSI one started whose host agent
  finds the same guest (its VM directory holds a link to the guest's monitor socket);
* ``local-lvm``: a raw file on the host's filesystem opened with ``cache=none`` (O_DIRECT, native
  AIO). It stands in for the paper's (docs/architecture.md §1) Local-LVM (a logical volume): no device-mapper on this
  machine;
* ``local-image``: a raw image file opened with the host's page cache on (``cache=writeback``): the
  paper's Local-Image. Its host cache is capped by a memory cgroup around the QEMU process (cgroup v2
  ``memory.max`` in a child of /sys/fs/cgroup, or v1 ``memory.limit_in_bytes`` in a child of this
  process's own memory cgroup): the cap is what QEMU uses before that run plus ``--host-cache``. It
  caps QEMU's whole memory, so the cache gets what QEMU's own use leaves: the most page cache seen
  charged to the cgroup (sampled twice a second) is printed as the cap in effect.

Sizes as the paper chose them: bonnie++'s file is twice the guest's RAM and twice the host cache
(``-s 2R -r R``, the cap R too), ``-n`` in thousands of files for create / delete. ``--quick``
lies to bonnie++ about the RAM (``-r``) so that a small file is allowed and skips the per-character
tests (``-f``: under TCG they take about 100 s per disk whatever the file size): its figures are
mostly the guest's page cache, a proof that the chain works rather than a measurement.

The local-lvm run is the baseline: each figure's ratio to it is printed (the paper's "VBS-LVM on the
order of Local-LVM"), with the load average (the machine is shared). Several rounds: the median.
Every process is stopped by its PID in a ``finally`` (the guest by ``TestGuest.stop``, ``vbs up`` by
SIGINT); the cgroup is removed; only 127.0.0.1 is used. Run as root (cgroup, tgtd).

    .venv/bin/python bench/bonnie.py            # 128 MiB guest, 256 MiB file, -n 16, 3 rounds
    .venv/bin/python bench/bonnie.py --quick    # 96 MiB file (-r 48), -n 4, no per-char tests, one round
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.attach import HOST, VM, wait_instance  # noqa: E402
from bench.common import log  # noqa: E402
from bench.datapath import evict as drop_host_cache  # noqa: E402
from tests.conftest import Vbs, VbsUp, wait_until  # noqa: E402

from vbs.ids import virtio_serial  # noqa: E402
from vbs.rigs.testguest import TestGuest, build_guest  # noqa: E402
from vbs.rigs.testguest.bonnie import PAPER_COLUMNS, BonnieResult, BonnieSize, mount_ext2, run_bonnie, unmount  # noqa: E402

MIB = 1024 * 1024
LOCAL_DISK_BYTES = 1 << 30  # as large as the VBS volumes (1 GiB): ext2 lays out the same groups
BASELINE = "local-lvm"


# -- the host cache cap ------------------------------------------------------------------------------


@dataclass
class MemoryCgroup:
    """A memory cgroup of our own (v2 or v1), for the QEMU process alone."""

    path: Path
    v2: bool

    @classmethod
    def create(cls, name: str) -> MemoryCgroup:
        root = Path("/sys/fs/cgroup")
        if (root / "cgroup.controllers").exists() and "memory" in (root / "cgroup.controllers").read_text():
            # v2: a child of the root (the root alone may hold processes and delegate memory).
            subtree = root / "cgroup.subtree_control"
            if "memory" not in subtree.read_text().split():
                subtree.write_text("+memory")
            path, v2 = root / name, True
        elif (root / "memory" / "memory.limit_in_bytes").exists():
            # v1: a child of our own memory cgroup, so that whatever limits us limits it too.
            own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                       if line.split(":")[1] == "memory")
            path, v2 = root / "memory" / own.lstrip("/") / name, False
        else:
            raise RuntimeError("no cgroup memory controller on this machine: cannot cap the host cache")
        path.mkdir()
        return cls(path, v2)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def usage(self) -> int:
        return int((self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")).read_text())

    def file_cache(self) -> int:
        """Bytes of page cache charged here now."""
        key = "file" if self.v2 else "cache"
        for line in (self.path / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0

    def limit(self, limit: int | None) -> None:
        """Cap the cgroup at ``limit`` bytes (None: no cap)."""
        if self.v2:
            (self.path / "memory.max").write_text("max" if limit is None else str(limit))
        else:
            (self.path / "memory.limit_in_bytes").write_text("-1" if limit is None else str(limit))

    def remove(self) -> None:
        """Back to the parent with whatever still runs in it (nothing, normally), then remove it."""
        for pid in (self.path / "cgroup.procs").read_text().split():
            (self.path.parent / "cgroup.procs").write_text(pid)
        self.path.rmdir()


class CacheSampler:
    """The most page cache the cgroup held, sampled twice a second while a disk is benchmarked: shows
    the cap at work (the kernel reclaims the cache at the cgroup's limit)."""

    def __init__(self, cgroup: MemoryCgroup) -> None:
        self.cgroup, self.peak = cgroup, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-sampler", daemon=True)

    def __enter__(self) -> CacheSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self.cgroup.file_cache())


# -- disks -------------------------------------------------------------------------------------------


def plug_local_file(guest: TestGuest, path: Path, name: str, host_cache: bool, iothread: bool = False) -> str:
    """Hot-plug ``path`` (raw) into the guest as QEMU's ``cache=none`` or ``cache=writeback`` would open
    it (with ``iothread``, its device in an I/O thread of its own); return the serial the guest reports
    it under."""
    with path.open("wb") as f:
        f.truncate(LOCAL_DISK_BYTES)
    file_node = {"driver": "file", "node-name": f"{name}-file", "filename": str(path),
                 "cache": {"direct": not host_cache, "no-flush": False},
                 "aio": "threads" if host_cache else "native"}
    guest.qmp("blockdev-add", file_node)
    guest.qmp("blockdev-add", {"driver": "raw", "node-name": f"{name}-raw", "file": f"{name}-file"})
    serial = name.replace("-", "")
    thread = {}
    if iothread:
        guest.qmp("object-add", {"qom-type": "iothread", "id": f"{name}-io"})
        thread = {"iothread": f"{name}-io"}
    guest.qmp("device_add", {"driver": "virtio-blk-pci", "id": f"{name}-dev", "drive": f"{name}-raw",
                             "serial": serial, **thread})
    return serial


def attach_volume(vbs: Vbs, guest: TestGuest) -> str:
    """A new 1 GiB VBS volume attached to the guest through VBS's API; its serial in the guest."""
    volume_id = vbs.create_volume(size_gib=1)["volume_id"]
    vbs.wait_volume(volume_id, "available")
    r = vbs.http.post(f"/v1/volumes/{volume_id}/attach", json={"host": HOST, "vm_id": VM})
    if r.status_code != 200:
        raise RuntimeError(f"attach: {r.status_code} {r.text[:300]}")
    serial = virtio_serial(volume_id)
    guest.wait_for_disk(serial, 120)
    wait_until(lambda: vbs.volume(volume_id)["attachments"][0]["state"] == "attached", 120, what="attached")
    return volume_id


def start_install(work: Path, export: str, guest: TestGuest, qemu_options: str = "") -> tuple[VbsUp, Vbs]:
    """``vbs up --export EXPORT`` in ``work/EXPORT`` whose host agent finds ``guest`` (its VM directory holds
    a link to the guest's monitor socket unless the guest's monitor is there already), once it reports
    the guest's instance. One install at a time holds the guest's monitor: stop the last one first.
    ``qemu_options``: TOML lines of ``[host_agent.options.qemu]`` (through a ``VBS_CONFIG`` file)."""
    vms = work / export / "var" / "vms"
    vms.mkdir(parents=True, exist_ok=True)
    if guest.qmp_path.parent.resolve() != vms.resolve():
        (vms / guest.qmp_path.name).symlink_to(guest.qmp_path)
    env = {}
    if qemu_options:
        config = work / export / "vbs.toml"
        config.write_text(f"[host_agent.options.qemu]\n{qemu_options}\n")
        env["VBS_CONFIG"] = str(config)
    up = VbsUp(work / export / "var", work / export / "up.log", extra=["--export", export], env=env)
    vbs = up.start()
    try:
        wait_instance(vbs)
    except BaseException:
        up.stop()
        raise
    return up, vbs


def detach_volume(vbs: Vbs, guest: TestGuest, volume_id: str) -> None:
    r = vbs.http.post(f"/v1/volumes/{volume_id}/detach", json={})
    if r.status_code != 200:
        raise RuntimeError(f"detach: {r.status_code} {r.text[:300]}")
    guest.wait_disk_gone(virtio_serial(volume_id), 120)
    vbs.wait_volume(volume_id, "available", 120)


# -- one disk ----------------------------------------------------------------------------------------


@dataclass
class DiskFigures:
    name: str
    rounds: list[BonnieResult]
    load: list[float]  # 1-minute load average after each round
    note: str = ""

    def median(self, field: str) -> float | None:
        values = [v for r in self.rounds if isinstance(v := getattr(r, field), float)]
        return statistics.median(values) if values else None


def bench_disk(guest: TestGuest, serial: str, name: str, size: BonnieSize, rounds: int,
               before_round: Callable[[], None] = lambda: None) -> DiskFigures:
    dev = guest.wait_for_disk(serial, 120)
    mountpoint = f"/mnt/{name.replace('-', '')[:16]}"
    mount_ext2(guest, dev, mountpoint)
    figures = DiskFigures(name, [], [])
    try:
        for i in range(rounds):
            before_round()
            t0 = time.monotonic()
            result = run_bonnie(guest, mountpoint, size, name.replace("-", ""), timeout=6 * 3600)
            figures.rounds.append(result)
            figures.load.append(os.getloadavg()[0])
            log(f"{name}: round {i + 1}/{rounds} in {time.monotonic() - t0:.0f} s, load {figures.load[-1]:.2f}: "
                + ", ".join(f"{k}={v}" for k, v in asdict(result).items() if k not in ("label", "file_size")))
    finally:
        unmount(guest, mountpoint)
    return figures


# -- the report --------------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    return "+++" if value is None else f"{value:,.0f}"


def report(results: list[DiskFigures], size: BonnieSize, guest_ram: int, cache_mib: int) -> str:
    base = next((r for r in results if r.name == BASELINE), None)
    heads = [h for h, _ in PAPER_COLUMNS]
    flags = "" if size.per_char else " -f"
    lines = [f"bonnie++ -s {size.file_mib}M -r {size.ram_mib} -n {size.files_k}{flags} in a {guest_ram} MiB guest "
             f"(QEMU TCG); local-image host cache capped at {cache_mib} MiB",
             "", "| disk | " + " | ".join(heads) + " | load |", "|---" * (len(heads) + 2) + "|"]
    for r in results:
        load = statistics.median(r.load) if r.load else float("nan")
        lines.append(f"| {r.name} | " + " | ".join(_fmt(r.median(f)) for _, f in PAPER_COLUMNS) + f" | {load:.2f} |")
    if base is not None:
        lines += ["", f"Ratio to {BASELINE} (same run; +++: too quick to time):", "",
                  "| disk | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for r in results:
            cells = []
            for _, f in PAPER_COLUMNS:
                mine, ref = r.median(f), base.median(f)
                cells.append("+++" if mine is None or not ref else f"{mine / ref:.2f}")
            lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    lines += [""] + [f"{r.name}: {r.note}" for r in results if r.note]
    return "\n".join(lines)


# -- the run -----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="a 96 MiB file (-r 48), -n 4, no per-char tests, one round")
    ap.add_argument("--guest-ram", type=int, default=128, help="MiB of guest RAM (bonnie++ -r; the file is twice)")
    ap.add_argument("--host-cache", type=int, default=None, help="MiB of host cache for local-image (default: "
                    "the guest's RAM, so that the file is twice each)")
    ap.add_argument("--files", type=int, default=16, help="bonnie++ -n (thousands of files)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disks", default="vbs-nbd,local-lvm,local-image,vbs-iscsi")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    guest_ram = 128 if args.quick else args.guest_ram
    if args.quick:
        size, rounds = BonnieSize(file_mib=96, ram_mib=48, files_k=4, per_char=False), 1
    else:
        size, rounds = BonnieSize(file_mib=2 * guest_ram, ram_mib=guest_ram, files_k=args.files), args.rounds
    cache_mib = args.host_cache if args.host_cache is not None else size.ram_mib
    disks = args.disks.split(",")
    if unknown := set(disks) - {"vbs-nbd", "vbs-iscsi", "local-lvm", "local-image"}:
        ap.error(f"unknown disks {unknown}")

    tmp = Path(tempfile.mkdtemp(prefix="bonnie-", dir=args.work))
    log(f"work dir {tmp}; building the bench guest")
    image = build_guest(bench=True)
    cgroup = MemoryCgroup.create(f"vbs-bonnie-{os.getpid()}")
    ups: list[VbsUp] = []
    guest = TestGuest(VM, tmp / "guest", image, tmp / "nbd" / "var" / "vms", memory_mib=guest_ram)
    results: list[DiskFigures] = []
    finished = False
    try:
        guest.start()
        assert guest.pid is not None
        cgroup.add(guest.pid)  # before the guest touches its RAM: all of QEMU's memory is charged there
        up = VbsUp(tmp / "nbd" / "var", tmp / "nbd" / "up.log", extra=["--export", "nbd"])
        ups.append(up)
        vbs = up.start()
        log(f"guest booted in {guest.wait_ready(300):.1f} s")
        wait_instance(vbs)
        if "vbs-nbd" in disks:
            volume_id = attach_volume(vbs, guest)
            results.append(bench_disk(guest, virtio_serial(volume_id), "vbs-nbd", size, rounds))
            detach_volume(vbs, guest, volume_id)
        if "local-lvm" in disks:
            serial = plug_local_file(guest, tmp / "local-lvm.raw", "local-lvm", host_cache=False)
            results.append(bench_disk(guest, serial, "local-lvm", size, rounds))
        if "local-image" in disks:
            image_file = tmp / "local-image.raw"
            serial = plug_local_file(guest, image_file, "local-image", host_cache=True)
            caps: list[str] = []

            def cap() -> None:  # before each round: an empty host cache, capped at cache_mib over QEMU's own use
                cgroup.limit(None)
                drop_host_cache(image_file)
                limit = cgroup.usage() - cgroup.file_cache() + cache_mib * MIB
                cgroup.limit(limit)
                caps.append(f"{limit // MIB} MiB")

            with CacheSampler(cgroup) as sampler:
                figures = bench_disk(guest, serial, "local-image", size, rounds, before_round=cap)
            figures.note = (f"QEMU's memory cgroup capped at {', '.join(caps)} (its use before the round plus "
                            f"{cache_mib} MiB of host cache); most page cache seen charged to it: "
                            f"{sampler.peak / MIB:.1f} MiB")
            cgroup.limit(None)
            results.append(figures)
        if "vbs-iscsi" in disks:
            up.stop()  # the NBD install lets go of the guest's monitor; the iSCSI one takes it
            up, vbs = start_install(tmp, "iscsi", guest)
            ups.append(up)
            volume_id = attach_volume(vbs, guest)
            results.append(bench_disk(guest, virtio_serial(volume_id), "vbs-iscsi", size, rounds))
            detach_volume(vbs, guest, volume_id)
        finished = True
    finally:
        guest.stop()
        for u in ups:
            u.stop()
        cgroup.remove()
        if finished and args.work is None:
            shutil.rmtree(tmp)  # its disk images: GiBs of a full run
        else:
            log(f"work dir {tmp} kept (logs of the installs in */up.log)")
    print(report(results, size, guest_ram, cache_mib))
    print("\nbonnie++ fields per round (KiB/s and /s):")
    for r in results:
        for i, result in enumerate(r.rounds):
            print(f"  {r.name} #{i + 1}: " + ", ".join(f"{f.name}={getattr(result, f.name)}" for f in fields(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
