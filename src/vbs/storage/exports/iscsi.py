"""iSCSI exports from one userspace tgtd per storage agent, driven with tgtadm (argv, timeouts).

One target per key (``<iqn_prefix>:t<the key, sealed>``, a volume or a snapshot a hypervisor copies into), LUN 1
backed by its file, an address ACL entry and a CHAP account per (key, host); desired state survives
tgtd and agent restarts.

Online resize: tgt reads a LUN's size when the LUN is made and never again (no tgtadm parameter
changes it; QEMU's initiator re-reads the capacity on ``block_resize`` but gets the old one). So
``refresh_export`` adds another LUN on the same target, backed by the same (grown) file: the host
logs in to it next to its current session (same ACL and CHAP account) and moves its disk over, then
``retire_exports`` deletes the LUN it left. Each host's grant names the LUN it uses and the ones
it may still be using; a LUN is kept while any grant names it, so hosts of a multi-attached volume
move independently and share the newest LUN. Numbers are reused: a lone host alternates 1 and 2.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import ipaddress
import logging
import os
import re
import secrets
import signal
import socket
import string
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from vbs.config import StorageAgentConfig
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter
from vbs.net.stunnel import Tunnel, server_config
from vbs.qemu.tls import X509Files
from vbs.storage.exports import tgt_ipc
from vbs.storage.exports.base import ExportSource, RbdSource
from vbs.storage.exports.supervised import ServedKey, SupervisedExportDriver, check_key, source_size
from vbs.system.argv import run
from vbs.system.daemons import DaemonSpec, argv0_is
from vbs.system.desired_state import DesiredState
from vbs.system.processes import cmdline, environ_value, minimal_environment
from vbs.system.socket_paths import socket_path
from vbs.wire.connection import Connection, HostIdentity, IscsiConnection
from vbs.wire.storage import ExportInfo

__all__ = ["IscsiExportDriver", "parse_targets"]

log = logging.getLogger(__name__)

# What tgt 1.0.85 (Debian 12) does, measured here, and what this module does about it:
# * ACL entries are alternatives: a login is admitted if its address OR its initiator name is
#   bound. Binding a host's initiator name next to its address would admit that name from any
#   address, so only addresses are bound. The host's initiator name goes back in the connection
#   info (the hypervisor logs in with it, so sessions are identifiable) but grants nothing.
# * A target with no account bound admits logins without CHAP: accounts are bound before the
#   first ACL entry and unbound after the last one.
# * ACLs and accounts are per target, not per LUN or per host: on a multi-attached volume each
#   host's CHAP account also works from the other hosts' addresses. Read-only is per LUN, so all
#   hosts of a volume share one mode.
# * Unbinding any account but the last bound one leaves a hole in tgt's account array: the next
#   `--op show` crashes tgtd (SIGSEGV) and CHAP refuses the accounts behind the hole. Deleting a
#   bound account does the same. _unbind_accounts never leaves a hole.
# * tgtadm exits 0 with "tgtd closed the socket" when tgtd dies under a request.
# * tgtd -C takes 0-32767. If the portal cannot be bound (port taken) tgtd keeps running and
#   listens on 0.0.0.0:3260 instead: start-up checks the portal list and refuses such a daemon.
# * tgtd ignores SIGTERM; it exits on `--op delete --mode system` once it has no targets.
# * Deleting a target under a logged-in session hangs that client. tgtd refuses it without
#   --force, which this module uses only in stop(), when the daemon exits and closes every session.
# Secrets: CHAP secrets are 24 random alphanumerics, kept in memory and in <state_dir>/exports.json
# (mode 0600) so that check() and a restarted agent re-create the same accounts. tgtadm takes a
# secret only as an argument, visible in /proc/<pid>/cmdline to every local user, so accounts are
# made by sending tgtadm's request on tgtd's management socket directly (tgt_ipc); no secret is on
# any command line. tgtd and tgtadm run with a minimal environment. Secrets are never logged.
# Off loopback (``tunnel``): tgtd listens on 127.0.0.1 behind a stunnel on the export address that
# admits only certificates of hosts with an export here (vbs.net.stunnel); the ACL then holds
# 127.0.0.1, where stunnel connects from.

TGTD = "tgtd"
TGTADM = "tgtadm"
LUN = 1
# Larger PDUs and unsolicited data: measured to double write throughput (MACHINE-FACTS).
TUNING: tuple[tuple[str, str], ...] = (
    ("MaxRecvDataSegmentLength", "262144"),
    ("MaxXmitDataSegmentLength", "262144"),
    ("FirstBurstLength", "262144"),
    ("MaxBurstLength", "1048576"),
    ("InitialR2T", "No"),
)
_STATE_VERSION = 2
_SECRET_ALPHABET = string.ascii_letters + string.digits  # safe in URLs, configs and every initiator
_SECRET_LEN = 24  # iSCSI wants at least 12 (96 bits); 24 alphanumerics are about 143 bits
_CHAP_USER_MAX = 64  # IscsiConnection.chap_user limit
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path minus the NUL; tgtd truncates longer paths silently
_CONTROL_MAX = 32767  # tgtd and tgtadm refuse a larger -C
_PREFIX_RE = re.compile(r"^iqn\.\d{4}-\d{2}\.[a-z0-9.-]+$")

# tgtadm's error strings (tgtadm_strerror); its exit code is 22 for all of them.
_E_EXISTS = ("already exists",)
_E_ABSENT = ("can't find", "does not exist")
_E_ACTIVE = ("still active",)


# -- desired state --------------------------------------------------------------------------------


class _Grant(BaseModel):
    """One host's access to one key: its ACL addresses and its CHAP account."""

    host: str
    address: str  # as the host identity gave it
    addresses: list[str]  # numeric, what the ACL holds (resolved once, not at every check)
    initiator_name: str | None
    user: str
    secret: str
    lun: int = LUN  # the LUN this host is given
    old_luns: list[int] = Field(default_factory=list)  # LUNs it may still use until retire_exports


