"""tgtd's control: its command line, and tgtadm requests against it (argv, timeout, minimal
environment), with tgtadm's own reasons kept to tell benign failures apart."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from vbs.errors import DriverError
from vbs.system.argv import run
from vbs.system.daemons import DaemonSpec, argv0_is
from vbs.system.processes import cmdline, environ_value

from .state import View, parse_targets

TGTD = "tgtd"
TGTADM = "tgtadm"

# tgtadm's error strings (tgtadm_strerror); its exit code is 22 for all of them.
E_EXISTS = ("already exists",)
E_ABSENT = ("can't find", "does not exist")
E_ACTIVE = ("still active",)


class AdmError(DriverError):
    """A tgtadm call failed; ``detail`` is tgtadm's own reason, matched to tell benign cases apart."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"tgtadm {step}: {detail}")
        self.detail = detail

    def says(self, phrases: tuple[str, ...]) -> bool:
        return any(p in self.detail for p in phrases)


def tgtd_spec(state_dir: Path, control_port: int, portal: str, owns: Callable[[int], bool], env: dict[str, str],
              start_timeout: float) -> DaemonSpec:
    return DaemonSpec(
        name=TGTD, argv=(TGTD, "-f", "-C", str(control_port), "--iscsi", f"portal={portal}"),
        pid_path=state_dir / "tgtd.pid",  # tgtd -f ignores -p: the supervisor writes it
        log_path=state_dir / "tgtd.log", owns=owns, env=env,
        stop_signals=(signal.SIGKILL,),  # tgtd ignores SIGTERM
        start_timeout=start_timeout)


class Tgtadm:
    """tgtadm against one tgtd, on its control port."""

    def __init__(self, control_port: int, socket_base: Path, timeout: float, env: dict[str, str]) -> None:
        self.control_port, self.socket_base, self.timeout, self.env = control_port, socket_base, timeout, env

    def is_ours(self, pid: int) -> bool:
        """A live tgtd on our control socket (guards against a reused PID: never signal a stranger)."""
        if not argv0_is(pid, TGTD) or cmdline(pid)[1:4] != ["-f", "-C", str(self.control_port)]:
            return False
        env = environ_value(pid, "TGT_IPC_SOCKET")
        return env is None or env == str(self.socket_base)

    def adm(self, step: str, *args: str) -> str:
        """Run one tgtadm request against our daemon; failures name ``step`` (never the argv)."""
        argv = [TGTADM, "-C", str(self.control_port), *args]
        proc = run(argv, timeout=self.timeout, check=False, env=self.env)
        # tgtadm exits 0 with "tgtd closed the socket" when tgtd dies under the request.
        if proc.returncode != 0 or "tgtadm:" in proc.stderr:
            detail = (proc.stderr or proc.stdout).strip().removeprefix("tgtadm: ")[-300:]
            raise AdmError(step, detail or f"exit status {proc.returncode}")
        return proc.stdout

    def iscsi(self, step: str, *args: str) -> str:
        return self.adm(step, "--lld", "iscsi", *args)

    def show(self) -> View:
        return parse_targets(self.iscsi("show targets", "--mode", "target", "--op", "show"))

    def accounts(self) -> set[str]:
        out = self.iscsi("show accounts", "--mode", "account", "--op", "show")
        return {line.strip() for line in out.splitlines()[1:] if line.strip()}

    def bind(self, step: str, *args: str) -> None:
        """A bind; one tgtd already has is fine."""
        try:
            self.iscsi(step, *args)
        except AdmError as exc:
            if not exc.says(E_EXISTS):
                raise
