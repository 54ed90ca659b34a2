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
import secrets
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
    DesiredExports,
    ServedKey,
    advertised_host,
    check_host,
    check_key,
    check_port,
    checked_source,
)
from vbs.system.daemons import START_TIMEOUT_S
from vbs.system.desired_state import DesiredState
from vbs.system.socket_paths import socket_path
from vbs.wire.connection import NBD_SOCKET_RE, HostIdentity, NbdConnection
from vbs.wire.storage import ExportInfo

from .process import TlsMode
from .processes import Processes
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


class NbdkitExportDriver(DesiredExports[Served]):
    """Export driver for NBD through one nbdkit per (key, host); see the module docstring."""

    protocol = "nbd"

    def __init__(self, state_dir: Path, listen_host: str = "127.0.0.1", port: int = 10809,
                 tls: TlsMode = "off", *, advertise_host: str | None = None, x509: X509Files | None = None,
                 socket_dir: Path | None = None, threads: int = 16, cache: str = "default", ports: int = 256,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        """``port``: the first of ``ports`` TCP ports the processes take, one each. ``tls``: ``x509``
        (needs ``x509``: this node's certificate, key and the install's CA), ``psk`` or ``off``.
        ``socket_dir``: unix sockets there instead of TCP (no TLS: the directory's mode is the boundary)."""
        options = NbdkitOptions(threads=threads, cache=cache, ports=ports)
        if not LISTEN_RE.fullmatch(listen_host):
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
        self.threads, self.cache = options.threads, options.cache
        self._processes = Processes(self.state_dir, listen_host=listen_host, ports=self.ports, tls=self.tls,
                                    x509=x509, socket_dir=self.socket_dir, threads=options.threads,
                                    cache=options.cache, start_timeout=start_timeout)
        self.run_dir, self.tls_dir = self._processes.run_dir, self._processes.tls_dir
        self.state_path = self.state_dir / "exports.json"
        self._state = DesiredState(self.state_path, Served, version=STATE_VERSION)
        self._lock = threading.RLock()
        self._desired: dict[str, Served] = {}
        self._loaded = False

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
            return self._processes.pid(key, host_name)

    def log_path(self, key: str, host_name: str) -> Path:
        return self._processes.log_path(key, host_name)

    def _free_port(self) -> int:
        return self._processes.free_port({e.port for s in self._desired.values() for e in s.exports})

    # -- the daemons' life (ExportDriver) --------------------------------------------------------------

    def start(self) -> None:
        """Adopt every process an earlier agent left serving, start the others, and stop those it
        left that serve no desired export (fail closed: none outlives its attachment)."""
        with self._lock:
            self._load()
            known = {process_id(s.key, e.host) for s in self._desired.values() for e in s.exports}
            for pid in self._processes.end_unknown(known):
                log.warning("stopped nbdkit process %s: it served no export this agent knows", pid)
        self.check()

    def check(self) -> None:
        """Start again every process that should run and does not (same port, name and credentials:
        clients reconnect)."""
        with self._lock:
            self._load()
            failed: list[str] = []
            for served in list(self._desired.values()):
                for exp in served.exports:
                    try:
                        self._processes.run(served, exp)
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
                    self._processes.stop(served, exp)

    def close(self) -> None:
        """Let go of the processes without stopping them: the next agent adopts them."""
        with self._lock:
            self._processes.forget()

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
                    self._processes.end(key, host.name)
                    exp.address = host.address
                    self._save()
                self._processes.run(served, exp)
                return self._connection(served, exp)
            exp = HostExport(host=host.name, address=host.address, read_only=read_only,
                             name=f"{key}-{secrets.token_hex(16)}",
                             port=self._free_port() if self.socket_dir is None else None,
                             psk=secrets.token_hex(32) if self.tls == "psk" else None)
            served.exports.append(exp)
            self._desired[key] = served
            self._save()  # first: a crash from here on leaves an export check() re-creates
            try:
                self._processes.run(served, exp)
            except BaseException:
                served.exports.remove(exp)
                if not served.exports:
                    del self._desired[key]
                self._save()
                self._processes.end(key, host.name)
                raise
            log.info("exported %s to %s through nbdkit (tls=%s)", key, host.name, self.tls)
            return self._connection(served, exp)

    def remove_export(self, key: str, host_name: str) -> None:
        """Withdraw ``host_name``'s export of ``key``: its process stops; idempotent."""
        with self._desired_for(key, host_name) as served:
            exp = served.export_for(host_name) if served is not None else None
            if served is not None and exp is not None:
                served.exports.remove(exp)
                if not served.exports:
                    del self._desired[key]
                self._save()
            self._processes.end(key, host_name)
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
            self._processes.run(served, exp)
            return self._connection(served, exp)

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
                    if self._processes.serving(served, exp):
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
        return checked

    def _connection(self, served: Served, exp: HostExport) -> NbdConnection:
        sock = self._processes.socket(process_id(served.key, exp.host))
        if sock is not None:
            return NbdConnection(socket=str(sock), export=exp.name)
        if self.tls == "x509":
            return NbdConnection(host=self.advertise_host, port=exp.port, export=exp.name, tls="x509")
        if self.tls == "psk" and exp.psk is not None:
            return NbdConnection(host=self.advertise_host, port=exp.port, export=exp.name, tls="psk",
                                 tls_psk_identity=exp.host, tls_psk_key=SecretStr(exp.psk))
        return NbdConnection(host=self.advertise_host, port=exp.port, export=exp.name)
