"""The requests the iSCSI driver sends on tgtd's management socket, byte for byte.

Each request form is checked against the layout of tgt's ``struct tgtadm_req`` (usr/tgtadm.h) and
against ``tgtadm`` itself, the upstream tool: a fake tgtd (a unix socket server in a thread, in
tmp_path) records what the real ``tgtadm`` binary sends for an operator's command line and what the
driver's ``TgtControl`` sends for the same request; the two must be equal. The fake answers as tgtd
does (``struct tgtadm_rsp``, then a NUL-terminated text), so the answers are checked the same way.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vbs.storage.exports import tgt_ipc
from vbs.storage.exports.iscsi.control import E_ABSENT, E_ACTIVE, E_EXISTS, AdmError, TgtControl
from vbs.storage.exports.iscsi.state import LiveTarget
from vbs.storage.exports.tgt_ipc import GLOBAL_TID, NO_LUN, Errno, Mode, Op, Request

pytestmark = pytest.mark.unit

HEADER = struct.Struct("=ii64sIiQQIIIIII")  # struct tgtadm_req, field by field
CONTROL = 5
IQN = "iqn.2026-11.org.vbs:tabcdef"
LIVE = LiveTarget(tid=3, iqn=IQN)


class FakeTgtd:
    """Accepts connections on ``<base>.<CONTROL>``, records each request (header and body) and answers
    ``err`` with ``text``; after a ``--mode system --op delete`` it stops listening, as tgtd exits."""

    def __init__(self, base: Path, *, err: int = 0, text: bytes = b"", answer: bool = True) -> None:
        self.path = Path(f"{base}.{CONTROL}")
        self.err, self.text, self.answer = err, text, answer
        self.requests: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                head = _recv(conn, HEADER.size)
                if len(head) < HEADER.size:
                    continue  # tgtadm's connect probe after a shutdown
                length = HEADER.unpack(head)[3]
                self.requests.append(head + _recv(conn, length - HEADER.size))
                if not self.answer:
                    continue  # closes the socket: tgtd died under the request
                body = self.text + b"\0" if self.text and not self.err else b""
                conn.sendall(struct.pack("=II", self.err, 8 + len(body)) + body)
                mode, op = HEADER.unpack(head)[:2]
            if (mode, op) == (Mode.SYSTEM, Op.DELETE) and not self.err:
                self.sock.close()  # the file stays: connecting is refused, which tgtadm waits for
                return

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        except OSError:
            pass  # closed already: tgtd "exited"
        self.sock.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


def _recv(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Callable[..., FakeTgtd]]:
    servers: list[FakeTgtd] = []

    def make(**kw: object) -> FakeTgtd:
        base = tmp_path / f"s{len(servers)}"
        server = FakeTgtd(base, **kw)  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.close()


def run_tgtadm(server: FakeTgtd, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin"), "TGT_IPC_SOCKET": str(server.path)[:-2]}
    return subprocess.run(["tgtadm", "-C", str(CONTROL), *args], capture_output=True, text=True, env=env,
                          timeout=30, check=False)


def control(server: FakeTgtd) -> TgtControl:
    return TgtControl(CONTROL, Path(str(server.path)[:-2]), timeout=5.0)


# (what the driver calls, what an operator types): the same request.
S = "--lld", "iscsi"
FORMS: list[tuple[str, Callable[[TgtControl], object], list[str]]] = [
    ("probe", lambda t: t.probe(), ["--mode", "sys", "--op", "show"]),
    ("portals", lambda t: t.portals(), ["--mode", "portal", "--op", "show"]),
    ("offline", lambda t: t.go_offline(), ["--op", "update", "--mode", "sys", "--name", "State", "-v", "offline"]),
    ("shut down", lambda t: t.shut_down(), ["--op", "delete", "--mode", "system"]),
    ("show targets", lambda t: t.show(), [*S, "--mode", "target", "--op", "show"]),
    ("new target", lambda t: t.new_target(3, IQN), [*S, "--mode", "target", "--op", "new", "--tid", "3",
                                                     "--targetname", IQN]),
    ("delete target", lambda t: t.delete_target(LIVE), [*S, "--mode", "target", "--op", "delete", "--tid", "3"]),
    ("delete target --force", lambda t: t.delete_target(LIVE, force=True),
     [*S, "--mode", "target", "--op", "delete", "--force", "--tid", "3"]),
    ("target param", lambda t: t.set_param(LIVE, "MaxBurstLength", "1048576"),
     [*S, "--mode", "target", "--op", "update", "--tid", "3", "--name", "MaxBurstLength", "--value", "1048576"]),
    ("bind address", lambda t: t.bind_acl(LIVE, "initiator-address", "127.0.0.1"),
     [*S, "--mode", "target", "--op", "bind", "--tid", "3", "--initiator-address", "127.0.0.1"]),
    ("bind v6 address", lambda t: t.bind_acl(LIVE, "initiator-address", "fd00::2"),
     [*S, "--mode", "target", "--op", "bind", "--tid", "3", "--initiator-address", "fd00::2"]),
    ("unbind address", lambda t: t.unbind_acl(LIVE, "initiator-address", "127.0.0.1"),
     [*S, "--mode", "target", "--op", "unbind", "--tid", "3", "--initiator-address", "127.0.0.1"]),
    ("bind name", lambda t: t.bind_acl(LIVE, "initiator-name", "iqn.2026-11.org.vbs.host:hv-a"),
     [*S, "--mode", "target", "--op", "bind", "--tid", "3", "--initiator-name", "iqn.2026-11.org.vbs.host:hv-a"]),
    ("unbind name", lambda t: t.unbind_acl(LIVE, "initiator-name", "iqn.1994-05.com.redhat:x"),
     [*S, "--mode", "target", "--op", "unbind", "--tid", "3", "--initiator-name", "iqn.1994-05.com.redhat:x"]),
    ("new file LUN", lambda t: t.new_lun(LIVE, 1, (("path", "/p/vol-1"), ("bstype", "rdwr"), ("bsoflags", "direct"))),
     [*S, "--mode", "logicalunit", "--op", "new", "--tid", "3", "--lun", "1", "--backing-store", "/p/vol-1",
      "--bstype", "rdwr", "--bsoflags", "direct"]),
    ("new rbd LUN", lambda t: t.new_lun(LIVE, 2, (("path", "rbd/vol-1"), ("bstype", "rbd"),
                                                  ("bsopts", (("conf", "/c/ceph.conf"), ("id", "vbs.agent"))))),
     [*S, "--mode", "logicalunit", "--op", "new", "--tid", "3", "--lun", "2", "--backing-store", "rbd/vol-1",
      "--bstype", "rbd", "--bsopts", "conf=/c/ceph.conf;id=vbs.agent"]),
    ("LUN params", lambda t: t.set_lun_params(LIVE, 1, (("readonly", "1"), ("thin_provisioning", "0"))),
     [*S, "--mode", "logicalunit", "--op", "update", "--tid", "3", "--lun", "1", "--params",
      "readonly=1,thin_provisioning=0"]),
    ("delete LUN", lambda t: t.delete_lun(LIVE, 255),
     [*S, "--mode", "logicalunit", "--op", "delete", "--tid", "3", "--lun", "255"]),
    ("show accounts", lambda t: t.accounts(), [*S, "--mode", "account", "--op", "show"]),
    ("new account", lambda t: t.new_account("vol-1.hv-a", "Secret12345678"),
     [*S, "--mode", "account", "--op", "new", "--user", "vol-1.hv-a", "--password", "Secret12345678"]),
    ("delete account", lambda t: t.delete_account("vol-1.hv-a"),
     [*S, "--mode", "account", "--op", "delete", "--user", "vol-1.hv-a"]),
    ("bind account", lambda t: t.bind_account(LIVE, "vol-1.hv-a"),
     [*S, "--mode", "account", "--op", "bind", "--tid", "3", "--user", "vol-1.hv-a"]),
    ("unbind account", lambda t: t.unbind_account(LIVE, "vol-1.hv-a"),
     [*S, "--mode", "account", "--op", "unbind", "--tid", "3", "--user", "vol-1.hv-a"]),
]


@pytest.mark.parametrize(("name", "call", "argv"), FORMS, ids=[f[0] for f in FORMS])
def test_each_request_is_byte_for_byte_what_tgtadm_sends(
        fake: Callable[..., FakeTgtd], name: str, call: Callable[[TgtControl], object], argv: list[str]) -> None:
    by_tgtadm, by_driver = fake(), fake()
    proc = run_tgtadm(by_tgtadm, *argv)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    call(control(by_driver))
    assert len(by_tgtadm.requests) == 1 and by_driver.requests == by_tgtadm.requests, name


def test_a_shown_text_is_what_tgtadm_prints(fake: Callable[..., FakeTgtd]) -> None:
    text = (f"Target 3: {IQN}\n    System information:\n        Driver: iscsi\n    LUN information:\n"
            "        LUN: 1\n            Backing store path: /p/vol-1\n            Readonly: No\n"
            "    Account information:\n        vol-1.hv-a\n    ACL information:\n        127.0.0.1\n")
    server = fake(text=text.encode())
    printed = run_tgtadm(server, *S, "--mode", "target", "--op", "show").stdout
    tgt = control(server)
    assert tgt.call("show", Request(Mode.TARGET, Op.SHOW)) == printed == text
    live = tgt.show()[IQN]
    assert (live.tid, live.luns[1].path, live.accounts, live.acl) == (3, "/p/vol-1", ["vol-1.hv-a"], {"127.0.0.1"})


@pytest.mark.parametrize("code", [int(e) for e in Errno if e], ids=[e.name for e in Errno if e])
def test_each_refusal_reads_as_tgtadm_says_it(fake: Callable[..., FakeTgtd], code: int) -> None:
    server = fake(err=code)
    said = run_tgtadm(server, *S, "--mode", "target", "--op", "delete", "--tid", "3").stderr.strip()
    with pytest.raises(AdmError) as exc:
        control(server).delete_target(LIVE)
    assert exc.value.tgt_errno == code and said == f"tgtadm: {exc.value.detail}"
    assert f"delete target {IQN}" in exc.value.message


def test_benign_refusals_are_told_by_code() -> None:
    assert E_EXISTS == {Errno.TARGET_EXIST, Errno.LUN_EXIST, Errno.BINDING_EXIST, Errno.ACL_EXIST, Errno.USER_EXIST}
    assert Errno.NO_DRIVER not in E_ABSENT and {Errno.NO_TARGET, Errno.NO_LUN, Errno.ACL_NOEXIST,
                                                 Errno.NO_USER} <= E_ABSENT
    assert E_ACTIVE == {Errno.TARGET_ACTIVE, Errno.LUN_ACTIVE}


def test_binds_that_exist_and_unbinds_of_what_is_gone(fake: Callable[..., FakeTgtd]) -> None:
    control(fake(err=Errno.ACL_EXIST)).bind_acl(LIVE, "initiator-address", "127.0.0.1")
    control(fake(err=Errno.BINDING_EXIST)).bind_account(LIVE, "u")
    with pytest.raises(AdmError) as exc:
        control(fake(err=Errno.NO_TARGET)).bind_account(LIVE, "u")
    assert exc.value.says(E_ABSENT)


def test_tgtd_closing_the_socket_under_a_request_is_an_error(fake: Callable[..., FakeTgtd]) -> None:
    server = fake(answer=False)
    with pytest.raises(AdmError, match="tgtd closed the socket") as exc:
        control(server).new_target(3, IQN)
    assert exc.value.tgt_errno is None and len(server.requests) == 1


def test_a_tgtd_that_does_not_answer_times_out(tmp_path: Path) -> None:
    path = tmp_path / f"s.{CONTROL}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:  # listens, never accepts (a stopped tgtd)
        hung.bind(str(path))
        hung.listen(1)
        with pytest.raises(AdmError, match="did not answer target show within 0.2 s") as exc:
            TgtControl(CONTROL, tmp_path / "s", timeout=0.2).show()
    assert exc.value.tgt_errno is None


def test_no_tgtd_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(AdmError, match="probe: tgtd management socket"):
        TgtControl(CONTROL, tmp_path / "s", timeout=1.0).probe()


# -- the layout, field by field (usr/tgtadm.h) ---------------------------------------------------------


def fields(req: Request) -> tuple[tuple[object, ...], bytes]:
    data = req.encode()
    return HEADER.unpack(data[:HEADER.size]), data[HEADER.size:]


def test_the_header_is_struct_tgtadm_req() -> None:
    assert HEADER.size == 120
    head, body = fields(Request(Mode.DEVICE, Op.UPDATE, params=(("readonly", "0"),), tid=7, lun=2, force=True))
    mode, op, lld, length, tid, sid, lun, cid, host_no, device_type, ac_dir, pack, force = head
    assert (mode, op, lld.rstrip(b"\0"), tid, lun, force) == (2, 5, b"iscsi", 7, 2, 1)
    assert (sid, cid, host_no, device_type, ac_dir, pack) == (0, 0, 0, 0, 0, 0)
    assert length == 120 + len(body) and body == b"targetOps readonly=0,\0"


def test_a_request_without_fields_has_no_body_and_the_defaults_of_tgtadm() -> None:
    head, body = fields(Request(Mode.SYSTEM, Op.SHOW, lld=""))
    assert body == b"" and head[3] == 120
    assert head[2] == b"\0" * 64 and head[4] == GLOBAL_TID and head[6] == NO_LUN


@pytest.mark.parametrize(("req", "body"), [
    (Request(Mode.TARGET, Op.NEW, (("targetname", IQN),), tid=1), f"targetname={IQN}"),
    (Request(Mode.TARGET, Op.UPDATE, (("InitialR2T", "No"),), tid=1), "InitialR2T=No"),
    (Request(Mode.TARGET, Op.BIND, (("initiator-address", "10.0.0.1"),), tid=1), "initiator-address=10.0.0.1"),
    (Request(Mode.TARGET, Op.BIND, (("initiator-name", "iqn.2026-11.org.vbs.host:hv-a"),), tid=1),
     "initiator-name=iqn.2026-11.org.vbs.host:hv-a"),
    (Request(Mode.DEVICE, Op.NEW, (("path", "/f"), ("bstype", "rdwr"), ("bsoflags", "direct")), tid=1, lun=1),
     "path=/f,bstype=rdwr,bsoflags=direct"),
    (Request(Mode.DEVICE, Op.NEW, (("path", "p/i"), ("bstype", "rbd"), ("bsopts", (("conf", "/c"), ("id", "a")))),
             tid=1, lun=1), "path=p/i,bstype=rbd,bsopts=conf=/c;id=a"),
    (Request(Mode.DEVICE, Op.UPDATE, params=(("readonly", "1"), ("thin_provisioning", "1")), tid=1, lun=1),
     "targetOps readonly=1,thin_provisioning=1,"),
    (Request(Mode.ACCOUNT, Op.NEW, (("user", "u"), ("password", "p"))), "user=u,password=p"),
    (Request(Mode.SYSTEM, Op.UPDATE, (("State", "offline"),), lld=""), "State=offline"),
], ids=["target", "param", "acl", "acl name", "file LUN", "rbd LUN", "LUN params", "account", "state"])
def test_each_body_form(req: Request, body: str) -> None:
    assert fields(req)[1] == body.encode() + b"\0"


@pytest.mark.parametrize("bad", ["a,b", "a=b", "a;b", "a\0b", ""])
def test_a_value_tgtd_would_split_is_refused_before_anything_is_sent(bad: str) -> None:
    for req in (Request(Mode.ACCOUNT, Op.NEW, (("user", "u"), ("password", bad))),
                Request(Mode.TARGET, Op.BIND, (("initiator-address", bad),), tid=1),
                Request(Mode.DEVICE, Op.NEW, (("path", "p"), ("bsopts", (("conf", bad),))), tid=1, lun=1),
                Request(Mode.DEVICE, Op.UPDATE, params=(("readonly", bad),), tid=1, lun=1),
                Request(Mode.ACCOUNT, Op.NEW, ((bad or "=", "u"),))):
        with pytest.raises(tgt_ipc.TgtIpcError, match="splits on"):
            req.encode()


def test_out_of_range_numbers_and_long_bodies_are_refused() -> None:
    for req in (Request(Mode.TARGET, Op.DELETE, tid=1 << 31), Request(Mode.DEVICE, Op.DELETE, tid=1, lun=-1),
                Request(Mode.TARGET, Op.SHOW, lld="x" * 64),
                Request(Mode.TARGET, Op.NEW, (("targetname", "x" * 5000),), tid=1)):
        with pytest.raises(tgt_ipc.TgtIpcError):
            req.encode()
