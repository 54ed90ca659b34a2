"""The nbdkit export driver: the ``ExportDriver`` contract over one nbdkit process per (key, host).

Why one process per export and host, not one daemon per node as the ``nbd`` driver has:
* Access. A process serves one export to one host, so who may open a session on it is exactly who
  may use that export: the gap of one server-wide daemon (a host admitted for one export could list
  and open every other export of the node) does not exist. Modes:
  - unix socket (``socket_dir``, ``vbs up``): ``<socket_dir>/<id>.sock`` in a 0700 directory; only
    processes of the agent's user (QEMU on the same machine) can connect;
  - X.509 (the default over TCP): ``--tls=require --tls-verify-peer``; the client's certificate must
    chain to the install's CA through the process's own anchor (anchor.py), which admits only
    certificates whose names of the host address's kind are that address (nbdkit 1.32 cannot check
    a certificate's CN, and Debian's ``ip`` filter cannot match addresses: see anchor.py);
  - TLS-PSK (``nbd_tls = "psk"``): the process's key file holds the one host's identity and key;
  - plain TCP (``--insecure`` only).
  In every mode the process answers to its one export name (``<key>-<128-bit random token>``, told
  only to that host) and lists none (``exportname`` filter, strict): a host that was given a stale
  name, or a port since reused for another export, fails instead of reaching another volume.
* Throughput. nbdkit's file plugin runs one connection's requests in parallel (``--threads``);
  QEMU's NBD server serves a connection from one thread (docs/benchmarks.md).
* Failure. A process that dies takes one export with it; ``check()`` starts it again with the same
  port, name and credentials, and QEMU's NBD client reconnects.

What nbdkit does not do, and who does it instead (as for iSCSI): QoS is the hypervisor's (no
``LimitEnforcer``: QEMU throttles the guest's disk); snapshots of an attached volume are the pool's
reflink at one instant, or on a copy pool the guest's QEMU copies (no ``PointInTimeCopier``). Online
resize needs no second export: the file plugin reads the file's size at each new connection, so the
host's fresh node on the same connection sees the grown volume. RBD pools cannot be served (1.32 has
no rbd plugin), nor qcow2 images (no qcow2 filter before 1.36).

Desired state (``exports.json``, 0600, with the PSK keys) is written before a process is started or
stopped; a restarted agent adopts every process whose command line is still what the state says
(clients keep their sessions), and starts the others.
"""

from __future__ import annotations

import logging
import re
import secrets
import socket
import threading
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from vbs.config import StorageAgentConfig
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, NotFound
from vbs.pools.exports import ExportSource, FileSource, RbdSource
from vbs.qemu.tls import X509Files
from vbs.storage.exports.nbd.options import tls_of
from vbs.storage.exports.supervised import (
    LISTEN_RE,
    ServedKey,
    advertised_host,
    check_host,
    check_key,
    check_port,
    checked_source,
)
from vbs.system.daemons import Daemon
from vbs.system.desired_state import DesiredState
from vbs.system.files import write_private
from vbs.system.socket_paths import socket_path
from vbs.wire.connection import NBD_SOCKET_RE, HostIdentity, NbdConnection
from vbs.wire.storage import ExportInfo

from .anchor import host_anchor
from .process import Listener, TlsMode, process_spec, ready, stopper_spec
from .state import STATE_VERSION, HostExport, Served, process_id

log = logging.getLogger(__name__)

MAX_EXPORTS = 4096


class NbdkitOptions(BaseModel):
    """``[storage_agent.options.nbdkit]``: worker threads per process, the file plugin's cache mode,
    and how many ports from ``nbd_port`` on its processes may take (one per export over TCP)."""

    model_config = ConfigDict(extra="forbid")

    threads: int = Field(16, ge=1, le=256)
    cache: str = Field("default", pattern=r"^(default|none)$")
    ports: int = Field(256, ge=1, le=MAX_EXPORTS)


