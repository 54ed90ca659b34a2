"""iSCSI secrets stay off every command line and out of tgtd's environment; CHAP is required.

Real tgtd, libiscsi's iscsi-readcapacity16. CHAP accounts, like every request of the driver, are
made on tgtd's management socket (``vbs.storage.exports.tgt_ipc``), never with ``tgtadm
--password``. Each test runs its own tgtd on a free port and stops it by PID.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import export_fixtures
from tests.export_fixtures import drivers_of
from tests.test_iscsi_export import live_accounts, logged_in, readcap, secret_of, tgtd_driver
from vbs.config import StorageAgentConfig
from vbs.errors import InvalidParameter
from vbs.pools.exports import FileSource
from vbs.storage.exports import tgt_ipc
from vbs.storage.exports.iscsi import IscsiExportDriver
from vbs.storage.exports.tgt_ipc import Mode, Op, Request
from vbs.trust.pki import CertificateAuthority
from vbs.wire.connection import HostIdentity, IscsiConnection

pytestmark = pytest.mark.integration

VOLS = [f"vol-{i:017x}" for i in range(1, 7)]
HOST = HostIdentity(name="hv-a", address="127.0.0.1")
volume = export_fixtures.volume


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., IscsiExportDriver]]:
    yield from drivers_of(tgtd_driver, tmp_path, "tgtd")


def all_cmdlines() -> list[bytes]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out.append((proc / "cmdline").read_bytes())
            except OSError:
                pass
    return out


def record_processes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, str]]]:
    """The argv and environment of every process this test's process starts from now on."""
    started: list[tuple[list[str], dict[str, str]]] = []
    real_init = subprocess.Popen.__init__

    def recording_init(self: subprocess.Popen[Any], args: Any, *a: Any, **kw: Any) -> None:
        argv = [str(args)] if isinstance(args, str | bytes | Path) else [str(x) for x in args]
        started.append((argv, dict(kw.get("env") or os.environ)))
        real_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_init)
    return started


def record_requests(monkeypatch: pytest.MonkeyPatch) -> list[Request]:
    """Every request the driver sends on tgtd's management socket from now on."""
    sent: list[Request] = []
    real = tgt_ipc.exchange

    def recording(control_socket: Path, req: Request, timeout: float) -> str:
        sent.append(req)
        return real(control_socket, req, timeout)

    monkeypatch.setattr(tgt_ipc, "exchange", recording)
    return sent


def test_no_chap_secret_is_ever_on_a_command_line(make_driver: Callable[..., IscsiExportDriver], volume: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    drv = make_driver()
    drv.start()
    argvs = record_processes(monkeypatch)
    sent = record_requests(monkeypatch)
    seen: list[bytes] = []
    done = threading.Event()

    def watch() -> None:  # every process's argv, over and over, while accounts are made
        while not done.is_set():
            seen.extend(all_cmdlines())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        conns = [drv.ensure_export(vol, FileSource(volume), HOST) for vol in VOLS]
    finally:
        done.set()
        watcher.join()
    secrets = [secret_of(c) for c in conns if isinstance(c, IscsiConnection)]
    assert len(secrets) == len(VOLS) and len(set(secrets)) == len(VOLS)
    assert [r for r in sent if (r.mode, r.op) == (Mode.ACCOUNT, Op.NEW)] and len(seen) > len(VOLS)  # it did run
    assert argvs == [], "a process per request"  # every request went on the management socket
    for secret in secrets:
        assert not [a for a, _ in argvs if any(secret in arg for arg in a)], "a secret on a child's argv"
        assert not [c for c in seen if secret.encode() in c], "a secret in some /proc/<pid>/cmdline"
        assert not [c for c in all_cmdlines() if secret.encode() in c]
    assert {c.chap_user for c in conns if isinstance(c, IscsiConnection)} <= live_accounts(drv)
    for c in conns:
        assert isinstance(c, IscsiConnection) and logged_in(c)  # accounts made over the socket work


def test_every_target_requires_chap(make_driver: Callable[..., IscsiExportDriver], volume: Path) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOLS[0], FileSource(volume), HOST)
    assert isinstance(c, IscsiConnection) and c.chap_user and c.chap_secret
    rc, out = readcap(c, user="", secret="")
    assert rc != 0 and "Authentication failure" in out, out
    assert logged_in(c)


