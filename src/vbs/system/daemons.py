"""The one daemon supervisor: spawn, adopt, stop and restart a long-lived helper process by its PID.

Export drivers run their daemon (qemu-storage-daemon, tgtd) in its own session so that it outlives
the agent: a restarted agent adopts it from its pidfile and attached hosts keep their sessions.
Nothing is ever signalled by name, and a PID is signalled only while ``owns(pid)`` confirms it is
still the daemon this supervisor means (a recycled PID belongs to someone else).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vbs.errors import DriverError
from vbs.system.files import write_private
from vbs.system.processes import cmdline, minimal_environment, pid_alive

__all__ = ["DaemonSpec", "Daemon", "START_TIMEOUT_S", "argv0_is"]

# How long a daemon may take to come up (its monitor or control socket answering) before its start
# fails. A bound on a wedged start, not a speed: qemu-storage-daemon, which answers in tens of
# milliseconds on an idle machine, once took over 15 s to greet its first QMP client while a loaded
# machine (load 19: the test suite and the benchmarks side by side) was writing gigabytes.
START_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DaemonSpec:
    """How to run one daemon.

    ``owns(pid)`` says whether a live process is this daemon (its command line names our socket,
    say), whatever its configuration; ``writes_pidfile``: the daemon writes ``pid_path`` itself,
    else the supervisor does. ``stop_signals`` are sent in turn, by PID, after a clean exit was
    asked for and ``grace`` passed (tgtd ignores SIGTERM: it gets only SIGKILL). ``forks``: the
    program forks into the background itself and its child writes ``pid_path`` (needs
    ``writes_pidfile``); the process started exits 0 meanwhile (nbdkit: in the foreground it stops
    serving when the process that started it dies, which an agent restart must survive).
    """

    name: str
    argv: tuple[str, ...]
    pid_path: Path
    log_path: Path
    owns: Callable[[int], bool]
    env: Mapping[str, str] | None = None
    writes_pidfile: bool = False
    stop_signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)
    start_timeout: float = START_TIMEOUT_S
    stale_files: tuple[Path, ...] = field(default_factory=tuple)
    forks: bool = False


class Daemon:
    """One supervised daemon. Not thread-safe: its driver serialises calls under its own lock."""

    def __init__(self, spec: DaemonSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The PID of the daemon this supervisor started or adopted (None when it has none)."""
        return self._pid

    def running(self) -> bool:
        if self._pid is None:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        return self.spec.owns(self._pid)

    def recorded_pid(self) -> int | None:
        """The PID in the pidfile, if it is a live process that is this daemon."""
        try:
            pid = int(self.spec.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if self.spec.owns(pid) else None

    def adopt(self, *, same_config: bool = True) -> bool:
        """Take over the daemon an earlier agent left, if it is alive and runs with our argv.

        One that runs with another configuration (port, bind address, TLS) is stopped, and False
        returned: the caller spawns a new one and re-creates its state there.
        """
        pid = self.recorded_pid()
        if pid is None:
            return False
        self._pid, self._proc = pid, None
        if same_config and cmdline(pid)[1:] != list(self.spec.argv[1:]):
            log.warning("%s pid %d runs with another configuration: restarting it", self.spec.name, pid)
            self.terminate(grace=0.0)
            return False
        log.info("adopted %s pid %d", self.spec.name, pid)
        return True

    def spawn(self, ready: Callable[[float], None]) -> None:
        """Start the daemon in a new session and wait for ``ready(deadline)`` to return.

        ``ready`` raises (a DriverError) while the daemon cannot serve; if it still does at the
        deadline, or the daemon exits, the daemon is stopped and a DriverError carries the tail of
        its log.
        """
        spec = self.spec
        spec.pid_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in (*spec.stale_files, spec.pid_path):
            stale.unlink(missing_ok=True)
        log_start = spec.log_path.stat().st_size if spec.log_path.exists() else 0
        fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            proc = subprocess.Popen(  # noqa: S603 - argv list, no shell
                list(spec.argv), stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                env=dict(spec.env) if spec.env is not None else minimal_environment(), start_new_session=True)
        except FileNotFoundError as exc:
            raise DriverError(f"{spec.name}: not installed") from exc
        finally:
            os.close(fd)
        # A daemon that forks is the process its pidfile names once the one started here exited.
        self._proc, self._pid = proc, None if spec.forks else proc.pid
        if not spec.writes_pidfile:
            write_private(spec.pid_path, f"{proc.pid}\n")
        deadline = time.monotonic() + spec.start_timeout
        while True:
            if not self._starting(proc):
                self.terminate(grace=0.0)
                raise DriverError(f"{spec.name} did not start (it exited): {self.log_tail(log_start)}")
            try:
                ready(deadline)
                if self._pid is None:
                    raise DriverError(f"{spec.name} has not forked into the background yet")
                break
            except DriverError as exc:
                if time.monotonic() >= deadline or not self._starting(proc):
                    self.terminate(grace=0.0)
                    raise DriverError(f"{spec.name} did not start: {exc.message}; {self.log_tail(log_start)}") from exc
            time.sleep(0.02)
        log.info("started %s pid %d", spec.name, self._pid)

    def _starting(self, proc: subprocess.Popen[bytes]) -> bool:
        """Whether a daemon being spawned may still come up. One that ``forks`` is, once the process
        started exited 0, the one its pidfile names (None until that is written)."""
        if proc.poll() is None:
            return True
        if not self.spec.forks:
            return False
        self._proc = None
        self._pid = self.recorded_pid()  # a child of a failed start is stopped with it
        return proc.returncode == 0 and (self._pid is None or self.spec.owns(self._pid))

    def stop(self, ask: Callable[[], bool] | None = None, *, grace: float = 10.0) -> None:
        """Stop the daemon: ``ask()`` requests a clean exit (True if it was asked), then, after
        ``grace`` (none if it was not asked), the stop signals by PID. Also a daemon only found
        by its pidfile (a fresh supervisor stopping what an earlier agent left)."""
        if self._pid is None:
            self._pid = self.recorded_pid()
            self._proc = None
        if self._pid is None:
            return
        asked = False
        if ask is not None and self.running():
            try:
                asked = ask()
            except DriverError as exc:
                log.warning("%s pid %s did not take the request to exit: %s", self.spec.name, self._pid, exc.message)
        self.terminate(grace=grace if asked else 0.0)

    def terminate(self, *, grace: float = 0.0) -> None:
        """Make sure the daemon is gone: wait ``grace``, then the stop signals, always by PID."""
        pid, proc = self._pid, self._proc
        if pid is None and proc is not None:
            pid = proc.pid  # one that forks, stopped before it did
        if pid is not None:
            steps: list[tuple[signal.Signals | None, float]] = [(None, grace)]
            steps += [(sig, 5.0) for sig in self.spec.stop_signals]
            for sig, wait in steps:
                if proc is None and not self.spec.owns(pid):
                    break  # an adopted daemon that is gone: its PID may belong to someone else now
                if sig is not None:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                if self._wait_exit(pid, proc, wait):
                    break
            else:
                raise DriverError(f"{self.spec.name} pid {pid} survived {self.spec.stop_signals[-1].name}")
        self._pid, self._proc = None, None
        for leftover in (*self.spec.stale_files, self.spec.pid_path):
            leftover.unlink(missing_ok=True)

    def forget(self) -> None:
        """Let go of the daemon without stopping it (an agent restart: the next one adopts it)."""
        self._pid, self._proc = None, None

    def log_size(self) -> int:
        try:
            return self.spec.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, start: int = 0) -> str | None:
        """Everything the daemon wrote to its log since byte ``start`` (None: no log to read)."""
        try:
            with open(self.spec.log_path, "rb") as f:
                f.seek(start)
                return f.read().decode(errors="replace")
        except OSError:
            return None

    def log_tail(self, start: int = 0) -> str:
        """What the daemon wrote to its log since ``start``: its own reason for failing."""
        text = self.log_since(start)
        if text is None:
            return "(no log)"
        return text.strip()[-500:] or "(no output)"

    @staticmethod
    def _wait_exit(pid: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            gone = proc.poll() is not None if proc is not None else not pid_alive(pid)
            if gone:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def argv0_is(pid: int, program: str, *, mentions: str | None = None) -> bool:
    """Whether ``pid`` is a live ``program`` whose command line contains ``mentions``."""
    argv = cmdline(pid)
    if not (pid_alive(pid) and argv and Path(argv[0]).name == program):
        return False
    return mentions is None or mentions in " ".join(argv)
