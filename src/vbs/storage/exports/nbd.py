"""NBD exports from one long-lived qemu-storage-daemon (QSD) per storage agent, driven over QMP.

Each key (a volume, or a snapshot a hypervisor copies into) is opened once, as a *chain* of a file
node and a raw node, and every host's NBD export of that key is added on that one chain, under its
own random name; TLS-PSK is optional. The daemon also takes point-in-time copies of what it serves.

Access control (measured on QEMU 7.2, the version installed here). The NBD server is one per
daemon and answers ``NBD_OPT_LIST`` with every export, and QEMU has no per-export ACL: a client
that can open a session can list and open every export. So who can open a session is the
boundary; export names (``<key>-<128-bit random token>`` per attachment) only make a host that asks
for a name it was not given (a typo, a stale id) fail rather than reach the wrong volume. Modes:

* Unix socket (``socket_dir``): the daemon listens on ``<socket_dir>/nbd.sock`` in a 0700
  directory; only processes of the daemon's user (QEMU on the same machine) can connect. ``vbs up``.
* TLS with X.509 (``tls="x509"``, the default over TCP): the daemon presents the storage node's
  certificate and requires a client certificate from the same CA (``verify-peer``); plaintext
  clients are refused before any option, listing included. A ``tls-authz`` list admits only the
  client certificates whose DN is ``CN=<host>`` of a host with at least one export here: it is an
  ``authz-list`` object made over QMP, replaced whenever that set of hosts changes (QEMU looks it
  up by id at every handshake; while it is absent every client is refused). A host that holds an
  export here can still list and open other hosts' exports on this daemon (the authz list is
  server-wide); strict per-host isolation would need one daemon per host.
* TLS-PSK (``tls="psk"``): each host gets its own PSK identity (its host name) and a 256-bit key,
  kept in ``<state_dir>/tls/keys.psk`` only while the host has at least one export here. GnuTLS
  reads that file at every handshake, so a host is admitted as soon as its key is written and
  refused for new sessions as soon as its last export is removed. ``tls-authz`` ignores PSK
  identities on 7.2, so the same server-wide caveat holds.
* Plain TCP (``tls="off"``): the bind address is the only isolation; the storage agent allows it
  only with ``insecure`` and says so at every start.

Other choices: desired chains and exports are kept in memory and in ``<state_dir>/exports.json``
(mode 0600), keys only in ``keys.psk``. That way ``check()`` can rebuild a dead daemon, and a
restarted agent can adopt a running one, with the same names and keys, so connected clients just
reconnect. Removal uses ``block-export-del`` mode ``hard``. The controller removes an export only
after the host unplugged the disk. Any client still connected at that point (a forced detach) must
be cut off, or the volume could never be deleted.

Online resize (measured on QEMU 7.2): an NBD export's size is fixed when it is added, and a node
opened before the file grew keeps its old size (``block_resize`` on it is refused: the export's
BlockBackend does not share ``resize``; a second export on the same node has the old size too). So
``refresh_export`` gives the host a new export, under a new name, on a chain that has the file's
current size: the key's newest chain if it has (another host refreshed first), else a new chain
opened on the grown file, the key's next *generation*. The host's older export keeps serving until
it moved over and ``retire_exports`` removes it; a chain that no export and no copy uses is closed.
Two chains on one file in one daemon are fine (no lock conflict: none of them takes ``resize``).

Point-in-time copies (``ensure_copy``): ``blockdev-backup`` (``sync=full``) from the key's newest
chain into a file node on the target. QEMU puts a copy-before-write filter above the chain's raw
node: a write from any export reaches the volume only after the old data went to the target, so
the target is the volume at the instant the job started. Exports added while a copy runs go on the
filter (an export added on the raw node below it is refused: the filter does not share ``write``);
when the job ends QEMU drops the filter and the exports move back to the raw node. A job writes the
source's zero regions with write-zeroes without MAY_UNMAP, so on ext4/xfs the target is allocated
(unwritten extents) for its whole size: the caller punches those out afterwards. A copy cannot
survive its daemon: one whose job is gone is an error (its instant is lost), never restarted.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from vbs import ids
from vbs.config import StorageAgentConfig
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, NotFound, RetryLater
from vbs.qemu.qmp import QmpClient, QmpCommandError, QmpConnectionError, QmpError, connect_until
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.storage.exports.base import ExportSource, FileSource
from vbs.storage.exports.nodelay import force_nodelay
from vbs.storage.exports.supervised import (
    LISTEN_RE,
    ServedImage,
    ServedKey,
    SupervisedExportDriver,
    check_key,
    file_size,
    source_file,
    source_size,
)
from vbs.system.daemons import DaemonSpec, argv0_is
from vbs.system.desired_state import DesiredState
from vbs.system.files import fsync_path, write_private
from vbs.system.processes import minimal_environment
from vbs.system.socket_paths import socket_path
from vbs.wire.connection import NBD_SOCKET_RE, Connection, HostIdentity, NbdConnection
from vbs.wire.qos import VOLUME_TYPE_RE, ExportLimits, QoS, throttle_limits
from vbs.wire.storage import ExportInfo, ItemStatus

__all__ = ["NbdExportDriver", "TlsMode"]

TlsMode = Literal["x509", "psk", "off"]

log = logging.getLogger(__name__)

QSD = "qemu-storage-daemon"
_ID_PREFIX = "vbs_"  # "_" never occurs in a key or a host name, so ids split back unambiguously
_JOB_PREFIX = "vbs_copy_"
_STATE_VERSION = 2
_AUTHZ_ID = "vbsauthz"
_INTERRUPTED = "the copy was interrupted; its point in time is lost"


# -- desired state ------------------------------------------------------------------------------


class _Chain(BaseModel):
    """One opening of the key's file in the daemon: a file node, a raw node on it, and above it the
    throttle node of the key's own group, then (where the node shares out its volume type) the one of
    the type's fair-dispatch group. Chains of state files older than QoS have no throttle node."""

    gen: int = Field(ge=0)
    read_only: bool
    size: int | None = None  # bytes the raw node had when the daemon last opened it (None: unknown)
    file_node: str
    raw_node: str
    throttle_node: str | None = None
    fair_node: str | None = None
    fair_group: str | None = None

    def top(self) -> str:
        """The node exports go on."""
        return self.fair_node or self.throttle_node or self.raw_node

    def nodes(self) -> tuple[str, ...]:
        """Its nodes, each before its child (the order they are deleted in)."""
        return tuple(n for n in (self.fair_node, self.throttle_node, self.raw_node, self.file_node) if n)


