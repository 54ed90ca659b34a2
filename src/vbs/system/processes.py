"""Facts about other processes, read from /proc: is a PID alive, what is its command line; and the
minimal environment every helper process VBS starts gets.

Drivers that adopt a daemon left by an earlier agent check both before they signal anything, so a
recycled PID never gets a signal meant for a daemon that is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from vbs.errors import DriverError


def stop_child(proc: subprocess.Popen[bytes], *, timeout: float, what: str,
               first: signal.Signals = signal.SIGTERM, last: signal.Signals = signal.SIGKILL) -> None:
    """Stop a child of this process by its PID: ``first``, then ``last`` if it has not exited within
    ``timeout``; ``DriverError`` naming ``what`` if its PID is still alive after that."""
    if proc.poll() is None:
        proc.send_signal(first)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(last)
            proc.wait(timeout)
    if pid_alive(proc.pid):
        raise DriverError(f"{what} {proc.pid} is still running")


def stop_children(procs: list[subprocess.Popen[bytes]], *, timeout: float) -> None:
    """Stop several children of this process together: SIGTERM to each that runs, then wait for each,
    SIGKILL to any still running ``timeout`` seconds after the first signal."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (and still holds its sockets)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    # A zombie answers kill(0) but is gone, unless only its main thread has exited: with other
    # threads still exiting it keeps its sockets (a restarted daemon would find its port taken).
    return not (fields[0] == "Z" and int(fields[17]) <= 1)


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether ``pid`` has installed a handler for ``sig`` (its ``SigCgt`` in /proc): before it has, the
    signal does what its inherited disposition says (SIGHUP's default ends the process)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def cmdline(pid: int) -> list[str]:
    """The argv of ``pid``; empty if it is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def environ_value(pid: int, name: str) -> str | None:
    """One variable of the environment ``pid`` started with."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def minimal_environment(**extra: str) -> dict[str, str]:
    """The whole environment of a helper VBS starts (export daemons, their admin tools): the search
    path, the C locale (their output is parsed) and ``extra``. Nothing of the agent's own
    environment (``VBS_AGENT_TOKEN``, cloud credentials…) reaches a child."""
    return {"PATH": os.environ.get("PATH") or _DEFAULT_PATH, "LC_ALL": "C", **extra}
