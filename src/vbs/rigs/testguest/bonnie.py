"""bonnie++ in the bench flavour of the test guest (``build_guest(bench=True)``): an ext2 filesystem
made and mounted on one of its disks, one bonnie++ run in it over the console, and bonnie++'s CSV
line read into the figures of the paper's (docs/architecture.md §1) table.

    mount_ext2(guest, "vdb", "/mnt/vdb")
    result = run_bonnie(guest, "/mnt/vdb", BonnieSize(file_mib=256, ram_mib=128, files_k=16), "nbd")
    print(result.put_block_kib_s)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from vbs.errors import DriverError, InvalidParameter
from vbs.rigs.testguest.bench_image import BONNIE_PATH, FS_MODULE_DIR, FS_MODULE_ORDER
from vbs.rigs.testguest.guest import TestGuest

__all__ = ["BonnieSize", "BonnieResult", "PAPER_COLUMNS", "load_ext2", "mount_ext2", "unmount", "run_bonnie",
           "parse_csv"]

_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,31}$")
_DIR_RE = re.compile(r"^/mnt/[a-z][a-z0-9]{0,15}$")
# bonnie++ 1.9x/2.x's CSV: format version 1.98 (bon_csv2txt reads the same columns).
_CSV_RE = re.compile(r"^1\.9[0-9]+,[^,\n]*,.*$", re.MULTILINE)
_CSV_COLUMNS = 50
_SPEED_UNITS = {"": 1, "K": 1, "M": 1024, "G": 1024 * 1024}


@dataclass(frozen=True)
class BonnieSize:
    """What bonnie++ is told: its file (``-s``, MiB), the RAM it assumes (``-r``, MiB: the file must be
    at least twice that, the paper's rule), the files of the create / delete tests (``-n``, in
    multiples of 1024), and whether to run the per-character tests (one ``putc`` / ``getc`` per
    byte: under TCG they take about 100 s whatever the file size; ``-f`` skips them)."""

    file_mib: int
    ram_mib: int
    files_k: int
    per_char: bool = True

    def __post_init__(self) -> None:
        if not (1 <= self.file_mib <= 1 << 20 and 1 <= self.ram_mib and 0 <= self.files_k <= 1024):
            raise InvalidParameter(f"invalid bonnie++ sizes {self}")
        if self.file_mib < 2 * self.ram_mib:
            raise InvalidParameter(f"bonnie++ needs a file of at least twice the RAM: {self}")


@dataclass(frozen=True)
class BonnieResult:
    """One bonnie++ run. Throughputs in KiB/s, the rest per second; ``None`` where bonnie++ printed
    "+++++" (the test ended too quickly to time) or nothing (not run)."""

    label: str
    file_size: str
    putc_kib_s: float | None
    put_block_kib_s: float | None
    rewrite_kib_s: float | None
    getc_kib_s: float | None
    get_block_kib_s: float | None
    seeks_per_s: float | None
    seq_create_per_s: float | None
    seq_delete_per_s: float | None
    random_create_per_s: float | None
    random_delete_per_s: float | None


# The paper's table, left to right: its heading and the result's field.
PAPER_COLUMNS: tuple[tuple[str, str], ...] = (
    ("Write per-char KiB/s", "putc_kib_s"),
    ("Write block KiB/s", "put_block_kib_s"),
    ("Rewrite KiB/s", "rewrite_kib_s"),
    ("Read per-char KiB/s", "getc_kib_s"),
    ("Read block KiB/s", "get_block_kib_s"),
    ("Seq create /s", "seq_create_per_s"),
    ("Seq delete /s", "seq_delete_per_s"),
    ("Rand create /s", "random_create_per_s"),
    ("Rand delete /s", "random_delete_per_s"),
)
_FIELDS = {f.name for f in fields(BonnieResult)}
assert all(name in _FIELDS for _, name in PAPER_COLUMNS)

# Column of each figure in the CSV line (0-based; bonnie++'s bon_csv2txt order).
_CSV_INDEX = {
    "label": 2, "file_size": 5, "putc_kib_s": 9, "put_block_kib_s": 11, "rewrite_kib_s": 13, "getc_kib_s": 15,
    "get_block_kib_s": 17, "seeks_per_s": 19, "seq_create_per_s": 26, "seq_delete_per_s": 30,
    "random_create_per_s": 32, "random_delete_per_s": 36,
}  # fmt: skip


def parse_csv(output: str) -> BonnieResult:
    """The last bonnie++ CSV line in ``output`` (bonnie++ -q prints it on stdout)."""
    lines = _CSV_RE.findall(output)
    if not lines:
        raise DriverError(f"no bonnie++ CSV line in its output: {output.strip()[-500:]!r}")
    cols = lines[-1].strip().split(",")
    if len(cols) < _CSV_COLUMNS:
        raise DriverError(f"bonnie++ CSV line has {len(cols)} columns, not {_CSV_COLUMNS}: {lines[-1]!r}")
    values: dict[str, str | float | None] = {}
    for name, index in _CSV_INDEX.items():
        values[name] = cols[index] if name in ("label", "file_size") else _figure(cols[index])
    return BonnieResult(**values)  # type: ignore[arg-type]


def _figure(text: str) -> float | None:
    """A bonnie++ figure: "+++++" or "" -> None; a throughput may carry a unit (bonnie++ writes
    1.98-format rates in K/s unless they are large: "12M" is 12 MiB/s)."""
    text = text.strip()
    if not text or set(text) == {"+"}:
        return None
    found = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMG]?)", text)
    if found is None:
        raise DriverError(f"unexpected bonnie++ figure {text!r}")
    return float(found.group(1)) * _SPEED_UNITS[found.group(2)]


def mount_ext2(guest: TestGuest, dev: str, mountpoint: str) -> None:
    """Load the guest's ext2 driver (once), make an ext2 filesystem on ``dev`` with busybox's mke2fs
    and mount it on ``mountpoint``."""
    path = _dev_path(dev)
    _check_dir(mountpoint)
    load_ext2(guest)
    guest.check(f"mke2fs -b 4096 {path} >/dev/null && mkdir -p {mountpoint} && mount -t ext2 {path} {mountpoint}",
                timeout=600)


def load_ext2(guest: TestGuest, timeout: float = 600) -> None:
    """Load the guest's ext2 driver (the modules of ``FS_MODULE_ORDER``) unless it has it already."""
    guest.check(
        f"grep -qw ext2 /proc/filesystems || for m in $(cat {FS_MODULE_ORDER}); do "
        f'grep -q "^$m " /proc/modules || insmod {FS_MODULE_DIR}/$m.ko || exit 1; done; '
        f"grep -qw ext2 /proc/filesystems",
        timeout=timeout,
    )


