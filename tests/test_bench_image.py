"""Which kernel modules the bench guest gets for ext2: the module itself, what its .modinfo says it
depends on, and the crypto driver its softdep asks for, each before the modules that need it (the
kernel package ships no modules.dep). A small kernel tree of modules with real .modinfo strings."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

from vbs.errors import DriverError
from vbs.rigs.testguest.bench_image import fs_modules

pytestmark = pytest.mark.unit

RELEASE = "6.1.0-99-amd64"


def _kernel(tmp_path: Path, config: str, modules: dict[str, bytes]) -> Path:
    root = tmp_path / "kernel"
    (root / "boot").mkdir(parents=True)
    (root / "boot" / f"config-{RELEASE}").write_text(config)
    for relpath, info in modules.items():
        path = root / "lib" / "modules" / RELEASE / "kernel" / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        body = b"\x7fELF" + info + b"\0"
        path.write_bytes(lzma.compress(body) if relpath.endswith(".xz") else body)
    return root


EXT4_TREE = {
    "fs/ext4/ext4.ko": b"\0license=GPL\0softdep=pre: crc32c\0depends=mbcache,jbd2,crc16\0",
    "fs/jbd2/jbd2.ko": b"\0softdep=pre: crypto-crc32c\0depends=\0",
    "fs/mbcache.ko": b"\0depends=\0",
    "lib/crc16.ko.xz": b"\0depends=\0",
    "crypto/crc32c_generic.ko": b"\0depends=\0",
    "fs/btrfs/btrfs.ko": b"\0depends=crc16\0",
}


def test_ext4_serves_ext2_and_comes_after_everything_it_needs(tmp_path: Path) -> None:
    root = _kernel(tmp_path, "CONFIG_EXT4_FS=m\nCONFIG_EXT4_USE_FOR_EXT2=y\n", EXT4_TREE)
    modules = fs_modules(root, RELEASE)
    order = list(modules)
    assert set(order) == {"ext4", "jbd2", "mbcache", "crc16", "crc32c_generic"}
    assert order[-1] == "ext4"
    assert order.index("crc32c_generic") < order.index("jbd2")
    # An .xz module is stored uncompressed: the guest's busybox insmod takes a plain .ko.
    assert modules["crc16"].startswith(b"\x7fELF")


def test_a_kernel_with_an_ext2_module_gets_that_one(tmp_path: Path) -> None:
    root = _kernel(tmp_path, "CONFIG_EXT2_FS=m\n", {**EXT4_TREE, "fs/ext2/ext2.ko": b"\0depends=mbcache\0"})
    assert list(fs_modules(root, RELEASE)) == ["mbcache", "ext2"]


def test_a_kernel_without_ext2_is_refused(tmp_path: Path) -> None:
    root = _kernel(tmp_path, "CONFIG_EXT4_FS=m\n", EXT4_TREE)
    with pytest.raises(DriverError, match="no ext2"):
        fs_modules(root, RELEASE)


def test_a_missing_dependency_is_named(tmp_path: Path) -> None:
    tree = {k: v for k, v in EXT4_TREE.items() if not k.startswith("fs/jbd2")}
    root = _kernel(tmp_path, "CONFIG_EXT4_USE_FOR_EXT2=y\n", tree)
    with pytest.raises(DriverError, match="jbd2"):
        fs_modules(root, RELEASE)
