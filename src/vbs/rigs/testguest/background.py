"""The test guest as a VM of its own, in the background: what ``vbs demo-vm`` runs.

QEMU (TCG) boots the guest of ``build.py`` and daemonizes itself, with the guest's QMP socket at
``DIR/vms/NAME.qmp`` (where ``vbs up``'s host agent finds VMs) and its serial console on a socket of its
own, ``DIR/demo-vms/NAME.console``: any later command connects there and speaks the console protocol of
``init.sh`` (``disks``, ``run``). QEMU's PID is in ``DIR/demo-vms/NAME.pid``; ``stop`` signals that PID,
and only if that process's command line names this VM's QMP socket (no PID-reuse accidents), never a
process found by name.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vbs.errors import DriverError, InvalidParameter
from vbs.rigs.testguest.build import GuestImage
from vbs.rigs.testguest.guest import qemu_argv

__all__ = ["BackgroundGuest", "GuestDisk", "DEMO_DIR"]

DEMO_DIR = "demo-vms"  # beside the data dir's vms/: each VM's console socket and pidfile
VM_DIR = "vms"  # vbs up's host agent finds <vm>.qmp there (vbs.cli.up.VM_DIR)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # a VM id the host agent takes (wire/host.py)
# The guest reads a command as one canonical tty line, which holds at most 4095 bytes.
_MAX_LINE = 4000
_PROBE_EVERY_S = 3.0
# What the guest runs for ``disks``: one line per disk, "<name> <serial or -> <bytes>" (a SCSI disk's
# serial from its VPD page 0x80, as init.sh reads it).
_DISKS_SCRIPT = (
    'for d in /sys/block/vd* /sys/block/sd*; do [ -e "$d/size" ] || continue; s=; '
    'if [ -e "$d/serial" ]; then read -r s 2>/dev/null < "$d/serial"; '
    'elif [ -e "$d/device/vpd_pg80" ]; then read -r s 2>/dev/null < "$d/device/vpd_pg80"; s=${s#??}; fi; '
    'read -r n < "$d/size"; echo "${d##*/} ${s:--} $((n * 512))"; done'
)


@dataclass(frozen=True)
class GuestDisk:
    """A disk as the guest sees it: its name (``vdb``, or ``sda`` on virtio-scsi), serial (a VBS volume's
    id without its dash) and size in bytes, read from ``/sys/block`` at the time of asking."""

    device: str
    serial: str
    size_bytes: int

    @property
    def volume_id(self) -> str | None:
        """The VBS volume whose serial this is (``vol0123…`` → ``vol-0123…``), if it is one."""
        return f"vol-{self.serial[3:]}" if re.fullmatch(r"vol[0-9a-f]{17}", self.serial) else None


class BackgroundGuest:
    """The test guest ``name`` of the data dir ``data_dir``: start it, ask it, stop it, from any process."""

    def __init__(self, name: str, data_dir: Path) -> None:
        if not _NAME_RE.fullmatch(name):
            raise InvalidParameter(f"a VM's name is 1-64 of A-Z a-z 0-9 . _ - (starting with a letter or digit), "
                                   f"not {name!r}")
        self.name = name
        self.data_dir = Path(data_dir).absolute()
        self.qmp_path = self.data_dir / VM_DIR / f"{name}.qmp"
        demo = self.data_dir / DEMO_DIR
        self.console_path = demo / f"{name}.console"
        self.pid_path = demo / f"{name}.pid"

    # -- lifecycle -------------------------------------------------------------------------------

    def pid(self) -> int | None:
        """QEMU's PID if this VM runs: the pidfile's, and that process's command line names its QMP socket."""
        try:
            pid = int(self.pid_path.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            return None
        return pid if str(self.qmp_path).encode() in cmdline and state != "Z" else None

    def start(self, image: GuestImage, *, machine: str = "pc", memory_mib: int = 256, root_ports: int = 0,
              incoming: bool = False) -> int:
        """Boot the guest in the background; QEMU's PID. Refused if it runs, or if something else serves
        its QMP socket (another VM of that name). ``incoming``: boot nothing, wait as the destination of
        a live migration of the VM of this name on another host (``-incoming defer``, the same machine,
        memory and root ports as that VM's): ``vbs migrate-instance`` moves the guest in, and its
        console is this VM's from then on."""
        running = self.pid()
        if running is not None:
            raise InvalidParameter(f"{self.name} runs already (QEMU PID {running}); vbs demo-vm {self.name} --stop "
                                   "stops it")
        if self.qmp_path.exists() and _answers(self.qmp_path):
            raise InvalidParameter(f"another VM serves {self.qmp_path}: give this one another name")
        for folder in (self.qmp_path.parent, self.console_path.parent):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stale in (self.qmp_path, self.console_path, self.pid_path):
            stale.unlink(missing_ok=True)
        argv = [
            *qemu_argv(self.name, image, self.qmp_path, machine=machine, memory_mib=memory_mib,
                       root_ports=root_ports, serial=f"unix:{self.console_path},server=on,wait=off"),
            "-daemonize", "-pidfile", str(self.pid_path), *(["-incoming", "defer"] if incoming else []),
        ]
        # QEMU forks, and its first process exits once the VM is set up: errors (no KVM is fine, TCG is
        # asked for; a kernel that will not load) come back here, after that it runs on by itself.
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                                  check=False)
        except FileNotFoundError as exc:
            raise DriverError("qemu-system-x86_64 is not installed (make run installs qemu-system-x86)") from exc
        if proc.returncode != 0:
            raise DriverError(f"QEMU did not start {self.name}: {' '.join(proc.stderr.split())[-800:]}")
        pid = self.pid()
        if pid is None:
            raise DriverError(f"QEMU started {self.name} but left no PID in {self.pid_path}")
        return pid

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Wait until the guest's console answers a command (it has booted); the seconds it took."""
        started = time.monotonic()
        deadline = started + timeout
        probes: set[str] = set()

        def answered(line: str) -> bool:
            parts = line.split()
            return line == "VBS-READY" or (parts[:1] == ["VBS-END"] and len(parts) == 3 and parts[1] in probes)

        with _Console(self.console_path, deadline) as console:
            while True:
                if self.pid() is None:
                    raise DriverError(f"{self.name} stopped while booting")
                # A command sent before the guest reads its console may be lost: ask again until one is
                # answered (each is `true`), or until the guest says it is ready.
                probe = _command_id()
                probes.add(probe)
                console.send(_command_line(probe, "true", 10))
                if console.until(answered, min(deadline, time.monotonic() + _PROBE_EVERY_S)):
                    return time.monotonic() - started
                if time.monotonic() >= deadline:
                    raise DriverError(f"{self.name} did not answer on its console within {timeout:g} s")

    def stop(self, timeout: float = 20.0) -> int | None:
        """Stop QEMU (SIGTERM, then SIGKILL after ``timeout``) and remove its sockets; the PID it had, or
        None if it was not running."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.pid() is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.pid() is not None:
                os.kill(pid, signal.SIGKILL)
                while self.pid() is not None and time.monotonic() < deadline + 10:
                    time.sleep(0.1)
        for path in (self.qmp_path, self.console_path, self.pid_path):
            path.unlink(missing_ok=True)
        return pid

    # -- asking the guest ------------------------------------------------------------------------

    def run(self, command: str, timeout: float = 60.0) -> tuple[int, str]:
        """Run ``command`` with the guest's busybox sh; its exit status and stdout+stderr."""
        if self.pid() is None:
            raise InvalidParameter(f"{self.name} is not running (vbs demo-vm {self.name} starts it)")
        limit = max(1, int(timeout))
        cmd_id = _command_id()
        line = _command_line(cmd_id, command, limit)
        if len(line) > _MAX_LINE:
            raise InvalidParameter(f"command too long for the console ({len(line)} bytes)")
        collected: list[str] = []
        collecting = False
        status: int | None = None

        def take(text: str) -> bool:
            nonlocal collecting, status
            if text == f"VBS-BEGIN {cmd_id}":
                collecting = True
            elif collecting and (end := re.fullmatch(rf"VBS-END {cmd_id} (\d+)", text)):
                status = int(end.group(1))
                return True
            elif collecting:
                collected.append(text)
            return False

        # The guest kills the command at ``limit``; allow a little for the answer to come back.
        with _Console(self.console_path, time.monotonic() + limit + 10) as console:
            console.send(line)
            if not console.until(take, time.monotonic() + limit + 10):
                raise DriverError(f"{self.name} did not answer within {limit + 10} s")
        assert status is not None
        # The guest prints one newline after the command's output (init.sh): joined, the exact text.
        return status, "\n".join(collected)

    def disks(self) -> list[GuestDisk]:
        """The guest's disks (virtio-blk and SCSI) as it sees them now."""
        status, out = self.run(_DISKS_SCRIPT, 30)
        if status != 0:
            raise DriverError(f"{self.name}: listing its disks failed ({status}): {out.strip()[-300:]}")
        found = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[2].isdigit():
                found.append(GuestDisk(parts[0], parts[1], int(parts[2])))
        return found


