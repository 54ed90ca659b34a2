"""iSCSI exports from one userspace tgtd per storage agent, driven with tgtadm (argv, timeouts).

One target per volume (``<iqn_prefix>:<volume_id>``), LUN 1 backed by the volume file, an address
ACL entry and a CHAP account per (volume, host); desired state survives tgtd and agent restarts.

Online resize: tgt reads a LUN's size when the LUN is made and never again (no tgtadm parameter
changes it; QEMU's initiator re-reads the capacity on ``block_resize`` but gets the old one). So
``refresh_export`` adds another LUN on the same target, backed by the same (grown) file: the host
logs in to it next to its current session (same ACL and CHAP account) and moves its disk over, then
``retire_exports`` deletes the LUN it left. Each host's grant names the LUN it uses and the ones
it may still be using; a LUN is kept while any grant names it, so hosts of a multi-attached volume
move independently and share the newest LUN. Numbers are reused: a lone host alternates 1 and 2.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import logging
import os
import re
import secrets
import signal
import socket
import string
import subprocess
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import SecretStr

from vbs import ids
from vbs.argv import run
from vbs.connection import HOST_NAME_RE, Connection, HostIdentity, IscsiConnection
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, NotFound
from vbs.files import write_private
from vbs.processes import cmdline, environ_value, pid_alive
from vbs.runtime import socket_path
from vbs.storage.exports.base import ExportInfo

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
# (mode 0600) so that check() and a restarted agent re-create the same accounts. tgtadm takes the
# secret only as an argument: it is visible in /proc/<pid>/cmdline of that tgtadm (to local users)
# for the few milliseconds it runs. Secrets are never logged.

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
_STATE_VERSION = 1
_SECRET_ALPHABET = string.ascii_letters + string.digits  # safe in URLs, configs and every initiator
_SECRET_LEN = 24  # iSCSI wants at least 12 (96 bits); 24 alphanumerics are about 143 bits
_CHAP_USER_MAX = 64  # IscsiConnection.chap_user limit
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path minus the NUL; tgtd truncates longer paths silently
_CONTROL_MAX = 32767  # tgtd and tgtadm refuse a larger -C
_WILDCARDS = {"0.0.0.0", "::", ""}
_PREFIX_RE = re.compile(r"^iqn\.\d{4}-\d{2}\.[a-z0-9.-]+$")
_LISTEN_RE = re.compile(r"^[0-9a-fA-F.:]{2,45}$|^[a-z0-9][a-z0-9.-]{0,252}$")

# tgtadm's error strings (tgtadm_strerror); its exit code is 22 for all of them.
_E_EXISTS = ("already exists",)
_E_ABSENT = ("can't find", "does not exist")
_E_ACTIVE = ("still active",)


# -- desired state --------------------------------------------------------------------------------


@dataclass
class _Grant:
    """One host's access to one volume: its ACL addresses and its CHAP account."""

    host: str
    address: str  # as the host identity gave it
    addresses: list[str]  # numeric, what the ACL holds (resolved once, not at every check)
    initiator_name: str | None
    user: str
    secret: str
    lun: int = LUN  # the LUN this host is given
    old_luns: list[int] = field(default_factory=list)  # LUNs it may still use until retire_exports


@dataclass
class _Export:
    """One volume as it should be served: one target, its LUNs, one grant per host."""

    volume_id: str
    path: str
    read_only: bool
    grants: dict[str, _Grant] = field(default_factory=dict)
    lun: int = LUN  # the newest LUN: a host that joins gets this one
    lun_sizes: dict[int, int] = field(default_factory=dict)  # file size when tgtd made each LUN

    def wanted_luns(self) -> set[int]:
        return {n for g in self.grants.values() for n in (g.lun, *g.old_luns)} or {self.lun}


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


def _parse_portals(text: str) -> set[str]:
    return {line.split("Portal: ", 1)[1].rsplit(",", 1)[0] for line in text.splitlines() if "Portal: " in line}


# -- processes ------------------------------------------------------------------------------------


def _acl_kind(entry: str) -> str:
    """The tgtadm option that unbinds an ACL entry as ``--op show`` lists it."""
    return "--initiator-name" if entry.startswith(("iqn.", "eui.", "naa.")) else "--initiator-address"


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