class _HostExport(BaseModel):
    """One host's NBD export of the key, on the chain of generation ``gen``."""

    host: str
    gen: int = Field(ge=0)
    read_only: bool
    name: str  # the NBD export name: the per-attachment secret-ish handle
    id: str  # QEMU's block export id


class _Copy(BaseModel):
    """A point-in-time copy that was started (never re-created: its job cannot outlive the daemon)."""

    id: str
    gen: int = Field(ge=0)  # the chain it copies
    target: str
    size: int
    outcome: Literal["copying", "ready", "error"] = "copying"
    error: str | None = None


class _Served(ServedKey):
    """Everything the daemon should hold of one key."""

    chains: list[_Chain] = Field(default_factory=list)
    exports: list[_HostExport] = Field(default_factory=list)
    copies: list[_Copy] = Field(default_factory=list)
    limits: ExportLimits | None = None  # what every export of the key may do together (None: unlimited)

    def chain(self, gen: int) -> _Chain | None:
        return next((c for c in self.chains if c.gen == gen), None)

    def newest(self) -> _Chain | None:
        return max(self.chains, key=lambda c: c.gen, default=None)

    def current(self, host: str) -> _HostExport | None:
        """The host's newest export: what ``ensure_export`` answers."""
        return max((e for e in self.exports if e.host == host), key=lambda e: e.gen, default=None)

    def next_gen(self) -> int:
        return 1 + max([c.gen for c in self.chains] + [c.gen for c in self.copies], default=-1)


def _export_id(key: str, host: str, gen: int) -> str:
    return f"{_ID_PREFIX}{key}_{host}_{gen}"


def _key_host(export_id: str) -> tuple[str, str] | None:
    """(key, host) of one of our export ids (also those of earlier versions), None for anyone else's."""
    if not export_id.startswith(_ID_PREFIX) or export_id.startswith(_JOB_PREFIX):
        return None
    parts = export_id[len(_ID_PREFIX):].split("_")
    if len(parts) == 2 or (len(parts) == 3 and parts[2].isdigit()):
        return parts[0], parts[1]
    return None


def _hashed(text: str) -> str:
    # QEMU caps node names at 31 characters, too short for a key plus a 63-character host name:
    # a hash keeps them deterministic ("vbs" + one letter + 24 hex digits).
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _new_chain(key: str, gen: int, read_only: bool, fair_group: str | None) -> _Chain:
    h = _hashed(f"{key}/{gen}")
    return _Chain(gen=gen, read_only=read_only, file_node=f"vbsf{h}", raw_node=f"vbsr{h}", throttle_node=f"vbsq{h}",
                  fair_node=f"vbsp{h}" if fair_group else None, fair_group=fair_group)


def _group_id(key: str) -> str:
    """The throttle group of one key: every export of it, on every chain, shares its limits."""
    return f"vbsg{_hashed(key)}"


def _fair_group_id(volume_type: str) -> str:
    return f"vbsfair-{volume_type}"


_MAX_PENDING_LIMITS = 4096  # limits set for keys whose export has not been asked for yet
_CHAIN_PREFIXES = ("vbsp", "vbsq", "vbsr", "vbsf")  # a chain's nodes: the same hash after these


def _copy_names(copy_id: str) -> tuple[str, str, str]:
    """The job id, target node and copy-before-write filter node of a copy."""
    h = _hashed(copy_id)
    return f"{_JOB_PREFIX}{copy_id}", f"vbst{h}", f"vbsc{h}"


