"""tgtd's control: its command line, and each request the driver makes of it, sent on its management
socket (``tgt_ipc``: no tgtadm process, no argv, no environment), with tgtd's error codes kept to
tell benign failures apart."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from vbs.errors import DriverError
from vbs.storage.exports import tgt_ipc
from vbs.storage.exports.tgt_ipc import Errno, Mode, Op, Request
from vbs.system.daemons import DaemonSpec, argv0_is
from vbs.system.processes import cmdline, environ_value

from .state import LiveTarget, View, parse_portals, parse_targets

TGTD = "tgtd"

E_EXISTS = frozenset({Errno.TARGET_EXIST, Errno.LUN_EXIST, Errno.BINDING_EXIST, Errno.ACL_EXIST, Errno.USER_EXIST})
E_ABSENT = frozenset({Errno.NO_TARGET, Errno.NO_LUN, Errno.NO_SESSION, Errno.NO_CONNECTION, Errno.NO_BINDING,
                      Errno.ACL_NOEXIST, Errno.NO_USER})
E_ACTIVE = frozenset({Errno.TARGET_ACTIVE, Errno.LUN_ACTIVE})

AclKind = Literal["initiator-address", "initiator-name"]  # tgtadm's --initiator-address / --initiator-name


class AdmError(DriverError):
    """A request tgtd refused (``tgt_errno``: its ``tgtadm_errno``) or that got no answer (``tgt_errno``
    None: unreachable, timed out, or tgtd closed the socket as it died under the request)."""

    def __init__(self, step: str, detail: str, tgt_errno: int | None) -> None:
        super().__init__(f"tgtd {step}: {detail}")
        self.detail, self.tgt_errno = detail, tgt_errno

    def says(self, codes: frozenset[Errno]) -> bool:
        return self.tgt_errno in codes


def tgtd_spec(state_dir: Path, control_port: int, portal: str, owns: Callable[[int], bool], env: dict[str, str],
              start_timeout: float) -> DaemonSpec:
    return DaemonSpec(
        name=TGTD, argv=(TGTD, "-f", "-C", str(control_port), "--iscsi", f"portal={portal}"),
        pid_path=state_dir / "tgtd.pid",  # tgtd -f ignores -p: the supervisor writes it
        log_path=state_dir / "tgtd.log", owns=owns, env=env,
        stop_signals=(signal.SIGKILL,),  # tgtd ignores SIGTERM
        start_timeout=start_timeout)


class TgtControl:
    """The requests the driver makes of one tgtd, each on its management socket ``<socket_base>.<control_port>``
    within ``timeout`` seconds. Failures name the step (never a value that may be a secret)."""

    def __init__(self, control_port: int, socket_base: Path, timeout: float) -> None:
        self.control_port, self.socket_base, self.timeout = control_port, socket_base, timeout
        self.control_socket = Path(f"{socket_base}.{control_port}")

    def is_ours(self, pid: int) -> bool:
        """A live tgtd on our control socket (guards against a reused PID: never signal a stranger)."""
        if not argv0_is(pid, TGTD) or cmdline(pid)[1:4] != ["-f", "-C", str(self.control_port)]:
            return False
        env = environ_value(pid, "TGT_IPC_SOCKET")
        return env is None or env == str(self.socket_base)

    def call(self, step: str, req: Request) -> str:
        """Send one request; its text answer. ``AdmError`` names ``step``."""
        try:
            return tgt_ipc.exchange(self.control_socket, req, self.timeout)
        except tgt_ipc.TgtIpcError as exc:
            raise AdmError(step, exc.message, exc.tgt_errno) from exc

    # -- the daemon ------------------------------------------------------------------------------------

    def probe(self) -> None:
        self.call("probe", Request(Mode.SYSTEM, Op.SHOW, lld=""))

    def portals(self) -> set[str]:
        return parse_portals(self.call("show portals", Request(Mode.PORTAL, Op.SHOW, lld="")))

    def go_offline(self) -> None:
        self.call("go offline", Request(Mode.SYSTEM, Op.UPDATE, (("State", "offline"),), lld=""))

    def shut_down(self) -> None:
        """tgtd exits once it answered (it has no targets left)."""
        self.call("shut down", Request(Mode.SYSTEM, Op.DELETE, lld=""))

    # -- targets ---------------------------------------------------------------------------------------

    def show(self) -> View:
        return parse_targets(self.call("show targets", Request(Mode.TARGET, Op.SHOW)))

    def new_target(self, tid: int, iqn: str) -> None:
        self.call(f"create target {iqn}", Request(Mode.TARGET, Op.NEW, (("targetname", iqn),), tid=tid))

    def delete_target(self, live: LiveTarget, *, force: bool = False) -> None:
        self.call(f"delete target {live.iqn}", Request(Mode.TARGET, Op.DELETE, tid=live.tid, force=force))

    def set_param(self, live: LiveTarget, name: str, value: str) -> None:
        """A target's iSCSI parameter (what a login negotiates)."""
        self.call(f"set {name} on {live.iqn}", Request(Mode.TARGET, Op.UPDATE, ((name, value),), tid=live.tid))

    def bind_acl(self, live: LiveTarget, kind: AclKind, entry: str) -> None:
        """Admit logins from an address (or an initiator name); one tgtd already has is fine."""
        try:
            self.call(f"bind {entry} to {live.iqn}", Request(Mode.TARGET, Op.BIND, ((kind, entry),), tid=live.tid))
        except AdmError as exc:
            if not exc.says(E_EXISTS):
                raise

    def unbind_acl(self, live: LiveTarget, kind: AclKind, entry: str) -> None:
        self.call(f"unbind {entry} from {live.iqn}", Request(Mode.TARGET, Op.UNBIND, ((kind, entry),), tid=live.tid))

    # -- logical units -------------------------------------------------------------------------------

    def new_lun(self, live: LiveTarget, lun: int, store: tuple[tuple[str, tgt_ipc.Value], ...]) -> None:
        """``store``: the backing store's fields (path, bstype, bsopts, bsoflags)."""
        self.call(f"create LUN {lun} of {live.iqn}",
                  Request(Mode.DEVICE, Op.NEW, store, tid=live.tid, lun=lun))

    def set_lun_params(self, live: LiveTarget, lun: int, params: tuple[tuple[str, str], ...]) -> None:
        """tgtadm's ``--params`` of a LUN (tgt takes them only as an update, never at creation)."""
        shown = ",".join(f"{k}={v}" for k, v in params)
        self.call(f"set {shown} on LUN {lun} of {live.iqn}",
                  Request(Mode.DEVICE, Op.UPDATE, params=params, tid=live.tid, lun=lun))

    def delete_lun(self, live: LiveTarget, lun: int) -> None:
        self.call(f"delete LUN {lun} of {live.iqn}", Request(Mode.DEVICE, Op.DELETE, tid=live.tid, lun=lun))

    # -- CHAP accounts -------------------------------------------------------------------------------

    def accounts(self) -> set[str]:
        out = self.call("show accounts", Request(Mode.ACCOUNT, Op.SHOW))
        return {line.strip() for line in out.splitlines()[1:] if line.strip()}

    def new_account(self, user: str, secret: str) -> None:
        self.call(f"create account {user}", Request(Mode.ACCOUNT, Op.NEW, (("user", user), ("password", secret))))

    def delete_account(self, user: str) -> None:
        self.call(f"delete account {user}", Request(Mode.ACCOUNT, Op.DELETE, (("user", user),)))

    def bind_account(self, live: LiveTarget, user: str) -> None:
        """An incoming account of the target; one it already has is fine."""
        try:
            self.call(f"bind account {user}", Request(Mode.ACCOUNT, Op.BIND, (("user", user),), tid=live.tid))
        except AdmError as exc:
            if not exc.says(E_EXISTS):
                raise

    def unbind_account(self, live: LiveTarget, user: str) -> None:
        self.call(f"unbind account {user}", Request(Mode.ACCOUNT, Op.UNBIND, (("user", user),), tid=live.tid))