def _command_id() -> str:
    return str(10**8 + secrets.randbelow(9 * 10**8))  # digits only (init.sh); unlike any a former client used


def _command_line(cmd_id: str, command: str, limit: int) -> bytes:
    return f"VBS-CMD {cmd_id} {limit} {base64.b64encode(command.encode()).decode()}\n".encode()


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


class _Console:
    """One connection to a guest's console socket (QEMU serves one client at a time: a second waits)."""

    def __init__(self, path: Path, deadline: float) -> None:
        self.path, self.deadline = path, deadline
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.buffer = b""

    def __enter__(self) -> _Console:
        while True:
            try:
                self.sock.settimeout(max(0.1, self.deadline - time.monotonic()))
                self.sock.connect(str(self.path))
                return self
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() >= self.deadline:
                    self.sock.close()
                    raise DriverError(f"nothing answers on {self.path}") from exc
                time.sleep(0.2)
            except OSError as exc:
                self.sock.close()
                raise DriverError(f"cannot connect to {self.path}: {exc}") from exc

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def send(self, line: bytes) -> None:
        self.sock.sendall(line)

    def until(self, done: Callable[[str], bool], deadline: float) -> bool:
        """Read the console's lines until ``done(line)`` is true (True), or until ``deadline`` (False)."""
        while True:
            while b"\n" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\n", 1)
                if done(raw.decode("utf-8", errors="replace").rstrip("\r")):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return False
            except OSError as exc:
                raise DriverError(f"the console {self.path} failed: {exc}") from exc
            if not chunk:
                raise DriverError(f"the console {self.path} closed (the VM stopped?)")
            self.buffer += chunk
