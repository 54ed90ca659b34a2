"""The iSCSI export driver against a real tgtd: data path with CHAP, ACL, multi-attach, read-only,
recovery after SIGKILL, adoption, stop. Clients are libiscsi's tools and qemu-io.

Each test runs its own tgtd in tmp_path (own control socket) on a free loopback port and stops it
by PID at teardown; nothing is killed by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from tests import export_fixtures
from tests.export_fixtures import MiB, drivers_of, read_at, taken_port, wait_dead, write_at
from vbs.config import StorageAgentConfig
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, NotFound
from vbs.pools.exports import ExportDriver, FileSource, PointInTimeCopier
from vbs.storage.exports.iscsi import IscsiExportDriver, parse_targets
from vbs.system.argv import run
from vbs.wire.connection import HostIdentity, IscsiConnection
from vbs.wire.storage import ExportInfo

pytestmark = pytest.mark.integration

VOL = "vol-0123456789abcdef0"
VOL2 = "vol-0fedcba9876543210"
HOST_A = HostIdentity(name="hv-a", address="127.0.0.1")
HOST_B = HostIdentity(name="hv-b.example", address="127.0.0.1")
ELSEWHERE = HostIdentity(name="hv-far", address="127.0.0.2")  # every client here connects from .1
volume = export_fixtures.volume

Make = Callable[..., IscsiExportDriver]


def tgtd_driver(state_dir: Path, *, port: int, **kw: Any) -> IscsiExportDriver:
    kw.setdefault("control_port", port % 32768)  # tgtd's range; the socket is in tmp_path anyway
    kw.setdefault("session_grace", 2.0)
    return IscsiExportDriver(state_dir, port=port, **kw)


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Make]:
    """Build drivers on a fresh port and control number; every tgtd they ran is stopped, by PID."""
    yield from drivers_of(tgtd_driver, tmp_path, "tgtd")


@pytest.fixture
def clients() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Long-lived initiators a test starts; killed by PID at teardown."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def tgtadm(drv: IscsiExportDriver, *args: str) -> str:
    """Ask the driver's tgtd directly (its own control socket), as an operator would."""
    env = {**os.environ, "TGT_IPC_SOCKET": str(drv.socket_base)}
    return run(["tgtadm", "-C", str(drv.control_port), "--lld", "iscsi", *args], timeout=30, env=env).stdout


def live_targets(drv: IscsiExportDriver) -> dict[str, Any]:
    return parse_targets(tgtadm(drv, "--mode", "target", "--op", "show"))


def live_accounts(drv: IscsiExportDriver) -> set[str]:
    out = tgtadm(drv, "--mode", "account", "--op", "show")
    return {line.strip() for line in out.splitlines()[1:] if line.strip()}


def info(key: str, host: str, target: str) -> ExportInfo:
    return ExportInfo(key=key, host=host, protocol="iscsi", target=target)


def secret_of(c: IscsiConnection) -> str:
    assert c.chap_secret is not None
    return c.chap_secret.get_secret_value()


def iscsi_url(c: IscsiConnection, *, user: str | None = None, secret: str | None = None) -> str:
    user = c.chap_user if user is None else user
    secret = secret_of(c) if secret is None else secret
    cred = f"{user}%{secret}@" if user else ""
    return f"iscsi://{cred}{c.host}:{c.port}/{c.iqn}/{c.lun}"


