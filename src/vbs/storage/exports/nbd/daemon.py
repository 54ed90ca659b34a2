"""The qemu-storage-daemon of the NBD driver: its command line, and its monitor (QMP), through
which the driver starts, adopts, asks and stops it. Every other module of the package reaches the
daemon through ``Monitor``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from vbs.errors import DriverError
from vbs.qemu.qmp import QmpClient, QmpCommandError, QmpError, connect_until
from vbs.system.daemons import DaemonSpec, argv0_is
from vbs.system.processes import minimal_environment

from .state import JOB_PREFIX, Job, Live

TlsMode = Literal["x509", "psk", "off"]

QSD = "qemu-storage-daemon"
AUTHZ_ID = "vbsauthz"


def daemon_spec(state_dir: Path, qmp_path: Path, *, socket: Path | None, listen_host: str, port: int,
                tls: TlsMode, tls_dir: Path, x509_dir: Path, start_timeout: float) -> DaemonSpec:
    """How the daemon is run: its monitor socket, its NBD server (unix socket, or TCP with the TLS
    credentials of ``tls``), its pidfile and log."""
    pid_path = state_dir / "qsd.pid"
    if socket is not None:
        nbd = f"addr.type=unix,addr.path={socket}"
    else:
        nbd = f"addr.type=inet,addr.host={listen_host},addr.port={port}"
    argv = [QSD, "--chardev", f"socket,path={qmp_path},server=on,wait=off,id=m", "--monitor", "chardev=m"]
    if tls == "psk":
        argv += ["--object", f"tls-creds-psk,id=tls0,endpoint=server,dir={tls_dir}"]
        nbd += ",tls-creds=tls0"
    elif tls == "x509":
        # verify-peer: a client must present a certificate from the CA; the authz list (made
        # over QMP, see access.Access.write_authz) then admits only hosts with an export here.
        argv += ["--object", f"tls-creds-x509,id=tls0,endpoint=server,dir={x509_dir},verify-peer=on"]
        nbd += f",tls-creds=tls0,tls-authz={AUTHZ_ID}"
    argv += ["--nbd-server", nbd, "--pidfile", str(pid_path)]
    stale = (qmp_path,) if socket is None else (qmp_path, socket)

    def owns(pid: int) -> bool:
        """A live qemu-storage-daemon with our monitor socket (guards against a reused PID)."""
        return argv0_is(pid, QSD, mentions=str(qmp_path))

    return DaemonSpec(name=QSD, argv=tuple(argv), pid_path=pid_path, log_path=state_dir / "qsd.log",
                      owns=owns, writes_pidfile=True, start_timeout=start_timeout,
                      stale_files=stale, env=minimal_environment())


class Monitor:
    """The driver's one QMP client of its daemon (the monitor takes one client at a time)."""

    def __init__(self, qmp_path: Path, timeout: float) -> None:
        self.qmp_path, self.timeout = qmp_path, timeout
        self.client: QmpClient | None = None

    def connect(self, deadline: float, alive: Callable[[], bool]) -> None:
        self.client = connect_until(self.qmp_path, deadline, alive=alive, name="vbs-nbd", timeout=self.timeout)

    def take_over(self, pid: int | None, forget: Callable[[], None]) -> bool:
        """Adopt a running daemon; one whose monitor does not answer is left to an operator."""
        client = QmpClient(self.qmp_path, name="vbs-nbd", timeout=self.timeout)
        try:
            client.execute("query-version")
        except QmpError as exc:
            client.close()
            forget()
            # The monitor takes one client at a time: most likely another agent still drives this
            # daemon. Killing it would cut every attached host, so an operator decides.
            raise DriverError(
                f"{QSD} pid {pid} is alive but its monitor does not answer ({exc.message}); "
                "is another storage agent using it? Stop that agent or the daemon, then retry") from exc
        self.client = client
        return True

    def ask_exit(self) -> bool:
        # Also a daemon found only by its pidfile (a fresh driver stopping what an earlier agent
        # left). A monitor that does not answer raises: then SIGTERM follows at once.
        self.client = self.client or QmpClient(self.qmp_path, name="vbs-nbd", timeout=self.timeout)
        self.client.execute("quit", timeout=5.0)
        return True

    def let_go(self) -> None:
        if self.client is not None:
            self.client.close()
        self.client = None

    def q(self, command: str, args: dict[str, Any] | None = None) -> Any:
        if self.client is None:
            raise DriverError(f"{QSD} is not running")
        return self.client.execute(command, args, timeout=self.timeout)

    def connected(self) -> QmpClient:
        client = self.client
        assert client is not None
        return client

    def view(self, running: bool) -> Live:
        """What the daemon has, or nothing if it does not run."""
        if not running or self.client is None:
            return Live()
        jobs = {j["id"]: Job(status=j["status"], error=j.get("error"), done=int(j["current-progress"]),
                             total=int(j["total-progress"]))
                for j in self.q("query-jobs") if str(j["id"]).startswith(JOB_PREFIX)}
        return Live(exports=self.live_exports(), nodes=self.live_nodes(), jobs=jobs, groups=self.live_groups())

    def live_exports(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in self.q("query-block-exports")}

    def live_groups(self) -> set[str]:
        try:
            objects = self.q("qom-list", {"path": "/objects"})
        except QmpCommandError as exc:
            if exc.error_class != "DeviceNotFound":
                raise
            return set()  # QEMU makes /objects with the daemon's first object
        return {str(o["name"]) for o in objects if str(o.get("type", "")) == "child<throttle-group>"}

    def live_nodes(self) -> dict[str, int | None]:
        return {n["node-name"]: n.get("image", {}).get("virtual-size")
                for n in self.q("query-named-block-nodes", {"flat": True})}
