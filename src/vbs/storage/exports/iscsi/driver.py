"""The iSCSI export driver: the ``ExportDriver`` contract over one userspace tgtd per storage agent,
composed of tgtd's control (control.py), access (access.py: ACL and CHAP) and targets (targets.py),
with online resize as a mixin (resize_calls.py).

iSCSI exports from one userspace tgtd per storage agent, driven on its management socket with the
requests tgtadm would send (tgt_ipc: no process per request; timeouts).

One target per key (``<iqn_prefix>:t<the key, sealed>``, a volume or a snapshot a hypervisor copies into), LUN 1
backed by its file, an ACL entry (the host's initiator name, or its address) and a CHAP account
per (key, host); desired state survives
tgtd and agent restarts.

Online resize (a LUN of the grown size beside the one a host uses): resize_calls.py.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, SecretStr

from vbs.config import StorageAgentConfig
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter
from vbs.net.stunnel import Tunnel, server_config
from vbs.pools.exports import ExportSource, RbdSource
from vbs.qemu.tls import X509Files
from vbs.storage.exports.supervised import ServedKey, SupervisedExportDriver, source_size
from vbs.system.daemons import START_TIMEOUT_S, DaemonSpec
from vbs.system.desired_state import DesiredState
from vbs.system.processes import minimal_environment
from vbs.system.socket_paths import socket_path
from vbs.wire.connection import Connection, HostIdentity, IscsiConnection
from vbs.wire.storage import ExportInfo

from .access import Access, acl_addresses, chap_user, is_loopback, new_secret
from .control import TGTD, TgtControl, tgtd_spec
from .resize_calls import ResizeCalls
from .state import STATE_VERSION, Export, Grant, View, upgrade_v1
from .targets import Targets

log = logging.getLogger(__name__)

# What tgt 1.0.85 (Debian 12) does, measured here, and what this module does about it:
# * ACL entries are alternatives: a login is admitted if its address OR its initiator name is
#   bound (an address ACL of 127.0.0.2 plus a name admits that name from 127.0.0.1). So each grant
#   binds one kind (access.acl_entries): where tgtd listens on loopback (`vbs up`, or behind the
#   TLS tunnel, where every login comes from stunnel on 127.0.0.1) the address tells no host from
#   another, and the host's initiator name is bound instead (a host that sends none, an agent of
#   0.1.0, keeps its address). Plain TCP off loopback (--insecure) binds addresses only: a name
#   next to them would admit it from anywhere. The name goes back in the connection info: the
#   hypervisor logs in with it.
# * A target with no account bound admits logins without CHAP: accounts are bound before the
#   first ACL entry and unbound after the last one.
# * ACLs and accounts are per target, not per LUN or per host: on a multi-attached volume each
#   host's CHAP account also works from the other hosts' addresses. Read-only is per LUN, so all
#   hosts of a volume share one mode.
# * Unbinding any account but the last bound one leaves a hole in tgt's account array: the next
#   `--op show` crashes tgtd (SIGSEGV) and CHAP refuses the accounts behind the hole. Deleting a
#   bound account does the same. access.Access.unbind_accounts never leaves a hole.
# * tgtd closes the management socket without an answer when it dies under a request: that is
#   an error with no tgt errno (tgtadm printed "tgtd closed the socket" and exited 0).
# * tgtd -C takes 0-32767. If the portal cannot be bound (port taken) tgtd keeps running and
#   listens on 0.0.0.0:3260 instead: start-up checks the portal list and refuses such a daemon.
# * tgtd ignores SIGTERM; it exits on `--op delete --mode system` once it has no targets.
# * Deleting a target under a logged-in session hangs that client. tgtd refuses it without
#   --force, which this module uses only in stop(), when the daemon exits and closes every session.
# Secrets: CHAP secrets are 24 random alphanumerics, kept in memory and in <state_dir>/exports.json
# (mode 0600) so that check() and a restarted agent re-create the same accounts. tgtadm takes a
# secret only as an argument, visible in /proc/<pid>/cmdline to every local user; the driver runs
# no tgtadm: every request, accounts included, goes on tgtd's management socket (tgt_ipc), so no
# secret is on any command line. tgtd runs with a minimal environment. Secrets are never logged.
# Off loopback (``tunnel``): tgtd listens on 127.0.0.1 behind a stunnel on the export address that
# admits only certificates of hosts with an export here (vbs.net.stunnel); the ACL then holds the
# hosts' initiator names (or 127.0.0.1, where stunnel connects from, for a host that gives none).

SUN_PATH_MAX = 107  # sockaddr_un.sun_path minus the NUL; tgtd truncates longer paths silently
CONTROL_MAX = 32767  # tgtd and tgtadm refuse a larger -C
PREFIX_RE = re.compile(r"^iqn\.\d{4}-\d{2}\.[a-z0-9.-]+$")


class _IscsiOptions(BaseModel):
    """``[storage_agent.options.iscsi]``."""

    model_config = ConfigDict(extra="forbid")

    iqn_prefix: str = "iqn.2026-11.org.vbs"
    direct_io: bool = True


def _checked(control_port: int, iqn_prefix: str, listen_host: str) -> str:
    """The driver's arguments checked; ``listen_host`` as the literal tgtd reports."""
    if not 0 <= control_port <= CONTROL_MAX:
        raise InvalidParameter(f"control_port must be 0-{CONTROL_MAX} (tgtd -C), not {control_port}")
    if not PREFIX_RE.fullmatch(iqn_prefix):
        raise InvalidParameter(f"invalid IQN prefix {iqn_prefix[:80]!r} (expecting iqn.YYYY-MM.domain)")
    try:
        # A literal: tgtd reports its portal numerically, and start-up compares the two.
        listen_host = str(ipaddress.ip_address(listen_host))
    except ValueError:
        raise InvalidParameter(f"listen_host must be an IP address, not {listen_host[:80]!r}") from None
    return listen_host


