"""tgtd's management socket, spoken directly: every request the iSCSI driver makes, without tgtadm.

A request is what ``tgtadm`` would send (tgt's ``usr/tgtadm.h`` and ``usr/tgtadm.c``): a fixed header
``struct tgtadm_req``, then, if there is one, a NUL-terminated ``name=value,…`` body; the answer is
``struct tgtadm_rsp`` and, for ``show``, a NUL-terminated text (what tgtadm prints). It goes over
the unix socket ``<TGT_IPC_SOCKET>.<control>``, which only the agent's user can open: no process per
request, no secret on a command line. Layout as built for x86-64 Linux (native byte order, no
padding: every field is naturally aligned), the same in tgt 1.0.85 (Debian 12) and later.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from vbs.errors import DriverError

__all__ = ["Request", "Mode", "Op", "Errno", "TgtIpcError", "exchange", "Value", "GLOBAL_TID", "NO_LUN"]


class Mode(IntEnum):
    """enum tgtadm_mode."""

    SYSTEM = 0
    TARGET = 1
    DEVICE = 2  # tgtadm --mode logicalunit
    PORTAL = 3
    LLD = 4
    SESSION = 5
    CONNECTION = 6
    ACCOUNT = 7


class Op(IntEnum):
    """enum tgtadm_op."""

    NEW = 0
    DELETE = 1
    SHOW = 2
    BIND = 3
    UNBIND = 4
    UPDATE = 5
    STATS = 6
    START = 7
    STOP = 8


class Errno(IntEnum):
    """enum tgtadm_errno (tgtadm_error.h): what tgtd answers a request with."""

    SUCCESS = 0
    UNKNOWN_ERR = 1
    NOMEM = 2
    NO_DRIVER = 3
    NO_TARGET = 4
    NO_LUN = 5
    NO_SESSION = 6
    NO_CONNECTION = 7
    NO_BINDING = 8
    TARGET_EXIST = 9
    LUN_EXIST = 10
    BINDING_EXIST = 11
    ACL_EXIST = 12
    ACL_NOEXIST = 13
    USER_EXIST = 14
    NO_USER = 15
    TOO_MANY_USER = 16
    INVALID_REQUEST = 17
    OUTACCOUNT_EXIST = 18
    TARGET_ACTIVE = 19
    LUN_ACTIVE = 20
    DRIVER_ACTIVE = 21
    UNSUPPORTED_OPERATION = 22
    UNKNOWN_PARAM = 23
    PREVENT_REMOVAL = 24


# tgtadm_strerror's words, so that messages read as an operator knows them from tgtadm.
_REASONS: dict[int, str] = {
    Errno.SUCCESS: "success", Errno.UNKNOWN_ERR: "unknown error", Errno.NOMEM: "out of memory",
    Errno.NO_DRIVER: "can't find the driver", Errno.NO_TARGET: "can't find the target",
    Errno.NO_LUN: "can't find the logical unit", Errno.NO_SESSION: "can't find the session",
    Errno.NO_CONNECTION: "can't find the connection", Errno.NO_BINDING: "can't find the binding",
    Errno.TARGET_EXIST: "this target already exists", Errno.BINDING_EXIST: "this binding already exists",
    Errno.LUN_EXIST: "this logical unit number already exists",
    Errno.ACL_EXIST: "this access control rule already exists",
    Errno.ACL_NOEXIST: "this access control rule does not exist",
    Errno.USER_EXIST: "this account already exists", Errno.NO_USER: "can't find the account",
    Errno.TOO_MANY_USER: "too many accounts", Errno.INVALID_REQUEST: "invalid request",
    Errno.OUTACCOUNT_EXIST: "this target already has an outgoing account",
    Errno.TARGET_ACTIVE: "this target is still active", Errno.LUN_ACTIVE: "this logical unit is still active",
    Errno.DRIVER_ACTIVE: "this driver is busy", Errno.UNSUPPORTED_OPERATION: "this operation isn't supported",
    Errno.UNKNOWN_PARAM: "unknown parameter", Errno.PREVENT_REMOVAL: "this device has Prevent Removal set",
}

GLOBAL_TID = -1  # tgtadm's GLOBAL_TID (~0U) and its default when no --tid is given
NO_LUN = (1 << 64) - 1  # tgtadm's default when no --lun is given
TYPE_DISK = 0  # tgtadm's --device-type default

# struct tgtadm_req: mode, op, lld[64], len, tid, sid, lun, cid, host_no, device_type, ac_dir,
# pack, force.
_REQ = struct.Struct("=ii64sIiQQIIIIII")
_RSP = struct.Struct("=II")  # struct tgtadm_rsp: err, len (header included)
_LLD_LEN = 64
_BODY_MAX = 4096  # tgtd takes up to 8 KiB; nothing the driver sends comes near
_TEXT_MAX = 64 << 20  # a show of many targets; more is not an answer of tgtd's
_SPLITS = ",=;\0"  # tgtd splits the body on ',' and '=', the rbd store its options on ';'

# A body field's value: a string, or (for ``bsopts``) options sent as ``name=value;name=value``.
Value = str | tuple[tuple[str, str], ...]


class TgtIpcError(DriverError):
    """tgtd refused the request (``tgt_errno`` is its ``tgtadm_errno``), or could not be reached, or
    closed the socket before it answered (it died under the request): ``tgt_errno`` None."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.tgt_errno = code


