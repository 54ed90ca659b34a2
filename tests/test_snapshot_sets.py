"""CreateSnapshots for real: a guest writes numbered blocks alternately to two volumes, one at a time and
each flushed before the next, while the set is taken. A set taken at one instant holds blocks 1..k across
both volumes with none missing; a set of two snapshots taken at two instants would miss the blocks written
in between on the volume snapshotted first. The VM runs again afterwards, and a VM that nobody resumes is
resumed by its host agent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError

from tests.conftest import Vbs, node_token, vbs_up_with_guest, wait_until
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest

BLOCK = 4096
BLOCKS = 1500
FAST = {"Delay": 0.2, "MaxAttempts": 600}


class Env:
    def __init__(self, vbs: Vbs, guest: TestGuest, tmp: Path) -> None:
        self.vbs, self.guest, self.tmp = vbs, guest, tmp
        self.ec2 = vbs.ec2()

    def instance(self) -> str:
        return self.vbs.instance("vm1")

    def attached_volume(self, device: str) -> tuple[str, str]:
        vol = self.vbs.create_volume(size_gib=1)["volume_id"]
        self.vbs.wait_volume(vol, "available")
        r = self.vbs.http.post(f"/v1/volumes/{vol}/attach", json={"instance_id": self.instance(), "device": device})
        assert r.status_code == 200, r.text
        return vol, self.guest.wait_for_disk(virtio_serial(vol), 60)

    def vm_status(self) -> str:
        return str(self.guest.qmp("query-status")["status"])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("snapshot-sets")
    with vbs_up_with_guest(tmp) as (vbs, _up, guest):
        yield Env(vbs, guest, tmp)


def numbered_blocks(path: Path) -> set[int]:
    """The block numbers the writer left in a snapshot file (block i holds i at its start)."""
    found = set()
    with open(path, "rb") as f:
        for i in range(1, BLOCKS + 1):
            f.seek(i * BLOCK)
            head = f.read(8)
            if head.strip(b"\0"):
                assert head == b"%08d" % i, (path, i, head)
                found.add(i)
    return found


def writer(dev_a: str, dev_b: str) -> str:
    """Block i to A when odd, to B when even; each flushed (fsync) before the next is written."""
    return (f"i=1; while [ $i -le {BLOCKS} ]; do "
            f"if [ $((i % 2)) -eq 1 ]; then d=/dev/{dev_a}; else d=/dev/{dev_b}; fi; "
            f"printf '%08d' $i | dd of=$d bs={BLOCK} seek=$i conv=sync,notrunc,fsync 2>/dev/null || exit 1; "
            "i=$((i+1)); done; echo written")


def test_a_snapshot_set_is_one_instant_across_two_volumes(env: Env) -> None:
    (vol_a, dev_a), (vol_b, dev_b) = env.attached_volume("vdb"), env.attached_volume("vdc")
    running = env.guest.run_background(writer(dev_a, dev_b), timeout=600)
    # Let it get going, then take the set while it writes.
    time.sleep(3)
    made = env.ec2.create_snapshots(InstanceSpecification={"InstanceId": env.instance()}, Description="set",
                                    TagSpecifications=[{"ResourceType": "snapshot",
                                                        "Tags": [{"Key": "set", "Value": "1"}]}])["Snapshots"]
    assert sorted(s["VolumeId"] for s in made) == sorted([vol_a, vol_b])
    assert env.vm_status() == "running" or wait_until(lambda: env.vm_status() == "running", 10, what="resumed")
    env.ec2.get_waiter("snapshot_completed").wait(SnapshotIds=[s["SnapshotId"] for s in made], WaiterConfig=FAST)
    rc, out = running.result(timeout=600)
    assert rc == 0 and "written" in out, out
    by_volume = {s["VolumeId"]: s["SnapshotId"] for s in made}
    in_a = numbered_blocks(env.vbs.snapshot_data(by_volume[vol_a]))  # from the store on a copy pool
    in_b = numbered_blocks(env.vbs.snapshot_data(by_volume[vol_b]))
    held = in_a | in_b
    assert held, "the set was taken before the writer started"
    k = max(held)
    assert k < BLOCKS, "the set was taken after the writer finished"
    assert held == set(range(1, k + 1)), f"blocks missing from the set: {sorted(set(range(1, k + 1)) - held)[:20]}"
    assert in_a == {i for i in held if i % 2} and in_b == {i for i in held if not i % 2}
    shown = env.ec2.describe_snapshots(SnapshotIds=[by_volume[vol_a]])["Snapshots"][0]
    assert (shown["Description"], shown["Tags"]) == ("set", [{"Key": "set", "Value": "1"}])


def test_a_paused_vm_that_no_one_resumes_runs_again_after_its_hold(env: Env) -> None:
    """The controller pauses through the host agent; should it never resume, the agent does."""
    host = env.vbs.http.get("/v1/hosts").json()["hosts"][0]
    token = node_token(env.vbs.data_dir, "host", host["name"])
    headers = {"authorization": f"Bearer {token}"}
    r = httpx.put(f"{host['url']}/v1/vms/vm1/pause", json={"hold_s": 2}, headers=headers, timeout=10)
    assert r.status_code == 200 and r.json() == {"paused_by_vbs": True}, r.text
    assert env.vm_status() == "paused"
    wait_until(lambda: env.vm_status() == "running", 20, what="resumed after its hold")
    # A VM its operator paused is not VBS's to resume.
    env.guest.qmp("stop")
    try:
        r = httpx.put(f"{host['url']}/v1/vms/vm1/pause", json={"hold_s": 1}, headers=headers, timeout=10)
        assert r.json() == {"paused_by_vbs": False}
        assert httpx.delete(f"{host['url']}/v1/vms/vm1/pause", headers=headers, timeout=10).status_code == 200
        time.sleep(2)
        assert env.vm_status() == "paused"
    finally:
        env.guest.qmp("cont")


def test_refusals(env: Env) -> None:
    def code(**params: Any) -> str:
        with pytest.raises(ClientError) as info:
            env.ec2.create_snapshots(**params)
        return str(info.value.response["Error"]["Code"])

    assert code(InstanceSpecification={"InstanceId": "i-0123456789abcdef0"}) == "InvalidInstanceID.NotFound"
    assert code(InstanceSpecification={"InstanceId": "nope"}) == "InvalidInstanceID.Malformed"
    attached = [a["volume_id"] for v in env.vbs.all_volumes() for a in v["attachments"]]
    assert code(InstanceSpecification={"InstanceId": env.instance(), "ExcludeDataVolumeIds": attached}) \
        == "InvalidParameterValue"