def readcap(c: IscsiConnection, *, secret: str | None = None, user: str | None = None,
            initiator: str | None = None) -> tuple[int, str]:
    """Log in and read the capacity (libiscsi): rc 0 and the output, or the login error."""
    argv = ["iscsi-readcapacity16"]
    if initiator:
        argv += ["-i", initiator]
    proc = run([*argv, iscsi_url(c, user=user, secret=secret)], timeout=30, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def qemu_io(c: IscsiConnection, cmd: str, *, read_only: bool = False) -> tuple[int, str]:
    """One qemu-io command through QEMU's iSCSI driver, the secret passed as QEMU does it."""
    ro = ["-r"] if read_only else []
    opts = (f"driver=iscsi,transport=tcp,portal={c.host}:{c.port},target={c.iqn},lun={c.lun},"
            f"user={c.chap_user},password-secret=s0")
    if c.initiator_name:
        opts += f",initiator-name={c.initiator_name}"
    proc = run(["qemu-io", *ro, "--object", f"secret,id=s0,data={secret_of(c)}", "--image-opts", opts,
                "-c", cmd], timeout=60, check=False)
    out = proc.stdout + proc.stderr
    # qemu-io exits 0 even when a command inside fails: look at its output too.
    failed = proc.returncode != 0 or "failed" in out.lower() or "error" in out.lower()
    return (1 if failed else 0), out


def logged_in(c: IscsiConnection, **kw: str) -> bool:
    rc, out = readcap(c, **kw)
    if rc == 0:
        assert f"Total size:{16 * MiB}" in out, out
    return rc == 0


def wait_for_progress(log_path: Path, offset: int, timeout: float = 20.0) -> None:
    """Wait for iscsi-perf to report I/O done after ``offset`` in its log (a line a second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_bytes()[offset:].decode(errors="replace")
        for status in text.replace("\r", "\n").splitlines():
            if "iops current" in status and "iops current 0 " not in status:
                return
        time.sleep(0.2)
    raise AssertionError(f"no I/O progress: {log_path.read_bytes()[offset:][-500:]!r}")


def test_driver_satisfies_the_contract(make_driver: Make) -> None:
    drv = make_driver()
    assert isinstance(drv, ExportDriver) and not isinstance(drv, PointInTimeCopier)


def test_from_config(tmp_path: Path) -> None:
    cfg = StorageAgentConfig(export="iscsi", export_host="127.0.0.1", iscsi_port=3261, iscsi_control=99,
                             options={"iscsi": {"iqn_prefix": "iqn.2030-01.org.example"}})
    drv = IscsiExportDriver.from_config(cfg, tmp_path / "iscsi")
    assert (drv.listen_host, drv.port, drv.control_port) == ("127.0.0.1", 3261, 99)
    assert drv.iqn(VOL).startswith("iqn.2030-01.org.example:t") and VOL not in drv.iqn(VOL)
    assert drv.pid is None


def test_export_read_write_with_chap(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    drv.start()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c, IscsiConnection)
    assert (c.host, c.port, c.iqn, c.lun) == ("127.0.0.1", drv.port, drv.iqn(VOL), 1)
    assert c.chap_user == f"{VOL}.hv-a"
    assert len(secret_of(c)) >= 16 and secret_of(c).isalnum()
    assert secret_of(c) not in repr(c)

    assert logged_in(c)
    # initiator write -> lands in the file
    rc, out = qemu_io(c, "write -P 0xab 1M 64k")
    assert rc == 0, out
    assert read_at(volume, MiB, 65536) == b"\xab" * 65536
    # file content -> initiator read
    write_at(volume, 4 * MiB, b"\xcd" * 4096)
    rc, out = qemu_io(c, "read -P 0xcd 4M 4k")
    assert rc == 0, out


def test_negotiation_is_tuned(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    drv.ensure_export(VOL, FileSource(volume), HOST_A)
    tid = live_targets(drv)[drv.iqn(VOL)].tid
    params = tgtadm(drv, "--mode", "target", "--op", "show", "--tid", str(tid))
    for line in ("MaxRecvDataSegmentLength=262144", "MaxXmitDataSegmentLength=262144",
                 "FirstBurstLength=262144", "MaxBurstLength=1048576", "InitialR2T=No"):
        assert line in params.splitlines()


def test_wrong_or_missing_chap_secret_is_refused(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    right = secret_of(c)
    rc, out = readcap(c, secret=("Y" if right[0] == "X" else "X") + right[1:])  # one character off
    assert rc != 0 and "Authentication failure" in out, out
    rc, out = readcap(c, user="", secret="")  # no CHAP at all
    assert rc != 0 and "Authentication failure" in out, out
    rc, out = readcap(c, user=f"{VOL}.someone-else")
    assert rc != 0 and "Authentication failure" in out, out
    assert logged_in(c)


def test_initiator_address_not_bound_is_refused(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    far = drv.ensure_export(VOL, FileSource(volume), ELSEWHERE)  # ACL: 127.0.0.2 only
    rc, out = readcap(far)  # right CHAP, from 127.0.0.1
    assert rc != 0 and "Target not found" in out, out
    near = drv.ensure_export(VOL, FileSource(volume), HOST_A)  # now 127.0.0.1 is bound too
    assert logged_in(near)


def test_hostname_address_is_resolved_for_the_acl(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-local", address="localhost"))
    assert logged_in(c)


def test_ensure_is_idempotent(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    c1 = drv.ensure_export(VOL, FileSource(volume), HOST_A)  # starts tgtd itself
    c2 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert c1 == c2 and secret_of(c1) == secret_of(c2)
    assert drv.list_exports() == [info(VOL, HOST_A.name, drv.iqn(VOL))]
    assert logged_in(c1)
    with pytest.raises(IdempotentParameterMismatch):
        drv.ensure_export(VOL, FileSource(volume), HOST_A, read_only=True)
    other = volume.with_name("other.img")
    other.write_bytes(b"\0" * MiB)
    with pytest.raises(IdempotentParameterMismatch):
        drv.ensure_export(VOL, FileSource(other), HOST_A)
    assert logged_in(c1)  # a refused call changed nothing


def test_remove_is_idempotent_and_deletes_the_target(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    drv.remove_export(VOL, HOST_A.name)
    assert drv.list_exports() == []
    assert live_targets(drv) == {}  # LUN and target gone
    assert live_accounts(drv) == set()  # and the account
    rc, out = readcap(c)
    assert rc != 0, out
    drv.remove_export(VOL, HOST_A.name)
    drv.remove_export(VOL2, "never-seen")
    # a new attachment after removal gets a new secret
    c2 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert secret_of(c2) != secret_of(c)
    assert logged_in(c2) and not logged_in(c)


def test_multi_attach_hosts_share_one_target(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    b = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-c", address="127.0.0.1"))
    assert isinstance(a, IscsiConnection) and isinstance(b, IscsiConnection)
    assert a.iqn == b.iqn == c.iqn
    assert len({a.chap_user, b.chap_user, c.chap_user}) == 3
    assert len({secret_of(a), secret_of(b), secret_of(c)}) == 3
    assert sorted(drv.list_exports(), key=lambda e: e.host) == [
        info(VOL, h, a.iqn) for h in ("hv-a", "hv-b.example", "hv-c")]
    assert logged_in(a) and logged_in(b) and logged_in(c)
    rc, out = qemu_io(a, "write -P 0x11 0 4k")
    assert rc == 0, out
    rc, out = qemu_io(b, "read -P 0x11 0 4k")
    assert rc == 0, out

    # B (the middle account in tgtd's slots) leaves: its account goes, the others keep working
    # and tgtd survives (a hole in its account array would crash it at the next show).
    pid = drv.pid
    drv.remove_export(VOL, HOST_B.name)
    assert drv.pid == pid and live_targets(drv)[a.iqn].accounts == [a.chap_user, c.chap_user]
    assert {e.host for e in drv.list_exports()} == {"hv-a", "hv-c"}
    assert logged_in(a) and logged_in(c) and not logged_in(b)
    drv.remove_export(VOL, "hv-c")  # the last slot
    assert drv.list_exports() == [info(VOL, HOST_A.name, a.iqn)]
    assert logged_in(a) and not logged_in(c)
    assert drv.pid == pid


def test_removing_one_host_unbinds_its_address(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)  # 127.0.0.1
    far = drv.ensure_export(VOL, FileSource(volume), ELSEWHERE)  # 127.0.0.2
    drv.remove_export(VOL, HOST_A.name)
    assert drv.list_exports() == [info(VOL, ELSEWHERE.name, a.iqn)]
    live = live_targets(drv)[a.iqn]
    assert live.acl == {"127.0.0.2"} and live.accounts == [far.chap_user]
    rc, out = readcap(far)  # far's CHAP is fine, but 127.0.0.1 is no longer bound
    assert rc != 0 and "Target not found" in out, out
    assert not logged_in(a)


def test_zeroing_a_range_punches_it_out_of_the_file(make_driver: Make, volume: Path) -> None:
    """A file LUN is thin-provisioned: an initiator's write-zeroes (QEMU's, as a mirror onto the LUN
    sends for the source's holes) is one WRITE SAME with UNMAP, and the file gives the space back."""
    drv = make_driver()
    drv.start()
    volume.write_bytes(b"\x6b" * (16 * MiB))
    allocated = os.stat(volume).st_blocks * 512
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    lun = live_targets(drv)[drv.iqn(VOL)].luns[1]
    assert lun.thin and not lun.readonly
    rc, out = qemu_io(c, "write -z -u 0 8M")
    assert rc == 0, out
    assert read_at(volume, 0, 8 * MiB) == bytes(8 * MiB)
    assert read_at(volume, 8 * MiB, 8 * MiB) == b"\x6b" * (8 * MiB)
    assert os.stat(volume).st_blocks * 512 <= allocated - 8 * MiB
    drv.ensure_export(VOL, FileSource(volume), HOST_A)  # applied again: nothing to change
    assert live_targets(drv)[drv.iqn(VOL)].luns[1].thin


def test_read_only_lun_refuses_writes(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    volume.write_bytes(b"\x5a" * (16 * MiB))
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A, read_only=True)
    assert isinstance(c, IscsiConnection)
    rc, out = qemu_io(c, "read -P 0x5a 0 64k", read_only=True)
    assert rc == 0, out
    rc, out = qemu_io(c, "write -P 0x00 0 4k")
    assert rc != 0 and "write protected" in out, out
    # Below QEMU's own check: a raw SCSI WRITE(10) gets DATA PROTECT from the target.
    proc = run(["iscsi-test-cu", "--dataloss", "-V", "--test", "ALL.Write10.Simple", iscsi_url(c)],
               timeout=120, check=False)
    assert "WRITE_PROTECTED" in proc.stdout, proc.stdout[-2000:]
    assert volume.read_bytes() == b"\x5a" * (16 * MiB)
    with pytest.raises(IdempotentParameterMismatch):  # one LUN: every host has the same mode
        drv.ensure_export(VOL, FileSource(volume), HOST_B)


def test_sigkill_then_check_restores_the_same_iqn_and_secret(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    b = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    other = volume.with_name("vol2.img")
    other.write_bytes(b"\0" * MiB)
    ro = drv.ensure_export(VOL2, FileSource(other), HOST_A, read_only=True)
    rc, out = qemu_io(a, "write -P 0x77 0 4k")
    assert rc == 0, out
    before = sorted(drv.list_exports(), key=repr)

    old = drv.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_dead(old)
    assert drv.list_exports() == []
    drv.check()
    assert drv.pid not in (None, old)
    assert sorted(drv.list_exports(), key=repr) == before
    assert logged_in(a) and logged_in(b)  # same IQN, same accounts, same secrets
    rc, out = qemu_io(a, "read -P 0x77 0 4k")
    assert rc == 0, out
    rc, out = qemu_io(ro, "write -P 0 0 4k")
    assert rc != 0 and "write protected" in out, out  # read-only survives the restart
    drv.check()  # healthy: nothing to do
    assert drv.pid is not None and drv.list_exports() == before


def test_hung_tgtd_is_replaced_by_check(make_driver: Make, volume: Path) -> None:
    drv = make_driver(adm_timeout=1.0)
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    old = drv.pid
    assert old is not None
    os.kill(old, signal.SIGSTOP)  # alive, but its control socket never answers
    drv.check()
    wait_dead(old)
    assert drv.pid not in (None, old)
    assert logged_in(c)


def test_connected_initiator_resumes_after_check(
    make_driver: Make, volume: Path, tmp_path: Path, clients: list[subprocess.Popen[bytes]]
) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    log_path = tmp_path / "perf.log"
    with open(log_path, "wb") as out:
        # -x: reconnect up to 1000 times, as QEMU's initiator does after a lost session
        perf = subprocess.Popen(["iscsi-perf", "-x", "1000", iscsi_url(c)], stdout=out, stderr=out)
    clients.append(perf)
    wait_for_progress(log_path, 0)
    old = drv.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_dead(old)
    drv.check()
    mark = log_path.stat().st_size
    wait_for_progress(log_path, mark)
    assert perf.poll() is None


def test_remove_under_a_live_session_is_refused_then_completes(
    make_driver: Make, volume: Path, tmp_path: Path, clients: list[subprocess.Popen[bytes]]
) -> None:
    """The caller must unplug first; if it did not, tgtd is never forced (that hangs the client)."""
    drv = make_driver(session_grace=1.0)
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    log_path = tmp_path / "perf.log"
    with open(log_path, "wb") as out:
        # -n: keep the session through I/O errors, like a hypervisor that was not unplugged
        perf = subprocess.Popen(["iscsi-perf", "-n", iscsi_url(c)], stdout=out, stderr=out)
    clients.append(perf)
    wait_for_progress(log_path, 0)
    with pytest.raises(DriverError, match="still has a session"):
        drv.remove_export(VOL, HOST_A.name)
    assert drv.list_exports() == []  # no account, no LUN: nothing is exported any more
    assert not logged_in(c)  # ACL and account are gone: no new logins
    assert live_targets(drv)[c.iqn].sessions  # only the old session holds the target
    perf.kill()
    perf.wait(10)
    deadline = time.monotonic() + 10
    while c.iqn in live_targets(drv):  # the next check() finishes the removal
        assert time.monotonic() < deadline, "target never removed"
        drv.check()
        time.sleep(0.2)
    drv.remove_export(VOL, HOST_A.name)


def test_list_exports_matches_the_daemon(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    assert drv.list_exports() == []  # not started: nothing
    drv.start()
    other = volume.with_name("vol2.img")
    other.write_bytes(b"\0" * MiB)
    drv.ensure_export(VOL, FileSource(volume), HOST_A)
    drv.ensure_export(VOL2, FileSource(other), HOST_A)
    drv.ensure_export(VOL2, FileSource(other), HOST_B)
    got = {(e.key, e.host, e.protocol, e.target) for e in drv.list_exports()}
    assert got == {(VOL, "hv-a", "iscsi", drv.iqn(VOL)), (VOL2, "hv-a", "iscsi", drv.iqn(VOL2)),
                   (VOL2, "hv-b.example", "iscsi", drv.iqn(VOL2))}
    live = live_targets(drv)
    assert {t.tid for t in live.values()} == {1, 2}  # tids come from what tgtd has
    # A target that is not ours (an operator's) is left alone and not reported.
    tgtadm(drv, "--mode", "target", "--op", "new", "--tid", "9", "--targetname", "iqn.2000-01.com.example:manual")
    assert {(e.key, e.host, e.protocol, e.target) for e in drv.list_exports()} == got
    drv.check()
    assert "iqn.2000-01.com.example:manual" in live_targets(drv)


def test_stop_and_start_again(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    pid = drv.pid
    assert pid is not None
    drv.stop()  # tgtd ignores SIGTERM: offline, delete targets, delete system, wait for the PID
    wait_dead(pid)
    assert drv.pid is None and not drv.pid_path.exists()
    assert drv.list_exports() == []
    drv.stop()  # idempotent
    drv.start()  # desired exports come back with their secrets
    assert logged_in(c)


def test_restarted_agent_adopts_the_running_tgtd(make_driver: Make, volume: Path) -> None:
    first = make_driver()
    c = first.ensure_export(VOL, FileSource(volume), HOST_A)
    pid = first.pid
    first.close()  # the agent goes away, tgtd keeps serving
    second = make_driver(port=first.port, control_port=first.control_port)
    second.start()
    assert second.pid == pid
    assert second.ensure_export(VOL, FileSource(volume), HOST_A) == c
    assert logged_in(c)
    second.stop()
    assert pid is not None
    wait_dead(pid)


def test_lost_state_file_gets_a_fresh_secret_that_works(make_driver: Make, volume: Path) -> None:
    first = make_driver()
    c = first.ensure_export(VOL, FileSource(volume), HOST_A)
    first.close()
    first.state_path.unlink()
    second = make_driver(port=first.port, control_port=first.control_port)
    second.start()
    c2 = second.ensure_export(VOL, FileSource(volume), HOST_A)  # the account tgtd has is replaced, not trusted
    assert secret_of(c2) != secret_of(c)
    assert logged_in(c2) and not logged_in(c)


def test_port_in_use_is_refused(make_driver: Make) -> None:
    with taken_port() as port:
        drv = make_driver(port=port)
        with pytest.raises(DriverError, match="could not listen"):
            drv.start()
    assert drv.pid is None  # the fallback daemon (0.0.0.0:3260) was not kept


def test_bad_input_is_refused(make_driver: Make, volume: Path, tmp_path: Path) -> None:
    drv = make_driver()
    with pytest.raises(InvalidParameter):
        drv.ensure_export("vol-nothex", FileSource(volume), HOST_A)
    with pytest.raises(InvalidParameter):
        drv.ensure_export(VOL, FileSource(Path("relative.img")), HOST_A)
    comma = tmp_path / "a,b.img"  # tgtd would split its backing store there
    comma.write_bytes(b"\0" * MiB)
    with pytest.raises(InvalidParameter):
        drv.ensure_export(VOL, FileSource(comma), HOST_A)
    with pytest.raises(NotFound):
        drv.ensure_export(VOL, FileSource(tmp_path / "missing.img"), HOST_A)
    with pytest.raises(InvalidParameter):
        drv.remove_export(VOL, "Bad Host")
    # A state dir too deep for a unix socket path puts the control socket under /run/vbs instead.
    deep = IscsiExportDriver(tmp_path / ("x" * 120), port=3260)
    assert str(deep.socket_base).startswith("/run/vbs/") and len(str(deep.socket_base)) < 100
    with pytest.raises(InvalidParameter):
        IscsiExportDriver(tmp_path, listen_host="0.0.0.0")
    with pytest.raises(InvalidParameter):
        IscsiExportDriver(tmp_path, control_port=40000)  # beyond tgtd's -C range
    with pytest.raises(InvalidParameter):
        IscsiExportDriver(tmp_path, listen_host="storage.example")  # tgtd reports portals numerically
    assert drv.pid is None  # nothing was started for bad input


# -- online resize: refresh_export / retire_exports ---------------------------------------------------


def lun_sizes(drv: IscsiExportDriver, c: IscsiConnection) -> dict[int, int]:
    """The data LUNs of the volume's target as an initiator reads them (READ CAPACITY 16)."""
    sizes = {}
    for n in sorted(live_targets(drv)[c.iqn].luns):
        if n:
            rc, out = readcap(c.model_copy(update={"lun": n}))
            assert rc == 0, out
            sizes[n] = int(out.split("Total size:")[1].split()[0])
    return sizes


def test_refresh_adds_a_lun_with_the_new_size_and_retire_deletes_the_old(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    c1 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c1, IscsiConnection)
    assert drv.refresh_export(VOL, FileSource(volume), HOST_A.name) == c1  # the file did not grow: nothing to do
    os.truncate(volume, 32 * MiB)
    assert lun_sizes(drv, c1) == {1: 16 * MiB}  # tgt read the size once, when it made the LUN

    c2 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    assert isinstance(c2, IscsiConnection)
    assert c2 == c1.model_copy(update={"lun": 2})  # same target, account and secret
    assert lun_sizes(drv, c1) == {1: 16 * MiB, 2: 32 * MiB}
    assert drv.refresh_export(VOL, FileSource(volume), HOST_A.name) == c2
    assert drv.ensure_export(VOL, FileSource(volume), HOST_A) == c2
    assert drv.list_exports() == [info(VOL, HOST_A.name, c1.iqn)]
    rc, out = qemu_io(c1, "write -P 0x42 0 64k")  # the old LUN serves on, the same file behind both
    assert rc == 0, out
    rc, out = qemu_io(c2, "read -P 0x42 0 64k")
    assert rc == 0, out

    drv.retire_exports(VOL, HOST_A.name)
    drv.retire_exports(VOL, HOST_A.name)
    assert lun_sizes(drv, c2) == {2: 32 * MiB}
    rc, out = qemu_io(c1, "read 0 4k")
    assert rc != 0, out

    os.truncate(volume, 48 * MiB)
    c3 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    assert isinstance(c3, IscsiConnection) and c3.lun == 1  # numbers alternate
    assert lun_sizes(drv, c3) == {1: 48 * MiB, 2: 32 * MiB}
    drv.remove_export(VOL, HOST_A.name)  # every LUN and the target go
    assert live_targets(drv) == {} and drv.list_exports() == []
    with pytest.raises(NotFound):
        drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    drv.retire_exports(VOL, HOST_A.name)
    with pytest.raises(InvalidParameter):
        drv.retire_exports(VOL, "Bad Host")


def test_multi_attached_hosts_refresh_on_their_own_and_share_the_new_lun(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    a1 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    b1 = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    assert isinstance(a1, IscsiConnection) and isinstance(b1, IscsiConnection) and a1.lun == b1.lun == 1
    os.truncate(volume, 32 * MiB)
    a2 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    b2 = drv.refresh_export(VOL, FileSource(volume), HOST_B.name)
    assert isinstance(a2, IscsiConnection) and isinstance(b2, IscsiConnection) and a2.lun == b2.lun == 2
    drv.retire_exports(VOL, HOST_A.name)
    assert set(live_targets(drv)[a1.iqn].luns) == {0, 1, 2}  # B may still be on LUN 1
    drv.retire_exports(VOL, HOST_B.name)
    assert set(live_targets(drv)[a1.iqn].luns) == {0, 2}
    c = drv.ensure_export(VOL, FileSource(volume), HostIdentity(name="hv-c", address="127.0.0.1"))
    assert isinstance(c, IscsiConnection) and c.lun == 2  # a host that joins gets the newest LUN
    assert lun_sizes(drv, c) == {2: 32 * MiB}
    drv.remove_export(VOL, HOST_A.name)
    drv.remove_export(VOL, "hv-c")
    assert lun_sizes(drv, b2) == {2: 32 * MiB}


def test_refresh_survives_tgtd_and_agent_restarts(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    c1 = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    os.truncate(volume, 32 * MiB)
    c2 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    assert isinstance(c1, IscsiConnection) and isinstance(c2, IscsiConnection)
    old = drv.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_dead(old)
    drv.check()  # both LUNs come back, the old one now made from the grown file
    assert lun_sizes(drv, c2) == {1: 32 * MiB, 2: 32 * MiB}
    assert drv.refresh_export(VOL, FileSource(volume), HOST_A.name) == c2

    drv.close()  # the agent restarts between refresh and retire
    second = make_driver(port=drv.port, control_port=drv.control_port)
    second.start()
    assert second.ensure_export(VOL, FileSource(volume), HOST_A) == c2
    second.retire_exports(VOL, HOST_A.name)
    assert lun_sizes(second, c2) == {2: 32 * MiB}
    rc, out = qemu_io(c2, "read 0 4k")
    assert rc == 0, out


def saved_item(drv: IscsiExportDriver, key: str) -> dict[str, Any]:
    (item,) = [i for i in json.loads(drv.state_path.read_text())["items"] if i["key"] == key]
    return dict(item)


def test_a_new_export_is_saved_once_and_a_crash_before_its_lun_is_recovered(
        make_driver: Make, volume: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One save (one fsync) per new export: the LUN's size goes in with the grant, before the LUN
    is made. A crash right after that save (the state file on disk, no LUN yet) is made whole by
    the next start, with the size the file has by then."""
    drv = make_driver()
    drv.start()
    saves: list[int] = []
    real_save = drv._state.save
    monkeypatch.setattr(drv._state, "save", lambda items: (saves.append(1), real_save(items))[1])
    c = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c, IscsiConnection) and saves == [1]
    assert saved_item(drv, VOL)["lun_sizes"] == {"1": 16 * MiB}
    assert logged_in(c)

    other = volume.with_name("vol2.img")
    other.write_bytes(b"\0" * MiB)
    left: list[str] = []

    def crash(*_: Any) -> None:  # what the disk holds when the agent dies just before the LUN
        left.append(drv.state_path.read_text())
        raise SystemExit("crash")

    monkeypatch.setattr(drv._tgt, "new_lun", crash)
    with pytest.raises(SystemExit):
        drv.ensure_export(VOL2, FileSource(other), HOST_A)
    monkeypatch.undo()
    pid = drv.pid
    drv.close()
    with open(other, "r+b") as fh:  # the file grows while the agent is down
        fh.truncate(2 * MiB)
    drv.state_path.write_text(left[0])  # the crash's file, not the rollback's
    second = make_driver(port=drv.port, control_port=drv.control_port)
    second.start()  # adopts tgtd and makes what the state holds
    assert second.pid == pid
    c2 = second.ensure_export(VOL2, FileSource(other), HOST_A)  # the same grant: the secret of the crashed call
    assert isinstance(c2, IscsiConnection)
    crashed = [i for i in json.loads(left[0])["items"] if i["key"] == VOL2]
    assert crashed[0]["grants"]["hv-a"]["secret"] == secret_of(c2) and crashed[0]["lun_sizes"] == {"1": MiB}
    assert lun_sizes(second, c2) == {1: 2 * MiB}
    assert saved_item(second, VOL2)["lun_sizes"] == {"1": 2 * MiB}  # what a refresh compares with
    rc, out = readcap(c2)
    assert rc == 0 and f"Total size:{2 * MiB}" in out, out
    assert second.ensure_export(VOL, FileSource(volume), HOST_A) == c and logged_in(c)


# -- keys and the state file of version 1 -------------------------------------------------------------


def v1_state(volume: Path, c: IscsiConnection, host: str, address: str) -> str:
    """What the driver before the driver kit wrote for one (volume, host) export."""
    return json.dumps({"version": 1, "exports": [{
        "volume_id": VOL, "path": str(volume), "read_only": False, "lun": 1, "lun_sizes": {"1": 16 * MiB},
        "grants": [{"host": host, "address": address, "addresses": [address], "initiator_name": None,
                    "user": c.chap_user, "secret": secret_of(c), "lun": 1, "old_luns": []}]}]})


def test_v1_state_is_upgraded_under_a_running_tgtd(make_driver: Make, volume: Path) -> None:
    first = make_driver()
    c = first.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(c, IscsiConnection)
    pid = first.pid
    first.close()
    first.state_path.write_text(v1_state(volume, c, HOST_A.name, HOST_A.address))  # the agent upgraded
    second = make_driver(port=first.port, control_port=first.control_port)
    second.start()
    assert second.pid == pid
    assert second.ensure_export(VOL, FileSource(volume), HOST_A) == c  # same account, same secret
    assert second.list_exports() == [info(VOL, HOST_A.name, c.iqn)]
    assert logged_in(c)
    second.remove_export(VOL, HOST_A.name)
    assert live_targets(second) == {} and live_accounts(second) == set()


def test_v1_state_is_upgraded_without_a_tgtd(make_driver: Make, volume: Path) -> None:
    drv = make_driver()
    drv.state_path.parent.mkdir(parents=True)
    c = IscsiConnection(host="127.0.0.1", port=drv.port, iqn=drv.iqn(VOL), chap_user=f"{VOL}.hv-a",
                        chap_secret=SecretStr("S3cretS3cretS3cretS3cret"))
    drv.state_path.write_text(v1_state(volume, c, HOST_A.name, HOST_A.address))
    drv.start()  # tgtd comes up with the target, the ACL and the account of the old state
    assert logged_in(c)
    assert drv.ensure_export(VOL, FileSource(volume), HOST_A) == c


def test_a_snapshot_key_is_exported_like_a_volume(make_driver: Make, volume: Path) -> None:
    """A snapshot a hypervisor copies into: served writable to that one host, under its own id."""
    drv = make_driver()
    snap = "snap-0123456789abcdef0"
    c = drv.ensure_export(snap, FileSource(volume), HOST_A)
    assert isinstance(c, IscsiConnection) and c.iqn == drv.iqn(snap) and c.chap_user == f"{snap}.hv-a"
    assert drv.is_exported(snap) and not drv.is_exported(VOL)
    rc, out = qemu_io(c, "write -P 0x3d 0 4k")
    assert rc == 0, out
    assert drv.list_exports() == [info(snap, HOST_A.name, c.iqn)]
    drv.remove_export(snap, HOST_A.name)
    assert not drv.is_exported(snap) and live_targets(drv) == {}
