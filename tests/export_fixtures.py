"""What the export driver tests share: drivers on free loopback ports whose daemons are stopped by PID
at teardown (never by name), a sparse volume, waiting for a killed daemon to be really gone, and a test
guest that writes to an export as its disk through the host agent's QEMU driver.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.conftest import free_port
from vbs.errors import DriverError
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.ids import virtio_serial
from vbs.qemu.tls import X509Files
from vbs.rigs.testguest import TestGuest, build_guest, pattern_bytes, pattern_sha256
from vbs.storage.exports.supervised import SupervisedExportDriver
from vbs.wire.connection import AnyConnection

__all__ = ["free_port", "runs", "wait_dead", "drivers_of", "volume", "read_at", "write_at", "taken_port", "MiB",
           "GuestDisk", "guest_disk"]

MiB = 1024 * 1024

D = TypeVar("D", bound=SupervisedExportDriver[Any, Any])


def runs(pid: int, program: str) -> bool:
    """Whether ``pid`` is a live ``program`` (guards a teardown against a recycled PID)."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return Path(argv0.decode(errors="replace")).name == program


def wait_dead(pid: int, timeout: float = 10.0) -> None:
    """Wait until ``pid`` is gone or a zombie whose threads all exited (its sockets are closed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return
        if fields[0] == "Z" and int(fields[17]) <= 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} still alive")


def drivers_of(build: Callable[..., D], tmp_path: Path, program: str) -> Iterator[Callable[..., D]]:
    """The body of a ``make_driver`` fixture: ``make(state="state", **kw)`` builds a driver in
    ``tmp_path / state`` on a free port (``port=`` to choose one); every daemon those drivers ran
    is stopped at teardown, cleanly where it can be, else by SIGKILL to its PID."""
    drivers: list[D] = []

    def make(state: str = "state", **kw: Any) -> D:
        kw.setdefault("port", free_port())
        drv = build(tmp_path / state, **kw)
        drivers.append(drv)
        return drv

    yield make
    pids: set[int] = set()
    for drv in reversed(drivers):  # the newest owns the daemon (QSD's monitor takes one client)
        if drv.pid is not None:
            pids.add(drv.pid)
        try:
            pids.add(int(drv.pid_path.read_text()))
        except (OSError, ValueError):
            pass
        try:
            drv.stop()
        except DriverError:
            pass
    for pid in pids:
        if runs(pid, program):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    """An empty 16 MiB sparse volume file."""
    path = tmp_path / "vol.img"
    with open(path, "wb") as f:
        f.truncate(16 * MiB)
    return path


def read_at(path: Path, offset: int, length: int) -> bytes:
    """What the file holds there (what a client wrote through an export)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def write_at(path: Path, offset: int, data: bytes) -> None:
    """Write into the file behind an export, to the disk (the daemon reads with O_DIRECT)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port another process listens on, for as long as the context lasts."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield int(busy.getsockname()[1])


@dataclass(frozen=True)
class GuestDisk:
    """A running test guest ``vm1`` with an export attached as its disk ``serial`` by ``qemu``."""

    guest: TestGuest
    qemu: QemuDriver
    serial: str


@contextmanager
def guest_disk(tmp_path: Path, key: str, connection: AnyConnection, volume: Path, x509: X509Files,
               pattern: str) -> Iterator[GuestDisk]:
    """A real TCG guest with ``connection`` (``key``'s export of ``volume``) attached through the host
    agent's QEMU driver with the host's ``x509``, which has written 2 MiB of ``pattern`` to it; the body
    checks what it will. Then the disk is detached and ``volume`` must hold the pattern. The guest, the
    driver's monitors and any tunnel end it ran are stopped whatever happens."""
    vm_dir = tmp_path / "vms"
    guest = TestGuest("vm1", tmp_path / "guest", build_guest(), vm_dir)
    qemu = QemuDriver(vm_dir, secrets_dir=tmp_path / "host-secrets", x509=x509)
    try:
        guest.start()
        guest.wait_ready(120)
        serial = virtio_serial(key)
        qemu.attach("vm1", serial, connection)
        dev = guest.wait_for_disk(serial, 20)
        assert guest.write_pattern(dev, pattern, 2) == pattern_sha256(pattern, 2)
        yield GuestDisk(guest, qemu, serial)
        qemu.detach("vm1", serial)
        guest.wait_disk_gone(serial, 20)
        assert read_at(volume, 0, 2 * MiB) == pattern_bytes(pattern, 2)
    finally:
        qemu.close()
        qemu.tunnels.stop()
        guest.stop()
