"""The two moves of bench/rtt.py's paper experiment, measured through the delay proxy with VBS's own code.

- **migrate-volume**: the new storage node's ``FileBackend.pull_volume`` (``vbs.storage.pull``:
  ``qemu-img convert`` from the old node's NBD export) pulls the volume through the proxy; the clock
  runs from the call to ``ready`` (the copy published), and the copy is checked against the source
  afterwards, off the clock.
- **migrate-instance**: QEMU's own live migration between two bare QEMUs (no guest OS), driven by
  ``QemuDriver.listen_for_migration`` / ``migrate`` (``vbs.host.hypervisors.qemu_migration``), the
  stream through the proxy. A bare VM's RAM is zero pages, which QEMU sends as a header each: the
  source's RAM is a private mapping of a file of random data instead (``memory-backend-file``), so
  every page is sent as a busy guest's would be (its vCPU idles in the firmware: few pages dirtied
  again). The clock runs from ``migrate`` to the destination running the VM; the bytes are QEMU's.

Each VM and the pool are started before the clock and stopped (by PID) after it.
"""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vbs.host.hypervisors.qemu import QemuDriver
from vbs.storage.backends.file import FileBackend
from vbs.wire.connection import NbdConnection
from vbs.wire.host import StartMigration

VM_ID = "vm1"
VOLUME_ID = "vol-0123456789abcdef0"
_POLL_S = 0.02


@dataclass
class Move:
    seconds: float  # wall clock, the move alone
    bytes_sent: int  # what crossed the link: QEMU's transferred RAM, or the volume's size for a pull
    qemu_ms: int | None = None  # QEMU's own total-time of the migration
    downtime_ms: int | None = None


def _wait(check: Callable[[], bool], limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {limit:g} s")
        time.sleep(_POLL_S)


def migrate_volume(export: NbdConnection, source_file: Path, work: Path) -> Move:
    """Pull the volume ``export`` serves (through the proxy) into a fresh pool with ``FileBackend``."""
    size = source_file.stat().st_size
    pool = work / "new-pool"
    pool.mkdir()
    backend = FileBackend("storage-2", pool, clone_method="copy")
    try:
        start = time.monotonic()

        def ready() -> bool:
            state = backend.pull_volume(VOLUME_ID, size, export).state
            if state == "error":
                raise RuntimeError("the pull failed")
            return state == "ready"

        _wait(ready, 1200, "the pull")
        seconds = time.monotonic() - start
        if not filecmp.cmp(backend.volume_path(VOLUME_ID), source_file, shallow=False):
            raise RuntimeError("the pulled volume differs from the source")
        return Move(seconds, size)
    finally:
        backend.close()
        shutil.rmtree(pool, ignore_errors=True)


def _bare_vm(vm_dir: Path, memory_mib: int, *extra: str) -> subprocess.Popen[bytes]:
    vm_dir.mkdir(parents=True)
    proc = subprocess.Popen(["qemu-system-x86_64", "-accel", "tcg", "-machine", "pc", "-m", str(memory_mib),  # noqa: S603
                             "-nodefaults", "-display", "none",
                             "-qmp", f"unix:{vm_dir / (VM_ID + '.qmp')},server=on,wait=off", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: (vm_dir / f"{VM_ID}.qmp").exists() or proc.poll() is not None, 30, "QEMU's monitor")
        if proc.poll() is not None:
            raise RuntimeError(f"QEMU exited with {proc.returncode}")
    except BaseException:
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()  # the process this module started, by its own handle
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def migrate_instance(memory: Path, memory_mib: int, work: Path,
                     link: Callable[[int], int]) -> Move:
    """Live-migrate a bare VM with ``memory_mib`` MiB of RAM (the contents of ``memory``) to a twin
    waiting with ``-incoming defer``; ``link(port)`` opens the path to the destination's port and
    answers the port to dial (the caller closes it, after this returns)."""
    vms = work / "vms"
    # pc.ram: the RAM block's name of a plain -m, so the destination needs nothing but -m.
    source = _bare_vm(vms / "source", memory_mib, "-object",
                      f"memory-backend-file,id=pc.ram,size={memory_mib}M,mem-path={memory},share=off",
                      "-machine", "memory-backend=pc.ram")
    target: subprocess.Popen[bytes] | None = None
    drivers: list[QemuDriver] = []
    try:
        target = _bare_vm(vms / "target", memory_mib, "-incoming", "defer")
        src, dst = QemuDriver(vms / "source", qmp_timeout=30.0), QemuDriver(vms / "target", qmp_timeout=30.0)
        drivers += [src, dst]
        _wait(lambda: src.migration_info(VM_ID).status == "running", 30, "the source VM running")
        uri = dst.listen_for_migration(VM_ID).uri
        assert uri is not None
        port = link(int(uri.rsplit(":", 1)[1]))
        start = time.monotonic()
        src.migrate(VM_ID, StartMigration(uri=f"tcp:127.0.0.1:{port}"))

        def arrived() -> bool:
            info = src.migration_info(VM_ID)
            if info.state in ("failed", "cancelled"):
                raise RuntimeError(f"the migration {info.state}: {info.error}")
            return dst.migration_info(VM_ID).status == "running"

        _wait(arrived, 1200, "the migration")
        seconds = time.monotonic() - start
        info = src.migration_info(VM_ID)
        if info.transferred_bytes < memory_mib << 19:
            raise RuntimeError(f"{info.transferred_bytes} bytes sent for {memory_mib} MiB of random RAM: "
                               "zero pages (the memory file was not mapped?)")
        return Move(seconds, info.transferred_bytes, info.total_time_ms, info.downtime_ms)
    finally:
        for driver in drivers:
            driver.close()
        for proc in (source, target):
            if proc is not None:
                _stop(proc)
        shutil.rmtree(vms, ignore_errors=True)
