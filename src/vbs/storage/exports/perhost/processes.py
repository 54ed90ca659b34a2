"""The nbdkit processes of one export driver, one per (export, host): where each listens, what it
reads as it starts (its trust anchor and this node's certificate, or its one PSK key), the
connection its host is told, and their lives through the shared daemon supervisor: started,
adopted, stopped by PID, their files removed."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from vbs.errors import DriverError, InvalidParameter
from vbs.qemu.tls import X509Files
from vbs.system.daemons import Daemon
from vbs.system.files import write_private
from vbs.system.socket_paths import socket_path
from vbs.wire.connection import NbdConnection

from .anchor import host_anchor
from .process import NBDKIT, Listener, TlsMode, process_spec, ready, stopper_spec

__all__ = ["OneHost", "Processes"]


@dataclass(frozen=True)
class OneHost:
    """What one process serves: ``plugin`` (its name and parameters) through ``filters`` under the export name ``name``,
    to the host ``host`` at ``address`` (what its anchor admits), on ``port`` (TCP; None: a unix
    socket) with ``psk`` (hex, TLS-PSK mode). ``pid`` names its files, and ``what`` says in the logs
    what it serves.

    The nbd driver's *legacy front* (exports made before the fronts, whose hosts' addresses are not
    known) answers to ``more_names`` too, admits any certificate of the install's CA
    (``any_host_of_ca``: no anchor of one address) and, with TLS-PSK, the keys of ``more_keys``
    (host, hex key) too."""

    pid: str
    what: str
    host: str
    address: str
    name: str
    read_only: bool
    port: int | None
    psk: str | None
    plugin: tuple[str, ...]
    more_names: tuple[str, ...] = ()
    any_host_of_ca: bool = False
    more_keys: tuple[tuple[str, str], ...] = ()
    filters: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.more_names)


class Processes:
    """The processes under ``state_dir`` (``run/``: pidfiles and logs; ``tls/``: credentials). Not
    thread-safe: the driver calls it under its lock."""

    def __init__(self, state_dir: Path, *, listen_host: str, ports: range, tls: TlsMode, x509: X509Files | None,
                 socket_dir: Path | None, threads: int, start_timeout: float, logger: str, ports_option: str) -> None:
        """``logger``: the name the records go under (the driver's); ``ports_option``: the setting that
        sizes ``ports`` (named when they run out)."""
        self.run_dir = state_dir / "run"
        self.tls_dir = state_dir / "tls"
        self.listen_host, self.ports, self.tls, self.x509 = listen_host, ports, tls, x509
        self.socket_dir = socket_dir
        self.threads, self.start_timeout = threads, start_timeout
        self._log, self.ports_option = logging.getLogger(logger), ports_option
        self._daemons: dict[str, Daemon] = {}

    def pid(self, pid: str) -> int | None:
        """PID of the process ``pid`` (None when none runs)."""
        daemon = self._daemons.get(pid)
        return daemon.pid if daemon is not None and daemon.running() else None

    def log_path(self, pid: str) -> Path:
        return self.run_dir / f"{pid}.log"

    def socket(self, pid: str) -> Path | None:
        return socket_path(self.socket_dir, f"{pid}.sock") if self.socket_dir is not None else None

    def _listener(self, one: OneHost) -> Listener:
        tls_path = {"x509": self.tls_dir / one.pid, "psk": self.tls_dir / f"{one.pid}.psk"}.get(self.tls)
        return Listener(self.socket(one.pid), self.listen_host, one.port, self.tls, tls_path)

    def daemon(self, one: OneHost) -> tuple[Daemon, Listener]:
        listener = self._listener(one)
        spec = process_spec(self.run_dir, one.pid, plugin=one.plugin, filters=one.filters, names=one.names(),
                            read_only=one.read_only,
                            listener=listener, threads=self.threads, start_timeout=self.start_timeout)
        daemon = self._daemons.get(one.pid)
        if daemon is None or daemon.spec.argv != spec.argv:
            daemon = Daemon(spec)
            self._daemons[one.pid] = daemon
        return daemon, listener

    def connection(self, one: OneHost, advertise_host: str) -> NbdConnection:
        """What the host connects to: the process's socket, or its port with the TLS of the mode."""
        sock = self.socket(one.pid)
        if sock is not None:
            return NbdConnection(socket=str(sock), export=one.name)
        if self.tls == "x509":
            return NbdConnection(host=advertise_host, port=one.port, export=one.name, tls="x509")
        if self.tls == "psk" and one.psk is not None:
            return NbdConnection(host=advertise_host, port=one.port, export=one.name, tls="psk",
                                 tls_psk_identity=one.host, tls_psk_key=SecretStr(one.psk))
        return NbdConnection(host=advertise_host, port=one.port, export=one.name)

    def _credentials(self, listener: Listener, one: OneHost) -> None:
        """What the process reads as it starts: its anchor and this node's certificate, or its one key."""
        if listener.tls_path is None:
            return
        self.tls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.tls_dir.chmod(0o700)
        if listener.tls == "psk":
            if one.psk is None:
                raise DriverError(f"no TLS-PSK key for {one.host}")
            write_private(listener.tls_path, "".join(f"{h}:{k}\n" for h, k in ((one.host, one.psk), *one.more_keys)))
            return
        assert self.x509 is not None
        if not one.address and not one.any_host_of_ca:
            # An anchor must name the one address it admits (an export made before fronts had none).
            raise DriverError(f"the export of {one.what} for {one.host} has no host address: detach and attach again")
        try:
            ca, cert, key = self.x509.ca.read_bytes(), self.x509.cert.read_text(), self.x509.key.read_text()
        except OSError as exc:
            raise InvalidParameter(f"cannot read a TLS file: {exc}") from exc
        listener.tls_path.mkdir(exist_ok=True, mode=0o700)
        listener.tls_path.chmod(0o700)
        anchor = ca if one.any_host_of_ca else host_anchor(ca, one.address)
        write_private(listener.tls_path / "ca-cert.pem", anchor.decode())
        write_private(listener.tls_path / "server-cert.pem", cert)
        write_private(listener.tls_path / "server-key.pem", key)

    def run(self, one: OneHost) -> Daemon:
        """The process of ``one`` running as the state says: adopted if it is, else started (one that
        died is started again, with the same port, name and credentials: clients reconnect)."""
        daemon, listener = self.daemon(one)
        if daemon.running():
            return daemon
        if daemon.pid is not None:
            self._log.warning("nbdkit pid %s of %s for %s is gone: restarting it", daemon.pid, one.what, one.host)
            daemon.terminate()
        if daemon.adopt():
            return daemon
        for d in {p for p in (self.socket_dir, listener.socket.parent if listener.socket else None) if p}:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            d.chmod(0o700)
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._credentials(listener, one)
        daemon.spawn(lambda _deadline: ready(daemon.spec, listener))
        self._log.info("%s pid %s serves %s to %s (%s)", NBDKIT, daemon.pid, one.what, one.host,
                       listener.socket or f"{self.listen_host}:{one.port}, tls={self.tls}")
        return daemon

    def end(self, pid: str) -> None:
        """Stop the process ``pid``, also one the state file lost (found by its pidfile), and remove
        its files. Its clients are cut off."""
        daemon = self._daemons.pop(pid, None) or Daemon(stopper_spec(self.run_dir, pid))
        daemon.stop(grace=0.0)
        self._remove_files(pid)

    def ids(self) -> list[str]:
        """The ids of the processes that have a pidfile (running, or left by an earlier agent)."""
        return sorted(p.stem for p in self.run_dir.glob("*.pid")) if self.run_dir.is_dir() else []

    def end_unknown(self, known: set[str]) -> list[str]:
        """Stop the processes whose pidfile names none of ``known`` (process ids): an agent that died
        between forgetting an export and stopping its process left it serving. Their ids."""
        ended = []
        for pid in self.ids():
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
        raise DriverError(f"no free port for another {NBDKIT} process in {self.ports.start}-{self.ports.stop - 1} "
                          f"(raise {self.ports_option})")

    def serving(self, one: OneHost) -> bool:
        """Whether the process of ``one`` runs (this agent's, or one an earlier agent left)."""
        daemon = self.daemon(one)[0]
        return daemon.running() or daemon.recorded_pid() is not None

    def stop(self, one: OneHost) -> None:
        """Stop the process by PID (its files stay: ``run`` starts it again the same)."""
        self.daemon(one)[0].stop(grace=0.0)
        self._daemons.pop(one.pid, None)

    def forget(self) -> None:
        """Let go of every process without stopping it (the next agent adopts them)."""
        for daemon in self._daemons.values():
            daemon.forget()
        self._daemons.clear()