def unmount(guest: TestGuest, mountpoint: str) -> None:
    _check_dir(mountpoint)
    guest.check(f"umount {mountpoint}", timeout=600)


def run_bonnie(guest: TestGuest, directory: str, size: BonnieSize, label: str, timeout: float = 3600) -> BonnieResult:
    """One bonnie++ run in ``directory`` (a mounted filesystem of the guest), as root, with the page
    cache dropped before it starts; its figures."""
    _check_dir(directory)
    if not _LABEL_RE.fullmatch(label):
        raise InvalidParameter(f"invalid bonnie++ label {label!r}")
    cmd = (f"sync; echo 3 > /proc/sys/vm/drop_caches; {BONNIE_PATH} -q -d {directory} -s {size.file_mib} "
           f"-r {size.ram_mib} -n {size.files_k} -u 0:0 -m {label}{'' if size.per_char else ' -f'}")
    rc, out = guest.run(cmd, timeout)
    if rc != 0:
        raise DriverError(f"bonnie++ in {directory} failed ({rc}): {out.strip()[-800:]}")
    return parse_csv(out)


def _dev_path(dev: str) -> str:
    if not re.fullmatch(r"(/dev/)?vd[a-z]{1,2}", dev):
        raise InvalidParameter(f"invalid device name {dev!r}")
    return dev if dev.startswith("/dev/") else f"/dev/{dev}"


def _check_dir(directory: str) -> None:
    if not _DIR_RE.fullmatch(directory):
        raise InvalidParameter(f"invalid mount point {directory!r} (want /mnt/NAME)")
