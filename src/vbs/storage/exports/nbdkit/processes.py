"""The nbdkit processes of one agent, one per (key, host): where each listens, what it reads as it
starts (its trust anchor and this node's certificate, or its one PSK key), and their lives through
the shared daemon supervisor: started, adopted, stopped by PID, their files removed."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from vbs.errors import DriverError, InvalidParameter
from vbs.qemu.tls import X509Files
from vbs.system.daemons import Daemon
from vbs.system.files import write_private
from vbs.system.socket_paths import socket_path

from .anchor import host_anchor
from .process import Listener, TlsMode, process_spec, ready, stopper_spec
from .state import HostExport, Served, process_id

__all__ = ["Processes"]

log = logging.getLogger("vbs.storage.exports.nbdkit.driver")  # the records keep the driver's name


class Processes:
    """The processes under ``state_dir`` (``run/``: pidfiles and logs; ``tls/``: credentials). Not
    thread-safe: the driver calls it under its lock."""

    def __init__(self, state_dir: Path, *, listen_host: str, ports: range, tls: TlsMode, x509: X509Files | None,
                 socket_dir: Path | None, threads: int, cache: str, start_timeout: float) -> None:
        self.run_dir = state_dir / "run"
        self.tls_dir = state_dir / "tls"
        self.listen_host, self.ports, self.tls, self.x509 = listen_host, ports, tls, x509
        self.socket_dir = socket_dir
        self.threads, self.cache, self.start_timeout = threads, cache, start_timeout
        self._daemons: dict[tuple[str, str], Daemon] = {}

    def pid(self, key: str, host_name: str) -> int | None:
        """PID of the process serving ``key`` to ``host_name`` (None when none runs)."""
        daemon = self._daemons.get((key, host_name))
        return daemon.pid if daemon is not None and daemon.running() else None

    def log_path(self, key: str, host_name: str) -> Path:
        return self.run_dir / f"{process_id(key, host_name)}.log"

    def socket(self, pid: str) -> Path | None:
        return socket_path(self.socket_dir, f"{pid}.sock") if self.socket_dir is not None else None

    def _listener(self, served: Served, exp: HostExport) -> Listener:
        pid = process_id(served.key, exp.host)
        tls_path = {"x509": self.tls_dir / pid, "psk": self.tls_dir / f"{pid}.psk"}.get(self.tls)
        return Listener(self.socket(pid), self.listen_host, exp.port, self.tls, tls_path)

    def daemon(self, served: Served, exp: HostExport) -> tuple[Daemon, Listener]:
        listener = self._listener(served, exp)
        spec = process_spec(self.run_dir, process_id(served.key, exp.host), path=Path(served.path), name=exp.name,
                            read_only=exp.read_only, listener=listener, threads=self.threads, cache=self.cache,
                            start_timeout=self.start_timeout)
        daemon = self._daemons.get((served.key, exp.host))
        if daemon is None or daemon.spec.argv != spec.argv:
            daemon = Daemon(spec)
            self._daemons[(served.key, exp.host)] = daemon
        return daemon, listener

    def _credentials(self, listener: Listener, exp: HostExport) -> None:
        """What the process reads as it starts: its anchor and this node's certificate, or its one key."""
        if listener.tls_path is None:
            return
        self.tls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.tls_dir.chmod(0o700)
        if listener.tls == "psk":
            assert exp.psk is not None
            write_private(listener.tls_path, f"{exp.host}:{exp.psk}\n")
            return
        assert self.x509 is not None
        try:
            ca, cert, key = self.x509.ca.read_bytes(), self.x509.cert.read_text(), self.x509.key.read_text()
        except OSError as exc:
            raise InvalidParameter(f"cannot read a TLS file: {exc}") from exc
        listener.tls_path.mkdir(exist_ok=True, mode=0o700)
        listener.tls_path.chmod(0o700)
        write_private(listener.tls_path / "ca-cert.pem", host_anchor(ca, exp.address).decode())
        write_private(listener.tls_path / "server-cert.pem", cert)
        write_private(listener.tls_path / "server-key.pem", key)

    def run(self, served: Served, exp: HostExport) -> Daemon:
        """The process of (key, host) running as the state says: adopted if it is, else started (one
        that died is started again, with the same port, name and credentials: clients reconnect)."""
        daemon, listener = self.daemon(served, exp)
        if daemon.running():
            return daemon
        if daemon.pid is not None:
            log.warning("nbdkit pid %s of %s for %s is gone: restarting it", daemon.pid, served.key, exp.host)
            daemon.terminate()
        if daemon.adopt():
            return daemon
        for d in {p for p in (self.socket_dir, listener.socket.parent if listener.socket else None) if p}:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            d.chmod(0o700)
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._credentials(listener, exp)
        daemon.spawn(lambda _deadline: ready(daemon.spec, listener))
        log.info("nbdkit pid %s serves %s to %s (%s)", daemon.pid, served.key, exp.host,
                 listener.socket or f"{self.listen_host}:{exp.port}, tls={self.tls}")
        return daemon

    def end(self, key: str, host_name: str) -> None:
        """Stop (key, host)'s process, also one the state file lost (found by its pidfile), and remove
        its files. Its clients are cut off."""
        pid = process_id(key, host_name)
        daemon = self._daemons.pop((key, host_name), None) or Daemon(stopper_spec(self.run_dir, pid))
        daemon.stop(grace=0.0)
        self._remove_files(pid)

    def end_unknown(self, known: set[str]) -> list[str]:
        """Stop the processes whose pidfile names none of ``known`` (process ids): an agent that died
        between forgetting an export and stopping its process left it serving. Their ids."""
        ended = []
        for pidfile in sorted(self.run_dir.glob("*.pid")) if self.run_dir.is_dir() else []:
            pid = pidfile.stem
            if pid in known:
                continue
            Daemon(stopper_spec(self.run_dir, pid)).stop(grace=0.0)
            self._remove_files(pid)
            ended.append(pid)
        return ended

    def _remove_files(self, pid: str) -> None:
        sock = self.socket(pid)
        if sock is not None:
            sock.unlink(missing_ok=True)
        (self.tls_dir / f"{pid}.psk").unlink(missing_ok=True)
        anchor_dir = self.tls_dir / pid
        for f in ("ca-cert.pem", "server-cert.pem", "server-key.pem"):
            (anchor_dir / f).unlink(missing_ok=True)
        if anchor_dir.exists():
            anchor_dir.rmdir()

    def free_port(self, taken: set[int | None]) -> int:
        """The lowest port of ``ports`` that no export has (``taken``) and no one else listens on."""
        for port in self.ports:
            if port in taken:
                continue
            family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((self.listen_host, port))
                except OSError:
                    continue  # someone else's
            return port
        raise DriverError(f"no free port for another nbdkit export in {self.ports.start}-{self.ports.stop - 1} "
                          "(raise [storage_agent.options.nbdkit] ports)")

    def serving(self, served: Served, exp: HostExport) -> bool:
        """Whether (key, host)'s process runs (this agent's, or one an earlier agent left)."""
        daemon = self.daemon(served, exp)[0]
        return daemon.running() or daemon.recorded_pid() is not None

    def stop(self, served: Served, exp: HostExport) -> None:
        """Stop the process by PID (its files stay: ``run`` starts it again the same)."""
        self.daemon(served, exp)[0].stop(grace=0.0)
        self._daemons.pop((served.key, exp.host), None)

    def forget(self) -> None:
        """Let go of every process without stopping it (the next agent adopts them)."""
        for daemon in self._daemons.values():
            daemon.forget()
        self._daemons.clear()
