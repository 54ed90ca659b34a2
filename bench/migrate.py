#!/usr/bin/env python3
"""How fast a volume of files moves to another storage node: prints figures (it is not a test).

One volume file with ``--mib`` MiB of random data (the rest of it a hole) is moved, on loopback, the
two ways ``vbs migrate-volume`` moves a volume of files, each through the real parts:

* **pull** (an available volume): the old node's export daemon (``NbdExportDriver``,
  qemu-storage-daemon) exports the file over TLS-PSK to the new node, whose ``FileBackend.pull_volume``
  copies it with ``qemu-img convert``;
* **mirror** (an attached volume): a bare QEMU VM has the file attached (``QemuDriver``) and mirrors it
  (``blockdev-mirror``) onto the new node's export of an empty volume (TLS-PSK), then switches.

The baseline, measured in the same run, is the product's own local sparse copy of the same file
(``vbs.storage.copy.sparse_copy``: what a clone on a pool without reflink does). Each figure is the
seconds of the move alone (daemons and the VM are started before the clock starts; for the mirror
up to the switch) and the MiB/s of data moved, with its ratio to the baseline. The page
cache is dropped before each (root only; otherwise said so). Every daemon and the VM are stopped by
PID in a ``finally``; only 127.0.0.1 is used.

    .venv/bin/python bench/migrate.py               # 512 MiB of data
    .venv/bin/python bench/migrate.py --mib 128     # quicker
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vbs.host.hypervisors.qemu import QemuDriver
from vbs.net.ports import free_port
from vbs.pools.exports import FileSource
from vbs.storage.backends.file import FileBackend
from vbs.storage.copy import sparse_copy
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.wire.connection import FileConnection, HostIdentity, NbdConnection

MIB = 1024 * 1024
SIZE = 1 << 30
VOL = "vol-0123456789abcdef0"
SERIAL = "vol0123456789abcdef0"


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def make_volume(path: Path, mib: int) -> str:
    digest = hashlib.sha256()
    with path.open("wb") as f:
        f.truncate(SIZE)
        f.seek(64 * MIB)
        for _ in range(mib):
            chunk = os.urandom(MIB)
            f.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def data_sha(path: Path, mib: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(64 * MIB)
        for _ in range(mib):
            digest.update(f.read(MIB))
    return digest.hexdigest()


def until_ready(poll: Callable[[], str], limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while (state := poll()) != "ready":
        if state == "error" or time.monotonic() > deadline:
            raise RuntimeError(f"ended {state}")
        time.sleep(0.05)


def local_copy(tmp: Path, source: Path) -> tuple[Path, float]:
    target = tmp / "copy.raw"
    start = time.monotonic()
    src = os.open(source, os.O_RDONLY)
    dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        sparse_copy(src, dst, size_bytes=SIZE)
        os.fsync(dst)
    finally:
        os.close(src)
        os.close(dst)
    return target, time.monotonic() - start


def pull(tmp: Path, source: Path) -> tuple[Path, float]:
    exports = NbdExportDriver(tmp / "old-state", listen_host="127.0.0.1", port=free_port(), tls="psk")
    exports.start()
    try:
        conn = exports.ensure_export(VOL, FileSource(source), HostIdentity(name="storage-2", address="127.0.0.1"),
                                     read_only=True)
        assert isinstance(conn, NbdConnection)
        (tmp / "new-pool").mkdir()
        backend = FileBackend("new", tmp / "new-pool", clone_method="copy")
        start = time.monotonic()
        until_ready(lambda: backend.pull_volume(VOL, SIZE, conn).state)
        return tmp / "new-pool" / "volumes" / f"{VOL}.raw", time.monotonic() - start
    finally:
        exports.stop()


def mirror(tmp: Path, source: Path) -> tuple[Path, float]:
    vms = tmp / "vms"
    vms.mkdir()
    vm = subprocess.Popen(["qemu-system-x86_64", "-accel", "tcg", "-machine", "pc", "-m", "64", "-nodefaults",
                           "-display", "none", "-qmp", f"unix:{vms / 'vm1.qmp'},server=on,wait=off"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = tmp / "new.raw"
    with target.open("wb") as f:
        f.truncate(SIZE)
    exports = NbdExportDriver(tmp / "new-state", listen_host="127.0.0.1", port=free_port(), tls="psk")
    driver = QemuDriver(vms, secrets_dir=tmp / "secrets")
    try:
        deadline = time.monotonic() + 10
        while not (vms / "vm1.qmp").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the VM did not start")
            time.sleep(0.05)
        exports.start()
        conn = exports.ensure_export(VOL, FileSource(target), HostIdentity(name="host-1", address="127.0.0.1"))
        driver.attach("vm1", SERIAL, FileConnection(path=str(source)))
        start = time.monotonic()
        until_ready(lambda: driver.ensure_mirror("vm1", SERIAL, conn, pivot=False).state)
        until_ready(lambda: driver.ensure_mirror("vm1", SERIAL, conn, pivot=True).state)
        return target, time.monotonic() - start
    finally:
        driver.close()
        exports.stop()
        vm.terminate()
        vm.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB of random data in the 1 GiB volume")
    args = parser.parse_args()
    if args.mib < 1 or args.mib > 900:
        parser.error("--mib: 1 to 900")
    root = Path(tempfile.mkdtemp(prefix="vbs-bench-migrate-", dir="/var/tmp"))
    try:
        source = root / "old.raw"
        expected = make_volume(source, args.mib)
        cached = "page cache dropped before each" if drop_caches() else "page cache NOT dropped (not root)"
        print(f"1 GiB volume, {args.mib} MiB of random data, on {root} ({cached})")
        runs: list[tuple[str, Callable[[Path, Path], tuple[Path, float]]]] = [
            ("local sparse copy (baseline)", local_copy),
            ("pull over NBD, TLS-PSK (available)", pull),
            ("QEMU mirror onto NBD, TLS-PSK (attached)", mirror),
        ]
        base = 0.0
        for n, (name, move) in enumerate(runs):
            tmp = root / f"run-{n}"
            tmp.mkdir()
            drop_caches()
            moved, seconds = move(tmp, source)
            if data_sha(moved, args.mib) != expected:
                raise SystemExit(f"{name}: the data differs")
            base = base or seconds
            print(f"{name:42s} {seconds:7.2f} s {args.mib / seconds:8.1f} MiB/s  x{base / seconds:5.2f} of baseline")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
