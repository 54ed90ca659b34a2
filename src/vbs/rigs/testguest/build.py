"""Build the test guest: Debian's kernel plus a busybox initramfs that reports virtio disks.

Only Debian's package tools are needed (``apt-get download``, ``dpkg -x``); nothing is installed on the
host. The result is cached, keyed by the kernel and busybox package versions and the init script.
``build_guest(bench=True)`` builds the "bench" flavour beside it: the same guest plus bonnie++ and
ext2, and fio on a disk image of its own (``bench_image``); the default guest stays small and quick to boot.
"""

from __future__ import annotations

import hashlib
import logging
import lzma
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vbs.errors import DriverError
from vbs.rigs.testguest.bench_image import (
    BONNIE_PACKAGE,
    FIO_DISK,
    FIO_PACKAGE,
    bench_files,
    fio_files,
    make_ext2_image,
)
from vbs.system import argv

__all__ = ["GuestImage", "build_guest", "default_cache_dir", "MODULES"]

log = logging.getLogger(__name__)

# Load order matters: each module needs the ones before it (/init loads them in the order written to
# lib/modules/order). The SCSI ones give the guest the disks of the QEMU driver's virtio-scsi bus.
MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "virtio_blk",
    "crct10dif_common",
    "crct10dif_generic",
    "crc-t10dif",
    "crc64",
    "crc64_rocksoft_generic",
    "crc64-rocksoft",
    "t10-pi",
    "scsi_common",
    "scsi_mod",
    "sd_mod",
    "virtio_scsi",
)
KERNEL_META_PACKAGE = "linux-image-amd64"
BUSYBOX_PACKAGE = "busybox-static"
INIT_SCRIPT = Path(__file__).with_name("init.sh")
_XZ_MAGIC = b"\xfd7zXZ\x00"
_APT_TIMEOUT = 600.0
_BENCH_SUFFIX = "-bench"


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path
    # The bench flavour's read-only ext2 image with fio (``vbs.rigs.testguest.fio`` attaches it).
    fio_disk: Path | None = None


def default_cache_dir() -> Path:
    env = os.environ.get("VBS_CACHE_DIR")
    if env:
        return Path(env) / "testguest"
    return Path.home() / ".cache" / "vbs" / "testguest"


