"""One nbdkit process: the command line that serves one key to one host, and when it is ready.

nbdkit forks into the background by itself and its child writes the pidfile ``-P`` (which also
makes its command line name our state directory: ``owns`` and the tests' reaper find it by that):
run in the foreground (``-f``), nbdkit 1.32 stops serving when the process that started it dies
(measured: it sets PR_SET_PDEATHSIG, and the agent's SIGKILL cut every connection), and an agent
restart must not touch a session. What nbdkit says before it forks (a port in use, unreadable
credentials, a missing file) is in the process's log; after that its stderr is /dev/null.
The ``file`` plugin runs with ``--threads`` workers (its thread model is parallel: one NBD
connection's requests run at once), under the ``exportname`` filter in strict mode, so that the
process answers to its one export name and lists none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vbs.errors import DriverError
from vbs.system.daemons import DaemonSpec, argv0_is
from vbs.system.processes import minimal_environment

__all__ = ["NBDKIT", "Listener", "TlsMode", "process_spec", "stopper_spec", "ready"]

NBDKIT = "nbdkit"
TlsMode = Literal["x509", "psk", "off"]


@dataclass(frozen=True)
class Listener:
    """Where a process listens: a unix socket, or ``host``:``port`` with ``tls``'s credentials in
    ``tls_path`` (the X.509 directory, or the PSK file)."""

    socket: Path | None
    host: str
    port: int | None
    tls: TlsMode
    tls_path: Path | None

    def argv(self) -> list[str]:
        if self.socket is not None:
            return ["-U", str(self.socket), "--tls=off"]
        where = ["-i", self.host, "-p", str(self.port)]
        if self.tls == "x509":
            return [*where, "--tls=require", f"--tls-certificates={self.tls_path}", "--tls-verify-peer"]
        if self.tls == "psk":
            return [*where, "--tls=require", f"--tls-psk={self.tls_path}"]
        return [*where, "--tls=off"]


def _owns(pid_path: Path) -> Callable[[int], bool]:
    def owns(pid: int) -> bool:
        """A live nbdkit whose pidfile is ours (guards against a reused PID)."""
        return argv0_is(pid, NBDKIT, mentions=str(pid_path))
    return owns


def process_spec(run_dir: Path, pid: str, *, path: Path, name: str, read_only: bool, listener: Listener,
                 threads: int, cache: str, start_timeout: float) -> DaemonSpec:
    """How (key, host)'s process (files named ``pid`` in ``run_dir``) serves the file ``path``."""
    pid_path = run_dir / f"{pid}.pid"
    argv = [NBDKIT, "-P", str(pid_path), "--log=stderr", "-t", str(threads), *(["-r"] if read_only else []),
            *listener.argv(), "--filter=exportname", "file", f"file={path}", f"cache={cache}",
            f"exportname={name}", "exportname-strict=true", "exportname-list=empty"]
    stale = (listener.socket,) if listener.socket is not None else ()
    return DaemonSpec(name=NBDKIT, argv=tuple(argv), pid_path=pid_path, log_path=run_dir / f"{pid}.log",
                      owns=_owns(pid_path), writes_pidfile=True, forks=True,
                      start_timeout=start_timeout, stale_files=stale, env=minimal_environment())


def stopper_spec(run_dir: Path, pid: str) -> DaemonSpec:
    """Enough of a process's spec to stop it by its pidfile (an export the state file no longer has)."""
    pid_path = run_dir / f"{pid}.pid"
    return DaemonSpec(name=NBDKIT, argv=(NBDKIT,), pid_path=pid_path, log_path=run_dir / f"{pid}.log",
                      owns=_owns(pid_path), writes_pidfile=True, forks=True)


def ready(spec: DaemonSpec, listener: Listener) -> None:
    """nbdkit writes its pidfile once it listens; raise ``DriverError`` until it has."""
    if not spec.pid_path.exists() or (listener.socket is not None and not listener.socket.exists()):
        raise DriverError(f"{NBDKIT} is not listening yet")