class NbdkitExportDriver:
    """Export driver for NBD through one nbdkit per (key, host); see the module docstring."""

    protocol = "nbd"

    def __init__(self, state_dir: Path, listen_host: str = "127.0.0.1", port: int = 10809,
                 tls: TlsMode = "off", *, advertise_host: str | None = None, x509: X509Files | None = None,
                 socket_dir: Path | None = None, threads: int = 16, cache: str = "default", ports: int = 256,
                 start_timeout: float = 15.0) -> None:
        """``port``: the first of ``ports`` TCP ports the processes take, one each. ``tls``: ``x509``
        (needs ``x509``: this node's certificate, key and the install's CA), ``psk`` or ``off``.
        ``socket_dir``: unix sockets there instead of TCP (no TLS: the directory's mode is the boundary)."""
        options = NbdkitOptions(threads=threads, cache=cache, ports=ports)
        if not LISTEN_RE.match(listen_host):
            raise InvalidParameter(f"invalid listen_host: {listen_host[:80]!r}")
        self.state_dir = Path(state_dir).absolute()
        self.listen_host = listen_host
        self.port = check_port(port)
        self.ports = range(self.port, min(65536, self.port + options.ports))
        self.advertise_host = advertised_host(listen_host, advertise_host)
        self.socket_dir = Path(socket_dir).absolute() if socket_dir is not None else None
        if self.socket_dir is not None and not NBD_SOCKET_RE.fullmatch(str(socket_path(self.socket_dir, "a" * 24
                                                                                      + ".sock"))):
            raise InvalidParameter(f"unusable NBD socket directory {self.socket_dir} (plain components)")
        self.tls: TlsMode = "off" if self.socket_dir is not None else tls
        if self.tls not in ("x509", "psk", "off"):
            raise InvalidParameter(f"nbd tls must be x509, psk or off, not {self.tls!r}")
        if self.tls == "x509" and x509 is None:
            raise InvalidParameter("NBD TLS with X.509 needs this node's certificate, key and the install's CA")
        self.x509 = x509
        self.threads, self.cache, self.start_timeout = options.threads, options.cache, start_timeout
        self.run_dir = self.state_dir / "run"
        self.tls_dir = self.state_dir / "tls"
        self.state_path = self.state_dir / "exports.json"
        self._state = DesiredState(self.state_path, Served, version=STATE_VERSION)
        self._lock = threading.RLock()
        self._desired: dict[str, Served] = {}
        self._loaded = False
        self._daemons: dict[tuple[str, str], Daemon] = {}

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, state_dir: Path) -> NbdkitExportDriver:
        """``export_host``, ``nbd_port`` (the first port), ``nbd_tls`` and ``nbd_socket_dir`` as the
        ``nbd`` driver reads them; ``threads``, ``cache`` and ``ports`` from ``[storage_agent.options.nbdkit]``."""
        opts = NbdkitOptions.model_validate(cfg.options.get("nbdkit", {}))
        x509 = X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        return cls(state_dir, listen_host=cfg.export_host, port=cfg.nbd_port, tls=tls_of(cfg, x509), x509=x509,
                   socket_dir=cfg.nbd_socket_dir, threads=opts.threads, cache=opts.cache, ports=opts.ports)

    # -- the processes ---------------------------------------------------------------------------------

    def pid(self, key: str, host_name: str) -> int | None:
        """PID of the process serving ``key`` to ``host_name`` (None when none runs)."""
        with self._lock:
            daemon = self._daemons.get((key, host_name))
            return daemon.pid if daemon is not None and daemon.running() else None

    def log_path(self, key: str, host_name: str) -> Path:
        return self.run_dir / f"{process_id(key, host_name)}.log"

    def _socket(self, pid: str) -> Path | None:
        return socket_path(self.socket_dir, f"{pid}.sock") if self.socket_dir is not None else None

    def _listener(self, served: Served, exp: HostExport) -> Listener:
        pid = process_id(served.key, exp.host)
        tls_path = {"x509": self.tls_dir / pid, "psk": self.tls_dir / f"{pid}.psk"}.get(self.tls)
        return Listener(self._socket(pid), self.listen_host, exp.port, self.tls, tls_path)

    def _daemon(self, served: Served, exp: HostExport) -> tuple[Daemon, Listener]:
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
        if listener.tls == "psk":
            assert exp.psk is not None
            self.tls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(listener.tls_path, f"{exp.host}:{exp.psk}\n")
            return
        assert self.x509 is not None
        try:
            ca, cert, key = self.x509.ca.read_bytes(), self.x509.cert.read_text(), self.x509.key.read_text()
        except OSError as exc:
            raise InvalidParameter(f"cannot read a TLS file: {exc}") from exc
        listener.tls_path.mkdir(parents=True, exist_ok=True, mode=0o700)
        listener.tls_path.chmod(0o700)
        write_private(listener.tls_path / "ca-cert.pem", host_anchor(ca, exp.address).decode())
        write_private(listener.tls_path / "server-cert.pem", cert)
        write_private(listener.tls_path / "server-key.pem", key)

    def _run(self, served: Served, exp: HostExport) -> Daemon:
        """The process of (key, host) running as the state says: adopted if it is, else started."""
        daemon, listener = self._daemon(served, exp)
        if daemon.running():
            return daemon
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

    def _end(self, key: str, host_name: str) -> None:
        """Stop (key, host)'s process, also one the state file lost (found by its pidfile), and remove
        its files. Its clients are cut off."""
        pid = process_id(key, host_name)
        daemon = self._daemons.pop((key, host_name), None) or Daemon(stopper_spec(self.run_dir, pid))
        daemon.stop(grace=0.0)
        self._remove_files(pid)

    def _remove_files(self, pid: str) -> None:
        sock = self._socket(pid)
        if sock is not None:
            sock.unlink(missing_ok=True)
        (self.tls_dir / f"{pid}.psk").unlink(missing_ok=True)
        anchor_dir = self.tls_dir / pid
        for f in ("ca-cert.pem", "server-cert.pem", "server-key.pem"):
            (anchor_dir / f).unlink(missing_ok=True)
        if anchor_dir.exists():
            anchor_dir.rmdir()

    def _free_port(self) -> int:
        taken = {e.port for s in self._desired.values() for e in s.exports}
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

    # -- desired state ---------------------------------------------------------------------------------

    def _load(self) -> None:
        if self._loaded:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._desired = {item.key: item for item in self._state.load()}
        self._loaded = True

    def _save(self) -> None:
        self._state.save(self._desired.values())

    # -- the daemons' life (ExportDriver) --------------------------------------------------------------

    def start(self) -> None:
        """Adopt every process an earlier agent left serving, start the others."""
        self.check()

    def check(self) -> None:
        """Start again every process that should run and does not (same port, name and credentials:
        clients reconnect)."""
        with self._lock:
            self._load()
            failed: list[str] = []
            for served in list(self._desired.values()):
                for exp in served.exports:
                    daemon = self._daemons.get((served.key, exp.host))
                    if daemon is not None and daemon.pid is not None and not daemon.running():
                        log.warning("nbdkit pid %s of %s for %s is gone: restarting it", daemon.pid, served.key,
                                    exp.host)
                        daemon.terminate()
                    try:
                        self._run(served, exp)
                    except (DriverError, InvalidParameter) as exc:
                        # One missing source file must not keep every other host from its disk.
                        log.error("nbdkit export of %s for %s failed: %s", served.key, exp.host, exc.message)
                        failed.append(f"{served.key} ({exp.host})")
            if failed:
                raise DriverError(f"could not serve the nbdkit exports of {', '.join(failed)}")

    def stop(self) -> None:
        """Stop every process by PID; the desired exports are kept and ``start`` brings them back."""
        with self._lock:
            self._load()
            for served in self._desired.values():
                for exp in served.exports:
                    self._daemon(served, exp)[0].stop(grace=0.0)
            self._daemons.clear()

    def close(self) -> None:
        """Let go of the processes without stopping them: the next agent adopts them."""
        with self._lock:
            for daemon in self._daemons.values():
                daemon.forget()
            self._daemons.clear()

    # -- exports (ExportDriver) ------------------------------------------------------------------------

    def ensure_export(self, key: str, source: ExportSource, host: HostIdentity, *, read_only: bool = False
                      ) -> NbdConnection:
        """Serve ``source`` under ``key`` to ``host`` only, from a process of its own; idempotent
        (the same port, name and key while the state directory lives)."""
        check_key(key)
        served_source = self._file_of(key, source)
        with self._lock:
            self._load()
            served = self._desired.get(key)
            if served is not None and not served.serves(served_source):
                raise IdempotentParameterMismatch(f"{key} is served from {served.describe()}, not {source}")
            served = served or Served(key=key, **ServedKey.fields_of(served_source))
            exp = served.export_for(host.name)
            if exp is not None:
                if exp.read_only != read_only:
                    raise IdempotentParameterMismatch(f"{key} is already exported to {host.name} "
                                                      f"(read_only={exp.read_only}); remove that export first")
                if exp.address != host.address:
                    # Its anchor admits the old address: a new process for the new one.
                    self._end(key, host.name)
                    exp.address = host.address
                    self._save()
                self._run(served, exp)
                return self._connection(exp)
            exp = HostExport(host=host.name, address=host.address, read_only=read_only,
                             name=f"{key}-{secrets.token_hex(16)}",
                             port=self._free_port() if self.socket_dir is None else None,
                             psk=secrets.token_hex(32) if self.tls == "psk" else None)
            served.exports.append(exp)
            self._desired[key] = served
            self._save()  # first: a crash from here on leaves an export check() re-creates
            try:
                self._run(served, exp)
            except BaseException:
                served.exports.remove(exp)
                if not served.exports:
                    del self._desired[key]
                self._save()
                self._end(key, host.name)
                raise
            log.info("exported %s to %s through nbdkit (tls=%s)", key, host.name, self.tls)
            return self._connection(exp)

    def remove_export(self, key: str, host_name: str) -> None:
        """Withdraw ``host_name``'s export of ``key``: its process stops; idempotent."""
        check_key(key)
        check_host(host_name)
        with self._lock:
            self._load()
            served = self._desired.get(key)
            exp = served.export_for(host_name) if served is not None else None
            if served is not None and exp is not None:
                served.exports.remove(exp)
                if not served.exports:
                    del self._desired[key]
                self._save()
            self._end(key, host_name)
            log.info("removed the nbdkit export of %s for %s", key, host_name)

    def refresh_export(self, key: str, source: ExportSource, host_name: str) -> NbdConnection:
        """The same connection: each new connection to the process reports the file's current size."""
        check_key(key)
        check_host(host_name)
        served_source = self._file_of(key, source)
        with self._lock:
            self._load()
            served = self._desired.get(key)
            exp = served.export_for(host_name) if served is not None else None
            if served is None or exp is None:
                raise NotFound(f"{key} is not exported to {host_name}", code="InvalidAttachment.NotFound")
            if not served.serves(served_source):
                raise IdempotentParameterMismatch(f"{key} is served from {served.describe()}, not {source}")
            self._run(served, exp)
            return self._connection(exp)

    def retire_exports(self, key: str, host_name: str) -> None:
        """Nothing to retire: a refresh keeps the one process."""
        check_key(key)
        check_host(host_name)

    def is_exported(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            self._load()
            served = self._desired.get(key)
            return served is not None and bool(served.exports)

    def list_exports(self) -> list[ExportInfo]:
        """One entry per (key, host) whose process runs."""
        with self._lock:
            self._load()
            out = []
            for served in self._desired.values():
                for exp in served.exports:
                    daemon = self._daemon(served, exp)[0]
                    if daemon.running() or daemon.recorded_pid() is not None:
                        out.append(ExportInfo(key=served.key, host=exp.host, protocol=self.protocol,
                                              target=exp.name))
            return sorted(out, key=lambda e: (e.key, e.host))

    # -- helpers ---------------------------------------------------------------------------------------

    def _file_of(self, key: str, source: ExportSource) -> FileSource:
        if isinstance(source, RbdSource):
            raise InvalidParameter(f"the nbdkit export driver cannot serve the RBD image of {key}: nbdkit 1.32 has "
                                   "no rbd plugin (hosts open RBD pools natively, or use --export nbd)")
        checked = checked_source(key, source)
        assert isinstance(checked, FileSource)
        if re.search(r"[\s\0]", str(checked.path)):
            raise InvalidParameter(f"the nbdkit export driver serves files whose path has no white space: "
                                   f"{str(checked.path)[:200]}")
        return checked

    def _connection(self, exp: HostExport) -> NbdConnection:
        if self.socket_dir is not None:
            sock = self._socket(process_id(self._key_of(exp), exp.host))
            return NbdConnection(socket=str(sock), export=exp.name)
        if self.tls == "x509":
            return NbdConnection(host=self.advertise_host, port=exp.port, export=exp.name, tls="x509")
        if self.tls == "psk" and exp.psk is not None:
            return NbdConnection(host=self.advertise_host, port=exp.port, export=exp.name, tls="psk",
                                 tls_psk_identity=exp.host, tls_psk_key=SecretStr(exp.psk))
        return NbdConnection(host=self.advertise_host, port=exp.port, export=exp.name)

    @staticmethod
    def _key_of(exp: HostExport) -> str:
        return exp.name.rsplit("-", 1)[0]
