"""Warm starts of the test guest: a booted guest's state, saved once, resumed in a fraction of a second.

Booting the test guest under TCG costs 5–40 s of a host core (the kernel and init.sh, more on a loaded
machine), and the suite starts well over a hundred guests. Every one of them boots the same kernel and
initramfs to the same READY point, so the rig boots one guest per shape (QEMU build, image, machine type,
memory, empty root ports), lets it answer a command, and saves its state with QEMU's own migration into a
file beside the image. A warm start is that state resumed by a new QEMU process (``-incoming fd:N``): a
real guest of the same image with its own consoles and monitors, which then sets its clock to the host's
(its clock was saved with it) and goes on from READY as if it had just booted. Its host-agent monitor is
bound under a hidden name while QEMU loads the state (a host agent would take the VM for a migration's
destination) and shown, under its name, SETTLE_S before the guest is handed over. ``TestGuest(cold=True)``
boots from scratch, as the test of the boot itself does. A state QEMU cannot load (another QEMU build
without a new key, a truncated file) is removed and the guest boots cold.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from vbs.errors import DriverError
from vbs.rigs.testguest.build import GuestImage

if TYPE_CHECKING:
    from vbs.rigs.testguest.guest import TestGuest

__all__ = ["Shape", "saved_state", "forget"]

log = logging.getLogger(__name__)

# What a saved state depends on besides the image and the shape: the command line's form and init.sh's
# protocol. Bump it when either changes in a way a resumed guest would notice.
FORMAT = "1"
SAVE_TIMEOUT_S = 300.0
# How long a resumed guest's monitor is up before the guest is handed over (TestGuest._resume): the head
# start a boot gave host agents to report the VM, two of their heartbeats.
SETTLE_S = 4.0


class Shape:
    """The QEMU options a saved state must be resumed with: the same machine, memory, root ports and vCPUs."""

    def __init__(self, machine: str, memory_mib: int, root_ports: int, cmdline: str, cpus: int = 1) -> None:
        self.machine, self.memory_mib, self.root_ports, self.cmdline = machine, memory_mib, root_ports, cmdline
        self.cpus = cpus

    def key(self, image: GuestImage) -> str:
        parts = [FORMAT, _qemu_version(), str(image.kernel), str(image.initrd), _stamp(image.kernel),
                 _stamp(image.initrd), self.machine, str(self.memory_mib), str(self.root_ports), self.cmdline]
        if self.cpus != 1:  # one vCPU keeps the key it had before guests could have more
            parts.append(f"cpus={self.cpus}")
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def saved_state(image: GuestImage, shape: Shape) -> Path:
    """The saved state of a guest of ``image`` booted with ``shape``, saved first if there is none yet
    (one process at a time: the others wait on a lock and then use it)."""
    states = image.kernel.parent / "states"
    states.mkdir(mode=0o700, exist_ok=True)
    path = states / f"{shape.key(image)}.state"
    if path.exists():
        return path
    with _locked(states / f"{path.stem}.lock"):
        if not path.exists():
            _save(image, shape, path)
    return path


def forget(path: Path) -> None:
    """Drop a state that would not load, so the next guest saves a fresh one."""
    path.unlink(missing_ok=True)


def _save(image: GuestImage, shape: Shape, path: Path) -> None:
    from vbs.rigs.testguest.guest import TestGuest  # the guest module starts guests from here

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vbs-guest-state-") as tmp:
        work = Path(tmp)
        guest = TestGuest("state", work, image, work, machine=shape.machine, memory_mib=shape.memory_mib,
                          root_ports=shape.root_ports, cpus=shape.cpus, cold=True)
        with guest:
            guest.wait_ready(SAVE_TIMEOUT_S)
            guest.check("true")  # the command loop runs: a resumed guest answers at once
            partial = path.with_suffix(".partial")
            _migrate_to_file(guest, work / "migrate.sock", partial)
        partial.chmod(0o600)
        partial.rename(path)
    log.info("saved a booted test guest (%s, %d MiB) in %.1fs: %s", shape.machine, shape.memory_mib,
             time.monotonic() - started, path)


def _migrate_to_file(guest: TestGuest, sock_path: Path, target: Path) -> None:
    """QEMU's ``migrate`` to a unix socket that this process copies into ``target``."""
    errors: list[BaseException] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(sock_path))
        server.listen(1)
        server.settimeout(SAVE_TIMEOUT_S)

        def receive() -> None:
            try:
                conn, _ = server.accept()
                with conn, target.open("wb") as out:
                    while chunk := conn.recv(1 << 20):
                        out.write(chunk)
            except OSError as exc:
                errors.append(exc)

        reader = threading.Thread(target=receive, name="guest-state-writer", daemon=True)
        reader.start()
        guest.qmp("migrate", {"uri": f"unix:{sock_path}"})
        deadline = time.monotonic() + SAVE_TIMEOUT_S
        status = ""
        while time.monotonic() < deadline:
            status = guest.qmp("query-migrate").get("status", "")
            if status in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.05)
        reader.join(SAVE_TIMEOUT_S)
    if status != "completed" or errors or reader.is_alive():
        target.unlink(missing_ok=True)
        raise DriverError(f"saving the test guest's state: migration {status or 'timed out'} {errors}")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


_VERSION: list[str] = []


def _qemu_version() -> str:
    if not _VERSION:
        out = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True,  # noqa: S607
                             timeout=30, check=True).stdout
        _VERSION.append(out.splitlines()[0] if out else "unknown")
    return _VERSION[0]