def _tunnel_of(cfg: StorageAgentConfig) -> X509Files | None:
    """The TLS tunnel's credentials off loopback (None on loopback, or off it with ``insecure``)."""
    x509 = X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    tunnel = None
    if not is_loopback(cfg.export_host):
        # iSCSI has no encryption of its own: CHAP's challenge, and all data, would cross the
        # network in clear. So off loopback it goes through a TLS tunnel, or only --insecure.
        if x509 is not None:
            tunnel = x509
        elif not cfg.insecure:
            raise InvalidParameter(
                f"iSCSI on {cfg.export_host} would cross the network unencrypted: set tls_cert, tls_key and "
                "tls_ca of [storage_agent] (a TLS tunnel), serve it on loopback, or run --insecure on a "
                "dedicated storage network")
        else:
            log.warning("INSECURE: iSCSI exports are served unencrypted on %s:%d (CHAP and the address ACL "
                        "still apply)", cfg.export_host, cfg.iscsi_port)
    return tunnel


class IscsiExportDriver(ResizeCalls, SupervisedExportDriver[Export, View]):
    """Export driver for iSCSI through one tgtd; see the notes at the top of this module."""

    protocol = "iscsi"

    def __init__(
        self,
        state_dir: Path,
        listen_host: str = "127.0.0.1",
        port: int = 3260,
        control_port: int = 7,
        iqn_prefix: str = "iqn.2026-11.org.vbs",
        *,
        direct_io: bool = True,
        advertise_host: str | None = None,
        adm_timeout: float = 10.0,
        start_timeout: float = START_TIMEOUT_S,
        session_grace: float = 10.0,
        tunnel: X509Files | None = None,
    ) -> None:
        """``tunnel``: serve through TLS (stunnel with this node's certificate, key and CA) on
        ``listen_host``, a non-loopback address; tgtd itself then listens on 127.0.0.1."""
        listen_host = _checked(control_port, iqn_prefix, listen_host)
        state_dir = Path(state_dir).absolute()
        # Our own control socket inside state_dir: tests, several agents and a system tgtd (which
        # uses /var/run/tgtd/socket.N) never share one. tgtd appends ".<control_port>".
        self.socket_base = socket_path(state_dir, "tgtd.sock")
        control_socket = f"{self.socket_base}.{control_port}"
        if len(control_socket.encode()) > SUN_PATH_MAX:
            raise InvalidParameter(
                f"state_dir too long for a unix socket path ({len(control_socket)} > {SUN_PATH_MAX} bytes): "
                f"{control_socket}")
        self.control_port = control_port
        self.iqn_prefix = iqn_prefix
        self.direct_io = direct_io
        self.adm_timeout, self.start_timeout = adm_timeout, start_timeout
        self.session_grace = session_grace
        if tunnel is not None and is_loopback(listen_host):
            raise InvalidParameter("an iSCSI TLS tunnel is for a non-loopback listen_host (loopback needs none)")
        self.tunnel_files = tunnel
        self._tunnel = Tunnel(state_dir / "stunnel.conf") if tunnel is not None else None
        tgtd_host = "127.0.0.1" if tunnel is not None else listen_host
        self.portal = f"[{tgtd_host}]:{port}" if ":" in tgtd_host else f"{tgtd_host}:{port}"
        self.control_socket = Path(control_socket)
        # tgtd gets nothing of the agent's environment (its token, cloud credentials).
        self._env = minimal_environment(TGT_IPC_SOCKET=str(self.socket_base))
        self._portals: set[str] = set()  # what a starting tgtd offers
        self._doomed: set[str] = set()  # keys whose target teardown is unfinished (sessions)
        self._tgt = TgtControl(control_port, self.socket_base, adm_timeout)
        self._access = Access(self._tgt, iqn_prefix, state_dir)
        # Addresses identify a host only where tgtd itself is reached over the network.
        self.acl_by_name = tunnel is not None or is_loopback(listen_host)
        self._targets = Targets(self._tgt, self._access, self._save, direct_io=direct_io,
                                session_grace=session_grace, by_name=self.acl_by_name)
        state = DesiredState(state_dir / "exports.json", Export, version=STATE_VERSION, upgrades={1: upgrade_v1})
        super().__init__(state_dir, state, listen_host=listen_host, port=port, advertise_host=advertise_host)

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, state_dir: Path) -> IscsiExportDriver:
        """``export_host``, ``iscsi_port`` and ``iscsi_control``; ``iqn_prefix`` and ``direct_io``
        from ``[storage_agent.options.iscsi]``."""
        opts = _IscsiOptions.model_validate(cfg.options.get("iscsi", {}))
        tunnel = _tunnel_of(cfg)
        return cls(state_dir, listen_host=cfg.export_host, port=cfg.iscsi_port, control_port=cfg.iscsi_control,
                   iqn_prefix=opts.iqn_prefix, direct_io=opts.direct_io, tunnel=tunnel)

    def _daemon_spec(self) -> DaemonSpec:
        return tgtd_spec(self.state_dir, self.control_port, self.portal, self._tgt.is_ours, self._env,
                         self.start_timeout)

    # -- names ------------------------------------------------------------------------------------

    def iqn(self, key: str) -> str:
        return self._access.iqn(key)

    @staticmethod
    def chap_user(key: str, host_name: str) -> str:
        """The CHAP account of (key, host); see ``access.chap_user``."""
        return chap_user(key, host_name)

    # -- the daemon (hooks of SupervisedDaemon) ------------------------------------------------------

    def _ready(self, deadline: float) -> None:
        self._portals = self._tgt.portals()

    def _spawned(self) -> None:
        if self._portals != {self.portal}:
            # tgtd falls back to 0.0.0.0:3260 when it cannot bind the portal: never serve that.
            raise DriverError(f"{TGTD} could not listen on {self.portal} (port in use?); it offered "
                              f"{sorted(self._portals)}: {self._daemon.log_tail()}")
        log.info("tgtd serves %s (control %d)", self.portal, self.control_port)

    def _take_over(self) -> bool:
        try:
            self._tgt.probe()
        except DriverError as exc:
            # Management and I/O share one event loop in tgtd: a daemon that does not answer here
            # serves no I/O either, so replacing it costs the clients nothing more.
            log.warning("tgtd pid %s does not answer (%s): restarting it", self._daemon.pid, exc.message)
            self._daemon.terminate()
            return False
        return True

    def _probe(self) -> None:
        try:
            self._tgt.show()
        except DriverError:
            time.sleep(0.5)  # one slow answer is not a hang
            self._tgt.show()

    def _ask_exit(self) -> bool:
        """Offline, every target deleted, then ``--op delete --mode system``. Targets go with
        ``--force``: the daemon is going away, which closes every session anyway."""
        self._tgt.go_offline()
        for live in self._tgt.show().values():
            self._tgt.delete_target(live, force=True)
        self._tgt.shut_down()
        return True

    def _let_go(self) -> None:
        self._doomed.clear()  # the targets waiting for their sessions go with the daemon

    def _daemon_up(self) -> None:
        self._sync_tunnel()

    def _sync_tunnel(self) -> None:
        """The TLS tunnel running and admitting exactly the hosts with an export here."""
        if self._tunnel is None or self.tunnel_files is None:
            return
        hosts = sorted({h for item in self._desired.values() for h in item.grants})
        text = server_config((self.listen_host, self.port), self.port, self.tunnel_files, hosts)
        self._tunnel.ensure(text, (self.listen_host, self.port))

    def stop(self) -> None:
        """Stop tgtd, then the tunnel in front of it."""
        with self._lock:
            super().stop()
            if self._tunnel is not None:
                self._tunnel.stop()

    def close(self) -> None:
        with self._lock:
            super().close()
            if self._tunnel is not None:
                self._tunnel.forget()

    @property
    def tunnel_pid(self) -> int | None:
        return self._tunnel.pid if self._tunnel is not None else None

    def _view(self) -> View:
        return self._tgt.show()

    def _restore(self, item: Export, view: View) -> None:
        self._targets.apply(item, view)

    def _reconciled(self, view: View) -> None:
        self._sync_tunnel()  # restarted if it died
        for key in sorted(self._doomed - set(self._desired)):
            try:
                self._targets.teardown(key, view, grace=0.0)
                self._doomed.discard(key)
            except DriverError as exc:
                log.info("target of %s still not removable: %s", key, exc.message)

    # -- the contract (hooks of SupervisedExportDriver) ----------------------------------------------

    def _connection(self, exp: Export, grant: Grant) -> IscsiConnection:
        return IscsiConnection(
            host=self.advertise_host, port=self.port, iqn=self.iqn(exp.key), lun=grant.lun,
            chap_user=grant.user, chap_secret=SecretStr(grant.secret), initiator_name=grant.initiator_name,
            tls="stunnel" if self._tunnel is not None else None,
        )

    def _hosts(self, item: Export) -> set[str]:
        return set(item.grants)

    def _live_keys(self) -> set[str]:
        return {key for iqn, live in self._tgt.show().items() if live.accounts and (key := self._access.key_of(iqn))}

    def _check_source(self, source: ExportSource) -> None:
        # tgtd passes the backing store as "path=…,bstype=…,bsopts=…": a comma would split it, and
        # its rbd store splits bsopts on ";".
        named = source.conf if isinstance(source, RbdSource) else source.path
        if "," in str(named) or ";" in str(named):
            raise InvalidParameter(f"a path tgtd is given must not contain ',' or ';': {str(named)[:200]}")

    def _ensure(self, item: Export | None, key: str, source: ExportSource, host: HostIdentity, read_only: bool
                ) -> Connection:
        """A LUN of the key's target for the host (its initiator name or address in the ACL, see
        ``access.acl_entries``; its own CHAP account);
        the same (key, host) gets the same connection and secret. The LUN is 1 until a refresh
        (online resize): then the host's current one, or for a host that joins, the newest one.

        A second host on the same key (multi-attach) joins the same target with its own ACL
        entry and account. All hosts of a key share its mode: the read-only flag is per LUN.
        """
        exp = item or Export(key=key, **ServedKey.fields_of(source), read_only=read_only)
        if isinstance(source, RbdSource):
            exp.image_size = source_size(key, source)
        if exp.read_only != read_only:
            raise IdempotentParameterMismatch(
                f"{key} is already exported with read_only={exp.read_only} to "
                f"{', '.join(sorted(exp.grants)) or 'no host'}; remove those exports first")
        # Through the tunnel every host arrives from stunnel on 127.0.0.1: its certificate, checked
        # by stunnel, stands in for its address.
        addresses = ["127.0.0.1"] if self._tunnel is not None else acl_addresses(host.address)
        old = exp.grants.get(host.name)
        fresh: set[str] = set()
        if old is None:
            grant = Grant(host=host.name, address=host.address, addresses=addresses,
                           initiator_name=host.initiator_name, user=self.chap_user(key, host.name),
                           secret=new_secret(), lun=exp.lun)
            fresh.add(grant.user)
        else:
            # Same host, maybe a new address: same account, secret and LUNs. The initiator name
            # stays the one the grant was made with: the hypervisor was given it with the
            # connection and logs in again with it after any reconnect, so a host that reports a
            # new name (or its first, once upgraded from 0.1.0) gets it with its next grant.
            grant = old.model_copy(update={"address": host.address, "addresses": addresses})
            if host.initiator_name != old.initiator_name:
                log.info("%s keeps initiator name %s for %s until that export is removed (it reports %s now)",
                         host.name, old.initiator_name, key, host.initiator_name)
        exp.grants[host.name] = grant
        self._desired[key] = exp
        self._doomed.discard(key)
        view = self._tgt.show()
        live = view.get(self.iqn(key))
        sizes = dict(exp.lun_sizes)
        if live is None or exp.lun not in live.luns:
            # The size the LUN is about to be made with goes into the one save below (each save is
            # an fsync): apply measures it again as it makes the LUN and saves again only if it
            # changed. A crash before the LUN exists leaves a size the restart's apply replaces.
            exp.lun_sizes[exp.lun] = self._targets.store_size(exp)

        def undo() -> None:
            exp.lun_sizes = sizes
            if old is None:
                del exp.grants[host.name]
            else:
                exp.grants[host.name] = old
            if item is None:
                del self._desired[key]

        with self._desired_first(undo):
            self._targets.apply(exp, view, fresh_users=fresh, tune=True)
            self._sync_tunnel()
        log.info("exported %s to %s over iSCSI as %s (read_only=%s)", key, host.name, self.iqn(key), read_only)
        return self._connection(exp, grant)

    def _remove(self, item: Export | None, key: str, host_name: str) -> None:
        """Withdraw the host's ACL entry and account; with the last host, delete the LUN and then
        the target.

        The caller must have unplugged the disk on that host first: tgtd refuses to delete a target
        under a logged-in session (forcing it would hang that client forever). In that case this
        raises ``DriverError`` once ``session_grace`` has passed, with the ACL and accounts already
        gone so the initiator cannot log in again; the next call or ``check()`` finishes the job.
        """
        if item is not None and host_name in item.grants:
            del item.grants[host_name]
            if not item.grants:
                del self._desired[key]
            self._save()
        if self._running():
            self._sync_tunnel()  # a host with no export left loses the tunnel first
        if not self._running():
            return  # nothing live to change; check() will not re-create what is no longer desired
        view = self._tgt.show()
        if item is not None and item.grants:
            self._targets.apply(item, view)
            return
        live = view.get(self.iqn(key))
        user = self.chap_user(key, host_name)
        if live is not None and set(live.accounts) - {user}:
            # Accounts this agent does not know (a lost state file): leave those hosts be.
            self._access.unbind_accounts(live, [user])
            self._access.forget_account(live, user, view)
        elif live is not None:
            self._doomed.add(key)
            self._targets.teardown(key, view, grace=self.session_grace)
            self._doomed.discard(key)

    def _list(self) -> list[ExportInfo]:
        """One entry per (key, host) account bound to a target of ours that has its LUN."""
        out: list[ExportInfo] = []
        for iqn, live in sorted(self._tgt.show().items()):
            key = self._access.key_of(iqn)
            if key is None or not set(live.luns) - {0}:
                continue  # not ours (an operator's target), or half-made
            exp = self._desired.get(key)
            hosts = {g.user: g.host for g in exp.grants.values()} if exp else {}
            for user in sorted(live.accounts):
                host = hosts.get(user) or user.removeprefix(f"{key}.")
                if host != user:
                    out.append(ExportInfo(key=key, host=host, protocol=self.protocol, target=iqn))
        return sorted(out, key=lambda e: (e.key, e.host))  # by key: names are sealed, their order is no one's
