"""Denial of service, bounded: integers checked at the edge (400, never 500), pages on every describe,
overcommit against what a pool already promised, and per-tenant quotas — each against a real ``vbs up``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.conftest import Vbs, running_vbs_up, wait_until

GIB = 1 << 30
HUGE = [10**20, -(10**20), 2**63, -1]


def ec2_client(vbs: Vbs, key_id: str | None = None, secret: str | None = None) -> Any:
    return boto3.client("ec2", endpoint_url=vbs.endpoint, region_name="us-east-1",
                        aws_access_key_id=key_id or vbs.key.access_key_id,
                        aws_secret_access_key=secret or vbs.key.secret_access_key,
                        config=Config(retries={"max_attempts": 1}, parameter_validation=False))


def user_key(vbs: Vbs, tenant: str) -> tuple[httpx.Client, Any]:
    r = vbs.http.post("/v1/keys", json={"tenant": tenant, "role": "user"})
    assert r.status_code == 200, r.text
    k = r.json()
    http = httpx.Client(base_url=vbs.endpoint, timeout=60,
                        headers={"authorization": f"Bearer {k['access_key_id']}:{k['secret_access_key']}"})
    return http, ec2_client(vbs, k["access_key_id"], k["secret_access_key"])


def ec2_code(call: Any) -> tuple[str, int]:
    with pytest.raises(ClientError) as info:
        call()
    return info.value.response["Error"]["Code"], info.value.response["ResponseMetadata"]["HTTPStatusCode"]


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    with running_vbs_up(tmp_path_factory.mktemp("bounds")) as vbs:
        yield vbs


def world(vbs: Vbs) -> tuple[Any, ...]:
    snaps = vbs.http.get("/v1/snapshots", params={"max_results": 1000}).json()["snapshots"]
    return (sorted((v["volume_id"], v["size_gib"], v["iops"], v["throughput"]) for v in vbs.all_volumes()),
            sorted(s["snapshot_id"] for s in snaps), len(list(vbs.pool.iterdir())))


# -- integers ---------------------------------------------------------------------------------------------


def test_every_rest_integer_out_of_range_is_a_400_and_changes_nothing(vbs: Vbs) -> None:
    vol = vbs.create_volume(size_gib=1)
    vbs.wait_volume(vol["volume_id"], "available")
    before = world(vbs)
    bad: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]] = []
    for n in HUGE:
        for field in ("size_gib", "iops", "throughput"):
            bad.append(("POST", "/v1/volumes", {"size_gib": 1, field: n}, None))
            bad.append(("POST", f"/v1/volumes/{vol['volume_id']}/modify", {field: n}, None))
        for path in ("/v1/volumes", "/v1/snapshots", "/v1/volume-modifications", "/v1/hosts", "/v1/instances",
                     "/v1/storage-nodes"):
            bad.append(("GET", path, None, {"max_results": n}))
        for path, name in (("/v1/volumes", "size"), ("/v1/snapshots", "volume-size"), ("/v1/snapshots", "progress"),
                           ("/v1/volume-modifications", "target-size"),
                           ("/v1/volume-modifications", "original-size")):
            bad.append(("GET", path, None, {"filter": f"{name}={n}"}))
    for path in ("/v1/volumes", "/v1/snapshots", "/v1/hosts"):
        bad += [("GET", path, None, {"max_results": v}) for v in (0, 1001, "1e3", "١")]
    bad.append(("GET", "/v1/volumes", None, {"filter": "size=١"}))  # an Arabic-Indic digit: int() takes it
    bad.append(("GET", "/v1/volumes", None, {"filter": "size=1_0"}))
    for method, path, body, params in bad:
        r = vbs.http.request(method, path, json=body, params=params)
        assert r.status_code == 400, (method, path, body, params, r.text)
        assert r.json()["error"]["code"] == "InvalidParameterValue", r.text
    assert vbs.http.get("/v1/volumes", params={"filter": "size=1"}).status_code == 200
    assert world(vbs) == before


def test_every_ec2_integer_out_of_range_is_a_400_and_changes_nothing(vbs: Vbs) -> None:
    vol = vbs.create_volume(size_gib=1)
    vbs.wait_volume(vol["volume_id"], "available")
    before = world(vbs)
    ec2 = ec2_client(vbs)
    zone = {"AvailabilityZone": "us-east-1a"}
    calls: list[Any] = []
    for n in [*HUGE, 0]:
        calls += [partial(ec2.create_volume, Size=n, **zone),
                  partial(ec2.create_volume, Size=1, Iops=n, VolumeType="io1", **zone),
                  partial(ec2.create_volume, Size=1, Throughput=n, **zone),
                  partial(ec2.modify_volume, VolumeId=vol["volume_id"], Size=n),
                  partial(ec2.modify_volume, VolumeId=vol["volume_id"], Iops=n),
                  partial(ec2.describe_volumes, MaxResults=n),
                  partial(ec2.describe_snapshots, MaxResults=n),
                  partial(ec2.describe_tags, MaxResults=n),
                  partial(ec2.describe_volumes_modifications, MaxResults=n)]
    for value in (str(10**20), "-5", "١"):
        calls += [partial(ec2.describe_volumes, Filters=[{"Name": "size", "Values": [value]}]),
                  partial(ec2.describe_snapshots, Filters=[{"Name": "volume-size", "Values": [value]}]),
                  partial(ec2.describe_volumes_modifications, Filters=[{"Name": "target-size", "Values": [value]}])]
    for call in calls:
        code, status = ec2_code(call)
        assert (code, status) == ("InvalidParameterValue", 400), (call, code)
    code, status = ec2_code(lambda: ec2.describe_volumes(MaxResults=4))  # EC2's minimum is 5
    assert (code, status) == ("InvalidParameterValue", 400)
    assert world(vbs) == before


# -- pages ------------------------------------------------------------------------------------------------


def test_describes_answer_bounded_pages_and_clients_still_see_everything(vbs: Vbs) -> None:
    existing = len(vbs.all_volumes())
    wanted = 101 - existing
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: vbs.create_volume(size_gib=1), range(max(wanted, 0))))
    assert len(vbs.all_volumes()) >= 101
    first = vbs.http.get("/v1/volumes").json()
    assert len(first["volumes"]) == 100 and first["next_token"], "no max_results: the default page of 100"
    rest = vbs.http.get("/v1/volumes", params={"next_token": first["next_token"]}).json()
    ids = [v["volume_id"] for v in first["volumes"] + rest["volumes"]]
    assert len(ids) == len(set(ids)) == len(vbs.all_volumes())
    # EC2: a page is at most 500 whatever MaxResults asks; boto3's paginator follows NextToken.
    ec2 = ec2_client(vbs)
    page = ec2.describe_volumes(MaxResults=5)
    assert len(page["Volumes"]) == 5 and page["NextToken"]
    assert len(ec2.describe_volumes(MaxResults=100000)["Volumes"]) == len(ids)
    paged = [v["VolumeId"] for p in ec2.get_paginator("describe_volumes").paginate(PaginationConfig={"PageSize": 50})
             for v in p["Volumes"]]
    assert sorted(paged) == sorted(ids)
    # The CLI follows the tokens: describe-volumes shows every volume.
    assert len(vbs.cli("describe-volumes")["volumes"]) == len(ids)
    one = vbs.cli("describe-volumes", "--max-results", "1")
    assert len(one["volumes"]) == 1 and one["next_token"]
    for path, key in (("/v1/hosts", "hosts"), ("/v1/instances", "instances"), ("/v1/storage-nodes", "storage_nodes")):
        body = vbs.http.get(path, params={"max_results": 1}).json()
        assert len(body[key]) <= 1 and "next_token" in body


# -- overcommit -------------------------------------------------------------------------------------------


def test_overcommit_counts_what_the_pool_already_promised_even_under_concurrent_creates(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    capacity = st.f_blocks * st.f_frsize
    ratio = 10.5 * GIB / capacity  # the pool may promise 10.5 GiB: ten 1 GiB volumes, not eleven
    with running_vbs_up(tmp_path, "--overcommit-ratio", f"{ratio:.15g}") as vbs:
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: vbs.http.post("/v1/volumes", json={"size_gib": 1}), range(20)))
        accepted = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code != 200]
        assert len(accepted) == 10, [r.text for r in refused]
        assert {(r.status_code, r.json()["error"]["code"]) for r in refused} == {(400, "InsufficientVolumeCapacity")}
        assert len(vbs.all_volumes()) == 10
        code = ec2_code(lambda: ec2_client(vbs).create_volume(Size=1, AvailabilityZone="us-east-1a"))
        assert code == ("InsufficientVolumeCapacity", 400)
        grow = vbs.http.post(f"/v1/volumes/{accepted[0].json()['volume_id']}/modify", json={"size_gib": 2})
        vbs.wait_volume(accepted[0].json()["volume_id"], "available")
        assert grow.status_code == 400 and grow.json()["error"]["code"] == "InsufficientVolumeCapacity", grow.text
        assert len(vbs.all_volumes()) == 10 and {v["size_gib"] for v in vbs.all_volumes()} == {1}
        # A deleted volume gives its promise back.
        gone = accepted[1].json()["volume_id"]
        vbs.wait_volume(gone, "available")
        assert vbs.http.delete(f"/v1/volumes/{gone}").status_code == 200
        vbs.wait_volume(gone, "deleted")
        assert vbs.http.post("/v1/volumes", json={"size_gib": 1}).status_code == 200


# -- quotas -----------------------------------------------------------------------------------------------


def test_quotas_per_tenant_refuse_the_excess_and_leave_other_tenants_alone(tmp_path: Path) -> None:
    with running_vbs_up(tmp_path, "--quota-volumes", "3", "--quota-gib", "5", "--quota-snapshots", "1") as vbs:
        alice, alice_ec2 = user_key(vbs, "alice")
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: alice.post("/v1/volumes", json={"size_gib": 1}), range(6)))
        accepted = [r.json()["volume_id"] for r in answers if r.status_code == 200]
        assert len(accepted) == 3
        assert {(r.status_code, r.json()["error"]["code"]) for r in answers if r.status_code != 200} == {
            (400, "VolumeLimitExceeded")}
        assert ec2_code(lambda: alice_ec2.create_volume(Size=1, AvailabilityZone="us-east-1a")) == (
            "VolumeLimitExceeded", 400)
        assert len(alice.get("/v1/volumes").json()["volumes"]) == 3
        # GiB: 3 used of 5; growing one volume by 3 GiB would make 6.
        for vid in accepted:
            vbs_wait(alice, vid)
        grow = alice.post(f"/v1/volumes/{accepted[0]}/modify", json={"size_gib": 4})
        assert grow.status_code == 400 and grow.json()["error"]["code"] == "VolumeLimitExceeded", grow.text
        bob, _ = user_key(vbs, "bob")
        assert bob.post("/v1/volumes", json={"size_gib": 4}).status_code == 200
        big = bob.post("/v1/volumes", json={"size_gib": 2})
        assert big.status_code == 400 and big.json()["error"]["code"] == "VolumeLimitExceeded"
        # Snapshots: one each.
        assert alice.post("/v1/snapshots", json={"volume_id": accepted[0]}).status_code == 200
        second = alice.post("/v1/snapshots", json={"volume_id": accepted[1]})
        assert second.status_code == 400 and second.json()["error"]["code"] == "SnapshotLimitExceeded"
        assert ec2_code(lambda: alice_ec2.create_snapshot(VolumeId=accepted[2])) == ("SnapshotLimitExceeded", 400)
        assert len(alice.get("/v1/snapshots").json()["snapshots"]) == 1
        assert [v["size_gib"] for v in alice.get("/v1/volumes").json()["volumes"]] == [1, 1, 1]


def vbs_wait(http: httpx.Client, volume_id: str) -> None:
    wait_until(lambda: http.get(f"/v1/volumes/{volume_id}").json()["status"] == "available", 60,
               what=f"{volume_id} available")
