"""A running test guest: one QEMU (TCG) process booted from the image of ``build.py``.

Its serial console is QEMU's stdio: a reader thread parses the guest's lines (protocol in ``init.sh``)
into disk events and command results, and copies every line to a log file in the work dir.

The guest has two QMP monitors: ``<qmp_dir>/<name>.qmp`` for the host agent (whose driver holds it
with a persistent connection; QEMU serves one client per monitor) and ``<workdir>/<name>.test.qmp``,
which only tests and demos use (``TestGuest.qmp``).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from vbs.errors import DriverError, InvalidParameter
from vbs.qemu.qmp import QmpClient, QmpError
from vbs.rigs.testguest import warm
from vbs.rigs.testguest.build import GuestImage

__all__ = ["KERNEL_CMDLINE", "TestGuest", "pattern_bytes", "pattern_sha256", "qemu_argv", "qmp_execute"]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DEV_RE = re.compile(r"^(/dev/)?[a-z][a-z0-9]{0,15}$")
_SEED_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# The guest reads a command as one canonical tty line, which holds at most 4095 bytes.
_MAX_LINE = 4000
MIB = 1024 * 1024
MAX_ROOT_PORTS = 32
MAX_CPUS = 8


def qmp_execute(socket: Path, command: str, args: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
    """Run one QMP command on a monitor socket, in a connection of its own (tests and demos: use a
    VM's test monitor, as the host agent holds its main one)."""
    with QmpClient(socket, name="vbs-test", connect_timeout=timeout, timeout=timeout) as client:
        return client.execute(command, args)


def pattern_bytes(seed: str, mib: int) -> bytes:
    """The bytes ``write_pattern`` puts on a disk: ``seed`` and a newline, repeated, cut to ``mib`` MiB."""
    unit = (seed + "\n").encode()
    size = mib * MIB
    return (unit * (size // len(unit) + 1))[:size]


def pattern_sha256(seed: str, mib: int) -> str:
    return hashlib.sha256(pattern_bytes(seed, mib)).hexdigest()


# no_timer_check: under TCG on a loaded machine the kernel's check of the 8254 timer through the
# IO-APIC can fail ("MP-BIOS bug: 8254 timer not connected to IO-APIC"), and the boot then hung (a
# libvirt guest of a full make test, 2026-11-27). The check is for broken BIOSes, not for QEMU.
KERNEL_CMDLINE = "console=ttyS0 quiet panic=-1 no_timer_check"


def qemu_argv(name: str, image: GuestImage, qmp_path: Path, *, machine: str = "pc", memory_mib: int = 256,
              root_ports: int = 0, serial: str = "stdio", cpus: int = 1) -> list[str]:
    """The QEMU command line that boots the test guest ``name`` (TCG) with its QMP monitor at ``qmp_path``,
    its serial console (the protocol of ``init.sh``) on ``serial`` (a QEMU chardev: ``stdio``,
    ``unix:PATH,server=on,wait=off``) and ``root_ports`` empty PCIe root ports ``rp1``, ``rp2``, … (a q35
    machine hot-plugs disks only into those). ``cpus`` vCPUs (QEMU's multi-threaded TCG: one host thread
    each); one leaves ``-smp`` out."""
    if not 0 <= root_ports <= MAX_ROOT_PORTS:
        raise InvalidParameter(f"root_ports is 0-{MAX_ROOT_PORTS}, not {root_ports}")
    if not 1 <= cpus <= MAX_CPUS:
        raise InvalidParameter(f"cpus is 1-{MAX_CPUS}, not {cpus}")
    return [
        "qemu-system-x86_64",
        "-accel", "tcg",
        "-machine", machine,
        "-m", str(memory_mib),
        *(["-smp", str(cpus)] if cpus != 1 else []),
        "-nodefaults",
        "-display", "none",
        "-name", name,
        "-kernel", str(image.kernel),
        "-initrd", str(image.initrd),
        "-append", KERNEL_CMDLINE,
        "-serial", serial,
        "-qmp", f"unix:{qmp_path},server=on,wait=off",
        "-no-reboot",
        *(arg for n in range(1, root_ports + 1) for arg in ("-device", f"pcie-root-port,id=rp{n},chassis={n}")),
    ]  # fmt: skip


class TestGuest:
    """Boot a guest, watch its disks (virtio-blk and virtio-scsi), and run shell commands in it over the
    serial console."""

    __test__ = False  # not a pytest test class despite its name

    def __init__(
        self,
        name: str,
        workdir: Path,
        image: GuestImage,
        qmp_dir: Path,
        machine: str = "pc",
        memory_mib: int = 256,
        root_ports: int = 0,
        cold: bool = False,
        cpus: int = 1,
    ) -> None:
        """``cold``: boot the kernel from scratch; by default the guest resumes a saved boot of the same
        image and shape (``warm.py``), as fast as a guest can start."""
        if not _NAME_RE.fullmatch(name):
            raise InvalidParameter(f"invalid guest name {name!r}")
        self.name = name
        self.workdir = Path(workdir)
        self.image = image
        self.qmp_path = Path(qmp_dir) / f"{name}.qmp"
        self.test_qmp_path = self.workdir / f"{name}.test.qmp"
        self.console_log = self.workdir / f"{name}.console.log"
        self.machine = machine
        self.memory_mib = memory_mib
        # Empty PCIe root ports rp1, rp2, ... (a q35 machine hot-plugs disks only into those).
        if not 0 <= root_ports <= MAX_ROOT_PORTS:
            raise InvalidParameter(f"root_ports is 0-{MAX_ROOT_PORTS}, not {root_ports}")
        self.root_ports = root_ports
        if not 1 <= cpus <= MAX_CPUS:
            raise InvalidParameter(f"cpus is 1-{MAX_CPUS}, not {cpus}")
        self.cpus = cpus
        self.cold = cold
        self.boot_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._cond = threading.Condition()
        self._ready = False
        self._disks: dict[str, tuple[str, int]] = {}  # serial -> (device name, size in bytes)
        self._results: dict[str, tuple[int, str]] = {}
        self._collecting: dict[str, list[str]] = {}
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()  # one command line at a time onto the console
        self._started_at = 0.0
        self._incoming = False  # a live migration's destination (incoming_twin)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> TestGuest:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.qmp_path.parent.mkdir(parents=True, exist_ok=True)
        if not self.cold and not self._incoming:
            state = warm.saved_state(self.image, warm.Shape(self.machine, self.memory_mib, self.root_ports,
                                                            KERNEL_CMDLINE, self.cpus))
            if self._resume(state):
                return self
            log.warning("test guest %s: QEMU could not resume %s; booting it instead", self.name, state)
            warm.forget(state)
        self._launch(["-incoming", "defer"] if self._incoming else [])
        return self

    def _launch(self, extra: list[str], pass_fds: tuple[int, ...] = (), qmp_path: Path | None = None) -> None:
        argv = [
            *qemu_argv(self.name, self.image, qmp_path or self.qmp_path, machine=self.machine,
                       memory_mib=self.memory_mib,
                       root_ports=self.root_ports, serial="stdio", cpus=self.cpus),
            "-qmp", f"unix:{self.test_qmp_path},server=on,wait=off",
            *extra,
        ]  # fmt: skip
        stderr = (self.workdir / f"{self.name}.qemu.log").open("ab")
        self._started_at = time.monotonic()
        self._proc = subprocess.Popen(  # noqa: S603 - argv list, no shell
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, pass_fds=pass_fds
        )
        stderr.close()
        self._reader = threading.Thread(
            target=self._read_console, args=(self._proc.stdout,), name=f"console-{self.name}", daemon=True
        )
        self._reader.start()

    def _resume(self, state: Path, timeout: float = 120.0) -> bool:
        """Start QEMU on a saved boot (``warm.py``); True once the guest runs and its clock is the host's.
        False if QEMU could not load the state (it has exited then)."""
        # The host agent's monitor is bound under a name its discovery skips (not *.qmp) until the guest
        # runs: seen while it loads the state, the VM would be recorded as a migration's destination.
        hidden = self.qmp_path.with_name(f".{self.name}.resuming")
        fd = os.open(state, os.O_RDONLY)
        try:
            self._launch(["-incoming", f"fd:{fd}"], pass_fds=(fd,), qmp_path=hidden)
        finally:
            os.close(fd)
        deadline = time.monotonic() + timeout
        running = False
        while not running and self.alive() and time.monotonic() < deadline:
            try:
                running = self.qmp("query-status")["status"] == "running"
            except QmpError:
                pass  # the monitor is not up yet
            if not running:
                time.sleep(0.05)
        if not running:
            self.stop()
            hidden.unlink(missing_ok=True)
            return False
        os.rename(hidden, self.qmp_path)
        # A booted guest's monitor was up for seconds before READY, and callers count on a host agent having
        # reported the VM by then (its heartbeat: every 2 s); a resumed one gives it the same head start.
        time.sleep(warm.SETTLE_S)
        with self._cond:
            self._ready = True
            self.boot_seconds = time.monotonic() - self._started_at
            self._cond.notify_all()
        # The guest's clock was saved with it: the host's time, so that what it stamps is of today.
        self.check(f"date -s @{int(time.time())} > /dev/null")
        return True

    def incoming_twin(self, qmp_dir: Path, workdir: Path) -> TestGuest:
        """Start the destination of a live migration of this guest, as an orchestrator would: the same
        VM (name, image, machine, memory) waiting with ``-incoming defer``, its monitors in ``qmp_dir``
        (another host agent's VM directory) and its files in ``workdir``. Once the migration completes
        the guest runs there and its console is the twin's: use the twin for commands from then on
        (it knows the disks this guest reported; it sees no boot)."""
        twin = TestGuest(self.name, workdir, self.image, qmp_dir, machine=self.machine, memory_mib=self.memory_mib,
                         root_ports=self.root_ports, cpus=self.cpus)
        twin._incoming = True
        with self._cond:
            twin._disks = dict(self._disks)
            twin._ready, twin.boot_seconds = self._ready, self.boot_seconds
        # Command ids the guest has not seen: a result still due from the source is never taken for one.
        twin._ids = itertools.count(next(self._ids) + 1_000_000)
        return twin.start()

    def qmp(self, command: str, args: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
        """One QMP command on this guest's test monitor, in a connection of its own (so that any
        other test helper can use that monitor between two calls)."""
        return qmp_execute(self.test_qmp_path, command, args, timeout)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop QEMU by the PID we started (SIGTERM lets it exit cleanly and remove its socket)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc.stdin:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if self._reader:
            self._reader.join(timeout)
        self.qmp_path.unlink(missing_ok=True)
        self.test_qmp_path.unlink(missing_ok=True)

    def __enter__(self) -> TestGuest:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- waiting on the console ------------------------------------------------------------------

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Wait for the guest's READY line; return the boot time in seconds."""
        self._wait(lambda: self._ready, timeout, "boot")
        assert self.boot_seconds is not None
        return self.boot_seconds

    def wait_for_disk(self, serial: str, timeout: float = 10.0) -> str:
        """Wait until a disk with ``serial`` is present in the guest; return its name (``vdb``)."""
        self._wait(lambda: serial in self._disks, timeout, f"disk {serial} to appear")
        with self._cond:
            return self._disks[serial][0]

    def wait_disk_gone(self, serial: str, timeout: float = 10.0) -> None:
        self._wait(lambda: serial not in self._disks, timeout, f"disk {serial} to go")

    def disks(self) -> dict[str, str]:
        """The disks the guest reported and still has: serial -> device name."""
        with self._cond:
            return {serial: name for serial, (name, _) in self._disks.items()}

    def disk_size(self, serial: str) -> int:
        """Size in bytes of the disk with ``serial``, as the guest reported it when it appeared."""
        with self._cond:
            return self._disks[serial][1]

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: predicate() or not self.alive(), timeout)
            if ok and predicate():
                return
        state = "QEMU exited" if not self.alive() else f"no answer within {timeout:g}s"
        raise DriverError(f"test guest {self.name}: waiting for {what}: {state} (see {self.console_log})")

    # -- commands --------------------------------------------------------------------------------

    def run(self, cmd: str, timeout: float = 30.0) -> tuple[int, str]:
        """Run ``cmd`` with the guest's busybox sh; return its exit status and stdout+stderr.

        Thread-safe: commands from several threads run in the guest at the same time (each in a
        subshell of its own), so a long one in a thread does not hold up the others.
        """
        script = base64.b64encode(cmd.encode()).decode()
        limit = max(1, int(timeout))
        with self._write_lock:
            cmd_id = str(next(self._ids))
            line = f"VBS-CMD {cmd_id} {limit} {script}\n"
            if len(line) > _MAX_LINE:
                raise InvalidParameter(f"command too long for the console ({len(line)} bytes)")
            self._send(line.encode())
        # The guest kills the command at `limit`; allow a little for the answer to come back.
        self._wait(lambda: cmd_id in self._results, limit + 10.0, f"command {cmd_id}")
        with self._cond:
            return self._results.pop(cmd_id)

    def _send(self, line: bytes) -> None:
        """Write one line to the guest's console (QEMU's stdin here)."""
        proc = self._proc
        if proc is None or proc.stdin is None or not self.alive():
            raise DriverError(f"test guest {self.name} is not running")
        proc.stdin.write(line)
        proc.stdin.flush()

    def run_background(self, cmd: str, timeout: float = 300.0) -> Future[tuple[int, str]]:
        """Start ``cmd`` in the guest and return at once: the future gets what ``run`` answers.
        Other commands run meanwhile (a writer during a snapshot, say)."""
        future: Future[tuple[int, str]] = Future()
        future.set_running_or_notify_cancel()

        def work() -> None:
            try:
                future.set_result(self.run(cmd, timeout))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

        threading.Thread(target=work, name=f"guest-cmd-{self.name}", daemon=True).start()
        return future

    def check(self, cmd: str, timeout: float = 30.0) -> str:
        """Like ``run`` but a non-zero exit status raises ``DriverError``."""
        rc, out = self.run(cmd, timeout)
        if rc != 0:
            raise DriverError(f"guest command failed ({rc}): {cmd!r}: {out.strip()[-500:]}")
        return out

    def write_pattern(self, dev: str, seed: str, mib: int) -> str:
        """Write ``pattern_bytes(seed, mib)`` at the start of ``dev``; return the sha256 read back."""
        path = self._dev_path(dev)
        if not _SEED_RE.fullmatch(seed):
            raise InvalidParameter(f"invalid seed {seed!r}")
        self.check(f"yes {seed} | head -c {mib * MIB} | dd of={path} bs=1M conv=fsync 2>/dev/null", timeout=120)
        return self.checksum(dev, mib)

    def checksum(self, dev: str, mib: int) -> str:
        """sha256 of the first ``mib`` MiB of ``dev``, read from the device, not the guest's cache."""
        path = self._dev_path(dev)
        out = self.check(
            f"echo 3 > /proc/sys/vm/drop_caches; dd if={path} bs=1M count={mib} 2>/dev/null | sha256sum",
            timeout=120,
        )
        return out.split()[0]

    @staticmethod
    def _dev_path(dev: str) -> str:
        if not _DEV_RE.fullmatch(dev):
            raise InvalidParameter(f"invalid device name {dev!r}")
        return dev if dev.startswith("/dev/") else f"/dev/{dev}"

    # -- the reader thread -----------------------------------------------------------------------

    def _read_console(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        with self.console_log.open("a", encoding="utf-8") as logf:
            for raw in stream:
                line = raw.decode("utf-8", errors="replace").rstrip("\n").removesuffix("\r")
                logf.write(line + "\n")
                logf.flush()
                with self._cond:
                    self._on_line(line)
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _on_line(self, line: str) -> None:
        for cmd_id, lines in self._collecting.items():
            end = re.fullmatch(rf"VBS-END {re.escape(cmd_id)} (\d+)", line)
            if end:
                del self._collecting[cmd_id]
                self._results[cmd_id] = (int(end.group(1)), "\n".join(lines))
                return
            # The guest prints a whole command block under a lock, so nothing else interleaves.
            lines.append(line)
            return
        parts = line.split()
        if line.startswith("VBS-BEGIN ") and len(parts) == 2:
            self._collecting[parts[1]] = []
        elif line == "VBS-READY":
            self._ready = True
            self.boot_seconds = time.monotonic() - self._started_at
        elif parts[:2] == ["VBS-DISK", "ADD"] and len(parts) == 5:
            self._disks[parts[4]] = (parts[2], int(parts[3]))
        elif parts[:2] == ["VBS-DISK", "DEL"] and len(parts) == 4:
            name, serial = parts[2], parts[3]
            if serial in self._disks and self._disks[serial][0] == name:
                del self._disks[serial]
