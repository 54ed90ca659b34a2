"""The NBD export driver: the ``ExportDriver`` contract over one qemu-storage-daemon, composed of
its monitor (daemon.py), settings (options.py), session access (access.py), limits (limits.py),
block graph (chains.py), point-in-time copies (copies.py) and views (views.py); the calls that
take and drop copies and views are mixins (copy_calls.py, view_calls.py, instant_calls.py).

NBD exports from one long-lived qemu-storage-daemon (QSD) per storage agent, driven over QMP.

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

Point-in-time views (``ensure_view``, views.py) show a key as it was at one instant without copying it
(QEMU's fleecing): what the snapshot store's upload reads on a pool without reflink."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

from vbs.config import StorageAgentConfig
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, RetryLater
from vbs.pools.exports import ExportSource
from vbs.qemu.tls import X509Files
from vbs.storage.exports.nodelay import force_nodelay
from vbs.storage.exports.supervised import (
    LISTEN_RE,
    ServedKey,
    SupervisedExportDriver,
    check_key,
    source_size,
)
from vbs.system.daemons import START_TIMEOUT_S, DaemonSpec
from vbs.system.desired_state import DesiredState
from vbs.system.socket_paths import socket_path
from vbs.wire.connection import NBD_SOCKET_RE, Connection, HostIdentity, NbdConnection
from vbs.wire.qos import ExportLimits, QoS
from vbs.wire.storage import ExportInfo

from .access import Access
from .chains import Chains
from .copies import Copies
from .copy_calls import CopyCalls
from .daemon import QSD, Monitor, TlsMode, daemon_spec
from .limits import Limits
from .options import NbdOptions, tls_of
from .state import (
    STATE_VERSION,
    Book,
    Chain,
    HostExport,
    Live,
    Served,
    export_id,
    fits,
    group_id,
    key_host,
    new_chain,
    upgrade_v1,
)
from .tracking import Tracking
from .view_calls import ViewCalls
from .views import Views

log = logging.getLogger(__name__)


class NbdExportDriver(SupervisedExportDriver[Served, Live], CopyCalls, ViewCalls):
    """Export driver for NBD through one qemu-storage-daemon; see the module docstring."""

    protocol = "nbd"
    formats = ("raw", "qcow2")

    def __init__(self, state_dir: Path, listen_host: str = "127.0.0.1", port: int = 10809,
                 tls: TlsMode | bool = "off", aio: str = "native", cache_direct: bool = True, *,
                 advertise_host: str | None = None, qmp_timeout: float = 30.0, start_timeout: float = START_TIMEOUT_S,
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
        if not LISTEN_RE.fullmatch(listen_host):
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
        self.start_timeout = start_timeout
        self.qmp_path = socket_path(state_dir, "qsd.qmp")
        self._book = book = Book(desired=lambda: self._desired, save=self._save, first=self._desired_first)
        self._monitor = Monitor(self.qmp_path, qmp_timeout)
        self._access = Access(self.tls, state_dir, x509, self._monitor, book)
        self._limits = Limits(fair_share, self._monitor)
        tracking = Tracking(self._monitor, state_dir / "bitmaps")
        self._chains = Chains(self._monitor, self._limits, book, tracking, aio=aio, cache_direct=cache_direct)
        self._copies = Copies(self._monitor, self._chains, self._limits, book, copy_speed=copy_speed)
        self._views = Views(self._monitor, self._chains, self._limits, book, state_dir / "views")
        self.x509, self.x509_dir = x509, self._access.x509_dir
        self.tls_dir, self.keys_path = self._access.tls_dir, self._access.keys_path
        self.aio, self.cache_direct = aio, cache_direct  # how file nodes open their files
        self.qmp_timeout, self.copy_speed, self.fair_share = qmp_timeout, copy_speed, self._limits.fair_share
        state = DesiredState(state_dir / "exports.json", Served, version=STATE_VERSION, upgrades={1: upgrade_v1})
        super().__init__(state_dir, state, listen_host=listen_host, port=port, advertise_host=advertise_host)

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, state_dir: Path) -> NbdExportDriver:
        """``export_host``, ``nbd_port`` and ``nbd_tls``; ``aio``, ``cache_direct`` and ``copy_speed``
        (bytes/s) from ``[storage_agent.options.nbd]``."""
        opts = NbdOptions.model_validate(cfg.options.get("nbd", {}))
        x509 = X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        tls = tls_of(cfg, x509)
        return cls(state_dir, listen_host=cfg.export_host, port=cfg.nbd_port, tls=tls, aio=opts.aio,
                   cache_direct=opts.cache_direct, copy_speed=opts.copy_speed, x509=x509,
                   socket_dir=cfg.nbd_socket_dir, fair_share=opts.fair_share)

    # -- the daemon (hooks of SupervisedDaemon) ------------------------------------------------------

    def _daemon_spec(self) -> DaemonSpec:
        return daemon_spec(self.state_dir, self.qmp_path, socket=self.socket, listen_host=self.listen_host,
                           port=self.port, tls=self.tls, tls_dir=self.tls_dir, x509_dir=self.x509_dir,
                           start_timeout=self.start_timeout)

    def _ready(self, deadline: float) -> None:
        self._monitor.connect(deadline, self._daemon.running)

    def _take_over(self) -> bool:
        return self._monitor.take_over(self._daemon.pid, self._daemon.forget)

    def _daemon_up(self) -> None:
        """The authz list of an X.509 daemon; TCP_NODELAY (QEMU 7.2's NBD server leaves Nagle on,
        which stalls QEMU's NBD client)."""
        if self.tls == "x509":
            self._access.write_authz()
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
        return self._monitor.ask_exit()

    def _let_go(self) -> None:
        self._monitor.let_go()

    def _loaded_state(self) -> None:
        self._access.prepare(self.socket_dir, self.socket)

    def _view(self) -> Live:
        return self._monitor.view(self._running())

    def _restore(self, item: Served, view: Live) -> None:
        """Every chain an export uses and every export (older generations too: their host may not
        have moved yet); chains held only by copy jobs that died with a daemon are forgotten."""
        changed = self._views.check(item, view)  # views lost with a daemon: their leftovers go first
        for exp in item.exports:
            changed = self._chains.open_export(item, exp, view) or changed
        if self._chains.collect(item, view) or changed:
            self._save()

    def _reconciled(self, view: Live) -> None:
        self._views.sweep(view)

    def _q(self, command: str, args: dict[str, Any] | None = None) -> Any:
        """Ask the daemon over its monitor."""
        return self._monitor.q(command, args)

    # -- limits (vbs.pools.exports.LimitEnforcer) ------------------------------------------------

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
                self._limits.keep_pending(key, limits)
                return True
            served.limits = limits
            self._save()
            live = self._view()
            if any(c.top() in live.nodes for c in served.chains):
                self._limits.set_group(group_id(key), limits.qos, live)
            log.info("limits of %s: %s", key, limits.qos.model_dump(exclude_none=True) if limits.qos else "none")
            return all(c.throttle_node is not None for c in served.chains)

    # -- the contract (hooks of SupervisedExportDriver) ----------------------------------------------

    def _connection(self, exp: HostExport) -> NbdConnection:
        return self._access.connection(exp, socket=self.socket, host=self.advertise_host, port=self.port)

    def _hosts(self, item: Served) -> set[str]:
        return {e.host for e in item.exports}

    def _live_keys(self) -> set[str]:
        return {pair[0] for eid in self._monitor.live_exports() if (pair := key_host(eid)) is not None}

    def _ensure(self, item: Served | None, key: str, source: ExportSource, host: HostIdentity, read_only: bool
                ) -> Connection:
        """A name of its own for the host, on the key's newest chain (a new chain if that one is
        stale or read-only for a writer)."""
        served = item or Served(key=key, **ServedKey.fields_of(source), limits=self._limits.pending.get(key))
        self._limits.take_pending(key)
        cur = served.current(host.name)
        live = self._view()
        if cur is not None:
            if cur.read_only != read_only:
                raise IdempotentParameterMismatch(f"{key} is already exported to {host.name} "
                                                  f"(read_only={cur.read_only}); remove that export first")
            if self._chains.open_export(served, cur, live):
                self._save()
            return self._connection(cur)
        chain = served.newest()
        if chain is None or not fits(chain, read_only, source_size(key, source)):
            if chain is not None and self._chains.copying(served, live):
                # A new chain would escape the copy-before-write filter of the running copy.
                raise RetryLater(f"a point-in-time copy of {key} is running; a new chain of it must wait")
            chain = new_chain(key, served.next_gen(), read_only, self._limits.fair_group(served))
        exp = self._add_export(served, host.name, chain, read_only, live)
        log.info("exported %s to %s as NBD export (tls=%s)", key, host.name, self.tls)
        return self._connection(exp)

    def _add_export(self, served: Served, host: str, chain: Chain, read_only: bool, live: Live) -> HostExport:
        """A new export for ``host`` on ``chain`` (made if it is not in ``served``), desired first."""
        new_chain_ = served.chain(chain.gen) is None
        exp = HostExport(host=host, gen=chain.gen, read_only=read_only,
                         name=f"{served.key}-{secrets.token_hex(16)}", id=export_id(served.key, host, chain.gen))
        new_key, new_host = self._access.needs_key(host), self._access.is_new_host(host)
        if new_chain_:
            served.chains.append(chain)
        served.exports.append(exp)
        self._desired[served.key] = served
        if new_key:
            self._access.keys[host] = secrets.token_hex(32)

        def undo() -> None:
            served.exports.remove(exp)
            try:
                self._chains.close_export(exp.id, live)
                self._chains.collect(served, live)  # closes a chain made for it
            except DriverError as exc:
                log.error("could not remove the half-made export %s: %s", exp.id, exc.message)
            if new_key:
                del self._access.keys[host]
                self._access.write_keys()
            if new_host:
                self._access.write_authz_best_effort()

        # Desired state first: a crash from here on leaves an export that check() or the next
        # start() re-creates, never one the agent does not know about.
        with self._desired_first(undo):
            if new_key:
                self._access.write_keys()
            if new_host:
                self._access.write_authz()
            self._chains.open_export(served, exp, live, replace=True)
            self._save()  # with the size of a new chain
        return exp

    def _remove(self, item: Served | None, key: str, host_name: str) -> None:
        self._close_host_exports(item, key, host_name)
        if host_name not in self._book.hosts_with_exports():
            self._access.host_gone(host_name, self._running())

    def _list(self) -> list[ExportInfo]:
        desired = {e.id: e for s in self._desired.values() for e in s.exports}
        # One entry per (key, host), as the contract has it: while a refresh is pending the
        # daemon serves two exports of a pair, reported as the newest one it has.
        newest: dict[tuple[str, str], HostExport | None] = {}
        for eid in self._monitor.live_exports():
            pair = key_host(eid)
            if pair is None:
                continue  # not ours (an operator's manual export): not reported
            exp, best = desired.get(eid), newest.get(pair)
            if pair not in newest or (exp is not None and (best is None or exp.gen > best.gen)):
                newest[pair] = exp
        return [ExportInfo(key=k, host=h, protocol=self.protocol, target=exp.name if exp else "")
                for (k, h), exp in sorted(newest.items())]

    # -- online resize -------------------------------------------------------------------------------

    def _refresh(self, item: Served, host_name: str, size: int) -> Connection:
        """An export of the file's current size under a new name: on the key's newest chain if it
        has that size, else on a new chain; the older one serves on until retired. ``RetryLater``
        while a copy of the key runs (a new chain would escape its filter)."""
        cur = item.current(host_name)
        assert cur is not None
        live = self._view()
        if self._chains.copying(item, live):
            raise RetryLater(f"a point-in-time copy of {item.key} is running; refresh its exports after it")
        # The current export must serve meanwhile. If the daemon had lost it (restarted before
        # check()), its chain came back with the file's size: then it is the refreshed one already.
        if self._chains.open_export(item, cur, live):
            self._save()
        chain = item.chain(cur.gen)
        if chain is not None and chain.size == size:
            return self._connection(cur)
        newest = item.newest()
        if newest is None or not fits(newest, cur.read_only, size):
            newest = new_chain(item.key, item.next_gen(), cur.read_only, self._limits.fair_group(item))
        exp = self._add_export(item, host_name, newest, cur.read_only, live)
        log.info("refreshed the NBD export of %s for %s: chain %d serves %d bytes",
                 item.key, host_name, exp.gen, newest.size or 0)
        return self._connection(exp)

    def _retire(self, item: Served, host_name: str) -> None:
        """The host's exports older than its current one go (their clients are cut off), and the
        chains nothing uses any more."""
        going = self._close_host_exports(item, item.key, host_name, keep=item.current(host_name))
        if going:
            log.info("retired %d older NBD export(s) of %s for %s", going, item.key, host_name)

    def _close_host_exports(self, item: Served | None, key: str, host_name: str, *, keep: HostExport | None = None
                            ) -> int:
        """Close the host's exports of the key but ``keep``, also those the state file lost (none must
        outlive the attachment), and the chains nothing uses any more; how many of ``item``'s went."""
        live = self._view()
        self._chains.close_unknown(key, host_name, live)
        if item is None:
            return 0
        going = [e for e in item.exports if e.host == host_name and e is not keep]
        for exp in going:
            self._chains.close_export(exp.id, live)
            item.exports.remove(exp)
        if self._chains.collect(item, live) or going:
            self._save()
        return len(going)