def test_tgtd_gets_a_minimal_environment_and_no_other_process_runs(
        make_driver: Callable[..., IscsiExportDriver], volume: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VBS_AGENT_TOKEN", "agent-token-that-must-not-leak")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-that-must-not-leak")
    drv = make_driver()
    started = record_processes(monkeypatch)
    drv.ensure_export(VOLS[0], FileSource(volume), HOST)
    envs = [env for _, env in started]
    assert [argv[0] for argv, _ in started] == ["tgtd"]  # the daemon itself; its requests start nothing
    assert drv.pid is not None
    environ = Path(f"/proc/{drv.pid}/environ").read_bytes()
    assert b"must-not-leak" not in environ
    assert {item.split(b"=", 1)[0] for item in environ.split(b"\0") if item} <= {b"PATH", b"LC_ALL",
                                                                                 b"TGT_IPC_SOCKET"}
    assert envs and all(set(e) == {"PATH", "LC_ALL", "TGT_IPC_SOCKET"} for e in envs), envs


def test_the_management_socket_refuses_what_would_change_the_request(
        make_driver: Callable[..., IscsiExportDriver]) -> None:
    drv = make_driver()
    drv.start()

    def new_account(user: str, password: str) -> str:
        req = Request(Mode.ACCOUNT, Op.NEW, (("user", user), ("password", password)))
        return tgt_ipc.exchange(drv.control_socket, req, timeout=10.0)

    for user, password in (("a,password=x", "secretsecret1"), ("u", "pass,word=1"), ("u", "p\0w")):
        with pytest.raises(tgt_ipc.TgtIpcError, match="splits on"):
            new_account(user, password)
    new_account("u1", "p" * 16)
    with pytest.raises(tgt_ipc.TgtIpcError, match="already exists") as exc:
        new_account("u1", "q" * 16)
    assert exc.value.tgt_errno == 14
    assert "u1" in live_accounts(drv)


def test_iscsi_off_loopback_needs_insecure(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameter, match="unencrypted"):
        IscsiExportDriver.from_config(StorageAgentConfig(export="iscsi", export_host="10.0.0.5"), tmp_path / "a")
    drv = IscsiExportDriver.from_config(StorageAgentConfig(export="iscsi", export_host="10.0.0.5", insecure=True),
                                        tmp_path / "b")
    assert drv.listen_host == "10.0.0.5" and drv.pid is None
    assert IscsiExportDriver.from_config(StorageAgentConfig(export="iscsi", export_host="::1"), tmp_path / "c")


def test_iscsi_off_loopback_with_certificates_goes_through_the_tunnel(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca.pem", tmp_path / "ca-key.pem")
    node = ca.issue_in(tmp_path, "storage-1", ["10.0.0.5"])
    cfg = StorageAgentConfig(export="iscsi", export_host="10.0.0.5", tls_cert=node.cert, tls_key=node.key,
                             tls_ca=node.ca)
    drv = IscsiExportDriver.from_config(cfg, tmp_path / "a")
    assert drv.tunnel_files is not None and drv.portal.startswith("127.0.0.1:") and drv.pid is None
    on_loopback = IscsiExportDriver.from_config(cfg.model_copy(update={"export_host": "127.0.0.1"}), tmp_path / "b")
    assert on_loopback.tunnel_files is None  # nothing leaves the machine: no tunnel


def test_discovery_without_credentials_reveals_no_volume_id(make_driver: Callable[..., IscsiExportDriver],
                                                            volume: Path) -> None:
    """tgtd answers SendTargets without a login: the target names it gives must not name volumes."""
    import subprocess

    drv = make_driver()
    drv.start()
    for vol in VOLS[:3]:
        drv.ensure_export(vol, FileSource(volume), HOST)
    # The attack: any local user lists the targets (and tries their LUNs) without credentials.
    listing = ""
    for flags in ([], ["-s"]):  # the names, then the names and each target's LUNs (a login each)
        out = subprocess.run(["iscsi-ls", *flags, f"iscsi://127.0.0.1:{drv.port}"], capture_output=True,
                             text=True, timeout=60)
        listing += out.stdout + out.stderr
    names = [line.split(":", 1)[1].split()[0] for line in listing.splitlines() if line.startswith("Target:")]
    assert set(names) == {drv.iqn(vol) for vol in VOLS[:3]}, listing  # discovery did run
    assert "vol-" not in listing and not any(vol in listing or vol[4:] in listing for vol in VOLS), listing
    # The names are stable (a restarted agent finds its targets again) and map back to their keys.
    again = IscsiExportDriver(drv.state_dir, port=drv.port, control_port=drv.control_port)
    assert [again.iqn(vol) for vol in VOLS[:3]] == [drv.iqn(vol) for vol in VOLS[:3]]
    assert [drv._access.key_of(drv.iqn(vol)) for vol in VOLS[:3]] == VOLS[:3]
    assert drv._access.key_of(f"{drv.iqn_prefix}:{VOLS[0]}") is None  # a name not sealed by this node is not ours
    assert (drv.state_dir / "iqn.key").stat().st_mode & 0o077 == 0