@dataclass(frozen=True)
class Request:
    """One management request, as ``tgtadm`` builds it from its options.

    ``fields`` are the body's ``name=value`` pairs in tgtadm's order (``--name``/``--value`` first,
    then ``path``, ``bstype``, ``bsopts``, ``bsoflags``, ``targetname``, ``initiator-address``,
    ``initiator-name``, ``user``, ``password``); ``params`` are ``--params`` (sent last, as
    ``targetOps name=value,…,``). ``lld`` is empty where tgtadm is given no ``--lld``.
    """

    mode: Mode
    op: Op
    fields: tuple[tuple[str, Value], ...] = ()
    params: tuple[tuple[str, str], ...] = ()
    lld: str = "iscsi"
    tid: int = GLOBAL_TID
    lun: int = NO_LUN
    force: bool = False

    @property
    def label(self) -> str:
        """``mode op`` in tgtadm's words, for messages (never a value: one may be a secret)."""
        mode = "logicalunit" if self.mode is Mode.DEVICE else self.mode.name.lower()
        return f"{mode} {self.op.name.lower()}"

    def body(self) -> bytes:
        """The body tgtadm would send: empty, or the fields and params and a NUL."""
        items = [f"{_atom('field', name)}={_joined(name, value)}" for name, value in self.fields]
        if self.params:  # tgtadm's --params: "targetOps " and each name=value followed by ','
            items.append("targetOps " + "".join(f"{_atom('params', k)}={_atom(k, v)}," for k, v in self.params))
        if not items:
            return b""  # tgtd tells some requests apart by an empty body (a bind by host number)
        text = ",".join(items)
        payload = text.encode() + b"\0"
        if len(payload) > _BODY_MAX:
            raise TgtIpcError(f"tgtd request {self.label} too long")
        return payload

    def encode(self) -> bytes:
        """Header and body, byte for byte what tgtadm writes on the socket."""
        if len(self.lld.encode()) >= _LLD_LEN or any(c in self.lld for c in _SPLITS):
            raise TgtIpcError(f"invalid tgtd driver name {self.lld[:80]!r}")
        if not -1 <= self.tid < 1 << 31 or not 0 <= self.lun <= NO_LUN:
            raise TgtIpcError(f"tgtd request {self.label}: tid {self.tid} or LUN {self.lun} out of range")
        body = self.body()
        return _REQ.pack(self.mode, self.op, self.lld.encode(), _REQ.size + len(body), self.tid, 0, self.lun,
                         0, 0, TYPE_DISK, 0, 0, int(self.force)) + body


def _atom(name: str, value: str) -> str:
    """A name or value of the body, refused if tgtd would split it (the request would change)."""
    if not value or any(c in value for c in _SPLITS):
        raise TgtIpcError(f"tgtd request parameter {name!r} is empty or holds a character tgtd splits on")
    return value


def _joined(name: str, value: Value) -> str:
    if isinstance(value, str):
        return _atom(name, value)
    return ";".join(f"{_atom(name, k)}={_atom(name, v)}" for k, v in value)


def exchange(control_socket: Path, req: Request, timeout: float) -> str:
    """Send ``req`` to the tgtd listening on ``control_socket`` within ``timeout`` seconds; its text
    answer (empty but for ``show``). Raises ``TgtIpcError``."""
    data = req.encode()  # refused before anything is sent
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.settimeout(timeout)
            s.connect(str(control_socket))
            s.sendall(data)
            err, length = _RSP.unpack(_recv_exactly(s, _RSP.size, deadline))
            if err:
                reason = _REASONS.get(err, f"error {err}")
                raise TgtIpcError(reason, code=err)
            if not _RSP.size <= length <= _RSP.size + _TEXT_MAX:
                raise TgtIpcError(f"tgtd answered {req.label} with a length of {length}")
            text = _recv_exactly(s, length - _RSP.size, deadline)
        except TimeoutError as exc:
            raise TgtIpcError(f"tgtd did not answer {req.label} within {timeout:g} s") from exc
        except OSError as exc:
            raise TgtIpcError(f"tgtd management socket {control_socket}: {exc.strerror or exc}") from exc
    return text.split(b"\0", 1)[0].decode(errors="replace")


def _recv_exactly(s: socket.socket, n: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < n:
        s.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = s.recv(min(n - got, 1 << 20))
        if not chunk:
            raise OSError("tgtd closed the socket")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
