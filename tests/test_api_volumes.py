"""The core API on a real embedded install (controller + storage agent processes, ext4 pool), with its
metadata in SQLite and in PostgreSQL."""

from __future__ import annotations

import re

import pytest

from tests.conftest import DATABASES, Vbs

pytestmark = pytest.mark.parametrize("metadata_db", DATABASES, indirect=True, scope="module")

GIB = 1 << 30


def test_create_describe_delete_volume_through_the_cli(vbs_up: Vbs) -> None:
    vol = vbs_up.cli("create-volume", "--size", "1", "--comment", "demo", "--tag", "team=db", "--wait")
    assert re.fullmatch(r"vol-[0-9a-f]{17}", vol["volume_id"])
    assert vol["status"] == "available" and vol["size_gib"] == 1 and vol["comment"] == "demo"
    assert vol["tags"] == {"team": "db"}
    path = vbs_up.pool / "volumes" / f"{vol['volume_id']}.raw"
    assert path.stat().st_size == GIB
    assert path.stat().st_blocks * 512 < 16 << 20, "a new volume is sparse"

    listed = vbs_up.cli("describe-volumes")
    assert [v["volume_id"] for v in listed["volumes"]] == [vol["volume_id"]]

    deleted = vbs_up.cli("delete-volume", vol["volume_id"], "--wait")
    assert deleted["status"] == "deleted"
    assert not path.exists()
    # EBS keeps deleted volumes visible for a while.
    assert vbs_up.volume(vol["volume_id"])["status"] == "deleted"


def test_filters_on_status_tag_and_snapshot(vbs_up: Vbs) -> None:
    a = vbs_up.create_volume(size_gib=1, tags={"env": "prod"})
    b = vbs_up.create_volume(size_gib=2, tags={"env": "dev"})
    vbs_up.wait_volume(a["volume_id"], "available")
    vbs_up.wait_volume(b["volume_id"], "available")

    def ids(*filters: str) -> set[str]:
        args = [a for f in filters for a in ("--filter", f)]
        return {v["volume_id"] for v in vbs_up.cli("describe-volumes", *args)["volumes"]}

    assert ids("tag:env=prod") == {a["volume_id"]}
    assert ids("tag-key=env") == {a["volume_id"], b["volume_id"]}
    assert ids("size=2") == {b["volume_id"]}
    assert ids("status=available", "tag:env=dev,prod") == {a["volume_id"], b["volume_id"]}
    assert ids("status=creating") == set()
    snap = vbs_up.cli("create-snapshot", a["volume_id"], "--wait")
    c = vbs_up.cli("create-volume", "--snapshot", snap["snapshot_id"], "--wait")
    assert ids(f"snapshot-id={snap['snapshot_id']}") == {c["volume_id"]}


def test_pagination_walks_every_volume_once(vbs_up: Vbs) -> None:
    made = {vbs_up.create_volume(size_gib=1)["volume_id"] for _ in range(23)}
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        params = {"max_results": 5, **({"next_token": token} if token else {})}
        body = vbs_up.http.get("/v1/volumes", params=params).json()
        seen += [v["volume_id"] for v in body["volumes"]]
        pages += 1
        token = body.get("next_token")
        if not token:
            break
    assert pages == 5
    assert sorted(seen) == sorted(made)


def test_client_token_makes_create_idempotent(vbs_up: Vbs) -> None:
    first = vbs_up.create_volume(size_gib=1, client_token="tok-1")
    again = vbs_up.create_volume(size_gib=1, client_token="tok-1")
    assert again["volume_id"] == first["volume_id"]
    r = vbs_up.http.post("/v1/volumes", json={"size_gib": 2, "client_token": "tok-1"})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "IdempotentParameterMismatch"
    assert len(vbs_up.all_volumes()) == 1


def test_tags_can_be_added_and_removed(vbs_up: Vbs) -> None:
    vol = vbs_up.create_volume(size_gib=1)
    vbs_up.cli("create-tags", vol["volume_id"], "--tag", "a=1", "--tag", "b=2")
    assert vbs_up.volume(vol["volume_id"])["tags"] == {"a": "1", "b": "2"}
    vbs_up.cli("delete-tags", vol["volume_id"], "--key", "a")
    assert vbs_up.volume(vol["volume_id"])["tags"] == {"b": "2"}


def test_storage_node_reports_its_pool_and_clone_method(vbs_up: Vbs) -> None:
    nodes = vbs_up.cli("describe-storage-nodes")["storage_nodes"]
    assert len(nodes) == 1 and nodes[0]["state"] == "up"
    # vbs up's agent names no zone: it is in the controller's, and nobody drained it.
    assert (nodes[0]["availability_zone"], nodes[0]["drained"]) == ("us-east-1a", False)
    pool = nodes[0]["pools"][0]
    assert pool["clone_method"] == "copy", "the ext4 root has no reflink"
    assert pool["capacity_bytes"] > pool["free_bytes"] > 0


def test_table_output_names_the_columns(vbs_up: Vbs) -> None:
    vbs_up.create_volume(size_gib=1, comment="shown")
    proc = vbs_up.cli("--output", "table", "describe-volumes", check=False)
    # -o json comes first on the command line; the later --output table wins.
    assert proc.returncode == 0, proc.stderr
    assert "VolumeId" in proc.stdout and "shown" in proc.stdout


def test_a_volume_reports_its_zone_and_whether_io_reaches_it(vbs_up: Vbs) -> None:
    vol = vbs_up.create_volume(size_gib=1)
    assert vol["volume_status"] == "insufficient-data"  # still creating
    ready = vbs_up.wait_volume(vol["volume_id"], "available")
    assert (ready["availability_zone"], ready["volume_status"]) == ("us-east-1a", "ok")
    proc = vbs_up.cli("--output", "table", "describe-volumes", vol["volume_id"], check=False)
    assert proc.returncode == 0 and "Zone" in proc.stdout and "us-east-1a" in proc.stdout, proc.stderr
