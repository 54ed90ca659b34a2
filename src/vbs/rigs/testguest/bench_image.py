"""What the "bench" flavour of the test guest adds: Debian's bonnie++ and an ext2 filesystem to run it on,
and Debian's fio on a disk of its own.

bonnie++ comes from its .deb with the shared libraries its ELF asks for (resolved by the host's
``ldd``: Debian's libstdc++, libgcc_s, libc, libm and the loader); the filesystem from the kernel
package's own modules (ext2 itself, or ext4 where the kernel serves ext2 with it:
``CONFIG_EXT4_USE_FOR_EXT2``) with the dependencies (and pre-softdeps) their .modinfo names; ``mke2fs`` is busybox's.
The guest loads the modules listed in ``FS_MODULE_ORDER`` before its first mount (``vbs.rigs.testguest.bonnie``).

fio comes from its .deb too, with its libraries found the same way, but not in the initramfs: Debian
builds it with every engine (rbd, glusterfs, rdma, nbd, pmem), so it loads about 80 MiB of libraries,
and an initramfs lives in the guest's RAM (bonnie.py's guest has 128 MiB, and its figures depend on
that). They go into a read-only ext2 image beside the kernel (``FIO_DISK``, made by the host's
``mke2fs -d``) that ``vbs.rigs.testguest.fio`` hot-plugs and mounts when a benchmark wants fio; the
guest runs it through the image's own loader (``FIO_LOADER``) with the image's library directories.
"""

from __future__ import annotations

import lzma
import re
from pathlib import Path

from vbs.errors import DriverError
from vbs.system import argv

__all__ = ["BONNIE_PACKAGE", "BONNIE_PATH", "FIO_DISK", "FIO_LOADER", "FIO_PACKAGE", "FIO_PATH", "FS_MODULE_DIR",
           "FS_MODULE_ORDER", "bench_files", "fio_files", "fs_modules", "make_ext2_image"]

BONNIE_PACKAGE = "bonnie++"
BONNIE_PATH = "/usr/sbin/bonnie++"
FIO_PACKAGE = "fio"
FIO_PATH = "/usr/bin/fio"
FIO_DISK = "fio.ext2"  # beside the kernel and initrd.img of the bench flavour
FIO_LOADER = "/lib64/ld-linux-x86-64.so.2"
FS_MODULE_DIR = "/lib/modules/fs"
FS_MODULE_ORDER = "/lib/modules/fs.order"
# bonnie++ -u looks the user up: a passwd and group file with root alone.
_ETC = {"etc/passwd": b"root:x:0:0:root:/:/bin/sh\n", "etc/group": b"root:x:0:\n"}
_DEPENDS = re.compile(rb"\0depends=([A-Za-z0-9_,-]*)\0")
_SOFTDEP_PRE = re.compile(rb"\0softdep=pre: ?([A-Za-z0-9_ -]*)\0")
_LDD_LINE = re.compile(r"^\s*(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)$")


def bench_files(bonnie_root: Path, kernel_root: Path, kernel_release: str) -> dict[str, bytes]:
    """Initramfs path (no leading /) -> contents of regular files: bonnie++, its libraries, the
    filesystem modules and their load order."""
    binary = bonnie_root / BONNIE_PATH.lstrip("/")
    if not binary.is_file():
        raise DriverError(f"{BONNIE_PACKAGE} has no {BONNIE_PATH}")
    files = {BONNIE_PATH.lstrip("/"): binary.read_bytes(), **_ETC}
    for lib in _shared_libraries(binary):
        # The loader and libraries go where the ELF names them; the host's may be symlinks.
        files[str(lib).lstrip("/")] = lib.resolve().read_bytes()
    modules = fs_modules(kernel_root, kernel_release)
    for name, data in modules.items():
        files[f"{FS_MODULE_DIR.lstrip('/')}/{name}.ko"] = data
    files[FS_MODULE_ORDER.lstrip("/")] = "".join(f"{name}\n" for name in modules).encode()
    return files


