"""tgtd's management socket, spoken directly: for requests that carry a secret (CHAP accounts).

``tgtadm`` only takes a CHAP password on its command line, where every local user can read it in
``/proc/<pid>/cmdline``. This module sends the same request tgtadm would (tgt's ``usr/tgtadm.h``:
a fixed header ``struct tgtadm_req``, then a NUL-terminated ``name=value,…`` body; the answer is
``struct tgtadm_rsp`` and an optional text) over the unix socket ``<TGT_IPC_SOCKET>.<control>``,
which only the agent's user can open. Layout as built for x86-64 Linux (native byte order, no
padding: every field is naturally aligned), the same in tgt 1.0.85 (Debian 12) and later.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from vbs.errors import DriverError

__all__ = ["TgtIpcError", "MODE_ACCOUNT", "OP_NEW", "request"]

# enum tgtadm_mode / enum tgtadm_op (the values this module sends)
MODE_ACCOUNT = 7
OP_NEW = 0

# struct tgtadm_req: mode, op, lld[64], len, tid, sid, lun, cid, host_no, device_type, ac_dir,
# pack, force.
_REQ = struct.Struct("=ii64sIiQQIIIIII")
_RSP = struct.Struct("=II")  # struct tgtadm_rsp: err, len (header included)
_LLD_LEN = 64
_NO_LUN = (1 << 64) - 1  # what tgtadm sends when no --lun is given
_BODY_MAX = 4096

# enum tgtadm_errno, for messages (index = code)
_ERRORS = (
    "success", "unknown error", "out of memory", "no such driver", "can't find the target",
    "can't find the logical unit", "can't find the session", "can't find the connection",
    "can't find the binding", "this target already exists", "this logical unit number already exists",
    "this access control rule already exists", "this access control rule already exists",
    "this access control rule does not exist", "this account already exists", "can't find the account",
    "too many accounts", "invalid request", "this target already has an outgoing account",
    "this target is still active", "this logical unit is still active", "this driver is busy",
    "this operation isn't supported", "unknown parameter", "this device has removal prevention",
)


class TgtIpcError(DriverError):
    """tgtd refused the request (``tgt_errno`` is its ``tgtadm_errno``) or could not be reached."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.tgt_errno = code


def request(control_socket: Path, mode: int, op: int, body: dict[str, str], *, lld: str = "iscsi",
            tid: int = -1, timeout: float = 10.0) -> str:
    """Send one management request to the tgtd listening on ``control_socket``; its text answer."""
    for name, value in body.items():
        if any(c in name + value for c in ",=\0") or not name:
            # tgtd splits the body at ',' and '=': such a value would change the request.
            raise TgtIpcError(f"tgtd request parameter {name!r} holds a character tgtd splits on")
    payload = ",".join(f"{k}={v}" for k, v in body.items()).encode() + b"\0"
    if len(payload) > _BODY_MAX or len(lld) >= _LLD_LEN:
        raise TgtIpcError("tgtd request too long")
    header = _REQ.pack(mode, op, lld.encode(), _REQ.size + len(payload), tid, 0, _NO_LUN, 0, 0, 0, 0, 0, 0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(control_socket))
            s.sendall(header + payload)
            err, length = _RSP.unpack(_recv_exactly(s, _RSP.size))
            text = _recv_exactly(s, length - _RSP.size) if length > _RSP.size else b""
        except OSError as exc:
            raise TgtIpcError(f"tgtd management socket {control_socket}: {exc.strerror or exc}") from exc
    if err:
        reason = _ERRORS[err] if err < len(_ERRORS) else f"error {err}"
        raise TgtIpcError(reason, code=err)
    return text.rstrip(b"\0").decode(errors="replace")


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("tgtd closed the socket")
        data += chunk
    return data