def build_guest(cache_dir: Path | None = None, bench: bool = False) -> GuestImage:
    """Return the cached guest image, building it first if this kernel/busybox/init has none yet.
    ``bench``: the flavour with bonnie++ and ext2 (a bigger initramfs, for bench/bonnie.py) and a disk
    image with fio (bench/guest_datapath.py)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    init_text = INIT_SCRIPT.read_bytes()
    flavour = _BENCH_SUFFIX if bench else ""
    try:
        kernel_pkg, kernel_ver, busybox_ver, bench_vers = _current_packages(bench)
    except DriverError:
        # No package lists (offline, no apt-get update): any guest built before still does the job.
        built = (p for p in cache.glob("linux-image-*") if _image_in(p) and bench == p.name.endswith(_BENCH_SUFFIX))
        cached = sorted(built, key=lambda p: p.stat().st_mtime)
        if cached:
            log.warning("apt-cache unusable; using the cached test guest %s", cached[-1])
            image = _image_in(cached[-1])
            assert image is not None
            return image
        raise
    parts = [busybox_ver.encode(), init_text, " ".join(MODULES).encode()]
    if bench:
        parts += [*(v.encode() for v in bench_vers), Path(__file__).with_name("bench_image.py").read_bytes()]
    digest = hashlib.sha256(b"\0".join(parts))
    target = cache / f"{kernel_pkg}_{_safe(kernel_ver)}-{digest.hexdigest()[:12]}{flavour}"
    image = _image_in(target)
    if image is not None:
        return image
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent or interrupted build never leaves half a guest.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
        work = Path(tmp)
        out = work / "out"
        out.mkdir()
        _build_into(work, out, kernel_pkg, init_text, bench)
        try:
            out.rename(target)
        except OSError:
            if _image_in(target) is None:
                raise
    image = _image_in(target)
    if image is None:
        raise DriverError(f"test guest build produced nothing in {target}")
    log.info("test guest built in %s", target)
    return image


def _image_in(directory: Path) -> GuestImage | None:
    initrd = directory / "initrd.img"
    for name in ("vmlinux", "vmlinuz"):
        if (directory / name).is_file() and initrd.is_file():
            fio_disk = directory / FIO_DISK
            return GuestImage(kernel=directory / name, initrd=initrd, fio_disk=fio_disk if fio_disk.is_file() else None)
    return None


def _safe(version: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]", "_", version)


def _current_packages(bench: bool) -> tuple[str, str, str, tuple[str, ...]]:
    """(kernel image package, its version, busybox-static version, the versions of the bench flavour's
    packages (bonnie++, fio) or () unless ``bench``), in one apt-cache call."""
    extras = [BONNIE_PACKAGE, FIO_PACKAGE] if bench else []
    packages = [KERNEL_META_PACKAGE, BUSYBOX_PACKAGE, *extras]
    proc = argv.run(["apt-cache", "show", "--no-all-versions", *packages], timeout=60, check=False)
    fields: dict[str, dict[str, str]] = {}
    for stanza in proc.stdout.split("\n\n"):
        entry = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
        if "Package" in entry:
            fields[entry["Package"]] = entry
    meta, busybox = fields.get(KERNEL_META_PACKAGE), fields.get(BUSYBOX_PACKAGE)
    # The meta package pins the image package it points at: "linux-image-6.1.0-56-amd64 (= 6.1.192-2)".
    pin = re.search(r"(linux-image-[0-9][A-Za-z0-9.+-]*-amd64) \(= ([^)]+)\)", (meta or {}).get("Depends", ""))
    if pin is None or busybox is None or "Version" not in busybox:
        raise DriverError(f"apt-cache knows no {KERNEL_META_PACKAGE} / {BUSYBOX_PACKAGE}; run 'apt-get update' first")
    versions = tuple(fields.get(name, {}).get("Version", "") for name in extras)
    if missing := [name for name, version in zip(extras, versions, strict=True) if not version]:
        raise DriverError(f"apt-cache knows no {', '.join(missing)}; run 'apt-get update' first")
    return pin.group(1), pin.group(2), busybox["Version"], versions


def _download_and_extract(package: str, work: Path) -> Path:
    debs = work / "debs"
    debs.mkdir(exist_ok=True)
    # apt-get download saves into the current directory: `env -C` sets it without a shell or chdir.
    # (apt warns that _apt cannot write into a private temp dir and downloads as root instead.)
    argv.run(["env", "-C", str(debs), "apt-get", "download", package], timeout=_APT_TIMEOUT)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        raise DriverError(f"apt-get download {package} left no .deb in {debs}")
    root = work / f"root-{package}"
    argv.run(["dpkg", "-x", str(found[-1]), str(root)], timeout=_APT_TIMEOUT)
    return root


def _build_into(work: Path, out: Path, kernel_pkg: str, init_text: bytes, bench: bool) -> None:
    kernel_root = _download_and_extract(kernel_pkg, work)
    busybox_root = _download_and_extract(BUSYBOX_PACKAGE, work)
    vmlinuz = sorted((kernel_root / "boot").glob("vmlinuz-*"))
    if not vmlinuz:
        raise DriverError(f"{kernel_pkg} has no /boot/vmlinuz-*")
    kernel_release = vmlinuz[-1].name.removeprefix("vmlinuz-")
    _write_kernel(vmlinuz[-1], out)
    busybox = busybox_root / "bin" / "busybox"
    if not busybox.is_file():
        raise DriverError(f"{BUSYBOX_PACKAGE} has no /bin/busybox")
    modules_dir = kernel_root / "lib" / "modules" / kernel_release / "kernel"
    modules = {name: _module_bytes(modules_dir, name) for name in MODULES}
    applets = argv.run([str(busybox), "--list"], timeout=30).stdout.split()
    extra: dict[str, bytes] = {}
    if bench:
        extra = bench_files(_download_and_extract(BONNIE_PACKAGE, work), kernel_root, kernel_release)
        make_ext2_image(fio_files(_download_and_extract(FIO_PACKAGE, work)), out / FIO_DISK, work / "fio")
    (out / "initrd.img").write_bytes(_initramfs(busybox.read_bytes(), applets, modules, init_text, extra))


def _write_kernel(vmlinuz: Path, out: Path) -> None:
    """Store the kernel uncompressed if its xz payload can be found (boots in ~3 s instead of 5-8 s)."""
    data = vmlinuz.read_bytes()
    pos = data.find(_XZ_MAGIC)
    if pos >= 0:
        try:
            dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
            elf = dec.decompress(data[pos:])
            # QEMU boots an ELF vmlinux through its PVH entry note; anything else keeps the bzImage.
            if dec.eof and elf[:4] == b"\x7fELF":
                (out / "vmlinux").write_bytes(elf)
                return
        except lzma.LZMAError as exc:
            log.warning("kernel payload not decompressed (%s); keeping vmlinuz", exc)
    shutil.copyfile(vmlinuz, out / "vmlinuz")


def _module_bytes(modules_dir: Path, name: str) -> bytes:
    for suffix in (".ko", ".ko.xz"):
        found = sorted(modules_dir.rglob(name + suffix))
        if found:
            raw = found[0].read_bytes()
            return lzma.decompress(raw) if suffix == ".ko.xz" else raw
    raise DriverError(f"kernel module {name} not found under {modules_dir}")


def _initramfs(
    busybox: bytes, applets: list[str], modules: dict[str, bytes], init: bytes, extra: dict[str, bytes]
) -> bytes:
    """The newc archive; ``extra`` maps more regular files' paths (no leading /) to their contents."""
    cpio = _NewcWriter()
    dirs = {"bin", "dev", "proc", "sys", "run", "tmp", "lib", "lib/modules"}
    dirs |= {str(parent) for path in extra for parent in Path(path).parents if str(parent) != "."}
    # Parents before children: the kernel's unpacker does not create missing directories.
    for d in sorted(dirs, key=lambda d: (d.count("/"), d)):
        cpio.add(d, stat.S_IFDIR | 0o755)
    # The kernel opens /dev/console for init before our devtmpfs mount exists.
    cpio.add("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))
    cpio.add("bin/busybox", stat.S_IFREG | 0o755, busybox)
    for applet in sorted(set(applets)):
        if applet != "busybox" and "/" not in applet:
            cpio.add(f"bin/{applet}", stat.S_IFLNK | 0o777, b"busybox")
    for name, data in modules.items():
        cpio.add(f"lib/modules/{name}.ko", stat.S_IFREG | 0o644, data)
    cpio.add("lib/modules/order", stat.S_IFREG | 0o644, "".join(f"{name}\n" for name in modules).encode())
    for path, data in sorted(extra.items()):
        cpio.add(path, stat.S_IFREG | 0o755, data)
    cpio.add("init", stat.S_IFREG | 0o755, init)
    return cpio.finish()


class _NewcWriter:
    """A minimal writer of the "newc" cpio format the kernel unpacks as initramfs."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._ino = 1

    def add(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        self._entry(name, mode, data, rdev)

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0, b"", (0, 0))
        blob = b"".join(self._parts)
        return blob + b"\0" * (-len(blob) % 512)

    def _entry(self, name: str, mode: int, data: bytes, rdev: tuple[int, int]) -> None:
        encoded = name.encode() + b"\0"
        fields = (self._ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0)
        self._ino += 1
        header = b"070701" + b"".join(b"%08x" % f for f in fields)
        self._parts.append(header + encoded + b"\0" * (-(len(header) + len(encoded)) % 4))
        self._parts.append(data + b"\0" * (-len(data) % 4))
