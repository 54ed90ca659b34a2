"""fio in the bench flavour of the test guest (``build_guest(bench=True)``): its disk image hot-plugged
read-only and mounted, and one fio job at a time run on a raw disk of the guest over the console.

    mount_fio(guest)                      # once: the fio disk at /opt/fio
    fill(guest, "vdb")                    # written end to end (a hole reads for free)
    r = run_fio(guest, "vdb", FioJob("randread", 4096, 32, 10))
    print(r.iops, r.bytes_s / 1e6)

fio runs through the image's own loader with the image's library directories (``bench_image``), on
the block device itself (no filesystem), ``direct=1``, with one engine for every disk (``ENGINE``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from vbs.errors import DriverError, InvalidParameter
from vbs.rigs.testguest.bench_image import FIO_LOADER, FIO_PATH
from vbs.rigs.testguest.bonnie import load_ext2
from vbs.rigs.testguest.guest import TestGuest

__all__ = ["ENGINE", "FIO_MOUNT", "FIO_SERIAL", "FioJob", "FioResult", "fill", "mount_fio", "parse_json", "run_fio"]

FIO_MOUNT = "/opt/fio"
FIO_SERIAL = "benchfio"
# The guest's kernel (Debian 6.1) has native AIO; fio's libaio engine with O_DIRECT is what QEMU's
# aio=native does on the host, and the same engine runs on every disk.
ENGINE = "libaio"
_DEV_RE = re.compile(r"^(/dev/)?vd[a-z]{1,2}$")
_RW = ("read", "write", "randread", "randwrite")
MIB = 1024 * 1024


@dataclass(frozen=True)
class FioJob:
    """One fio job: ``rw`` with blocks of ``bs`` bytes, ``iodepth`` in flight, for ``runtime`` seconds
    (``0``: once over the device, as a fill is)."""

    rw: str
    bs: int
    iodepth: int
    runtime: int

    def __post_init__(self) -> None:
        if self.rw not in _RW:
            raise InvalidParameter(f"fio rw is one of {_RW}, not {self.rw!r}")
        if not (512 <= self.bs <= 16 * MIB and self.bs % 512 == 0):
            raise InvalidParameter(f"invalid fio block size {self.bs}")
        if not (1 <= self.iodepth <= 256 and 0 <= self.runtime <= 3600):
            raise InvalidParameter(f"invalid fio iodepth / runtime {self.iodepth} / {self.runtime}")


@dataclass(frozen=True)
class FioResult:
    iops: float
    bytes_s: float
    lat_mean_us: float


def mount_fio(guest: TestGuest, timeout: float = 120) -> None:
    """Hot-plug the image's fio disk read-only (over the test monitor) and mount it at ``FIO_MOUNT``,
    loading the guest's ext2 driver first if need be."""
    disk = guest.image.fio_disk
    if disk is None:
        raise DriverError(f"the guest image {guest.image.initrd.parent} has no fio disk (build_guest(bench=True))")
    guest.qmp("blockdev-add", {"driver": "file", "node-name": "fio-file", "filename": str(disk), "read-only": True})
    guest.qmp("blockdev-add", {"driver": "raw", "node-name": "fio-raw", "file": "fio-file", "read-only": True})
    guest.qmp("device_add", {"driver": "virtio-blk-pci", "id": "fio-dev", "drive": "fio-raw", "serial": FIO_SERIAL})
    dev = guest.wait_for_disk(FIO_SERIAL, timeout)
    load_ext2(guest, timeout)
    guest.check(f"mkdir -p {FIO_MOUNT} && mount -t ext2 -o ro /dev/{dev} {FIO_MOUNT}", timeout=timeout)


def _fio_command(guest: TestGuest) -> str:
    """The guest's command line that starts fio: the disk's loader with the disk's library directories."""
    dirs = guest.check(f"cd {FIO_MOUNT} && for f in $(find . -name '*.so*'); do dirname $f; done | sort -u")
    paths = [f"{FIO_MOUNT}/{d.removeprefix('./')}" for d in dirs.split() if re.fullmatch(r"\./[A-Za-z0-9_./+-]+", d)]
    if not paths:
        raise DriverError(f"no libraries under {FIO_MOUNT}: is the fio disk mounted?")
    return f"{FIO_MOUNT}{FIO_LOADER} --library-path {':'.join(paths)} {FIO_MOUNT}{FIO_PATH}"


def run_fio(guest: TestGuest, dev: str, job: FioJob, timeout: float | None = None) -> FioResult:
    """One fio job on the raw device ``dev`` (direct I/O, ``ENGINE``), with the guest's page cache dropped
    first; its figures from fio's JSON."""
    if not _DEV_RE.fullmatch(dev):
        raise InvalidParameter(f"invalid device name {dev!r}")
    path = dev if dev.startswith("/dev/") else f"/dev/{dev}"
    timed = f"--time_based=1 --runtime={job.runtime} --ramp_time=1" if job.runtime else ""
    cmd = (f"echo 3 > /proc/sys/vm/drop_caches; {_fio_command(guest)} --name=job --filename={path} "
           f"--ioengine={ENGINE} --direct=1 --rw={job.rw} --bs={job.bs} --iodepth={job.iodepth} "
           f"--numjobs=1 --randrepeat=0 --norandommap=1 {timed} --output-format=json")
    rc, out = guest.run(cmd, timeout if timeout is not None else job.runtime + 600)
    if rc != 0:
        raise DriverError(f"fio on {path} failed ({rc}): {out.strip()[-800:]}")
    return parse_json(out, "write" if "write" in job.rw else "read")


def fill(guest: TestGuest, dev: str, timeout: float = 3600) -> FioResult:
    """Write ``dev`` end to end with 1 MiB blocks (fio's own buffers, not zeros), so that every read
    afterwards reads data the export stored, not a hole."""
    return run_fio(guest, dev, FioJob("write", MIB, 8, 0), timeout)


def parse_json(out: str, side: str) -> FioResult:
    """The figures of the first job's ``side`` ("read" or "write") in fio's JSON output (after any warnings)."""
    found = re.search(r"^\{", out, re.MULTILINE)  # the document starts a line; a warning may hold a brace
    try:
        doc: dict[str, Any] = json.loads(out[found.start():]) if found else {}
        stats = doc["jobs"][0][side]
        return FioResult(iops=float(stats["iops"]), bytes_s=float(stats["bw_bytes"]),
                         lat_mean_us=float(stats["clat_ns"]["mean"]) / 1000)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise DriverError(f"no fio figures in its output ({exc}): {out.strip()[-500:]!r}") from exc
