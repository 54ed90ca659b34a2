"""Snapshot locks against a real ``vbs up``, driven by boto3's own EC2 client (LockSnapshot, UnlockSnapshot,
DescribeLockedSnapshots), the REST routes and the CLI: a locked snapshot cannot be deleted by anyone, an
admin key included; a compliance lock past its cooling-off period can be neither removed nor shortened,
only extended; a lock outlives a restart of the controller, and holds on a second controller (PostgreSQL)
while the first is frozen; an expired lock no longer holds."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from tests.conftest import VBS, Vbs, VbsUp, database_flags, stop_process, wait_until
from vbs.net.ports import free_port

pytestmark = pytest.mark.integration


class Env:
    def __init__(self, up: VbsUp, vbs: Vbs) -> None:
        self.up, self.vbs = up, vbs

    @property
    def ec2(self) -> Any:
        return self.vbs.ec2()

    def snapshot(self) -> str:
        vol = self.vbs.create_volume(size_gib=1)["volume_id"]
        self.vbs.wait_volume(vol, "available")
        snap = self.vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
        self.vbs.wait_snapshot(snap, "completed")
        return str(snap)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp: Path = tmp_path_factory.mktemp("locks")
    up = VbsUp(tmp / "var", tmp / "up.log")
    try:
        yield Env(up, up.start())
    finally:
        up.stop()


def code(exc: pytest.ExceptionInfo[ClientError]) -> str:
    return str(exc.value.response["Error"]["Code"])


def test_a_governance_lock_stops_every_delete_until_its_owner_unlocks(env: Env) -> None:
    ec2, snap = env.ec2, env.snapshot()
    with pytest.raises(ClientError) as exc:
        ec2.lock_snapshot(SnapshotId=snap, LockMode="governance", LockDuration=1, DryRun=True)
    assert code(exc) == "DryRunOperation"
    assert ec2.describe_locked_snapshots(SnapshotIds=[snap])["Snapshots"] == []
    locked = ec2.lock_snapshot(SnapshotId=snap, LockMode="governance", LockDuration=1)
    assert locked["LockState"] == "governance" and locked["LockDuration"] == 1
    assert locked["LockExpiresOn"] - locked["LockCreatedOn"] == timedelta(days=1)
    with pytest.raises(ClientError) as exc:  # the install's own key is an admin key
        ec2.delete_snapshot(SnapshotId=snap)
    assert code(exc) == "SnapshotLocked"
    r = env.vbs.http.delete(f"/v1/snapshots/{snap}")  # nor through REST
    assert r.status_code == 409 and r.json()["error"]["code"] == "SnapshotLocked"
    assert env.vbs.snapshot(snap)["status"] == "completed"
    # Governance: shortened, lengthened, unlocked by its owner.
    ec2.lock_snapshot(SnapshotId=snap, LockMode="governance", ExpirationDate=datetime.now(UTC) + timedelta(hours=2))
    assert ec2.unlock_snapshot(SnapshotId=snap)["SnapshotId"] == snap
    with pytest.raises(ClientError) as exc:
        ec2.unlock_snapshot(SnapshotId=snap)
    assert code(exc) == "SnapshotNotLocked"
    ec2.delete_snapshot(SnapshotId=snap)


def test_a_compliance_lock_past_its_cooling_off_can_only_be_extended(env: Env) -> None:
    ec2, snap = env.ec2, env.snapshot()
    ec2.lock_snapshot(SnapshotId=snap, LockMode="compliance", LockDuration=2)
    [shown] = ec2.describe_locked_snapshots(SnapshotIds=[snap])["Snapshots"]
    assert shown["LockState"] == "compliance" and shown["OwnerId"]
    for change in ({"LockMode": "governance", "LockDuration": 5}, {"LockMode": "compliance", "LockDuration": 1},
                   {"LockMode": "compliance", "LockDuration": 3, "CoolOffPeriod": 1}):
        with pytest.raises(ClientError) as exc:
            ec2.lock_snapshot(SnapshotId=snap, **change)
        assert code(exc) == "SnapshotLocked", change
    with pytest.raises(ClientError) as exc:
        ec2.unlock_snapshot(SnapshotId=snap)
    assert code(exc) == "SnapshotLocked"
    extended = ec2.lock_snapshot(SnapshotId=snap, LockMode="compliance", LockDuration=30)
    assert extended["LockState"] == "compliance" and extended["LockDuration"] == 30

    # Another compliance lock, in its cooling-off period: still free to change or remove.
    cooling = env.snapshot()
    made = ec2.lock_snapshot(SnapshotId=cooling, LockMode="compliance", LockDuration=10, CoolOffPeriod=1)
    assert made["LockState"] == "compliance-cooloff" and made["CoolOffPeriod"] == 1
    assert made["CoolOffPeriodExpiresOn"] - made["LockCreatedOn"] == timedelta(hours=1)
    states = {s["SnapshotId"]: s["LockState"] for s in ec2.describe_locked_snapshots(
        Filters=[{"Name": "lock-state", "Values": ["compliance", "compliance-cooloff"]}])["Snapshots"]}
    assert states[snap] == "compliance" and states[cooling] == "compliance-cooloff"
    ec2.unlock_snapshot(SnapshotId=cooling)
    ec2.delete_snapshot(SnapshotId=cooling)

    # The lock is in the metadata DB: a restarted controller holds it as well.
    env.up.stop()
    env.vbs = env.up.start()
    with pytest.raises(ClientError) as exc:
        env.ec2.delete_snapshot(SnapshotId=snap)
    assert code(exc) == "SnapshotLocked"
    [shown] = env.ec2.describe_locked_snapshots(SnapshotIds=[snap])["Snapshots"]
    assert shown["LockDuration"] == 30


def test_bad_locks_are_refused_and_an_expired_lock_no_longer_holds(env: Env) -> None:
    ec2, snap = env.ec2, env.snapshot()
    bad: list[dict[str, Any]] = [
        {"LockMode": "governance"},  # neither duration nor date
        {"LockMode": "governance", "LockDuration": 1, "ExpirationDate": datetime.now(UTC) + timedelta(days=1)},
        {"LockMode": "governance", "LockDuration": 1, "CoolOffPeriod": 1},  # cooling-off is compliance's
        {"LockMode": "compliance", "LockDuration": 1, "CoolOffPeriod": 73},
        {"LockMode": "governance", "LockDuration": 36501},
        {"LockMode": "governance", "ExpirationDate": datetime.now(UTC) - timedelta(minutes=1)},
        {"LockMode": "sometimes", "LockDuration": 1},
    ]
    for params in bad:
        with pytest.raises(ClientError) as exc:
            ec2.lock_snapshot(SnapshotId=snap, **params)
        assert code(exc) in ("InvalidParameterValue", "MissingParameter"), params
    assert ec2.describe_locked_snapshots(SnapshotIds=[snap])["Snapshots"] == []
    with pytest.raises(ClientError) as exc:
        ec2.lock_snapshot(SnapshotId="snap-0123456789abcdef0", LockMode="governance", LockDuration=1)
    assert code(exc) == "InvalidSnapshot.NotFound"

    until = datetime.now(UTC) + timedelta(seconds=3)
    ec2.lock_snapshot(SnapshotId=snap, LockMode="compliance", ExpirationDate=until)
    with pytest.raises(ClientError) as exc:
        ec2.delete_snapshot(SnapshotId=snap)
    assert code(exc) == "SnapshotLocked"
    time.sleep(max(0.0, (until - datetime.now(UTC)).total_seconds()) + 0.5)
    [shown] = ec2.describe_locked_snapshots(SnapshotIds=[snap])["Snapshots"]
    assert shown["LockState"] == "expired"
    ec2.delete_snapshot(SnapshotId=snap)


def test_the_cli_and_rest_lock_list_and_unlock(env: Env) -> None:
    vbs, snap = env.vbs, env.snapshot()
    made = vbs.cli("lock-snapshot", snap, "--mode", "governance", "--duration-days", "7")
    assert made["lock_state"] == "governance" and made["duration_days"] == 7
    listed = vbs.cli("describe-locked-snapshots", snap)["locks"]
    assert [x["snapshot_id"] for x in listed] == [snap]
    refused = vbs.cli("delete-snapshot", snap, check=False)
    assert refused.returncode != 0 and "locked" in refused.stderr
    r = vbs.http.put(f"/v1/snapshots/{snap}/lock", json={"mode": "governance"})
    assert r.status_code == 400, r.text
    assert vbs.cli("unlock-snapshot", snap)["snapshot_id"] == snap
    assert vbs.http.get("/v1/snapshot-locks", params={"snapshot_id": snap}).json()["locks"] == []
    vbs.cli("delete-snapshot", snap)


def _healthy(vbs: Vbs) -> bool:
    try:
        return vbs.http.get("/health", timeout=5).status_code == 200
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def test_a_lock_holds_on_the_other_controller_while_the_first_is_frozen(tmp_path: Path,
                                                                         request: pytest.FixtureRequest) -> None:
    """Two controllers on one PostgreSQL database: a compliance lock taken through one refuses a delete
    through the other (an admin key) while the first is frozen (SIGSTOP): the lock is the database's,
    not a controller's."""
    flags = database_flags("postgresql", request)
    up = VbsUp(tmp_path / "var", tmp_path / "up.log", extra=flags)
    try:
        a = up.start()
        port = free_port()
        with (tmp_path / "controller-b.log").open("ab") as log:
            proc = subprocess.Popen([*VBS, "controller", "--port", str(port), "--data-dir", str(a.data_dir), *flags],
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            b = Vbs(f"http://127.0.0.1:{port}", a.data_dir)
            wait_until(lambda: _healthy(b) or proc.poll() is not None, 60, what="the second controller")
            assert proc.poll() is None, (tmp_path / "controller-b.log").read_text()[-3000:]
            snap = Env(up, a).snapshot()
            a.ec2().lock_snapshot(SnapshotId=snap, LockMode="compliance", LockDuration=1)
            frozen = up.child_pid("controller")
            assert frozen is not None
            os.kill(frozen, signal.SIGSTOP)
            try:
                with pytest.raises(ClientError) as exc:
                    b.ec2().delete_snapshot(SnapshotId=snap)
                assert code(exc) == "SnapshotLocked"
                r = b.http.delete(f"/v1/snapshots/{snap}")
                assert r.status_code == 409 and r.json()["error"]["code"] == "SnapshotLocked"
                [shown] = b.ec2().describe_locked_snapshots(SnapshotIds=[snap])["Snapshots"]
                assert shown["LockState"] == "compliance" and shown["LockDuration"] == 1
                assert b.snapshot(snap)["status"] == "completed"
            finally:
                os.kill(frozen, signal.SIGCONT)
        finally:
            stop_process(proc)
    finally:
        up.stop()