class IscsiExportDriver:
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
        advertise_host: str | None = None,
        direct_io: bool = True,
        adm_timeout: float = 10.0,
        start_timeout: float = 15.0,
        session_grace: float = 10.0,
    ) -> None:
        if not 1 <= port <= 65535:
            raise InvalidParameter(f"port out of range: {port}")
        if not 0 <= control_port <= _CONTROL_MAX:
            raise InvalidParameter(f"control_port must be 0-{_CONTROL_MAX} (tgtd -C), not {control_port}")
        if not _PREFIX_RE.match(iqn_prefix):
            raise InvalidParameter(f"invalid IQN prefix {iqn_prefix[:80]!r} (expecting iqn.YYYY-MM.domain)")
        try:
            # A literal: tgtd reports its portal numerically, and start-up compares the two.
            listen_host = str(ipaddress.ip_address(listen_host))
        except ValueError:
            raise InvalidParameter(f"listen_host must be an IP address, not {listen_host[:80]!r}") from None
        if advertise_host is not None and not _LISTEN_RE.match(advertise_host):
            raise InvalidParameter(f"invalid advertise_host: {advertise_host[:80]!r}")
        advertised = advertise_host or listen_host
        if advertised in _WILDCARDS:
            raise InvalidParameter("listen_host is a wildcard: set advertise_host to the address clients use")
        self.state_dir = Path(state_dir).absolute()
        self.listen_host = listen_host
        self.port = port
        self.control_port = control_port
        self.iqn_prefix = iqn_prefix
        self.advertise_host = advertised
        self.direct_io = direct_io
        self.adm_timeout = adm_timeout
        self.start_timeout = start_timeout
        self.session_grace = session_grace

        # Our own control socket inside state_dir: tests, several agents and a system tgtd (which
        # uses /var/run/tgtd/socket.N) never share one. tgtd appends ".<control_port>".
        self.socket_base = socket_path(self.state_dir, "tgtd.sock")
        control_socket = f"{self.socket_base}.{control_port}"
        if len(control_socket.encode()) > _SUN_PATH_MAX:
            raise InvalidParameter(
                f"state_dir too long for a unix socket path ({len(control_socket)} > {_SUN_PATH_MAX} bytes): "
                f"{control_socket}")
        self.pid_path = self.state_dir / "tgtd.pid"  # tgtd -f ignores -p: we write it ourselves
        self.log_path = self.state_dir / "tgtd.log"
        self.state_path = self.state_dir / "exports.json"
        host = f"[{listen_host}]" if ":" in listen_host else listen_host
        self.portal = f"{host}:{port}"
        self._env = {**os.environ, "TGT_IPC_SOCKET": str(self.socket_base)}

        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._desired: dict[str, _Export] = {}
        self._doomed: set[str] = set()  # volumes whose target teardown is unfinished (sessions)
        self._loaded = False

    # -- names ------------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """PID of the tgtd this driver runs or adopted (None when stopped)."""
        return self._pid

    def iqn(self, volume_id: str) -> str:
        return f"{self.iqn_prefix}:{volume_id}"

    def _volume_of(self, iqn: str) -> str | None:
        prefix = f"{self.iqn_prefix}:"
        vol = iqn[len(prefix):] if iqn.startswith(prefix) else ""
        return vol if ids.is_valid("volume", vol) else None

    @staticmethod
    def chap_user(volume_id: str, host_name: str) -> str:
        """The CHAP account of (volume, host): readable where it fits, deterministic always.

        tgt accounts are global to the daemon, so the volume id is part of the name.
        """
        user = f"{volume_id}.{host_name}"
        if len(user) <= _CHAP_USER_MAX:
            return user
        return f"{volume_id}.h{hashlib.sha256(host_name.encode()).hexdigest()[:24]}"

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

    def _show(self) -> dict[str, _LiveTarget]:
        return parse_targets(self._iscsi("show targets", "--mode", "target", "--op", "show"))

    def _accounts(self) -> set[str]:
        out = self._iscsi("show accounts", "--mode", "account", "--op", "show")
        return {line.strip() for line in out.splitlines()[1:] if line.strip()}

    # -- daemon lifecycle -------------------------------------------------------------------------

    def _argv(self) -> list[str]:
        return [TGTD, "-f", "-C", str(self.control_port), "--iscsi", f"portal={self.portal}"]

    def _is_ours(self, pid: int) -> bool:
        """A live tgtd on our control socket (guards against a reused PID: never signal a stranger)."""
        argv = cmdline(pid)
        if not (pid_alive(pid) and argv and Path(argv[0]).name == TGTD):
            return False
        if argv[1:4] != ["-f", "-C", str(self.control_port)]:
            return False
        env = environ_value(pid, "TGT_IPC_SOCKET")
        return env is None or env == str(self.socket_base)

    def _running(self) -> bool:
        if self._pid is None:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        return self._is_ours(self._pid)

    def start(self) -> None:
        """Start tgtd, or adopt the one an earlier agent left, and create every desired export."""
        with self._lock:
            self._load_state()
            if self._running():
                return
            self._ensure_daemon()
            self._reconcile()

    def _ensure_daemon(self) -> None:
        if not self._adopt():
            self._spawn()

    def _adopt(self) -> bool:
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return False
        if not self._is_ours(pid):
            return False
        self._pid, self._proc = pid, None
        if cmdline(pid)[1:] != self._argv()[1:]:
            log.warning("tgtd pid %d listens elsewhere than %s: restarting it", pid, self.portal)
            self._terminate()
            return False
        try:
            self._adm("probe", "--mode", "sys", "--op", "show")
        except DriverError as exc:
            # Management and I/O share one event loop in tgtd: a daemon that does not answer here
            # serves no I/O either, so replacing it costs the clients nothing more.
            log.warning("tgtd pid %d does not answer (%s): restarting it", pid, exc.message)
            self._terminate()
            return False
        log.info("adopted tgtd pid %d", pid)
        return True

    def _spawn(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        logf = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed just below
        try:
            # A new session: tgtd outlives the agent (the next agent adopts it, so attached hosts
            # keep their sessions) and does not get the agent's terminal signals.
            proc = subprocess.Popen(  # noqa: S603 - argv list, no shell
                self._argv(), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                env=self._env, start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise DriverError(f"{TGTD}: not installed") from exc
        finally:
            logf.close()
        self._proc, self._pid = proc, proc.pid
        write_private(self.pid_path, f"{proc.pid}\n")
        deadline = time.monotonic() + self.start_timeout
        while True:
            if proc.poll() is not None:
                self._terminate()
                raise DriverError(f"{TGTD} exited at start: {self._log_tail(log_start)}")
            try:
                portals = _parse_portals(self._adm("show portals", "--mode", "portal", "--op", "show"))
                break
            except DriverError as exc:
                if time.monotonic() >= deadline:
                    self._terminate()
                    raise DriverError(f"{TGTD} did not answer within {self.start_timeout:g}s: "
                                      f"{exc.message}; {self._log_tail(log_start)}") from exc
                time.sleep(0.02)
        if portals != {self.portal}:
            # tgtd falls back to 0.0.0.0:3260 when it cannot bind the portal: never serve that.
            self._terminate()
            raise DriverError(f"{TGTD} could not listen on {self.portal} (port in use?); it offered "
                              f"{sorted(portals)}: {self._log_tail(log_start)}")
        log.info("started tgtd pid %d on %s (control %d)", proc.pid, self.portal, self.control_port)

    def _log_tail(self, start: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return "(no log)"
        return text[-400:] or "(no output)"

    def stop(self) -> None:
        """Stop tgtd: go offline, delete every target, ``--op delete --mode system``, wait for the
        PID, SIGKILL by PID as the last resort (tgtd ignores SIGTERM).

        Targets are deleted with ``--force``: the daemon is going away, which closes every session
        anyway. The desired exports are kept: ``start()`` brings them back.
        """
        with self._lock:
            if self._pid is None:
                try:
                    pid = int(self.pid_path.read_text().strip())
                except (OSError, ValueError):
                    return
                if not self._is_ours(pid):
                    return
                self._pid = pid
            asked = False
            if self._running():
                try:
                    self._adm("go offline", "--mode", "sys", "--op", "update", "--name", "State",
                              "-v", "offline")
                    for live in self._show().values():
                        self._iscsi(f"delete target {live.iqn}", "--mode", "target", "--op", "delete",
                                    "--force", "--tid", str(live.tid))
                    self._adm("shut down", "--op", "delete", "--mode", "system")
                    asked = True
                except DriverError as exc:
                    log.warning("tgtd pid %s did not shut down cleanly: %s", self._pid, exc.message)
            # Asked to exit: give it time to close its sessions. Otherwise only SIGKILL works.
            self._terminate(grace=10.0 if asked else 0.0)
            self._doomed.clear()
            log.info("stopped tgtd")

    def close(self) -> None:
        """Let go of tgtd without stopping it: exports keep serving and the next agent adopts it."""
        with self._lock:
            self._proc, self._pid = None, None

    def _terminate(self, grace: float = 0.0) -> None:
        """Make sure tgtd is gone: wait ``grace`` for it to exit, then SIGKILL it by PID."""
        pid, proc = self._pid, self._proc
        if pid is not None:
            for sig, wait in ((None, grace), (signal.SIGKILL, 5.0)):
                if proc is None and not self._is_ours(pid):
                    break  # an adopted daemon that is gone: its PID may belong to someone else now
                if sig is not None:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                if self._wait_exit(pid, proc, wait):
                    break
            else:
                raise DriverError(f"{TGTD} pid {pid} survived SIGKILL")
        self._pid, self._proc = None, None
        self.pid_path.unlink(missing_ok=True)

    @staticmethod
    def _wait_exit(pid: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            gone = proc.poll() is not None if proc is not None else not pid_alive(pid)
            if gone:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def check(self) -> None:
        """Restart a dead or hung tgtd and re-create every target, ACL and account that should exist,
        with the same IQNs and CHAP secrets: initiators that reconnect resume. Also finishes target
        removals that were waiting for sessions to log out."""
        with self._lock:
            self._load_state()
            view: dict[str, _LiveTarget] | None = None
            if self._running():
                for attempt in (1, 2):
                    try:
                        view = self._show()
                        break
                    except DriverError as exc:
                        if attempt == 2:
                            log.warning("tgtd pid %s does not answer (%s): restarting it, "
                                        "%d volumes to re-export", self._pid, exc.message,
                                        len(self._desired))
                        else:
                            time.sleep(0.5)  # one slow answer is not a hang
            elif self._pid is not None:
                log.warning("tgtd pid %s is gone: restarting it, %d volumes to re-export",
                            self._pid, len(self._desired))
            if view is None:
                if self._pid is not None:
                    self._terminate()
                self._ensure_daemon()  # adopts a tgtd left by an earlier agent, else starts one
            self._reconcile(view)

    def _reconcile(self, view: dict[str, _LiveTarget] | None = None) -> None:
        """Create in tgtd whatever desired state it lacks (after a restart or an adoption)."""
        view = self._show() if view is None else view
        failed: list[str] = []
        for exp in list(self._desired.values()):
            try:
                self._apply(exp, view)
            except DriverError as exc:
                # One missing volume file must not keep every other host from its disk.
                log.error("re-creating the iSCSI export of %s failed: %s", exp.volume_id, exc.message)
                failed.append(exp.volume_id)
        for volume_id in sorted(self._doomed - set(self._desired)):
            try:
                self._teardown(volume_id, view, grace=0.0)
                self._doomed.discard(volume_id)
            except DriverError as exc:
                log.info("target of %s still not removable: %s", volume_id, exc.message)
        if failed:
            raise DriverError(f"could not re-create the iSCSI exports of {', '.join(failed)}")

    # -- applying desired state -------------------------------------------------------------------

    def _apply(self, exp: _Export, view: dict[str, _LiveTarget], *, fresh_users: AbstractSet[str] = frozenset(),
               tune: bool = False) -> None:
        """Make tgtd's target for ``exp`` match it; ``view`` is updated as tgtd changes.

        ``fresh_users``: accounts whose secret is new, re-created even if tgtd has an account of
        that name (left by a lost state: its secret is unknown). ``tune``: set the negotiation
        parameters even on an existing target.
        """
        iqn = self.iqn(exp.volume_id)
        live = view.get(iqn)
        created = live is None
        if live is None:
            tid = max((t.tid for t in view.values()), default=0) + 1
            self._iscsi(f"create target {iqn}", "--mode", "target", "--op", "new", "--tid", str(tid),
                        "--targetname", iqn)
            live = view[iqn] = _LiveTarget(tid=tid, iqn=iqn)
        try:
            if self._apply_target(exp, live, view, fresh_users=fresh_users, tune=tune or created):
                self._save_state()  # the sizes of new LUNs, which a refresh compares with the file's
        except DriverError:
            if created:  # no half-made target: the caller sees the error, tgtd sees nothing
                try:
                    self._teardown(exp.volume_id, view, grace=0.0)
                except DriverError as exc:
                    log.error("could not remove the half-made target %s: %s", iqn, exc.message)
            raise

    def _apply_target(self, exp: _Export, live: _LiveTarget, view: dict[str, _LiveTarget], *,
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
                argv = ["--mode", "logicalunit", "--op", "new", "--tid", tid, "--lun", str(n),
                        "--backing-store", exp.path, "--bstype", "rdwr"]
                if self.direct_io and self._direct_ok(exp.path):
                    argv += ["--bsoflags", "direct"]
                try:
                    size = os.stat(exp.path).st_size  # what tgtd reads as it opens the file just below
                except OSError as exc:
                    raise DriverError(f"volume file {exp.path} of {exp.volume_id}: {exc.strerror}") from exc
                self._iscsi(f"create LUN {n} of {live.iqn}", *argv)
                lun = live.luns[n] = _LiveLun(path=exp.path)
                exp.lun_sizes[n] = size
                sizes_changed = True
            elif lun.path != exp.path:
                raise DriverError(f"target {live.iqn} serves {lun.path} as LUN {n}, not {exp.path}")
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

    def _create_account(self, grant: _Grant, view: dict[str, _LiveTarget]) -> None:
        if grant.user in self._accounts():
            # An account of that name whose secret is not ours (or not known to be): replace it,
            # unbound everywhere first (deleting a bound account leaves the same hole as below).
            for other in view.values():
                self._unbind_accounts(other, [grant.user])
            self._iscsi(f"delete account {grant.user}", "--mode", "account", "--op", "delete",
                        "--user", grant.user)
        # The secret is in this argv for the life of one tgtadm (see the notes at the top of this module).
        self._iscsi(f"create account {grant.user}", "--mode", "account", "--op", "new",
                    "--user", grant.user, "--password", grant.secret)

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

    def _forget_account(self, live: _LiveTarget, user: str, view: dict[str, _LiveTarget]) -> None:
        """Delete an unbound account of this target's volume once no target holds it."""
        volume_id = self._volume_of(live.iqn)
        if volume_id and user.startswith(f"{volume_id}.") and not any(
            user in t.accounts for t in view.values()
        ):
            try:
                self._iscsi(f"delete account {user}", "--mode", "account", "--op", "delete", "--user", user)
            except _AdmError as exc:
                if not exc.says(_E_ABSENT):
                    raise

    def _teardown(self, volume_id: str, view: dict[str, _LiveTarget], *, grace: float) -> None:
        """Remove the target of ``volume_id``: ACL first (no new logins), then accounts, LUNs and
        the target itself, which tgtd refuses while a session is logged in (never forced)."""
        iqn = self.iqn(volume_id)
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

    # -- persisted desired state ------------------------------------------------------------------

    def _load_state(self) -> None:
        if self._loaded:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            data = json.loads(self.state_path.read_text())
            items = data["exports"] if data.get("version") == _STATE_VERSION else []
            for item in items:
                grants = {g["host"]: _Grant(**g) for g in item.pop("grants")}
                # JSON keys are strings
                item["lun_sizes"] = {int(n): int(size) for n, size in item.get("lun_sizes", {}).items()}
                exp = _Export(**item, grants=grants)
                self._desired[exp.volume_id] = exp
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DriverError(f"unreadable export state {self.state_path}: {exc}") from exc
        self._loaded = True

    def _save_state(self) -> None:
        exports = []
        for exp in self._desired.values():
            item = asdict(exp)
            item["grants"] = list(item["grants"].values())
            exports.append(item)
        data = {"version": _STATE_VERSION, "exports": exports}
        write_private(self.state_path, json.dumps(data, indent=1) + "\n")


    # -- the contract -----------------------------------------------------------------------------

    def _connection(self, exp: _Export, grant: _Grant) -> IscsiConnection:
        return IscsiConnection(
            host=self.advertise_host, port=self.port, iqn=self.iqn(exp.volume_id), lun=grant.lun,
            chap_user=grant.user, chap_secret=SecretStr(grant.secret),
            initiator_name=grant.initiator_name,
        )

    def ensure_export(
        self, volume_id: str, path: Path, host: HostIdentity, *, read_only: bool = False
    ) -> Connection:
        """Serve ``path`` as a LUN of the volume's target to ``host`` (its address in the ACL, its
        own CHAP account); idempotent: the same (volume, host) gets the same connection and secret.
        The LUN is 1 until a refresh (online resize): then the host's current one, or for a host
        that joins, the newest one.

        A second host on the same volume (multi-attach) joins the same target with its own ACL
        entry and account. All hosts of a volume share its mode: the read-only flag is per LUN.
        """
        ids.check("volume", volume_id)
        path = Path(path)
        if not path.is_absolute():
            raise InvalidParameter(f"volume path must be absolute: {path}")
        if "," in str(path):
            # tgtd passes the backing store as "path=…,bstype=…": a comma would split it.
            raise InvalidParameter(f"volume path must not contain a comma: {path}")
        if not path.exists():
            raise NotFound(f"volume file {path} of {volume_id} does not exist", code="InvalidVolume.NotFound")
        addresses = _acl_addresses(host.address)
        with self._lock:
            self._load_state()
            exp = self._desired.get(volume_id)
            new_export = exp is None
            if exp is None:
                exp = _Export(volume_id=volume_id, path=str(path), read_only=read_only)
            elif exp.path != str(path) or exp.read_only != read_only:
                raise IdempotentParameterMismatch(
                    f"{volume_id} is already exported from {exp.path} (read_only={exp.read_only}) "
                    f"to {', '.join(sorted(exp.grants)) or 'no host'}; remove those exports first")
            old = exp.grants.get(host.name)
            fresh: set[str] = set()
            if old is None:
                grant = _Grant(host=host.name, address=host.address, addresses=addresses,
                               initiator_name=host.initiator_name,
                               user=self.chap_user(volume_id, host.name), secret=_new_secret(), lun=exp.lun)
                fresh.add(grant.user)
            else:
                # Same host, maybe a new address or initiator name: same account, secret and LUNs.
                grant = _Grant(host=host.name, address=host.address, addresses=addresses,
                               initiator_name=host.initiator_name, user=old.user, secret=old.secret,
                               lun=old.lun, old_luns=list(old.old_luns))
            exp.grants[host.name] = grant
            # Desired state first: a crash after this point leaves an export that check() or the
            # next start() re-creates, never one the agent does not know about.
            self._desired[volume_id] = exp
            self._doomed.discard(volume_id)
            try:
                self._save_state()
                started = not self._running()
                if started:
                    self._ensure_daemon()
                view = self._show()
                self._apply(exp, view, fresh_users=fresh, tune=True)
                if started:
                    try:
                        self._reconcile(view)
                    except DriverError:
                        pass  # logged per volume; other volumes' trouble is not this caller's
            except Exception:
                if old is None:
                    exp.grants.pop(host.name, None)
                else:
                    exp.grants[host.name] = old
                if new_export:
                    self._desired.pop(volume_id, None)
                self._best_effort_save()
                raise
            log.info("exported %s to %s over iSCSI as %s (read_only=%s)",
                     volume_id, host.name, self.iqn(volume_id), read_only)
            return self._connection(exp, grant)

    def _best_effort_save(self) -> None:
        try:
            self._save_state()
        except OSError as exc:
            log.error("could not roll back export state: %s", exc)

    def remove_export(self, volume_id: str, host_name: str) -> None:
        """Withdraw ``host_name``'s access to ``volume_id`` (its ACL entry and account); with the
        last host, delete the LUN and then the target. Idempotent: absent is success.

        The caller must have unplugged the disk on that host first: tgtd refuses to delete a target
        under a logged-in session (forcing it would hang that client forever). In that case this
        raises ``DriverError`` once ``session_grace`` has passed, with the ACL and accounts already
        gone so the initiator cannot log in again; the next call or ``check()`` finishes the job.
        """
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name: {host_name[:80]!r}")
        with self._lock:
            self._load_state()
            exp = self._desired.get(volume_id)
            if exp is not None and host_name in exp.grants:
                del exp.grants[host_name]
                if not exp.grants:
                    del self._desired[volume_id]
                self._save_state()
            if not self._running():
                return  # nothing live to change; check() will not re-create what is no longer desired
            view = self._show()
            exp = self._desired.get(volume_id)
            if exp is not None:
                self._apply(exp, view)
            else:
                live = view.get(self.iqn(volume_id))
                user = self.chap_user(volume_id, host_name)
                if live is not None and set(live.accounts) - {user}:
                    # Accounts this agent does not know (a lost state file): leave those hosts be.
                    self._unbind_accounts(live, [user])
                    self._forget_account(live, user, view)
                elif live is not None:
                    self._doomed.add(volume_id)
                    self._teardown(volume_id, view, grace=self.session_grace)
                    self._doomed.discard(volume_id)
            log.info("removed the iSCSI export of %s for %s", volume_id, host_name)

    def list_exports(self) -> list[ExportInfo]:
        """One entry per (volume, host) account bound to a target of ours that has its LUN."""
        with self._lock:
            self._load_state()
            if not self._running():
                return []
            out: list[ExportInfo] = []
            for iqn, live in sorted(self._show().items()):
                volume_id = self._volume_of(iqn)
                if volume_id is None or not set(live.luns) - {0}:
                    continue  # not ours (an operator's target), or half-made
                exp = self._desired.get(volume_id)
                hosts = {g.user: g.host for g in exp.grants.values()} if exp else {}
                for user in sorted(live.accounts):
                    host = hosts.get(user) or user.removeprefix(f"{volume_id}.")
                    if host != user:
                        out.append(ExportInfo(volume_id=volume_id, host=host, protocol=self.protocol,
                                              target=iqn))
            return out

    # -- online resize ----------------------------------------------------------------------------

    def refresh_export(self, volume_id: str, path: Path, host_name: str) -> Connection:
        """Give ``host_name`` a LUN of the volume's target that reports the file's current (grown)
        size: the newest LUN if it does already (another host refreshed first), else a new one.
        The LUN the host uses now keeps serving until ``retire_exports``. Same target, ACL and
        CHAP account; the connection differs in its LUN only. Idempotent.
        """
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name: {host_name[:80]!r}")
        path = Path(path)
        with self._lock:
            self._load_state()
            exp = self._desired.get(volume_id)
            grant = exp.grants.get(host_name) if exp is not None else None
            if exp is None or grant is None:
                raise NotFound(f"{volume_id} is not exported to {host_name}", code="InvalidAttachment.NotFound")
            if exp.path != str(path):
                raise IdempotentParameterMismatch(f"{volume_id} is exported from {exp.path}, not {path}")
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise NotFound(f"volume file {path} of {volume_id} does not exist",
                               code="InvalidVolume.NotFound") from None
            if not self._running():
                self._ensure_daemon()
                try:
                    self._reconcile()
                except DriverError:
                    pass  # logged per volume; other volumes' trouble is not this caller's
            view = self._show()
            # What should exist must, first (tgtd may have restarted): a LUN made now has the file's size.
            self._apply(exp, view)
            if exp.lun_sizes.get(grant.lun) == size:
                return self._connection(exp, grant)
            before = (exp.lun, grant.lun, list(grant.old_luns))
            if exp.lun_sizes.get(exp.lun) != size:
                live = view.get(self.iqn(volume_id))
                taken = exp.wanted_luns() | (set(live.luns) if live is not None else set())
                free = [n for n in range(1, 256) if n not in taken]
                if not free:
                    raise DriverError(f"target {self.iqn(volume_id)} has no free LUN number")
                exp.lun = free[0]
            if grant.lun not in grant.old_luns:
                grant.old_luns.append(grant.lun)
            grant.lun = exp.lun
            try:
                self._save_state()  # desired state first: after a crash, check() makes the LUN
                self._apply(exp, view)
            except Exception:
                exp.lun, grant.lun, grant.old_luns = before
                self._best_effort_save()
                try:
                    self._apply(exp, self._show())  # drops a half-made LUN
                except DriverError as exc:
                    log.error("could not roll back the refresh of %s: %s", volume_id, exc.message)
                raise
            log.info("refreshed the iSCSI export of %s for %s: LUN %d serves %d bytes",
                     volume_id, host_name, grant.lun, exp.lun_sizes.get(grant.lun, 0))
            return self._connection(exp, grant)

    def retire_exports(self, volume_id: str, host_name: str) -> None:
        """Forget the LUNs ``host_name`` used before its refreshes and delete those no other host
        uses (a client still on one gets I/O errors). Idempotent."""
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name: {host_name[:80]!r}")
        with self._lock:
            self._load_state()
            exp = self._desired.get(volume_id)
            grant = exp.grants.get(host_name) if exp is not None else None
            if exp is None or grant is None:
                return
            if grant.old_luns:
                retired, grant.old_luns = grant.old_luns, []
                self._save_state()
                log.info("retired LUN(s) %s of %s for %s", retired, volume_id, host_name)
            if self._running():
                self._apply(exp, self._show())  # also finishes a retire a crash interrupted
