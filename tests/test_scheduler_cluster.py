"""Several storage nodes and pools, as real processes: one ``vbs controller`` and three ``vbs storage-agent``
each with its own pool on its own ext4 loop filesystem (64, 128 and 192 MiB: capacities 1:2:3).

What the scheduler promises, checked from the outside (REST, the vbs CLI, boto3): creates spread in
proportion to capacity, no pool promises more than capacity x overcommit, a node that stopped
heartbeating gets nothing and its volumes are impaired, a drained node gets nothing until undrained,
and a zone keeps its volumes. Every process is stopped by its PID; every loop device is undone.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.conftest import (
    DATABASES,
    VBS,
    Services,
    Vbs,
    database_flags,
    free_port,
    reap_daemons,
    stop_process,
    wait_until,
)
from tests.loopfs import loop_filesystem

pytestmark = pytest.mark.integration

GIB = 1 << 30
HEARTBEAT_TIMEOUT_S = 4.0
HEARTBEAT_INTERVAL_S = 1.0
# The pools are tiny real filesystems and volumes are thin: 1,000 x 55 MiB promises 53 GiB.
OVERCOMMIT = 1000
ZONE_A, ZONE_B = "us-east-1a", "us-east-1b"
CLIENTS = 8


class Agent:
    """One ``vbs storage-agent`` process: its node name, pools (name -> directory) and zone."""

    def __init__(self, name: str, pools: dict[str, Path], zone: str | None) -> None:
        self.name, self.pools, self.zone = name, pools, zone
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None


class Cluster:
    """A controller (short heartbeat timeout, high overcommit) and its storage agents."""

    def __init__(self, tmp: Path, stack: ExitStack, database: list[str]) -> None:
        self.services = Services(tmp)
        self.tmp = tmp
        self.stack = stack
        self.agents: dict[str, Agent] = {}
        stack.callback(self.stop)
        self.services.start_controller(*database, VBS_CONTROLLER_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
                                       VBS_CONTROLLER_OVERCOMMIT_RATIO=str(OVERCOMMIT))

    @property
    def vbs(self) -> Vbs:
        return self.services.vbs

    def loop_pool(self, size_mib: int, fstype: str = "ext4") -> Path:
        """A pool directory on a fresh filesystem of ``size_mib`` (unmounted at teardown, after the agents stop)."""
        return self.stack.enter_context(loop_filesystem(self.tmp, fstype, size_mib=size_mib))

    def start_agent(self, name: str, pools: dict[str, Path], zone: str | None = None) -> Agent:
        agent = Agent(name, pools, zone)
        argv = [*VBS, "storage-agent", "--node-name", name, "--port", str(agent.port), "--controller-url",
                self.vbs.endpoint, "--state-dir", str(self.tmp / f"state-{name}"), "--nbd-port", str(free_port())]
        for pool_name, path in pools.items():
            argv += ["--pool", f"{pool_name}={path}"]
        if zone is not None:
            argv += ["--availability-zone", zone]
        env = {**self.services.node_env("storage", name),
               "VBS_STORAGE_AGENT_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S)}
        agent.proc = subprocess.Popen(argv, env=env, stdout=(self.tmp / f"{name}.log").open("ab"),
                                      stderr=subprocess.STDOUT)
        self.agents[name] = agent
        return agent

    def wait_up(self) -> None:
        wait_until(lambda: {n["name"] for n in self.nodes().values() if n["state"] == "up"} >= set(self.agents),
                   60, what="every storage agent up")

    def stop_agent(self, name: str) -> None:
        proc = self.agents[name].proc
        assert proc is not None
        stop_process(proc)
        reap_daemons(self.tmp / f"state-{name}")

    def stop(self) -> None:
        for name in self.agents:
            self.stop_agent(name)
        self.services.stop()

    def nodes(self) -> dict[str, dict[str, Any]]:
        r = self.vbs.http.get("/v1/storage-nodes")
        assert r.status_code == 200, r.text
        return {n["name"]: n for n in r.json()["storage_nodes"]}

    def create(self, **body: Any) -> dict[str, Any]:
        return self.vbs.create_volume(size_gib=1, **body)

    def placed(self, count: int, **body: Any) -> Counter[str]:
        """Create ``count`` volumes one after another: how many each node got."""
        return Counter(self.create(**body)["storage_node"] for _ in range(count))

    def file_of(self, volume: dict[str, Any]) -> Path:
        return self.agents[volume["storage_node"]].pools[volume["pool"]] / "volumes" / f"{volume['volume_id']}.raw"

    def ec2(self) -> Any:
        key = self.services.key
        return boto3.session.Session(aws_access_key_id=key.access_key_id, aws_secret_access_key=key.secret_access_key,
                                     region_name="us-east-1").client(
            "ec2", endpoint_url=self.vbs.endpoint, config=Config(retries={"max_attempts": 0}))


@pytest.fixture
def cluster(tmp_path: Path, metadata_db: str, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with ExitStack() as stack:
        yield Cluster(tmp_path, stack, database_flags(metadata_db, request))


def three_nodes(cluster: Cluster, zones: tuple[str | None, str | None, str | None] = (None, None, None), *,
                sizes_mib: tuple[int, int, int] = (64, 128, 192), fstype: str = "ext4") -> None:
    """s1, s2, s3 with one pool each, of capacities 1:2:3."""
    for i, (size, zone) in enumerate(zip(sizes_mib, zones, strict=True), start=1):
        cluster.start_agent(f"s{i}", {"default": cluster.loop_pool(size, fstype)}, zone)
    cluster.wait_up()


def concurrent_creates(cluster: Cluster, total: int | None) -> tuple[list[dict[str, Any]], list[httpx.Response]]:
    """Creates from ``CLIENTS`` threads, each with its own connection: ``total`` in all, or (None) until
    every thread was refused. The volumes made and the refusals."""
    made: list[dict[str, Any]] = []
    refused: list[httpx.Response] = []
    lock = threading.Lock()
    left = [total if total is not None else 10**6]
    auth = cluster.vbs.http.headers["authorization"]

    def client() -> None:
        with httpx.Client(base_url=cluster.vbs.endpoint, timeout=60, headers={"authorization": auth}) as http:
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                r = http.post("/v1/volumes", json={"size_gib": 1})
                with lock:
                    if r.status_code == 200:
                        made.append(r.json())
                    else:
                        refused.append(r)
                if r.status_code != 200 and total is None:
                    return

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads)
    return made, refused


# -- capacity ----------------------------------------------------------------------------------------


# The row locks that keep two creates from both taking a pool's last room matter most on PostgreSQL.
@pytest.mark.parametrize("metadata_db", DATABASES, indirect=True)
def test_creates_spread_by_capacity_and_no_pool_promises_more_than_it_may(cluster: Cluster) -> None:
    three_nodes(cluster)
    started = time.monotonic()
    made, refused = concurrent_creates(cluster, 300)
    assert refused == [] and len(made) == 300, [r.text for r in refused[:3]]
    per_node = Counter(v["storage_node"] for v in made)
    for node, share in (("s1", 1 / 6), ("s2", 2 / 6), ("s3", 3 / 6)):
        expected = 300 * share
        assert abs(per_node[node] - expected) <= 0.15 * expected, (per_node, time.monotonic() - started)

    # Until every client is refused: each pool then holds what it may promise, and not a GiB more.
    more, refused = concurrent_creates(cluster, None)
    assert len(refused) == CLIENTS
    assert {(r.status_code, r.json()["error"]["code"]) for r in refused} == {(400, "InsufficientVolumeCapacity")}
    promised: Counter[str] = Counter()
    for v in cluster.vbs.all_volumes():
        promised[v["storage_node"]] += v["size_gib"]
    assert sum(promised.values()) == len(made) + len(more)
    for name, node in cluster.nodes().items():
        may = node["pools"][0]["capacity_bytes"] * OVERCOMMIT / GIB
        assert may - 1 < promised[name] <= may, (name, promised[name], may)

    # The volumes are real: every file is in its own node's pool.
    wait_until(lambda: not any(v["status"] == "creating" for v in cluster.vbs.all_volumes()), 300,
               what="every create finished")
    volumes = cluster.vbs.all_volumes()
    assert {v["status"] for v in volumes} == {"available"}
    for v in volumes:
        assert cluster.file_of(v).stat().st_size == GIB, v


# -- a node that stops ---------------------------------------------------------------------------------


def test_a_stopped_node_gets_no_new_volume_and_its_volumes_are_impaired(cluster: Cluster) -> None:
    three_nodes(cluster)
    before = [cluster.create() for _ in range(12)]
    for v in before:
        cluster.vbs.wait_volume(v["volume_id"], "available")
    on_s2 = {v["volume_id"] for v in before if v["storage_node"] == "s2"}
    assert len(on_s2) == 4

    cluster.stop_agent("s2")
    wait_until(lambda: cluster.nodes()["s2"]["state"] == "down", HEARTBEAT_TIMEOUT_S + 10, what="s2 down")
    after = cluster.placed(12)
    assert set(after) == {"s1", "s3"} and after["s3"] > after["s1"], after
    r = cluster.vbs.http.post("/v1/volumes", json={"size_gib": 1, "storage_node": "s2"})
    assert r.status_code == 409 and "The storage node 's2' is down" in r.json()["error"]["message"], r.text

    for v in before:
        expected = "impaired" if v["volume_id"] in on_s2 else "ok"
        assert cluster.vbs.volume(v["volume_id"])["volume_status"] == expected, v

    ec2 = cluster.ec2()
    statuses = {s["VolumeId"]: s for s in ec2.describe_volume_status(
        VolumeIds=[v["volume_id"] for v in before])["VolumeStatuses"]}
    assert set(statuses) == {v["volume_id"] for v in before}
    for vol_id, s in statuses.items():
        io = s["VolumeStatus"]["Details"][0]
        if vol_id in on_s2:
            assert s["VolumeStatus"]["Status"] == "impaired" and io == {"Name": "io-enabled", "Status": "failed"}
        else:
            assert s["VolumeStatus"]["Status"] == "ok" and io == {"Name": "io-enabled", "Status": "passed"}
    impaired = ec2.describe_volume_status(Filters=[{"Name": "volume-status.status", "Values": ["impaired"]}])
    assert {s["VolumeId"] for s in impaired["VolumeStatuses"]} == on_s2


# -- draining ------------------------------------------------------------------------------------------


def test_a_drained_node_gets_nothing_until_undrained_and_its_snapshots_still_clone_there(cluster: Cluster) -> None:
    # Reflink pools: a snapshot on a copy pool would need the volume's size free while it copies.
    three_nodes(cluster, sizes_mib=(1024, 2048, 3072), fstype="xfs")
    before = [cluster.create() for _ in range(6)]
    on_s2 = sorted(v["volume_id"] for v in before if v["storage_node"] == "s2")
    assert len(on_s2) == 2

    drained = cluster.vbs.cli("drain-storage-node", "s2")
    assert drained["storage_node"]["drained"] is True
    assert [v["id"] for v in drained["volumes"]] == on_s2
    table = cluster.vbs.cli("-o", "table", "drain-storage-node", "s2", check=False)
    assert table.returncode == 0 and "is drained: 2 volume(s) and 0 snapshot(s)" in table.stdout, table.stderr
    assert all(v in table.stdout for v in on_s2)
    assert cluster.vbs.cli("describe-storage-nodes")["storage_nodes"][1]["drained"] is True

    assert "s2" not in cluster.placed(12)
    time.sleep(2 * HEARTBEAT_INTERVAL_S)  # heartbeats came in meanwhile: the mark stays
    assert cluster.nodes()["s2"]["drained"] is True
    assert "s2" not in cluster.placed(6)
    r = cluster.vbs.http.post("/v1/volumes", json={"size_gib": 1, "storage_node": "s2"})
    assert r.status_code == 409 and "'s2' is drained" in r.json()["error"]["message"], r.text

    # What lives on a drained node still clones there: the clone is made where its snapshot is.
    source = cluster.vbs.wait_volume(on_s2[0], "available")
    snap = cluster.vbs.http.post("/v1/snapshots", json={"volume_id": source["volume_id"]}).json()
    cluster.vbs.wait_snapshot(snap["snapshot_id"], "completed")
    clone = cluster.vbs.create_volume(snapshot_id=snap["snapshot_id"])
    assert clone["storage_node"] == "s2"
    cluster.vbs.wait_volume(clone["volume_id"], "available")
    assert cluster.file_of(clone).exists()

    undone = cluster.vbs.cli("drain-storage-node", "s2", "--undo")
    assert undone["storage_node"]["drained"] is False
    # s2 fell behind while drained: water-filling gives it the next ones.
    assert cluster.create()["storage_node"] == "s2"


def test_draining_needs_an_admin_key_and_a_known_node(cluster: Cluster) -> None:
    three_nodes(cluster)
    assert cluster.vbs.cli("drain-storage-node", "nowhere", check=False).returncode == 1
    r = cluster.vbs.http.post("/v1/storage-nodes/nowhere/drain")
    assert r.status_code == 404 and r.json()["error"]["code"] == "InvalidStorageNode.NotFound"
    key = cluster.vbs.http.post("/v1/keys", json={"tenant": "alice", "role": "user"}).json()
    user = httpx.Client(base_url=cluster.vbs.endpoint, timeout=30, headers={
        "authorization": f"Bearer {key['access_key_id']}:{key['secret_access_key']}"})
    r = user.post("/v1/storage-nodes/s1/drain")
    assert r.status_code == 403 and r.json()["error"]["code"] == "UnauthorizedOperation"
    assert cluster.nodes()["s1"]["drained"] is False


# -- zones ---------------------------------------------------------------------------------------------


def test_a_zone_keeps_its_volumes(cluster: Cluster) -> None:
    three_nodes(cluster, zones=(None, ZONE_B, ZONE_B))  # s1 names no zone: the controller's, us-east-1a
    ec2 = cluster.ec2()
    zones = ec2.describe_availability_zones()["AvailabilityZones"]
    assert [(z["ZoneName"], z["ZoneId"], z["State"]) for z in zones] == [
        (ZONE_A, "us-east-1-az1", "available"), (ZONE_B, "us-east-1-az2", "available")]
    rest = cluster.vbs.http.get("/v1/availability-zones").json()["availability_zones"]
    assert [z["zone_name"] for z in rest] == [ZONE_A, ZONE_B]

    in_b = [ec2.create_volume(Size=1, AvailabilityZone=ZONE_B) for _ in range(6)]
    assert {v["AvailabilityZone"] for v in in_b} == {ZONE_B}
    assert {cluster.vbs.volume(v["VolumeId"])["storage_node"] for v in in_b} == {"s2", "s3"}
    in_a = ec2.create_volume(Size=1, AvailabilityZone=ZONE_A)
    assert cluster.vbs.volume(in_a["VolumeId"])["storage_node"] == "s1"
    found = ec2.describe_volumes(Filters=[{"Name": "availability-zone", "Values": [ZONE_B]}])["Volumes"]
    assert {v["VolumeId"] for v in found} == {v["VolumeId"] for v in in_b}

    with pytest.raises(ClientError) as err:
        ec2.create_volume(Size=1, AvailabilityZone="us-east-1z")
    assert (err.value.response["ResponseMetadata"]["HTTPStatusCode"],
            err.value.response["Error"]["Code"]) == (400, "InvalidParameterValue")
    r = cluster.vbs.http.post("/v1/volumes", json={"size_gib": 1, "availability_zone": "us-east-1z"})
    assert r.status_code == 400 and "Invalid availability zone: [us-east-1z]" in r.json()["error"]["message"]
    assert len(cluster.vbs.all_volumes()) == 7

    by_cli = cluster.vbs.cli("create-volume", "--size", "1", "--availability-zone", ZONE_A)
    assert (by_cli["storage_node"], by_cli["availability_zone"]) == ("s1", ZONE_A)
    assert cluster.nodes()["s2"]["availability_zone"] == ZONE_B


# -- one node, several pools -------------------------------------------------------------------------


def test_one_agent_serves_several_pools_and_a_create_may_name_one(cluster: Cluster) -> None:
    fast, big = cluster.tmp / "fast", cluster.tmp / "big"
    fast.mkdir()
    big.mkdir()
    cluster.start_agent("s1", {"fast": fast, "big": big})
    cluster.wait_up()
    assert [p["name"] for p in cluster.nodes()["s1"]["pools"]] == ["fast", "big"]

    named = cluster.vbs.cli("create-volume", "--size", "1", "--storage-node", "s1", "--pool", "big", "--wait")
    assert (named["pool"], named["status"]) == ("big", "available")
    assert (big / "volumes" / f"{named['volume_id']}.raw").exists()
    # Same filesystem, same capacity: the two pools take turns.
    pools = Counter(cluster.create()["pool"] for _ in range(5))
    assert pools == {"fast": 3, "big": 2}

    refused = cluster.vbs.cli("create-volume", "--size", "1", "--pool", "nosuch", check=False)
    assert refused.returncode == 1 and "No storage node has a pool named 'nosuch'" in refused.stderr
    refused = cluster.vbs.cli("create-volume", "--size", "1", "--storage-node", "s9", check=False)
    assert refused.returncode == 1 and "The storage node 's9' does not exist" in refused.stderr


def test_an_agent_refuses_two_pools_of_one_name(tmp_path: Path) -> None:
    proc = subprocess.run([*VBS, "storage-agent", "--pool", f"a={tmp_path}", "--pool", f"a={tmp_path / 'x'}",
                           "--state-dir", str(tmp_path / "state")], env={**os.environ, "VBS_AGENT_TOKEN": "x"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "the pool name 'a' is given twice" in proc.stderr, proc.stderr
    assert not (tmp_path / "state").exists()
