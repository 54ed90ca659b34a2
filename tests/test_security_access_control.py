"""Roles and tenants against a real ``vbs up``: user keys stay out of the infrastructure, tenants out of
each other's volumes and snapshots (REST and EC2 through boto3), and nothing a refused request names changes.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.conftest import VBS, Vbs, running_vbs_up, wait_until

UNKNOWN_INSTANCE = "i-0123456789abcdef0"


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    with running_vbs_up(tmp_path_factory.mktemp("acl")) as vbs:
        yield vbs


@dataclass
class Key:
    access_key_id: str
    secret_access_key: str
    http: httpx.Client

    def ec2(self, endpoint: str) -> Any:
        return boto3.client("ec2", endpoint_url=endpoint, region_name="us-east-1",
                            aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
                            config=Config(retries={"max_attempts": 1}))


def make_key(vbs: Vbs, tenant: str, role: str = "user") -> Key:
    r = vbs.http.post("/v1/keys", json={"tenant": tenant, "role": role})
    assert r.status_code == 200, r.text
    body = r.json()
    http = httpx.Client(base_url=vbs.endpoint, timeout=30,
                        headers={"authorization": f"Bearer {body['access_key_id']}:{body['secret_access_key']}"})
    return Key(body["access_key_id"], body["secret_access_key"], http)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@dataclass
class Owned:
    """What tenant A holds: an available volume (tagged) and a completed snapshot of it."""

    volume_id: str
    snapshot_id: str
    operation_id: str


def owned_by(vbs: Vbs, key: Key) -> Owned:
    vol = ok(key.http.post("/v1/volumes", json={"size_gib": 1, "tags": {"team": "a"}}))
    wait_status(key, f"/v1/volumes/{vol['volume_id']}", "available")
    snap = ok(key.http.post("/v1/snapshots", json={"volume_id": vol["volume_id"]}))
    wait_status(key, f"/v1/snapshots/{snap['snapshot_id']}", "completed")
    att = key.http.post(f"/v1/volumes/{vol['volume_id']}/attach", json={"instance_id": UNKNOWN_INSTANCE})
    assert att.status_code == 404  # the owner gets past the volume check; only the instance is unknown
    admin_view = vbs.http.get(f"/v1/volumes/{vol['volume_id']}")
    assert admin_view.status_code == 404, "an admin key sees its own tenant's volumes only (here: default)"
    return Owned(vol["volume_id"], snap["snapshot_id"], _create_operation(vbs, vol["volume_id"]))


def _create_operation(vbs: Vbs, volume_id: str) -> str:
    db = sqlite3.connect(vbs.data_dir / "vbs.db")
    try:
        row = db.execute("SELECT id FROM operations WHERE resource_id = ? AND kind = 'create-volume'",
                         (volume_id,)).fetchone()
    finally:
        db.close()
    assert row is not None
    return str(row[0])


def wait_status(key: Key, path: str, status: str) -> None:
    wait_until(lambda: key.http.get(path).json().get("status") == status, 60, what=f"{path} {status}")


def snapshot_of_state(key: Key, owned: Owned) -> tuple[Any, ...]:
    vol = ok(key.http.get(f"/v1/volumes/{owned.volume_id}"))
    snap = ok(key.http.get(f"/v1/snapshots/{owned.snapshot_id}"))
    return (vol["status"], vol["size_gib"], vol["tags"], vol["attachments"], vol["volume_type"], snap["status"],
            snap["tags"], len(key.http.get("/v1/volumes").json()["volumes"]),
            len(key.http.get("/v1/snapshots").json()["snapshots"]))


# -- roles ------------------------------------------------------------------------------------------------


def test_create_key_cli_prints_the_new_key_as_json(vbs: Vbs) -> None:
    made = vbs.cli("create-key", "--tenant", "cli-tenant", "--role", "user")
    assert set(made) == {"access_key_id", "secret_access_key"}
    r = httpx.get(f"{vbs.endpoint}/v1/volumes",
                  headers={"authorization": f"Bearer {made['access_key_id']}:{made['secret_access_key']}"})
    assert r.status_code == 200 and r.json()["volumes"] == []
    listed = {k["access_key_id"]: k for k in vbs.cli("describe-keys")["keys"]}
    assert listed[made["access_key_id"]]["tenant"] == "cli-tenant"
    assert "secret_access_key" not in listed[made["access_key_id"]] or \
        listed[made["access_key_id"]]["secret_access_key"] is None


def test_user_key_is_refused_on_infrastructure_and_key_routes(vbs: Vbs) -> None:
    user = make_key(vbs, "infra-probe")
    keys_before = ok(vbs.http.get("/v1/keys"))["keys"]
    for method, path in (("GET", "/v1/hosts"), ("GET", "/v1/storage-nodes"), ("GET", "/v1/admin/check"),
                         ("POST", "/v1/admin/reconcile?now=true"), ("POST", "/v1/storage-nodes/storage-1/drain"),
                         ("GET", "/v1/keys"), ("POST", "/v1/instances/i-0123456789abcdef0/migrations"),
                         ("DELETE", f"/v1/keys/{vbs.key.access_key_id}")):
        r = user.http.request(method, path)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "UnauthorizedOperation"
    r = user.http.post("/v1/keys", json={"tenant": "infra-probe", "role": "admin"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "UnauthorizedOperation"
    assert ok(vbs.http.get("/v1/keys"))["keys"] == keys_before
    env = {**os.environ, "VBS_ENDPOINT": vbs.endpoint, "VBS_ACCESS_KEY_ID": user.access_key_id,
           "VBS_SECRET_ACCESS_KEY": user.secret_access_key}
    proc = subprocess.run([*VBS, "-o", "json", "create-key", "--tenant", "x", "--role", "admin"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "UnauthorizedOperation" in proc.stderr
    # A user may still list instances: attaching needs an instance id.
    assert user.http.get("/v1/instances").status_code == 200


def test_deleted_key_is_refused_at_once(vbs: Vbs) -> None:
    user = make_key(vbs, "short-lived")
    assert user.http.get("/v1/volumes").status_code == 200
    assert vbs.cli("delete-key", user.access_key_id) == {"return": True}
    r = user.http.get("/v1/volumes")
    assert r.status_code == 401 and r.json()["error"]["code"] == "AuthFailure"


def test_rotate_keys_gives_an_access_key_a_successor_and_the_old_one_works_until_deleted(vbs: Vbs) -> None:
    old = make_key(vbs, "rotating")
    new = vbs.cli("rotate-keys", "--access-key", old.access_key_id)
    assert new["replaces"] == old.access_key_id and new["access_key_id"] != old.access_key_id
    listed = {k["access_key_id"]: k for k in vbs.cli("describe-keys")["keys"]}
    assert (listed[new["access_key_id"]]["tenant"], listed[new["access_key_id"]]["role"]) == ("rotating", "user")
    successor = httpx.Client(base_url=vbs.endpoint, timeout=30, headers={
        "authorization": f"Bearer {new['access_key_id']}:{new['secret_access_key']}"})
    made = ok(successor.post("/v1/volumes", json={"size_gib": 1}))["volume_id"]
    # No downtime: both keys work, and see the same tenant's volumes, until the old one is deleted.
    assert made in [v["volume_id"] for v in ok(old.http.get("/v1/volumes"))["volumes"]]
    vbs.cli("delete-key", old.access_key_id)
    assert old.http.get("/v1/volumes").status_code == 401
    assert successor.get("/v1/volumes").status_code == 200
    # A user key cannot rotate keys, and a key that does not exist has no successor.
    user = make_key(vbs, "rotating")
    assert user.http.post(f"/v1/keys/{new['access_key_id']}/rotate").status_code == 403
    missing = vbs.http.post("/v1/keys/VBSK0000000000000000/rotate")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "InvalidAccessKeyId.NotFound"


def test_rotating_the_master_key_reseals_every_secret_while_the_controller_runs(vbs: Vbs) -> None:
    user = make_key(vbs, "resealed")
    before = (vbs.data_dir / "master.key").read_text()
    proc = subprocess.run([*VBS, "rotate-keys", "--master-key", "--data-dir", str(vbs.data_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    after = (vbs.data_dir / "master.key").read_text()
    assert after != before and len(after.split()) == 1  # one key left: the new one
    assert oct((vbs.data_dir / "master.key").stat().st_mode & 0o777) == "0o600"
    # The running controller opens every secret under the new key: bearer and SigV4 both still work.
    assert user.http.get("/v1/volumes").status_code == 200
    ec2 = boto3.client("ec2", endpoint_url=vbs.endpoint, region_name="us-east-1",
                       aws_access_key_id=user.access_key_id, aws_secret_access_key=user.secret_access_key)
    assert ec2.describe_volumes()["Volumes"] == []
    assert make_key(vbs, "after-rotation").http.get("/v1/volumes").status_code == 200


def test_made_secrets_are_sealed_in_the_database(vbs: Vbs) -> None:
    user = make_key(vbs, "sealed")
    db = (vbs.data_dir / "vbs.db").read_bytes() + b"".join(
        p.read_bytes() for p in vbs.data_dir.glob("vbs.db-*"))
    assert user.access_key_id.encode() in db
    assert user.secret_access_key.encode() not in db
    assert oct((vbs.data_dir / "master.key").stat().st_mode & 0o777) == "0o600"
    log = (vbs.data_dir.parent / "vbs-up.log").read_bytes()
    assert user.secret_access_key.encode() not in log


# -- tenants: REST ----------------------------------------------------------------------------------------


def refused_as_not_found(r: httpx.Response, code: str) -> None:
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["code"] == code, r.text


def test_tenants_cannot_see_or_touch_each_others_resources_over_rest(vbs: Vbs) -> None:
    alice, mallory = make_key(vbs, "alice"), make_key(vbs, "mallory")
    owned = owned_by(vbs, alice)
    before = snapshot_of_state(alice, owned)
    vol, snap = owned.volume_id, owned.snapshot_id
    volume_attacks: list[tuple[str, str, Any]] = [
        ("GET", f"/v1/volumes/{vol}", None),
        ("DELETE", f"/v1/volumes/{vol}", None),
        ("POST", f"/v1/volumes/{vol}/attach", {"instance_id": UNKNOWN_INSTANCE}),
        ("POST", f"/v1/volumes/{vol}/detach", {"force": True}),
        ("POST", f"/v1/volumes/{vol}/modify", {"size_gib": 2}),
        ("POST", "/v1/snapshots", {"volume_id": vol}),
        ("POST", "/v1/tags", {"resource_ids": [vol], "tags": {"owner": "mallory"}}),
        ("POST", "/v1/tags/delete", {"resource_ids": [vol], "keys": ["team"]}),
    ]
    for method, path, body in volume_attacks:
        refused_as_not_found(mallory.http.request(method, path, json=body), "InvalidVolume.NotFound")
    refused_as_not_found(mallory.http.get("/v1/volumes", params={"volume_id": vol}), "InvalidVolume.NotFound")
    snapshot_attacks: list[tuple[str, str, Any]] = [
        ("GET", f"/v1/snapshots/{snap}", None),
        ("DELETE", f"/v1/snapshots/{snap}", None),
        ("POST", "/v1/volumes", {"snapshot_id": snap}),
        ("POST", "/v1/tags", {"resource_ids": [snap], "tags": {"owner": "mallory"}}),
    ]
    for method, path, body in snapshot_attacks:
        refused_as_not_found(mallory.http.request(method, path, json=body), "InvalidSnapshot.NotFound")
    refused_as_not_found(mallory.http.get("/v1/snapshots", params={"snapshot_id": snap}), "InvalidSnapshot.NotFound")
    refused_as_not_found(mallory.http.get(f"/v1/operations/{owned.operation_id}"), "InvalidOperation.NotFound")
    assert ok(alice.http.get(f"/v1/operations/{owned.operation_id}"))["resource_id"] == vol
    assert ok(mallory.http.get("/v1/volumes"))["volumes"] == []
    assert ok(mallory.http.get("/v1/snapshots"))["snapshots"] == []
    assert ok(mallory.http.get("/v1/volumes", params={"filter": f"volume-id={vol}"}))["volumes"] == []
    assert ok(mallory.http.get("/v1/volume-modifications"))["modifications"] == []
    assert snapshot_of_state(alice, owned) == before


# -- tenants: EC2 (boto3) ---------------------------------------------------------------------------------


def ec2_refused(call: Callable[[], Any], code: str) -> None:
    with pytest.raises(ClientError) as info:
        call()
    assert info.value.response["Error"]["Code"] == code, info.value.response
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


def test_tenants_cannot_see_or_touch_each_others_resources_over_ec2(vbs: Vbs) -> None:
    alice, mallory = make_key(vbs, "alice-ec2"), make_key(vbs, "mallory-ec2")
    owned = owned_by(vbs, alice)
    before = snapshot_of_state(alice, owned)
    vol, snap = owned.volume_id, owned.snapshot_id
    ec2 = mallory.ec2(vbs.endpoint)
    not_vol = "InvalidVolume.NotFound"
    ec2_refused(lambda: ec2.describe_volumes(VolumeIds=[vol]), not_vol)
    ec2_refused(lambda: ec2.delete_volume(VolumeId=vol), not_vol)
    ec2_refused(lambda: ec2.attach_volume(VolumeId=vol, InstanceId=UNKNOWN_INSTANCE, Device="/dev/vdb"), not_vol)
    ec2_refused(lambda: ec2.detach_volume(VolumeId=vol, Force=True), not_vol)
    ec2_refused(lambda: ec2.modify_volume(VolumeId=vol, Size=2), not_vol)
    ec2_refused(lambda: ec2.create_snapshot(VolumeId=vol), not_vol)
    ec2_refused(lambda: ec2.create_tags(Resources=[vol], Tags=[{"Key": "owner", "Value": "mallory"}]), not_vol)
    ec2_refused(lambda: ec2.delete_tags(Resources=[vol], Tags=[{"Key": "team"}]), not_vol)
    not_snap = "InvalidSnapshot.NotFound"
    ec2_refused(lambda: ec2.describe_snapshots(SnapshotIds=[snap]), not_snap)
    ec2_refused(lambda: ec2.delete_snapshot(SnapshotId=snap), not_snap)
    ec2_refused(lambda: ec2.create_volume(SnapshotId=snap, AvailabilityZone="us-east-1a"), not_snap)
    ec2_refused(lambda: ec2.create_tags(Resources=[snap], Tags=[{"Key": "owner", "Value": "m"}]), not_snap)
    assert ec2.describe_volumes()["Volumes"] == []
    assert ec2.describe_volumes(Filters=[{"Name": "volume-id", "Values": [vol]}])["Volumes"] == []
    assert ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"] == []
    assert ec2.describe_tags()["Tags"] == []
    assert ec2.describe_volumes_modifications()["VolumesModifications"] == []
    # The owner sees its own through EC2 as well.
    mine = alice.ec2(vbs.endpoint)
    assert [v["VolumeId"] for v in mine.describe_volumes(VolumeIds=[vol])["Volumes"]] == [vol]
    assert snapshot_of_state(alice, owned) == before


def test_user_key_is_refused_on_nothing_it_owns_but_may_describe_instances_over_ec2(vbs: Vbs) -> None:
    user = make_key(vbs, "ec2-user")
    ec2 = user.ec2(vbs.endpoint)
    assert "Reservations" in ec2.describe_instances()
    created = ec2.create_volume(Size=1, AvailabilityZone="us-east-1a")
    assert [v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]] == [created["VolumeId"]]
    assert vbs.http.get(f"/v1/volumes/{created['VolumeId']}").status_code == 404