def fio_files(fio_root: Path) -> dict[str, bytes]:
    """Path in the fio disk (no leading /) -> contents: fio and every library it loads, the loader too."""
    binary = fio_root / FIO_PATH.lstrip("/")
    if not binary.is_file():
        raise DriverError(f"{FIO_PACKAGE} has no {FIO_PATH}")
    files = {FIO_PATH.lstrip("/"): binary.read_bytes()}
    for lib in _shared_libraries(binary):
        files[str(lib).lstrip("/")] = lib.resolve().read_bytes()
    if FIO_LOADER.lstrip("/") not in files:
        raise DriverError(f"{FIO_PATH} does not name the loader {FIO_LOADER}")
    return files


def make_ext2_image(files: dict[str, bytes], image: Path, work: Path) -> None:
    """A read-only-sized ext2 image at ``image`` holding ``files`` (relative path -> contents), made by the
    host's ``mke2fs -d`` from a tree under ``work``: no mount, no loop device."""
    tree = work / "tree"
    for path, data in files.items():
        target = tree / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(0o755)
    # Room for the metadata: 4 KiB blocks, a tenth more, and 8 MiB for the tables.
    kib = (sum((len(d) + 4095) // 4096 * 4 for d in files.values()) * 11) // 10 + 8192
    argv.run(["mke2fs", "-q", "-F", "-t", "ext2", "-b", "4096", "-L", "fio", "-E", "root_owner=0:0",
              "-d", str(tree), str(image), f"{kib}k"], timeout=300)


def _shared_libraries(binary: Path) -> list[Path]:
    """The absolute paths of what ``binary`` loads (its interpreter included), from the host's ldd."""
    out = argv.run(["ldd", str(binary)], timeout=30).stdout
    libs = [Path(m.group(1)) for line in out.splitlines() if (m := _LDD_LINE.match(line))]
    missing = [line.strip() for line in out.splitlines() if "not found" in line]
    if missing or not libs:
        raise DriverError(f"cannot resolve the libraries of {binary}: {missing or out.strip()}")
    return libs


def fs_modules(kernel_root: Path, kernel_release: str) -> dict[str, bytes]:
    """The modules that give this kernel ext2, dependencies first: name -> uncompressed .ko."""
    base = kernel_root / "lib" / "modules" / kernel_release
    config = kernel_root / "boot" / f"config-{kernel_release}"
    options = config.read_text() if config.is_file() else ""
    if "CONFIG_EXT2_FS=y" in options:
        return {}
    wanted = "ext2" if "CONFIG_EXT2_FS=m" in options else "ext4"
    if wanted == "ext4" and "CONFIG_EXT4_USE_FOR_EXT2=y" not in options:
        raise DriverError(f"kernel {kernel_release} has no ext2 driver (neither CONFIG_EXT2_FS nor "
                          "CONFIG_EXT4_USE_FOR_EXT2)")
    files = {_name(path.name): path for path in (base / "kernel").rglob("*.ko*")}
    order: list[str] = []
    _visit(wanted, files, order)
    return {name: _read_module(files[name]) for name in order}


def _visit(name: str, files: dict[str, Path], order: list[str]) -> None:
    """Add ``name`` to ``order`` after what it depends on (the deb has no modules.dep: depmod makes it
    on install; each module's own .modinfo names its dependencies)."""
    if name in order:
        return
    if name not in files:
        raise DriverError(f"kernel module {name} not in the kernel package")
    info = _read_module(files[name])
    found = _DEPENDS.search(info)
    for dep in (found.group(1).decode().split(",") if found else []):
        if dep:
            _visit(_name(dep), files, order)
    # "softdep=pre: crc32c": ext4 asks the crypto API for crc32c at mount time, and only the module
    # loader's softdep would bring its driver in; the portable one (no SSE4.2 under TCG) is *_generic.
    soft = _SOFTDEP_PRE.search(info)
    for alias in (soft.group(1).decode().split() if soft else []):
        algorithm = _name(alias.removeprefix("crypto-"))
        provider = algorithm if algorithm in files else f"{algorithm}_generic"
        if provider not in files:
            raise DriverError(f"no module provides {alias}, which {name} needs")
        _visit(provider, files, order)
    order.append(name)


def _name(filename: str) -> str:
    """A module's name as modinfo's ``depends=`` spells it (the kernel treats - and _ alike)."""
    return filename.removesuffix(".xz").removesuffix(".ko").replace("-", "_")


def _read_module(path: Path) -> bytes:
    raw = path.read_bytes()
    return lzma.decompress(raw) if path.name.endswith(".xz") else raw