class _Export(ServedKey):
    """One key as it should be served: one target, its LUNs, one grant per host."""

    read_only: bool
    grants: dict[str, _Grant] = Field(default_factory=dict)
    lun: int = LUN  # the newest LUN: a host that joins gets this one
    lun_sizes: dict[int, int] = Field(default_factory=dict)  # file size when tgtd made each LUN
    # An RBD source's size as its backend last read it (tgtd's rbd backing store opens the image
    # itself; there is no file to stat).
    image_size: int = 0

    def backing_store(self) -> list[str]:
        """tgtadm's arguments for a LUN of this key: a file read and written directly, or an RBD
        image that tgtd's rbd backing store (Debian's tgt-rbd) opens with librbd as the cephx
        user, whose key it reads from the keyring the conf names."""
        if self.rbd is None:
            return ["--backing-store", self.path, "--bstype", "rdwr"]
        return ["--backing-store", f"{self.rbd.pool}/{self.rbd.image}", "--bstype", "rbd",
                "--bsopts", f"conf={self.rbd.conf};id={self.rbd.user}"]

    def store_path(self) -> str:
        """What ``tgtadm --op show`` reports as the LUN's backing store path."""
        return self.path if self.rbd is None else f"{self.rbd.pool}/{self.rbd.image}"

    def wanted_luns(self) -> set[int]:
        return {n for g in self.grants.values() for n in (g.lun, *g.old_luns)} or {self.lun}