def _upgrade_v1(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Version 1 had one chain per (volume, host, generation). Each becomes a chain of its own with
    the same node names and export id, so a daemon adopted under running exports serves on
    untouched; later exports of the volume go on its newest chain."""
    olds: dict[str, list[dict[str, Any]]] = {}
    for item in data["exports"]:
        olds.setdefault(str(item["volume_id"]), []).append(item)
    items: list[dict[str, Any]] = []
    for key, group in olds.items():
        group.sort(key=lambda x: (int(x.get("gen", 0)), str(x["host"])))
        chains: list[dict[str, Any]] = []
        exports: list[dict[str, Any]] = []
        gen = -1
        for old in group:
            legacy_gen = int(old.get("gen", 0))
            # Never below the export's own generation: the ids of later exports
            # (vbs_<key>_<host>_<chain>) then never meet an adopted one.
            gen = max(gen + 1, legacy_gen)
            export_id = f"{_ID_PREFIX}{key}_{old['host']}" + (f"_{legacy_gen}" if legacy_gen else "")
            h = _hashed(export_id)
            chains.append({"gen": gen, "read_only": old["read_only"], "size": old.get("size"),
                           "file_node": f"vbsf{h}", "raw_node": f"vbsr{h}"})
            exports.append({"host": old["host"], "gen": gen, "read_only": old["read_only"],
                            "name": old["name"], "id": export_id})
        items.append({"key": key, "path": group[-1]["path"], "chains": chains, "exports": exports})
    return items


# -- what the daemon has --------------------------------------------------------------------------


@dataclass
class _Job:
    status: str
    error: str | None
    done: int
    total: int

    def percent(self) -> int:
        # Never 100 while it runs: 100 is for a finished copy.
        return min(99, self.done * 100 // self.total) if self.total else 0


@dataclass
class _Live:
    exports: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> query-block-exports entry
    nodes: dict[str, int | None] = field(default_factory=dict)  # node name -> virtual size
    jobs: dict[str, _Job] = field(default_factory=dict)  # our copy jobs by job id
    groups: set[str] = field(default_factory=set)  # throttle groups (QOM objects) the daemon has


def _fits(chain: _Chain, read_only: bool, size: int) -> bool:
    """Whether a host's export may go on ``chain``: the file's current size, and writable if needed."""
    return chain.size == size and (read_only or not chain.read_only)


# -- the driver -----------------------------------------------------------------------------------


class NbdExportDriver(SupervisedExportDriver[_Served, _Live]):
    """Export driver for NBD through one qemu-storage-daemon; see the module docstring."""

    protocol = "nbd"
    formats = ("raw", "qcow2")

    def __init__(self, state_dir: Path, listen_host: str = "127.0.0.1", port: int = 10809,
                 tls: TlsMode | bool = "off", aio: str = "native", cache_direct: bool = True, *,
                 advertise_host: str | None = None, qmp_timeout: float = 30.0, start_timeout: float = 15.0,
                 copy_speed: int = 0, x509: X509Files | None = None, socket_dir: Path | None = None,
                 fair_share: dict[str, QoS] | None = None) -> None:
        """``tls``: ``x509`` (needs ``x509``: this node's certificate, key and CA), ``psk``, or
        ``off`` (True and False are ``psk`` and ``off``). ``socket_dir``: listen on a unix socket
        there instead of TCP (no TLS then: the directory's mode is the boundary). ``fair_share``: per
        volume type, the limits all of this node's volumes of that type share, dispatched round-robin
        between them (QEMU's throttle groups); a type not named has no shared group."""
        if aio not in ("native", "threads", "io_uring"):
            raise InvalidParameter(f"aio must be native, threads or io_uring, not {aio!r}")
        if aio == "native" and not cache_direct:
            # QEMU refuses aio=native without O_DIRECT; say so at configuration time.
            raise InvalidParameter("aio=native requires cache_direct=True")
        if not LISTEN_RE.match(listen_host):
            raise InvalidParameter(f"invalid listen_host: {listen_host[:80]!r}")
        if "," in str(state_dir):
            # QEMU's option syntax would split the path there.
            raise InvalidParameter(f"state_dir must not contain a comma: {state_dir}")
        if copy_speed < 0:
            raise InvalidParameter(f"copy_speed must be 0 (unlimited) or bytes per second, not {copy_speed}")
        state_dir = Path(state_dir)
        mode: TlsMode = ("psk" if tls else "off") if isinstance(tls, bool) else tls
        if mode not in ("x509", "psk", "off"):
            raise InvalidParameter(f"nbd tls must be x509, psk or off, not {mode!r}")
        self.socket_dir = Path(socket_dir).absolute() if socket_dir is not None else None
        self.socket = socket_path(self.socket_dir, "nbd.sock") if self.socket_dir is not None else None
        if self.socket is not None and ("," in str(self.socket) or not NBD_SOCKET_RE.fullmatch(str(self.socket))):
            raise InvalidParameter(f"unusable NBD socket path {self.socket} (plain components, no comma)")
        self.tls: TlsMode = "off" if self.socket is not None else mode
        if self.tls == "x509" and x509 is None:
            raise InvalidParameter("NBD TLS with X.509 needs this node's certificate, key and CA")
        self.x509 = x509
        self.x509_dir = state_dir / "x509"
        self.aio, self.cache_direct = aio, cache_direct  # how file nodes open their files
        self.qmp_timeout, self.start_timeout = qmp_timeout, start_timeout
        self.copy_speed = copy_speed
        self.fair_share = _checked_fair_share(fair_share or {})
        self._pending_limits: dict[str, ExportLimits] = {}  # set before the key's first export
        self.qmp_path = socket_path(state_dir, "qsd.qmp")
        self.tls_dir = state_dir / "tls"
        self.keys_path = self.tls_dir / "keys.psk"
        self._qmp: QmpClient | None = None
        self._keys: dict[str, str] = {}  # host name -> hex PSK
        state = DesiredState(state_dir / "exports.json", _Served, version=_STATE_VERSION, upgrades={1: _upgrade_v1})
        super().__init__(state_dir, state, listen_host=listen_host, port=port, advertise_host=advertise_host)

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, state_dir: Path) -> NbdExportDriver:
        """``export_host``, ``nbd_port`` and ``nbd_tls``; ``aio``, ``cache_direct`` and ``copy_speed``
        (bytes/s) from ``[storage_agent.options.nbd]``."""
        opts = _NbdOptions.model_validate(cfg.options.get("nbd", {}))
        x509 = X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        tls: TlsMode = cfg.nbd_tls
        if cfg.nbd_socket_dir is None and tls == "x509" and x509 is None:
            if not cfg.insecure:
                raise InvalidParameter(
                    "NBD over TCP needs TLS: set tls_cert, tls_key and tls_ca of [storage_agent] (X.509, the "
                    "default), or nbd_tls = \"psk\", or nbd_socket_dir (hypervisor on this machine), or run "
                    "--insecure")
            tls = "off"
        if cfg.nbd_socket_dir is None and tls == "off":
            if not cfg.insecure:
                raise InvalidParameter("nbd_tls = \"off\" (plain NBD over TCP) is allowed only with --insecure")
            log.warning("INSECURE: NBD exports are served over plain TCP on %s:%d: anyone who reaches that "
                        "address can list, read and write every export", cfg.export_host, cfg.nbd_port)
        return cls(state_dir, listen_host=cfg.export_host, port=cfg.nbd_port, tls=tls, aio=opts.aio,
                   cache_direct=opts.cache_direct, copy_speed=opts.copy_speed, x509=x509,
                   socket_dir=cfg.nbd_socket_dir, fair_share=opts.fair_share)

    def _daemon_spec(self) -> DaemonSpec:
        pid_path = self.state_dir / "qsd.pid"
        if self.socket is not None:
            nbd = f"addr.type=unix,addr.path={self.socket}"
        else:
            nbd = f"addr.type=inet,addr.host={self.listen_host},addr.port={self.port}"
        argv = [QSD, "--chardev", f"socket,path={self.qmp_path},server=on,wait=off,id=m", "--monitor", "chardev=m"]
        if self.tls == "psk":
            argv += ["--object", f"tls-creds-psk,id=tls0,endpoint=server,dir={self.tls_dir}"]
            nbd += ",tls-creds=tls0"
        elif self.tls == "x509":
            # verify-peer: a client must present a certificate from the CA; the authz list (made
            # over QMP, see _write_authz) then admits only hosts with an export here.
            argv += ["--object", f"tls-creds-x509,id=tls0,endpoint=server,dir={self.x509_dir},verify-peer=on"]
            nbd += f",tls-creds=tls0,tls-authz={_AUTHZ_ID}"
        argv += ["--nbd-server", nbd, "--pidfile", str(pid_path)]
        stale = (self.qmp_path,) if self.socket is None else (self.qmp_path, self.socket)
        return DaemonSpec(name=QSD, argv=tuple(argv), pid_path=pid_path, log_path=self.state_dir / "qsd.log",
                          owns=self._owns, writes_pidfile=True, start_timeout=self.start_timeout,
                          stale_files=stale, env=minimal_environment())

    def _owns(self, pid: int) -> bool:
        """A live qemu-storage-daemon with our monitor socket (guards against a reused PID)."""
        return argv0_is(pid, QSD, mentions=str(self.qmp_path))

    # -- the daemon (hooks of SupervisedExportDriver) ------------------------------------------------

    def _ready(self, deadline: float) -> None:
        self._qmp = connect_until(self.qmp_path, deadline, alive=self._daemon.running, name="vbs-nbd",
                                  timeout=self.qmp_timeout)

    def _take_over(self) -> bool:
        client = QmpClient(self.qmp_path, name="vbs-nbd", timeout=self.qmp_timeout)
        try:
            client.execute("query-version")
        except QmpError as exc:
            client.close()
            pid = self._daemon.pid
            self._daemon.forget()
            # The monitor takes one client at a time: most likely another agent still drives this
            # daemon. Killing it would cut every attached host, so an operator decides.
            raise DriverError(
                f"{QSD} pid {pid} is alive but its monitor does not answer ({exc.message}); "
                "is another storage agent using it? Stop that agent or the daemon, then retry") from exc
        self._qmp = client
        return True

    def _daemon_up(self) -> None:
        """The authz list of an X.509 daemon; TCP_NODELAY (QEMU 7.2's NBD server leaves Nagle on,
        which stalls QEMU's NBD client)."""
        if self.tls == "x509":
            self._write_authz()
        pid = self._daemon.pid
        if pid is None or self.socket is not None:
            return
        try:
            force_nodelay(pid)
        except OSError as exc:
            log.warning("could not set TCP_NODELAY on %s %d (%s): small random I/O through QEMU's NBD "
                        "client will be slow", QSD, pid, exc.strerror or exc)

    def _probe(self) -> None:
        self._q("query-version")

    def _ask_exit(self) -> bool:
        # Also a daemon found only by its pidfile (a fresh driver stopping what an earlier agent
        # left). A monitor that does not answer raises: then SIGTERM follows at once.
        self._qmp = self._qmp or QmpClient(self.qmp_path, name="vbs-nbd", timeout=self.qmp_timeout)
        self._qmp.execute("quit", timeout=5.0)
        return True

    def _let_go(self) -> None:
        if self._qmp is not None:
            self._qmp.close()
        self._qmp = None

    def _loaded_state(self) -> None:
        if self.socket_dir is not None:
            # The boundary of a unix-socket export: only this user may enter the directory.
            for d in {self.socket_dir, Path(str(self.socket)).parent}:
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
                d.chmod(0o700)
        if self.tls == "x509":
            assert self.x509 is not None
            qemu_x509_dir(self.x509, self.x509_dir, "server")
        if self.tls != "psk":
            return
        # A host with no export keeps no key (a crash came between removing its last export and
        # dropping the key); one with exports and no key (TLS was just turned on) gets one. The
        # file is written even when empty: QSD refuses to start without it.
        keys = self._read_keys()
        self._keys = {h: keys.get(h) or secrets.token_hex(32) for h in sorted(self._hosts_with_exports())}
        self._write_keys()

    def _view(self) -> _Live:
        if not self._running() or self._qmp is None:
            return _Live()
        jobs = {j["id"]: _Job(status=j["status"], error=j.get("error"), done=int(j["current-progress"]),
                              total=int(j["total-progress"]))
                for j in self._q("query-jobs") if str(j["id"]).startswith(_JOB_PREFIX)}
        return _Live(exports=self._live_exports(), nodes=self._live_nodes(), jobs=jobs, groups=self._live_groups())

    def _restore(self, item: _Served, view: _Live) -> None:
        """Every chain an export uses and every export (older generations too: their host may not
        have moved yet); chains held only by copy jobs that died with a daemon are forgotten."""
        changed = False
        for exp in item.exports:
            changed = self._open_export(item, exp, view) or changed
        if self._collect(item, view) or changed:
            self._save()

    # -- QMP ----------------------------------------------------------------------------------------

    def _q(self, command: str, args: dict[str, Any] | None = None) -> Any:
        if self._qmp is None:
            raise DriverError(f"{QSD} is not running")
        return self._qmp.execute(command, args, timeout=self.qmp_timeout)

    def _live_exports(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in self._q("query-block-exports")}

    def _live_groups(self) -> set[str]:
        try:
            objects = self._q("qom-list", {"path": "/objects"})
        except QmpCommandError as exc:
            if exc.error_class != "DeviceNotFound":
                raise
            return set()  # QEMU makes /objects with the daemon's first object
        return {str(o["name"]) for o in objects if str(o.get("type", "")) == "child<throttle-group>"}

    def _live_nodes(self) -> dict[str, int | None]:
        return {n["node-name"]: n.get("image", {}).get("virtual-size")
                for n in self._q("query-named-block-nodes", {"flat": True})}

    def _file_attempts(self) -> list[tuple[bool, str]]:
        attempts = [(self.cache_direct, self.aio)]
        if self.aio != "threads":
            attempts.append((self.cache_direct, "threads"))
        if self.cache_direct:
            attempts.append((False, "threads"))  # a filesystem without O_DIRECT (tmpfs)
        return attempts

    def _add_file_node(self, node: str, path: str, *, read_only: bool, what: str, buffered: bool = False) -> None:
        """A file node in the configured mode, or the first fallback the file system takes; ``buffered``:
        through the page cache whatever the mode (``cache.direct`` off, ``aio=threads``)."""
        err: QmpCommandError | None = None
        for direct, aio in [(False, "threads")] if buffered else self._file_attempts():
            try:
                self._q("blockdev-add", {
                    "driver": "file", "node-name": node, "filename": path, "cache": {"direct": direct},
                    "aio": aio, "read-only": read_only,
                    "discard": "unmap",  # guest TRIM punches holes: files stay thin
                })
            except QmpCommandError as exc:
                err = err or exc
                log.info("%s: file node with cache.direct=%s aio=%s refused: %s", what, direct, aio, exc.desc)
                continue
            if (direct, aio) != (self.cache_direct, self.aio):
                log.warning("%s: serving with cache.direct=%s aio=%s (configured mode refused)", what, direct, aio)
            return
        assert err is not None
        raise DriverError(f"cannot open {path} for {what}: {err.desc}") from err

    def _add_rbd_node(self, node: str, image: ServedImage, *, read_only: bool, what: str) -> None:
        """A node on an RBD image, opened by the daemon's librbd. The cephx key is read by librbd
        from the keyring file the conf names: nothing secret crosses QMP or lands in a log.
        ``cache.direct`` turns librbd's write-back cache off: a write is acknowledged once the
        OSDs have it, as a file node's O_DIRECT write is once the disk has it."""
        try:
            self._q("blockdev-add", {
                "driver": "rbd", "node-name": node, "pool": image.pool, "image": image.image,
                "conf": image.conf, "user": image.user, "cache": {"direct": self.cache_direct},
                "read-only": read_only, "discard": "unmap",
            })
        except QmpCommandError as exc:
            raise DriverError(f"cannot open the RBD image {image.pool}/{image.image} for {what}: {exc.desc}") from exc

    def _del_nodes(self, nodes: Iterable[str], live: _Live) -> None:
        """Delete those of ``nodes`` the daemon has, in order (a parent before its child)."""
        for node in nodes:
            if node in live.nodes:
                self._q("blockdev-del", {"node-name": node})
                del live.nodes[node]

    # -- chains and exports in the daemon --------------------------------------------------------------

    def _open_chain(self, served: _Served, chain: _Chain, live: _Live) -> bool:
        """Open ``chain`` unless the daemon has it; returns whether its size changed (save it: a
        refresh compares it with the file's)."""
        if chain.top() in live.nodes:
            return False
        # Leftovers of an interrupted attempt (a raw node that has a parent, a copy's filter, stays).
        self._del_nodes(tuple(n for n in (chain.fair_node, chain.throttle_node) if n), live)
        if chain.raw_node not in live.nodes:
            self._open_format(served, chain, live)
        try:
            self._open_throttles(served, chain, live)
        except QmpError:
            live.nodes = self._live_nodes()
            self._del_nodes(chain.nodes(), live)
            raise
        live.nodes = self._live_nodes()
        # The chain serves the size its node had when it was opened, for good.
        size = live.nodes.get(chain.raw_node)
        changed, chain.size = size != chain.size, size
        return changed

    def _open_format(self, served: _Served, chain: _Chain, live: _Live) -> None:
        """The chain's file (or RBD) node and its format node."""
        self._del_nodes((chain.file_node,), live)  # the leftover of an interrupted attempt
        if served.rbd is not None:
            self._add_rbd_node(chain.file_node, served.rbd, read_only=chain.read_only, what=served.key)
        else:
            self._add_file_node(chain.file_node, served.path, read_only=chain.read_only, what=served.key)
        try:
            # The format node: raw, or qcow2 for an image of the command backend's qemu-img profile.
            self._q("blockdev-add", {"driver": served.format, "node-name": chain.raw_node, "file": chain.file_node,
                                     "read-only": chain.read_only, "discard": "unmap"})
        except QmpError:
            live.nodes[chain.file_node] = None
            self._del_nodes((chain.file_node,), live)
            raise
        live.nodes[chain.raw_node] = None

    def _open_throttles(self, served: _Served, chain: _Chain, live: _Live) -> None:
        """The key's throttle node on the raw node, the fair-dispatch one on it; their groups first.
        A point-in-time copy's filter goes above them (below, QEMU 7.2 aborts when two stacked
        filters are dropped): the copy reads through the volume's limits, as a hypervisor's would."""
        if chain.throttle_node is None:
            return
        group = _group_id(served.key)
        self._set_group(group, served.limits.qos if served.limits else None, live)
        self._q("blockdev-add", {"driver": "throttle", "node-name": chain.throttle_node, "throttle-group": group,
                                 "file": chain.raw_node, "read-only": chain.read_only})
        live.nodes[chain.throttle_node] = None
        if chain.fair_node is None or chain.fair_group is None:
            return
        fair_type = chain.fair_group.removeprefix(_fair_group_id(""))
        self._set_group(chain.fair_group, self.fair_share.get(fair_type), live)
        self._q("blockdev-add", {"driver": "throttle", "node-name": chain.fair_node, "throttle-group": chain.fair_group,
                                 "file": chain.throttle_node, "read-only": chain.read_only})
        live.nodes[chain.fair_node] = None

    def _set_group(self, group: str, qos: QoS | None, live: _Live) -> None:
        """Make the throttle group, or change its limits in place (members keep their queued I/O)."""
        limits = throttle_limits(qos)
        if group in live.groups:
            self._q("qom-set", {"path": f"/objects/{group}", "property": "limits", "value": limits})
            return
        self._q("object-add", {"qom-type": "throttle-group", "id": group, "limits": limits})
        live.groups.add(group)

    def _fair_group(self, served: _Served) -> str | None:
        volume_type = served.limits.volume_type if served.limits else None
        return _fair_group_id(volume_type) if volume_type in self.fair_share else None

    # -- limits (vbs.storage.exports.base.LimitEnforcer) ------------------------------------------------

    def set_limits(self, key: str, limits: ExportLimits) -> bool:
        """See ``LimitEnforcer``: recorded with the key (``exports.json``), applied to its group live.
        A key not served yet keeps them until its first export. A chain's fair-dispatch group is the
        one of the type the key had when the chain was opened (a type change moves it at its next
        chain: after a resize or a re-attach)."""
        check_key(key)
        with self._lock:
            self._up()
            served = self._desired.get(key)
            if served is None:
                self._pending_limits.pop(key, None)
                self._pending_limits[key] = limits
                while len(self._pending_limits) > _MAX_PENDING_LIMITS:
                    # Keys never exported after all (a native RBD connection): the oldest go.
                    del self._pending_limits[next(iter(self._pending_limits))]
                return True
            served.limits = limits
            self._save()
            live = self._view()
            if any(c.top() in live.nodes for c in served.chains):
                self._set_group(_group_id(key), limits.qos, live)
            log.info("limits of %s: %s", key, limits.qos.model_dump(exclude_none=True) if limits.qos else "none")
            return all(c.throttle_node is not None for c in served.chains)

    def _top(self, served: _Served, chain: _Chain, live: _Live) -> str:
        """The node exports of ``chain`` go on: the filter of the oldest copy that runs on it (copy
        filters stack below the first one), else the chain's top node."""
        for copy in served.copies:
            filter_node = _copy_names(copy.id)[2]
            if copy.gen == chain.gen and filter_node in live.nodes:
                return filter_node
        return chain.top()

    def _open_export(self, served: _Served, exp: _HostExport, live: _Live, *, replace: bool = False) -> bool:
        """Add ``exp`` (and its chain) unless the daemon has it; returns whether a chain size changed.

        ``replace``: an export with this id that the daemon has is not ``exp`` (its name was lost
        with the state file), so it is replaced rather than trusted.
        """
        if exp.id in live.exports:
            if not replace and not live.exports[exp.id].get("shutting-down"):
                return False
            self._close_export(exp.id, live)
        chain = served.chain(exp.gen)
        if chain is None:
            raise DriverError(f"export {exp.id} names chain {exp.gen} of {served.key}, which is not in the state")
        changed = self._open_chain(served, chain, live)
        node = self._top(served, chain, live)
        self._q("block-export-add", {"type": "nbd", "id": exp.id, "node-name": node, "name": exp.name,
                                     "writable": not exp.read_only})
        live.exports[exp.id] = {"id": exp.id, "node-name": node}
        return changed

    def _close_export(self, export_id: str, live: _Live) -> None:
        qmp = self._qmp
        if qmp is None or export_id not in live.exports:
            return
        mark = qmp.event_mark()
        try:
            # hard: a client still connected (forced detach) is cut off instead of pinning it.
            self._q("block-export-del", {"id": export_id, "mode": "hard"})
        except QmpCommandError as exc:
            if "not found" not in exc.desc:  # raced with its own shutdown: fine
                raise
        try:
            qmp.wait_event("BLOCK_EXPORT_DELETED", lambda e: e.get("data", {}).get("id") == export_id,
                           since=mark, timeout=self.qmp_timeout)
        except QmpConnectionError:
            self._wait_export_gone(export_id)  # event lost (reconnect): the daemon's state decides
        del live.exports[export_id]

    def _wait_export_gone(self, export_id: str) -> None:
        deadline = time.monotonic() + self.qmp_timeout
        while export_id in self._live_exports():
            if time.monotonic() >= deadline:
                raise DriverError(f"export {export_id} still shutting down after {self.qmp_timeout:g}s")
            time.sleep(0.05)

    def _close_unknown(self, key: str, host: str, live: _Live) -> None:
        """Close the exports of (key, host) that the daemon has and the state does not (lost with a
        state file), and the nodes only they used."""
        known = {e.id for s in self._desired.values() for e in s.exports}
        ours = {c.raw_node for s in self._desired.values() for c in s.chains}
        for export_id, info in sorted(live.exports.items()):
            if export_id in known or _key_host(export_id) != (key, host):
                continue
            self._close_export(export_id, live)
            top = str(info.get("node-name", ""))
            in_use = any(e.get("node-name") == top for e in live.exports.values())
            if top[:4] in _CHAIN_PREFIXES and "vbsr" + top[4:] not in ours and not in_use:
                self._del_nodes(tuple(prefix + top[4:] for prefix in _CHAIN_PREFIXES), live)

    def _in_use(self, served: _Served, gen: int, live: _Live) -> bool:
        return any(e.gen == gen for e in served.exports) or any(
            c.gen == gen and _copy_names(c.id)[0] in live.jobs for c in served.copies)

    def _collect(self, served: _Served, live: _Live) -> bool:
        """Close the chains of ``served`` that no export and no copy job uses; forget the key once
        nothing of it is left. Returns whether the desired state changed."""
        changed = False
        for chain in list(served.chains):
            if not self._in_use(served, chain.gen, live):
                self._del_nodes(chain.nodes(), live)  # parents first: each holds the next
                served.chains.remove(chain)
                changed = True
        if not (served.chains or served.exports or served.copies) and self._desired.get(served.key) is served:
            del self._desired[served.key]
            group = _group_id(served.key)
            if group in live.groups:
                self._q("object-del", {"id": group})
                live.groups.discard(group)
            changed = True
        return changed

    def _copying(self, served: _Served, live: _Live) -> bool:
        """Whether a copy of the key runs now (its job is there and has not concluded)."""
        jobs = (live.jobs.get(_copy_names(c.id)[0]) for c in served.copies)
        return any(job is not None and job.status != "concluded" for job in jobs)

    def _add_export(self, served: _Served, host: str, chain: _Chain, read_only: bool, live: _Live) -> _HostExport:
        """A new export for ``host`` on ``chain`` (made if it is not in ``served``), desired first."""
        new_chain = served.chain(chain.gen) is None
        exp = _HostExport(host=host, gen=chain.gen, read_only=read_only,
                          name=f"{served.key}-{secrets.token_hex(16)}", id=_export_id(served.key, host, chain.gen))
        new_key = self.tls == "psk" and host not in self._keys
        new_host = self.tls == "x509" and host not in self._hosts_with_exports()
        if new_chain:
            served.chains.append(chain)
        served.exports.append(exp)
        self._desired[served.key] = served
        if new_key:
            self._keys[host] = secrets.token_hex(32)

        def undo() -> None:
            served.exports.remove(exp)
            try:
                self._close_export(exp.id, live)
                self._collect(served, live)  # closes a chain made for it
            except DriverError as exc:
                log.error("could not remove the half-made export %s: %s", exp.id, exc.message)
            if new_key:
                del self._keys[host]
                self._write_keys()
            if new_host:
                self._write_authz_best_effort()

        # Desired state first: a crash from here on leaves an export that check() or the next
        # start() re-creates, never one the agent does not know about.
        with self._desired_first(undo):
            if new_key:
                self._write_keys()
            if new_host:
                self._write_authz()
            self._open_export(served, exp, live, replace=True)
            self._save()  # with the size of a new chain
        return exp

    # -- the contract (hooks of SupervisedExportDriver) ----------------------------------------------

    def _connection(self, exp: _HostExport) -> NbdConnection:
        if self.socket is not None:
            return NbdConnection(socket=str(self.socket), export=exp.name)
        if self.tls == "x509":
            return NbdConnection(host=self.advertise_host, port=self.port, export=exp.name, tls="x509")
        key = self._keys.get(exp.host) if self.tls == "psk" else None
        return NbdConnection(host=self.advertise_host, port=self.port, export=exp.name,
                             tls_psk_identity=exp.host if key else None,
                             tls_psk_key=SecretStr(key) if key else None)

    def _hosts(self, item: _Served) -> set[str]:
        return {e.host for e in item.exports}

    def _live_keys(self) -> set[str]:
        return {pair[0] for export_id in self._live_exports() if (pair := _key_host(export_id)) is not None}

    def _ensure(self, item: _Served | None, key: str, source: ExportSource, host: HostIdentity, read_only: bool
                ) -> Connection:
        """A name of its own for the host, on the key's newest chain (a new chain if that one is
        stale or read-only for a writer)."""
        served = item or _Served(key=key, **ServedKey.fields_of(source), limits=self._pending_limits.get(key))
        self._pending_limits.pop(key, None)
        cur = served.current(host.name)
        live = self._view()
        if cur is not None:
            if cur.read_only != read_only:
                raise IdempotentParameterMismatch(f"{key} is already exported to {host.name} "
                                                  f"(read_only={cur.read_only}); remove that export first")
            if self._open_export(served, cur, live):
                self._save()
            return self._connection(cur)
        chain = served.newest()
        if chain is None or not _fits(chain, read_only, source_size(key, source)):
            if chain is not None and self._copying(served, live):
                # A new chain would escape the copy-before-write filter of the running copy.
                raise RetryLater(f"a point-in-time copy of {key} is running; a new chain of it must wait")
            chain = _new_chain(key, served.next_gen(), read_only, self._fair_group(served))
        exp = self._add_export(served, host.name, chain, read_only, live)
        log.info("exported %s to %s as NBD export (tls=%s)", key, host.name, self.tls)
        return self._connection(exp)

    def _remove(self, item: _Served | None, key: str, host_name: str) -> None:
        live = self._view()
        # Every export of the pair, also one the state file lost: none must outlive the attachment.
        self._close_unknown(key, host_name, live)
        if item is not None:
            mine = [e for e in item.exports if e.host == host_name]
            for exp in mine:
                self._close_export(exp.id, live)
                item.exports.remove(exp)
            if self._collect(item, live) or mine:
                self._save()
        if host_name in self._hosts_with_exports():
            return
        # The host's last export here: it may not even open a TLS session any more.
        if self.tls == "psk" and host_name in self._keys:
            del self._keys[host_name]
            self._write_keys()
        if self.tls == "x509" and self._running() and self._qmp is not None:  # else made at its next start
            self._write_authz()

    def _list(self) -> list[ExportInfo]:
        desired = {e.id: e for s in self._desired.values() for e in s.exports}
        # One entry per (key, host), as the contract has it: while a refresh is pending the
        # daemon serves two exports of a pair, reported as the newest one it has.
        newest: dict[tuple[str, str], _HostExport | None] = {}
        for export_id in self._live_exports():
            pair = _key_host(export_id)
            if pair is None:
                continue  # not ours (an operator's manual export): not reported
            exp, best = desired.get(export_id), newest.get(pair)
            if pair not in newest or (exp is not None and (best is None or exp.gen > best.gen)):
                newest[pair] = exp
        return [ExportInfo(key=k, host=h, protocol=self.protocol, target=exp.name if exp else "")
                for (k, h), exp in sorted(newest.items())]

    # -- online resize -------------------------------------------------------------------------------

    def _refresh(self, item: _Served, host_name: str, size: int) -> Connection:
        """An export of the file's current size under a new name: on the key's newest chain if it
        has that size, else on a new chain; the older one serves on until retired. ``RetryLater``
        while a copy of the key runs (a new chain would escape its filter)."""
        cur = item.current(host_name)
        assert cur is not None
        live = self._view()
        if self._copying(item, live):
            raise RetryLater(f"a point-in-time copy of {item.key} is running; refresh its exports after it")
        # The current export must serve meanwhile. If the daemon had lost it (restarted before
        # check()), its chain came back with the file's size: then it is the refreshed one already.
        if self._open_export(item, cur, live):
            self._save()
        chain = item.chain(cur.gen)
        if chain is not None and chain.size == size:
            return self._connection(cur)
        newest = item.newest()
        if newest is None or not _fits(newest, cur.read_only, size):
            newest = _new_chain(item.key, item.next_gen(), cur.read_only, self._fair_group(item))
        exp = self._add_export(item, host_name, newest, cur.read_only, live)
        log.info("refreshed the NBD export of %s for %s: chain %d serves %d bytes",
                 item.key, host_name, exp.gen, newest.size or 0)
        return self._connection(exp)

    def _retire(self, item: _Served, host_name: str) -> None:
        """The host's exports older than its current one go (their clients are cut off), and the
        chains nothing uses any more."""
        cur = item.current(host_name)
        live = self._view()
        going = [e for e in item.exports if e.host == host_name and e is not cur]
        self._close_unknown(item.key, host_name, live)  # also those the state file lost
        for exp in going:
            self._close_export(exp.id, live)
            item.exports.remove(exp)
        if self._collect(item, live) or going:
            self._save()
        if going:
            log.info("retired %d older NBD export(s) of %s for %s", len(going), item.key, host_name)

    # -- point-in-time copies --------------------------------------------------------------------------

    def ensure_copy(self, copy_id: str, key: str, source: ExportSource, target: Path) -> ItemStatus:
        """Copy ``source`` as it is now into ``target`` (an existing file of its size) while hosts
        keep writing to it; see the module docstring. ``copying`` with its progress, then ``ready``;
        ``error`` if the job failed or its daemon restarted midway (never restarted: its instant is
        lost). ``RetryLater`` while a refresh of the key is not retired (a host still writes
        through an older chain, which the copy would not see)."""
        ids.check("snapshot", copy_id)
        check_key(key)
        path = source_file(key, source)
        target = Path(target)
        if not target.is_absolute():
            raise InvalidParameter(f"copy target must be absolute: {target}")
        with self._lock:
            self._up()
            live = self._view()
            found = self._find_copy(copy_id)
            if found is None:
                served = self._serving(key, FileSource(path)) or _Served(key=key, path=str(path))
                found = self._start_copy(copy_id, served, target, live)
            served, copy = found
            if served.key != key or copy.target != str(target):
                raise IdempotentParameterMismatch(f"copy {copy_id} is of {served.key} into {copy.target}")
            return self._copy_status(served, copy, live)

    def remove_copy(self, copy_id: str) -> None:
        """Cancel the copy if it runs, close its target and forget it; idempotent."""
        ids.check("snapshot", copy_id)
        with self._lock:
            self._load()
            live = self._view()
            self._end_copy(copy_id, live)  # also a job the state file lost
            found = self._find_copy(copy_id)
            if found is not None:
                served, copy = found
                served.copies.remove(copy)
                self._collect(served, live)
                self._save()
                log.info("removed copy %s of %s", copy_id, served.key)

    def _find_copy(self, copy_id: str) -> tuple[_Served, _Copy] | None:
        for served in self._desired.values():
            for copy in served.copies:
                if copy.id == copy_id:
                    return served, copy
        return None

    def _start_copy(self, copy_id: str, served: _Served, target: Path, live: _Live) -> tuple[_Served, _Copy]:
        size = file_size(served.key, Path(served.path))
        try:
            target_size = target.stat().st_size
        except FileNotFoundError:
            raise NotFound(f"copy target {target} does not exist", code="InvalidSnapshot.NotFound") from None
        if target_size != size:
            raise InvalidParameter(f"copy target {target} has {target_size} bytes, {served.key} has {size}")
        chain = served.newest()
        if chain is None:
            # Opened writable: a host that attaches during the copy joins this chain, below the filter.
            chain = _new_chain(served.key, served.next_gen(), False, self._fair_group(served))
        elif chain.size != size or any(not e.read_only and e.gen != chain.gen for e in served.exports):
            # Writes through another chain would not pass the copy's filter: wait until every
            # writer is on the newest one (a refresh retired, or an export older than this agent gone).
            raise RetryLater(f"hosts of {served.key} do not all write through its newest chain yet "
                             "(a resize is not finished); copy it after")
        copy = _Copy(id=copy_id, gen=chain.gen, target=str(target), size=size)
        new_chain = served.chain(chain.gen) is None
        if new_chain:
            served.chains.append(chain)
        served.copies.append(copy)
        self._desired[served.key] = served
        job, target_node, filter_node = _copy_names(copy_id)

        def undo() -> None:
            served.copies.remove(copy)
            try:
                self._del_nodes((target_node,), live)
                self._collect(served, live)
            except DriverError as exc:
                log.error("could not undo the start of copy %s: %s", copy_id, exc.message)

        with self._desired_first(undo):  # recorded before the job starts: a daemon restart is then an error
            self._open_chain(served, chain, live)
            self._del_nodes((target_node,), live)  # the leftover of an interrupted start
            # Written through the page cache: the job writes chunks of at most 1 MiB, and each O_DIRECT
            # write waits for the disk (a 1 GiB copy: 530-570 MB/s direct, 680-830 buffered).
            # The backend's finishing pass fsyncs the file before it is published, and QEMU flushes
            # the node as it closes it.
            self._add_file_node(target_node, str(target), read_only=False, what=copy_id, buffered=True)
            live.nodes[target_node] = size
            backup: dict[str, Any] = {"job-id": job, "device": chain.top(), "target": target_node,
                                      "sync": "full", "auto-dismiss": False, "filter-node-name": filter_node}
            if self.copy_speed:
                backup["speed"] = self.copy_speed
            self._q("blockdev-backup", backup)
            live.jobs[job] = _Job(status="created", error=None, done=0, total=size)
            live.nodes[filter_node] = size
            self._save()  # with the size of a new chain
        log.info("copying %s into %s at one instant (copy %s)", served.key, target, copy_id)
        return served, copy

    def _copy_status(self, served: _Served, copy: _Copy, live: _Live) -> ItemStatus:
        if copy.outcome == "copying":
            job = live.jobs.get(_copy_names(copy.id)[0])
            if job is not None and job.status != "concluded":
                return ItemStatus(state="copying", size_bytes=copy.size, progress=job.percent())
            succeeded = job is not None and not job.error
            if succeeded:
                self._flush_target(copy)  # before the outcome: a failed flush is asked again next time
            copy.outcome = "ready" if succeeded else "error"
            copy.error = (job.error or None) if job is not None else _INTERRUPTED
            self._save()  # the outcome first: the job that tells it goes next
            log.info("copy %s of %s: %s%s", copy.id, served.key, copy.outcome, f" ({copy.error})" if copy.error else "")
        self._end_copy(copy.id, live)
        if self._collect(served, live):
            self._save()
        return ItemStatus(state=copy.outcome, size_bytes=copy.size, progress=100 if copy.outcome == "ready" else 0,
                          error=copy.error)

    @staticmethod
    def _flush_target(copy: _Copy) -> None:
        """The target was written through the page cache: durable before the copy is called ready."""
        try:
            fsync_path(copy.target)
        except OSError as exc:
            raise DriverError(f"copy {copy.id}: cannot flush {copy.target}: {exc.strerror}") from exc

    def _end_copy(self, copy_id: str, live: _Live) -> None:
        """Cancel the copy's job if it runs, dismiss it and close its target node."""
        job_id, target_node, _ = _copy_names(copy_id)
        job = live.jobs.get(job_id)
        if job is not None:
            if job.status != "concluded":
                self._cancel(job_id)
            self._q("job-dismiss", {"id": job_id})
            del live.jobs[job_id]
            live.nodes = self._live_nodes()  # its filter is gone
        self._del_nodes((target_node,), live)

    def _cancel(self, job_id: str) -> None:
        qmp = self._qmp
        assert qmp is not None
        mark = qmp.event_mark()
        try:
            self._q("job-cancel", {"id": job_id})
        except QmpCommandError as exc:
            log.info("cancelling %s: %s", job_id, exc.desc)  # it concluded meanwhile
            return
        try:
            qmp.wait_event("JOB_STATUS_CHANGE", lambda e: e.get("data", {}).get("id") == job_id
                           and e["data"].get("status") == "concluded", since=mark, timeout=self.qmp_timeout)
        except QmpConnectionError:
            self._wait_job_concluded(job_id)  # event lost (reconnect): the daemon's state decides

    def _wait_job_concluded(self, job_id: str) -> None:
        deadline = time.monotonic() + self.qmp_timeout
        while any(j["id"] == job_id and j["status"] != "concluded" for j in self._q("query-jobs")):
            if time.monotonic() >= deadline:
                raise DriverError(f"copy job {job_id} still running {self.qmp_timeout:g}s after its cancel")
            time.sleep(0.05)

    # -- TLS keys -----------------------------------------------------------------------------------

    def _hosts_with_exports(self) -> set[str]:
        return {e.host for s in self._desired.values() for e in s.exports}

    def _read_keys(self) -> dict[str, str]:
        keys: dict[str, str] = {}
        try:
            text = self.keys_path.read_text()
        except FileNotFoundError:
            return keys
        for line in text.splitlines():
            ident, sep, key = line.strip().partition(":")
            if sep and ident and key:
                keys[ident] = key
        return keys

    def _write_authz(self) -> None:
        """Replace the daemon's authz list with the hosts that have an export here (QEMU cannot change
        an authz-list's rules in place; it looks the object up by id at each handshake, and refuses
        every client while it is missing)."""
        rules = [{"match": f"CN={h}", "policy": "allow", "format": "exact"}
                 for h in sorted(self._hosts_with_exports())]
        try:
            self._q("object-del", {"id": _AUTHZ_ID})
        except QmpCommandError as exc:
            if "not found" not in exc.desc:
                raise
        self._q("object-add", {"qom-type": "authz-list", "id": _AUTHZ_ID, "policy": "deny", "rules": rules})

    def _write_authz_best_effort(self) -> None:
        try:
            self._write_authz()
        except DriverError as exc:
            log.error("could not update the NBD authz list: %s", exc.message)

    def _write_keys(self) -> None:
        # The GnuTLS password-file format that psktool writes: "identity:hexkey" per line.
        self.tls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(self.keys_path, "".join(f"{h}:{k}\n" for h, k in sorted(self._keys.items())))


class _NbdOptions(BaseModel):
    """``[storage_agent.options.nbd]``: the daemon's I/O mode and the point-in-time copy rate."""

    model_config = ConfigDict(extra="forbid")

    aio: Literal["native", "threads", "io_uring"] = "native"
    cache_direct: bool = True
    copy_speed: int = Field(0, ge=0)
    # [storage_agent.options.nbd.fair_share.gp3] iops = …, mbps = …: what this node's gp3 volumes share.
    fair_share: dict[str, QoS] = Field(default_factory=dict, max_length=16)


def _checked_fair_share(fair_share: dict[str, QoS]) -> dict[str, QoS]:
    for volume_type, qos in fair_share.items():
        if not re.fullmatch(VOLUME_TYPE_RE, volume_type):
            raise InvalidParameter(f"fair_share: invalid volume type {volume_type[:20]!r}")
        if not qos.limits_anything():
            raise InvalidParameter(f"fair_share.{volume_type}: give iops, mbps or both")
    return dict(fair_share)