def _upgrade_v1(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Version 1 keyed exports by ``volume_id`` and listed grants; the same facts otherwise."""
    items: list[dict[str, Any]] = []
    for old in data["exports"]:
        item = {k: v for k, v in old.items() if k not in ("volume_id", "grants")}
        items.append({**item, "key": old["volume_id"], "grants": {g["host"]: g for g in old["grants"]}})
    return items


class _IscsiOptions(BaseModel):
    """``[storage_agent.options.iscsi]``."""

    model_config = ConfigDict(extra="forbid")

    iqn_prefix: str = "iqn.2026-11.org.vbs"
    direct_io: bool = True


# -- what tgtd reports ----------------------------------------------------------------------------


@dataclass
class _LiveLun:
    path: str = ""
    readonly: bool = False


@dataclass
class _LiveTarget:
    tid: int
    iqn: str
    luns: dict[int, _LiveLun] = field(default_factory=dict)
    accounts: list[str] = field(default_factory=list)  # in tgtd's slot order (see _unbind_accounts)
    acl: set[str] = field(default_factory=set)  # addresses and initiator names alike
    sessions: list[str] = field(default_factory=list)  # "initiator@address", for messages


def parse_targets(text: str) -> dict[str, _LiveTarget]:
    """Parse ``tgtadm --mode target --op show`` into targets by IQN (the stable key: tids are not)."""
    targets: dict[str, _LiveTarget] = {}
    cur: _LiveTarget | None = None
    section = ""
    lun: _LiveLun | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        m = re.match(r"^Target (\d+): (\S+)$", line)
        if m:
            cur = _LiveTarget(tid=int(m.group(1)), iqn=m.group(2))
            targets[cur.iqn] = cur
            section, lun = "", None
            continue
        if cur is None:
            continue
        if indent == 4:
            section = body.rstrip(":")
        elif section == "LUN information":
            if indent == 8 and body.startswith("LUN: "):
                lun = cur.luns.setdefault(int(body[5:]), _LiveLun())
            elif lun is not None and body.startswith("Backing store path: "):
                lun.path = body[len("Backing store path: "):]
            elif lun is not None and body.startswith("Readonly: "):
                lun.readonly = body.endswith("Yes")
        elif section == "Account information" and indent == 8:
            if not body.endswith("(outgoing)"):
                cur.accounts.append(body)
        elif section == "ACL information" and indent == 8:
            cur.acl.add(body)
        elif section == "I_T nexus information":
            if body.startswith("Initiator: "):
                cur.sessions.append(body[len("Initiator: "):].split(" alias:")[0])
            elif body.startswith("IP Address: ") and cur.sessions:
                cur.sessions[-1] += "@" + body[len("IP Address: "):]
    return targets


_View = dict[str, _LiveTarget]  # what tgtd serves, by IQN


def _parse_portals(text: str) -> set[str]:
    return {line.split("Portal: ", 1)[1].rsplit(",", 1)[0] for line in text.splitlines() if "Portal: " in line}




def _acl_kind(entry: str) -> str:
    """The tgtadm option that unbinds an ACL entry as ``--op show`` lists it."""
    return "--initiator-name" if entry.startswith(("iqn.", "eui.", "naa.")) else "--initiator-address"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _new_secret() -> str:
    return "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(_SECRET_LEN))


def _acl_addresses(address: str) -> list[str]:
    """Numeric addresses for the ACL: tgt compares numerically (``AI_NUMERICHOST``), never by name."""
    try:
        return [str(ipaddress.ip_address(address))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise DriverError(f"cannot resolve host address {address!r} for the iSCSI ACL: {exc}") from exc
    return sorted({str(info[4][0]) for info in infos})


class _AdmError(DriverError):
    """A tgtadm call failed; ``detail`` is tgtadm's own reason, matched to tell benign cases apart."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"tgtadm {step}: {detail}")
        self.detail = detail

    def says(self, phrases: tuple[str, ...]) -> bool:
        return any(p in self.detail for p in phrases)



# -- the driver -----------------------------------------------------------------------------------


class IscsiExportDriver(SupervisedExportDriver[_Export, _View]):
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
        start_timeout: float = 15.0,
        session_grace: float = 10.0,
        tunnel: X509Files | None = None,
    ) -> None:
        """``tunnel``: serve through TLS (stunnel with this node's certificate, key and CA) on
        ``listen_host``, a non-loopback address; tgtd itself then listens on 127.0.0.1."""
        if not 0 <= control_port <= _CONTROL_MAX:
            raise InvalidParameter(f"control_port must be 0-{_CONTROL_MAX} (tgtd -C), not {control_port}")
        if not _PREFIX_RE.match(iqn_prefix):
            raise InvalidParameter(f"invalid IQN prefix {iqn_prefix[:80]!r} (expecting iqn.YYYY-MM.domain)")
        try:
            # A literal: tgtd reports its portal numerically, and start-up compares the two.
            listen_host = str(ipaddress.ip_address(listen_host))
        except ValueError:
            raise InvalidParameter(f"listen_host must be an IP address, not {listen_host[:80]!r}") from None
        state_dir = Path(state_dir).absolute()
        # Our own control socket inside state_dir: tests, several agents and a system tgtd (which
        # uses /var/run/tgtd/socket.N) never share one. tgtd appends ".<control_port>".
        self.socket_base = socket_path(state_dir, "tgtd.sock")
        control_socket = f"{self.socket_base}.{control_port}"
        if len(control_socket.encode()) > _SUN_PATH_MAX:
            raise InvalidParameter(
                f"state_dir too long for a unix socket path ({len(control_socket)} > {_SUN_PATH_MAX} bytes): "
                f"{control_socket}")
        self.control_port = control_port
        self.iqn_prefix = iqn_prefix
        self.direct_io = direct_io
        self.adm_timeout, self.start_timeout = adm_timeout, start_timeout
        self.session_grace = session_grace
        if tunnel is not None and _is_loopback(listen_host):
            raise InvalidParameter("an iSCSI TLS tunnel is for a non-loopback listen_host (loopback needs none)")
        self.tunnel_files = tunnel
        self._tunnel = Tunnel(state_dir / "stunnel.conf") if tunnel is not None else None
        tgtd_host = "127.0.0.1" if tunnel is not None else listen_host
        self.portal = f"[{tgtd_host}]:{port}" if ":" in tgtd_host else f"{tgtd_host}:{port}"
        self.control_socket = Path(control_socket)
        # tgtd and tgtadm get nothing of the agent's environment (its token, cloud credentials).
        self._env = minimal_environment(TGT_IPC_SOCKET=str(self.socket_base))
        self._portals: set[str] = set()  # what a starting tgtd offers
        self._doomed: set[str] = set()  # keys whose target teardown is unfinished (sessions)
        state = DesiredState(state_dir / "exports.json", _Export, version=_STATE_VERSION, upgrades={1: _upgrade_v1})
        super().__init__(state_dir, state, listen_host=listen_host, port=port, advertise_host=advertise_host)

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, state_dir: Path) -> IscsiExportDriver:
        """``export_host``, ``iscsi_port`` and ``iscsi_control``; ``iqn_prefix`` and ``direct_io``
        from ``[storage_agent.options.iscsi]``."""
        opts = _IscsiOptions.model_validate(cfg.options.get("iscsi", {}))
        x509 = X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        tunnel = None
        if not _is_loopback(cfg.export_host):
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
        return cls(state_dir, listen_host=cfg.export_host, port=cfg.iscsi_port, control_port=cfg.iscsi_control,
                   iqn_prefix=opts.iqn_prefix, direct_io=opts.direct_io, tunnel=tunnel)

    def _daemon_spec(self) -> DaemonSpec:
        return DaemonSpec(
            name=TGTD, argv=(TGTD, "-f", "-C", str(self.control_port), "--iscsi", f"portal={self.portal}"),
            pid_path=self.state_dir / "tgtd.pid",  # tgtd -f ignores -p: the supervisor writes it
            log_path=self.state_dir / "tgtd.log", owns=self._is_ours, env=self._env,
            stop_signals=(signal.SIGKILL,),  # tgtd ignores SIGTERM
            start_timeout=self.start_timeout)

    # -- names ------------------------------------------------------------------------------------

    # A target's name reveals nothing: any local user (or any host an ACL admits) may list the
    # names without logging in (tgtd has no discovery authentication), so a name is the key
    # sealed with AES-SIV (deterministic) under a secret of this node, <state_dir>/iqn.key (0600).
    def _names(self) -> AESSIV:
        sealer: AESSIV | None = getattr(self, "_sealer", None)
        if sealer is None:
            path = self.state_dir / "iqn.key"
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(secrets.token_bytes(32))
            sealer = self._sealer = AESSIV(path.read_bytes()[:32])
        return sealer

    def iqn(self, key: str) -> str:
        sealed = base64.b32encode(self._names().encrypt(check_key(key).encode(), None)).decode()
        return f"{self.iqn_prefix}:t{sealed.rstrip('=').lower()}"

    def _key_of(self, iqn: str) -> str | None:
        prefix = f"{self.iqn_prefix}:t"
        name = iqn[len(prefix):] if iqn.startswith(prefix) else ""
        try:
            raw = base64.b32decode(name.upper() + "=" * (-len(name) % 8))
            return check_key(self._names().decrypt(raw, None).decode())
        except (ValueError, InvalidTag, InvalidParameter):
            return None  # not ours (an operator's target)

    @staticmethod
    def chap_user(key: str, host_name: str) -> str:
        """The CHAP account of (key, host): readable where it fits, deterministic always.

        tgt accounts are global to the daemon, so the key is part of the name.
        """
        user = f"{key}.{host_name}"
        if len(user) <= _CHAP_USER_MAX:
            return user
        return f"{key}.h{hashlib.sha256(host_name.encode()).hexdigest()[:24]}"

    # -- tgtadm -----------------------------------------------------------------------------------

    def _adm(self, step: str, *args: str) -> str:
        """Run one tgtadm request against our daemon; failures name ``step`` (never the argv)."""
        argv = [TGTADM, "-C", str(self.control_port), *args]
        proc = run(argv, timeout=self.adm_timeout, check=False, env=self._env)
        # tgtadm exits 0 with "tgtd closed the socket" when tgtd dies under the request.
        if proc.returncode != 0 or "tgtadm:" in proc.stderr:
            detail = (proc.stderr or proc.stdout).strip().removeprefix("tgtadm: ")[-300:]
            raise _AdmError(step, detail or f"exit status {proc.returncode}")
        return proc.stdout

    def _iscsi(self, step: str, *args: str) -> str:
        return self._adm(step, "--lld", "iscsi", *args)

    def _show(self) -> _View:
        return parse_targets(self._iscsi("show targets", "--mode", "target", "--op", "show"))

    def _accounts(self) -> set[str]:
        out = self._iscsi("show accounts", "--mode", "account", "--op", "show")
        return {line.strip() for line in out.splitlines()[1:] if line.strip()}

    # -- the daemon (hooks of SupervisedExportDriver) ------------------------------------------------

    def _is_ours(self, pid: int) -> bool:
        """A live tgtd on our control socket (guards against a reused PID: never signal a stranger)."""
        if not argv0_is(pid, TGTD) or cmdline(pid)[1:4] != ["-f", "-C", str(self.control_port)]:
            return False
        env = environ_value(pid, "TGT_IPC_SOCKET")
        return env is None or env == str(self.socket_base)

    def _ready(self, deadline: float) -> None:
        self._portals = _parse_portals(self._adm("show portals", "--mode", "portal", "--op", "show"))

    def _spawned(self) -> None:
        if self._portals != {self.portal}:
            # tgtd falls back to 0.0.0.0:3260 when it cannot bind the portal: never serve that.
            raise DriverError(f"{TGTD} could not listen on {self.portal} (port in use?); it offered "
                              f"{sorted(self._portals)}: {self._daemon.log_tail()}")
        log.info("tgtd serves %s (control %d)", self.portal, self.control_port)

    def _take_over(self) -> bool:
        try:
            self._adm("probe", "--mode", "sys", "--op", "show")
        except DriverError as exc:
            # Management and I/O share one event loop in tgtd: a daemon that does not answer here
            # serves no I/O either, so replacing it costs the clients nothing more.
            log.warning("tgtd pid %s does not answer (%s): restarting it", self._daemon.pid, exc.message)
            self._daemon.terminate()
            return False
        return True

    def _probe(self) -> None:
        try:
            self._show()
        except DriverError:
            time.sleep(0.5)  # one slow answer is not a hang
            self._show()

    def _ask_exit(self) -> bool:
        """Offline, every target deleted, then ``--op delete --mode system``. Targets go with
        ``--force``: the daemon is going away, which closes every session anyway."""
        self._adm("go offline", "--mode", "sys", "--op", "update", "--name", "State", "-v", "offline")
        for live in self._show().values():
            self._iscsi(f"delete target {live.iqn}", "--mode", "target", "--op", "delete", "--force",
                        "--tid", str(live.tid))
        self._adm("shut down", "--op", "delete", "--mode", "system")
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

    def _view(self) -> _View:
        return self._show()

    def _restore(self, item: _Export, view: _View) -> None:
        self._apply(item, view)

    def _reconciled(self, view: _View) -> None:
        self._sync_tunnel()  # restarted if it died
        for key in sorted(self._doomed - set(self._desired)):
            try:
                self._teardown(key, view, grace=0.0)
                self._doomed.discard(key)
            except DriverError as exc:
                log.info("target of %s still not removable: %s", key, exc.message)

    # -- applying desired state -------------------------------------------------------------------

    def _apply(self, exp: _Export, view: _View, *, fresh_users: AbstractSet[str] = frozenset(),
               tune: bool = False) -> None:
        """Make tgtd's target for ``exp`` match it; ``view`` is updated as tgtd changes.

        ``fresh_users``: accounts whose secret is new, re-created even if tgtd has an account of
        that name (left by a lost state: its secret is unknown). ``tune``: set the negotiation
        parameters even on an existing target.
        """
        iqn = self.iqn(exp.key)
        live = view.get(iqn)
        created = live is None
        if live is None:
            tid = max((t.tid for t in view.values()), default=0) + 1
            self._iscsi(f"create target {iqn}", "--mode", "target", "--op", "new", "--tid", str(tid),
                        "--targetname", iqn)
            live = view[iqn] = _LiveTarget(tid=tid, iqn=iqn)
        try:
            if self._apply_target(exp, live, view, fresh_users=fresh_users, tune=tune or created):
                self._save()  # the sizes of new LUNs, which a refresh compares with the file's
        except DriverError:
            if created:  # no half-made target: the caller sees the error, tgtd sees nothing
                try:
                    self._teardown(exp.key, view, grace=0.0)
                except DriverError as exc:
                    log.error("could not remove the half-made target %s: %s", iqn, exc.message)
            raise

    def _apply_target(self, exp: _Export, live: _LiveTarget, view: _View, *,
                      fresh_users: AbstractSet[str], tune: bool) -> bool:
        """Returns whether ``exp.lun_sizes`` changed."""
        tid = str(live.tid)
        sizes_changed = False
        # Nothing below lets an initiator in before the ACL exists, and the ACL comes last: a LUN
        # is never visible writable when it should be read-only, nor without CHAP.
        if tune:
            for name, value in TUNING:
                self._iscsi(f"set {name} on {live.iqn}", "--mode", "target", "--op", "update",
                            "--tid", tid, "--name", name, "--value", value)
        wanted = exp.wanted_luns()
        for n in sorted(wanted):
            lun = live.luns.get(n)
            if lun is None:
                argv = ["--mode", "logicalunit", "--op", "new", "--tid", tid, "--lun", str(n), *exp.backing_store()]
                if exp.rbd is None and self.direct_io and self._direct_ok(exp.path):
                    argv += ["--bsoflags", "direct"]
                size = self._store_size(exp)  # what tgtd reads as it opens the store just below
                self._iscsi(f"create LUN {n} of {live.iqn}", *argv)
                lun = live.luns[n] = _LiveLun(path=exp.store_path())
                exp.lun_sizes[n] = size
                sizes_changed = True
            elif lun.path != exp.store_path():
                raise DriverError(f"target {live.iqn} serves {lun.path} as LUN {n}, not {exp.store_path()}")
            if lun.readonly != exp.read_only:
                # tgtadm takes no --params at LUN creation: read-only is an update right after it.
                self._iscsi(f"set readonly={int(exp.read_only)} on LUN {n} of {live.iqn}", "--mode",
                            "logicalunit", "--op", "update", "--tid", tid, "--lun", str(n),
                            "--params", f"readonly={int(exp.read_only)}")
                lun.readonly = exp.read_only
        deadline = time.monotonic() + self.session_grace
        for n in sorted(set(live.luns) - wanted - {0}):  # LUN 0 is tgt's controller
            # A LUN no host may use any more (retired after a refresh, or its last host removed).
            # A client still on it gets I/O errors, not a hang.
            self._until_idle(deadline, f"delete LUN {n} of {live.iqn}", "--mode", "logicalunit",
                             "--op", "delete", "--tid", tid, "--lun", str(n))
            live.luns.pop(n, None)
            sizes_changed = exp.lun_sizes.pop(n, None) is not None or sizes_changed

        want_users = {g.user: g for g in exp.grants.values()}
        want_acl = {a for g in exp.grants.values() for a in g.addresses}
        # Accounts before the ACL opens: a target with an ACL entry and no account admits logins
        # without CHAP.
        stale = [u for u in live.accounts if u not in want_users or u in fresh_users]
        self._unbind_accounts(live, stale)
        for user in stale:
            if user not in want_users:
                self._forget_account(live, user, view)
        for user, grant in sorted(want_users.items()):
            if user in live.accounts:
                continue
            self._create_account(grant, view)
            self._bind(f"bind account {user}", "--mode", "account", "--op", "bind", "--tid", tid,
                       "--user", user)
            live.accounts.append(user)
        for address in sorted(want_acl - live.acl):
            self._bind(f"bind {address} to {live.iqn}", "--mode", "target", "--op", "bind",
                       "--tid", tid, "--initiator-address", address)
            live.acl.add(address)
        for entry in sorted(live.acl - want_acl):
            # Initiator names included: bound by hand, one would admit its name from any address.
            self._unbind_acl(live, _acl_kind(entry), entry)
        return sizes_changed

    def _bind(self, step: str, *args: str) -> None:
        try:
            self._iscsi(step, *args)
        except _AdmError as exc:
            if not exc.says(_E_EXISTS):
                raise

    @staticmethod
    def _store_size(exp: _Export) -> int:
        if exp.rbd is not None:
            return exp.image_size
        try:
            return os.stat(exp.path).st_size
        except OSError as exc:
            raise DriverError(f"source file {exp.path} of {exp.key}: {exc.strerror}") from exc

    def _direct_ok(self, path: str) -> bool:
        """Whether the file system takes O_DIRECT (tmpfs does not; tgtd would then fail the LUN)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                log.warning("%s: no O_DIRECT on this file system, serving it through the page cache", path)
                return False
            return True  # let tgtadm report the real problem
        os.close(fd)
        return True

    def _create_account(self, grant: _Grant, view: _View) -> None:
        if grant.user in self._accounts():
            # An account of that name whose secret is not ours (or not known to be): replace it,
            # unbound everywhere first (deleting a bound account leaves the same hole as below).
            for other in view.values():
                self._unbind_accounts(other, [grant.user])
            self._iscsi(f"delete account {grant.user}", "--mode", "account", "--op", "delete",
                        "--user", grant.user)
        # Not through tgtadm, which takes the secret only on its command line (readable in /proc by
        # every local user): the same request, sent on tgtd's management socket directly.
        try:
            tgt_ipc.request(self.control_socket, tgt_ipc.MODE_ACCOUNT, tgt_ipc.OP_NEW,
                            {"user": grant.user, "password": grant.secret}, timeout=self.adm_timeout)
        except tgt_ipc.TgtIpcError as exc:
            raise _AdmError(f"create account {grant.user}", exc.message) from exc

    def _unbind_acl(self, live: _LiveTarget, kind: str, entry: str) -> None:
        try:
            self._iscsi(f"unbind {entry} from {live.iqn}", "--mode", "target", "--op", "unbind",
                        "--tid", str(live.tid), kind, entry)
        except _AdmError as exc:
            if not exc.says(_E_ABSENT):
                raise
        live.acl.discard(entry)

    def _unbind_accounts(self, live: _LiveTarget, users: list[str]) -> None:
        """Unbind ``users`` from ``live`` without ever leaving tgtd a hole in its account slots.

        tgt 1.0.85 keeps a target's accounts in an array, an unbind zeroes a slot, and both
        ``--op show`` and the CHAP login read only the first N slots (N = accounts left): a hole
        there makes ``show`` crash tgtd (SIGSEGV) and CHAP refuse the accounts behind it. So the
        accounts are unbound from the last slot backwards and those that stay are bound again
        (binds fill the lowest free slot). Meanwhile the target may have no account, when tgt
        would admit logins without CHAP: the ACL is closed for those milliseconds (new logins
        of the other hosts fail and are retried by their initiators) and restored after.
        """
        going = [u for u in live.accounts if u in users]
        if not going:
            return
        keep = [u for u in live.accounts if u not in going]
        at_tail = live.accounts[len(keep):] == going
        unbind = going if at_tail else list(live.accounts)
        closed = sorted(live.acl) if not keep or not at_tail else []
        for entry in closed:
            self._unbind_acl(live, _acl_kind(entry), entry)
        for user in reversed(unbind):
            try:
                self._iscsi(f"unbind account {user}", "--mode", "account", "--op", "unbind",
                            "--tid", str(live.tid), "--user", user)
            except _AdmError as exc:
                if not exc.says(_E_ABSENT):
                    raise
            live.accounts.remove(user)
        for user in keep:
            if user not in live.accounts:
                self._bind(f"bind account {user}", "--mode", "account", "--op", "bind",
                           "--tid", str(live.tid), "--user", user)
                live.accounts.append(user)
        if keep:
            for entry in closed:
                kind = _acl_kind(entry)
                self._bind(f"bind {entry} to {live.iqn}", "--mode", "target", "--op", "bind",
                           "--tid", str(live.tid), kind, entry)
                live.acl.add(entry)

    def _forget_account(self, live: _LiveTarget, user: str, view: _View) -> None:
        """Delete an unbound account of this target's key once no target holds it."""
        key = self._key_of(live.iqn)
        if key and user.startswith(f"{key}.") and not any(
            user in t.accounts for t in view.values()
        ):
            try:
                self._iscsi(f"delete account {user}", "--mode", "account", "--op", "delete", "--user", user)
            except _AdmError as exc:
                if not exc.says(_E_ABSENT):
                    raise

    def _teardown(self, key: str, view: _View, *, grace: float) -> None:
        """Remove the target of ``key``: ACL first (no new logins), then accounts, LUNs and
        the target itself, which tgtd refuses while a session is logged in (never forced)."""
        iqn = self.iqn(key)
        live = view.get(iqn)
        if live is None:
            return
        for entry in sorted(live.acl):
            self._unbind_acl(live, _acl_kind(entry), entry)
        users = list(live.accounts)
        self._unbind_accounts(live, users)
        for user in users:
            self._forget_account(live, user, view)
        deadline = time.monotonic() + grace
        try:
            for lun in sorted(n for n in live.luns if n != 0):  # LUN 0 is tgt's controller
                # Without its LUN a lingering client gets I/O errors, not a hang.
                self._until_idle(deadline, f"delete LUN {lun} of {iqn}", "--mode", "logicalunit",
                                 "--op", "delete", "--tid", str(live.tid), "--lun", str(lun))
                live.luns.pop(lun, None)
            self._until_idle(deadline, f"delete target {iqn}", "--mode", "target", "--op", "delete",
                             "--tid", str(live.tid))
        except _AdmError as exc:
            if exc.says(_E_ACTIVE):
                sessions = ", ".join(live.sessions) or "an initiator"
                raise DriverError(
                    f"target {iqn} still has a session logged in ({sessions}): unplug the disk on "
                    "that host first; the removal completes at the next remove or check") from exc
            raise
        del view[iqn]

    def _until_idle(self, deadline: float, step: str, *args: str) -> None:
        """Run a delete, retrying while tgtd says "still active" (in-flight I/O, a session logging
        out) until ``deadline``; "already gone" is success."""
        while True:
            try:
                self._iscsi(step, *args)
                return
            except _AdmError as exc:
                if exc.says(_E_ABSENT):
                    return
                if not exc.says(_E_ACTIVE) or time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)

    # -- the contract (hooks of SupervisedExportDriver) ----------------------------------------------

    def _connection(self, exp: _Export, grant: _Grant) -> IscsiConnection:
        return IscsiConnection(
            host=self.advertise_host, port=self.port, iqn=self.iqn(exp.key), lun=grant.lun,
            chap_user=grant.user, chap_secret=SecretStr(grant.secret), initiator_name=grant.initiator_name,
            tls="stunnel" if self._tunnel is not None else None,
        )

    def _hosts(self, item: _Export) -> set[str]:
        return set(item.grants)

    def _live_keys(self) -> set[str]:
        return {key for iqn, live in self._show().items() if live.accounts and (key := self._key_of(iqn))}

    def _check_source(self, source: ExportSource) -> None:
        # tgtd passes the backing store as "path=…,bstype=…,bsopts=…": a comma would split it, and
        # its rbd store splits bsopts on ";".
        named = source.conf if isinstance(source, RbdSource) else source.path
        if "," in str(named) or ";" in str(named):
            raise InvalidParameter(f"a path tgtd is given must not contain ',' or ';': {str(named)[:200]}")

    def _ensure(self, item: _Export | None, key: str, source: ExportSource, host: HostIdentity, read_only: bool
                ) -> Connection:
        """A LUN of the key's target for the host (its address in the ACL, its own CHAP account);
        the same (key, host) gets the same connection and secret. The LUN is 1 until a refresh
        (online resize): then the host's current one, or for a host that joins, the newest one.

        A second host on the same key (multi-attach) joins the same target with its own ACL
        entry and account. All hosts of a key share its mode: the read-only flag is per LUN.
        """
        exp = item or _Export(key=key, **ServedKey.fields_of(source), read_only=read_only)
        if isinstance(source, RbdSource):
            exp.image_size = source_size(key, source)
        if exp.read_only != read_only:
            raise IdempotentParameterMismatch(
                f"{key} is already exported with read_only={exp.read_only} to "
                f"{', '.join(sorted(exp.grants)) or 'no host'}; remove those exports first")
        # Through the tunnel every host arrives from stunnel on 127.0.0.1: its certificate, checked
        # by stunnel, stands in for its address.
        addresses = ["127.0.0.1"] if self._tunnel is not None else _acl_addresses(host.address)
        old = exp.grants.get(host.name)
        fresh: set[str] = set()
        if old is None:
            grant = _Grant(host=host.name, address=host.address, addresses=addresses,
                           initiator_name=host.initiator_name, user=self.chap_user(key, host.name),
                           secret=_new_secret(), lun=exp.lun)
            fresh.add(grant.user)
        else:
            # Same host, maybe a new address or initiator name: same account, secret and LUNs.
            grant = old.model_copy(update={"address": host.address, "addresses": addresses,
                                           "initiator_name": host.initiator_name})
        exp.grants[host.name] = grant
        self._desired[key] = exp
        self._doomed.discard(key)

        def undo() -> None:
            if old is None:
                del exp.grants[host.name]
            else:
                exp.grants[host.name] = old
            if item is None:
                del self._desired[key]

        with self._desired_first(undo):
            self._apply(exp, self._show(), fresh_users=fresh, tune=True)
            self._sync_tunnel()
        log.info("exported %s to %s over iSCSI as %s (read_only=%s)", key, host.name, self.iqn(key), read_only)
        return self._connection(exp, grant)

    def _remove(self, item: _Export | None, key: str, host_name: str) -> None:
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
        view = self._show()
        if item is not None and item.grants:
            self._apply(item, view)
            return
        live = view.get(self.iqn(key))
        user = self.chap_user(key, host_name)
        if live is not None and set(live.accounts) - {user}:
            # Accounts this agent does not know (a lost state file): leave those hosts be.
            self._unbind_accounts(live, [user])
            self._forget_account(live, user, view)
        elif live is not None:
            self._doomed.add(key)
            self._teardown(key, view, grace=self.session_grace)
            self._doomed.discard(key)

    def _list(self) -> list[ExportInfo]:
        """One entry per (key, host) account bound to a target of ours that has its LUN."""
        out: list[ExportInfo] = []
        for iqn, live in sorted(self._show().items()):
            key = self._key_of(iqn)
            if key is None or not set(live.luns) - {0}:
                continue  # not ours (an operator's target), or half-made
            exp = self._desired.get(key)
            hosts = {g.user: g.host for g in exp.grants.values()} if exp else {}
            for user in sorted(live.accounts):
                host = hosts.get(user) or user.removeprefix(f"{key}.")
                if host != user:
                    out.append(ExportInfo(key=key, host=host, protocol=self.protocol, target=iqn))
        return sorted(out, key=lambda e: (e.key, e.host))  # by key: names are sealed, their order is no one's

    # -- online resize ----------------------------------------------------------------------------

    def _refresh(self, item: _Export, host_name: str, size: int) -> Connection:
        """A LUN of the key's target that reports the file's current (grown) size: the newest LUN
        if it does already (another host refreshed first), else a new one. The LUN the host uses
        now keeps serving until ``retire_exports``. Same target, ACL and CHAP account; the
        connection differs in its LUN only."""
        exp, grant = item, item.grants[host_name]
        if exp.rbd is not None:
            exp.image_size = size  # a LUN made from now on opens the grown image
        view = self._show()
        # What should exist must, first (tgtd may have restarted): a LUN made now has the file's size.
        self._apply(exp, view)
        if exp.lun_sizes.get(grant.lun) == size:
            return self._connection(exp, grant)
        before = (exp.lun, grant.lun, list(grant.old_luns))
        if exp.lun_sizes.get(exp.lun) != size:
            live = view.get(self.iqn(exp.key))
            taken = exp.wanted_luns() | (set(live.luns) if live is not None else set())
            free = [n for n in range(1, 256) if n not in taken]
            if not free:
                raise DriverError(f"target {self.iqn(exp.key)} has no free LUN number")
            exp.lun = free[0]
        if grant.lun not in grant.old_luns:
            grant.old_luns.append(grant.lun)
        grant.lun = exp.lun

        def undo() -> None:
            exp.lun, grant.lun, grant.old_luns = before
            try:
                self._apply(exp, self._show())  # drops a half-made LUN
            except DriverError as exc:
                log.error("could not roll back the refresh of %s: %s", exp.key, exc.message)

        with self._desired_first(undo):  # after a crash, check() makes the LUN
            self._apply(exp, view)
        log.info("refreshed the iSCSI export of %s for %s: LUN %d serves %d bytes",
                 exp.key, host_name, grant.lun, exp.lun_sizes.get(grant.lun, 0))
        return self._connection(exp, grant)

    def _retire(self, item: _Export, host_name: str) -> None:
        """Forget the LUNs the host used before its refreshes and delete those no other host uses
        (a client still on one gets I/O errors)."""
        grant = item.grants[host_name]
        if grant.old_luns:
            retired, grant.old_luns = grant.old_luns, []
            self._save()
            log.info("retired LUN(s) %s of %s for %s", retired, item.key, host_name)
        if self._running():
            self._apply(item, self._show())  # also finishes a retire a crash interrupted
