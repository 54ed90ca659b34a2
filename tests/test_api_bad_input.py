"""Bad input at the API edge: a 4xx with the EBS code and a clear message, and nothing changed; with the
metadata in SQLite and in PostgreSQL (whose text cannot hold what SQLite's can)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.conftest import DATABASES, Vbs, database_flags

pytestmark = pytest.mark.parametrize("metadata_db", DATABASES, indirect=True, scope="module")

BAD_CREATES: list[tuple[Any, int, str]] = [
    ({"size_gib": 0}, 400, "InvalidParameterValue"),
    ({"size_gib": -5}, 400, "InvalidParameterValue"),
    ({"size_gib": 10**9}, 400, "InvalidParameterValue"),
    ({"size_gib": "1"}, 400, "InvalidParameterValue"),
    ({"size_gib": 1.5}, 400, "InvalidParameterValue"),
    ({"size_gib": True}, 400, "InvalidParameterValue"),
    ({}, 400, "MissingParameter"),
    ({"size_gib": 1, "comment": "x" * 256}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "comment": "line\nbreak"}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "tags": {"k" * 129: "v"}}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "tags": {"k": "v" * 257}}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "tags": {"aws:name": "v"}}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "tags": {f"k{i}": "v" for i in range(51)}}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "tags": ["not", "a", "map"]}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "unknown_field": 1}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "snapshot_id": "snap-nothex"}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "snapshot_id": "snap-0123456789abcdef0"}, 404, "InvalidSnapshot.NotFound"),
    ({"size_gib": 1, "volume_type": "floppy"}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "client_token": "x" * 65}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "placement": "moon"}, 400, "InvalidParameterValue"),
    ({"size_gib": 1, "comment": "$(touch /tmp/vbs-pwned); `id`; | rm -rf /"}, 200, ""),
]


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory, metadata_db: str, request: pytest.FixtureRequest) -> Any:
    from tests.conftest import running_vbs_up

    with running_vbs_up(tmp_path_factory.mktemp("bad-input"), *database_flags(metadata_db, request)) as vbs:
        yield vbs


def _state(vbs: Vbs) -> tuple[list[Any], list[str]]:
    return vbs.all_volumes(), sorted(p.name for p in (vbs.pool / "volumes").iterdir())


@pytest.mark.parametrize(("body", "status", "code"), BAD_CREATES)
def test_create_volume_rejects_bad_input_and_changes_nothing(vbs: Vbs, body: Any, status: int, code: str) -> None:
    before = _state(vbs)
    r = vbs.http.post("/v1/volumes", json=body)
    assert r.status_code == status, r.text
    if status == 200:
        # Shell metacharacters are literal data: stored and returned as given, never run.
        assert r.json()["comment"] == body["comment"]
        vbs.wait_volume(r.json()["volume_id"], "available")
        vbs.http.delete(f"/v1/volumes/{r.json()['volume_id']}")
        vbs.wait_volume(r.json()["volume_id"], "deleted")
        return
    err = r.json()["error"]
    assert err["code"] == code
    assert err["message"]
    assert _state(vbs) == before


def test_body_that_is_not_json_is_refused(vbs: Vbs) -> None:
    r = vbs.http.post("/v1/volumes", content=b"{size_gib: 1", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "InvalidParameterValue"


def test_oversized_body_is_refused(vbs: Vbs) -> None:
    r = vbs.http.post("/v1/volumes", content=b"{" + b" " * (2 << 20) + b"}",
                      headers={"content-type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize("bad_id", ["vol-123", "vol-0123456789ABCDEF0", "snap-0123456789abcdef0", "x" * 300,
                                    "vol-0123456789abcdef0;rm"])
def test_malformed_volume_ids_are_invalid_parameters(vbs: Vbs, bad_id: str) -> None:
    for method, path in (("GET", f"/v1/volumes/{bad_id}"), ("DELETE", f"/v1/volumes/{bad_id}")):
        r = vbs.http.request(method, path)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "InvalidParameterValue"
        assert "expecting" in r.json()["error"]["message"]


def test_unknown_ids_are_not_found(vbs: Vbs) -> None:
    r = vbs.http.get("/v1/volumes/vol-0123456789abcdef0")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "InvalidVolume.NotFound")
    r = vbs.http.delete("/v1/snapshots/snap-0123456789abcdef0")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "InvalidSnapshot.NotFound")
    r = vbs.http.post("/v1/snapshots", json={"volume_id": "vol-0123456789abcdef0"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "InvalidVolume.NotFound")


@pytest.mark.parametrize(("params", "fragment"), [
    ({"filter": "nosuchfilter=1"}, "invalid"),
    ({"filter": "noequals"}, "name=value"),
    ({"max_results": 0}, "between"),
    ({"max_results": 5000}, "between"),
    ({"next_token": "garbage!"}, "token"),
    ({"filter": "size=big"}, "filter value"),
])
def test_describe_rejects_bad_filters_and_paging(vbs: Vbs, params: dict[str, Any], fragment: str) -> None:
    r = vbs.http.get("/v1/volumes", params=params)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "InvalidParameterValue"
    assert fragment in r.json()["error"]["message"]


def test_wrong_states_answer_incorrect_state(vbs: Vbs) -> None:
    vol = vbs.create_volume(size_gib=1)
    vbs.wait_volume(vol["volume_id"], "available")
    assert vbs.http.delete(f"/v1/volumes/{vol['volume_id']}").status_code == 200
    r = vbs.http.delete(f"/v1/volumes/{vol['volume_id']}")
    assert r.status_code in (404, 409)
    assert r.json()["error"]["code"] in ("IncorrectState", "InvalidVolume.NotFound")
    r = vbs.http.post("/v1/snapshots", json={"volume_id": vol["volume_id"]})
    assert r.status_code in (404, 409)


def test_cli_reports_api_errors_on_stderr_with_the_code(vbs: Vbs) -> None:
    proc = vbs.cli("create-volume", "--size", "0", check=False)
    assert proc.returncode == 1
    assert "InvalidParameterValue" in proc.stderr


NUL_TOKEN = base64.urlsafe_b64encode(b"v1:vol-\x00").decode().rstrip("=")


@pytest.mark.parametrize(("method", "path", "request_args"), [
    ("GET", "/v1/volumes", {"params": {"filter": "status=a\x00b"}}),
    ("GET", "/v1/volumes", {"params": {"filter": "tag:k\x00=v"}}),
    ("GET", "/v1/volumes", {"params": {"next_token": NUL_TOKEN}}),
    ("GET", "/v1/snapshots", {"params": {"filter": "description=\x00"}}),
    ("POST", "/v1/tags/delete", {"json": {"resource_ids": ["VOLUME"], "keys": ["k\x00"]}}),
    ("POST", "/", {"data": {"Action": "DescribeVolumes", "Version": "2016-11-15", "Filter.1.Name": "status",
                            "Filter.1.Value.1": "a\x00"}}),
])
def test_a_nul_character_that_reaches_a_query_is_never_an_internal_error(
        vbs: Vbs, metadata_db: str, method: str, path: str, request_args: dict[str, Any]) -> None:
    """SQLite compares text with a NUL in it (and finds nothing); PostgreSQL's text cannot hold one: there
    it is a 400 InvalidParameterValue, never a 500."""
    if request_args.get("json", {}).get("resource_ids") == ["VOLUME"]:
        request_args = {"json": {**request_args["json"], "resource_ids": [vbs.create_volume(size_gib=1)["volume_id"]]}}
    r = vbs.http.request(method, path, **request_args)
    assert r.status_code < 500, r.text
    if metadata_db == "postgresql":
        assert r.status_code == 400, r.text
        assert "InvalidParameterValue" in r.text and "NUL" in r.text


# --- text that no database can store: a lone UTF-16 surrogate (JSON "\ud800"), NUL ---------------------------

VOL = "vol-0123456789abcdef0"
SNAP = "snap-0123456789abcdef0"
# Every request body with string fields, each string a plain value the edge would take.
REST_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/volumes", {"size_gib": 1, "comment": "c", "tags": {"k": "v"}, "client_token": "t", "kms_key_id": "k",
                     "volume_type": "gp3", "placement": "shared", "host": "h", "availability_zone": "us-east-1a",
                     "storage_node": "n", "pool": "p", "snapshot_id": SNAP}),
    ("/v1/snapshots", {"volume_id": VOL, "comment": "c", "tags": {"k": "v"}}),
    ("/v1/snapshot-sets", {"instance_id": "i-0123456789abcdef0", "comment": "c", "tags": {"k": "v"},
                           "exclude_volume_ids": [VOL]}),
    ("/v1/snapshot-copies", {"source_snapshot_id": SNAP, "comment": "c", "tags": {"k": "v"}, "kms_key_id": "k"}),
    (f"/v1/snapshots/{SNAP}/permissions", {"add": ["t"], "remove": ["u"]}),
    ("/v1/tags", {"resource_ids": [VOL], "tags": {"k": "v"}}),
    ("/v1/tags/delete", {"resource_ids": [VOL], "keys": ["k"]}),
    (f"/v1/volumes/{VOL}/attach", {"instance_id": "i-0123456789abcdef0", "host": "h", "vm_id": "v", "device": "vdb"}),
    (f"/v1/volumes/{VOL}/detach", {"instance_id": "i-0123456789abcdef0"}),
    (f"/v1/volumes/{VOL}/modify", {"volume_type": "gp3"}),
    (f"/v1/volumes/{VOL}/migrate", {"storage_node": "n", "pool": "p"}),
    ("/v1/instances/i-0123456789abcdef0/migrations", {"host": "h"}),
    ("/v1/keys", {"tenant": "t", "role": "user"}),
]
UNSTORABLE = ["\ud800", "a\udfffb", "\udc80" * 3, "x\x00y"]


def _string_leaves(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where a string can go: every string value, and every key of a string-to-string map (as (..., KEY))."""
    if isinstance(doc, str):
        return [path]
    if isinstance(doc, dict):
        out = [path + (("KEY", k),) for k, v in doc.items() if isinstance(v, str) and path]
        return out + [leaf for k, v in doc.items() for leaf in _string_leaves(v, path + (k,))]
    if isinstance(doc, list):
        return [leaf for i, v in enumerate(doc) for leaf in _string_leaves(v, path + (i,))]
    return []


def _with(doc: Any, path: tuple[Any, ...], bad: str) -> Any:
    if not path:
        return bad
    head, rest = path[0], path[1:]
    if isinstance(head, tuple):  # replace a key
        return {(bad if k == head[1] else k): v for k, v in doc.items()}
    if isinstance(doc, list):
        return [_with(v, rest, bad) if i == head else v for i, v in enumerate(doc)]
    return {k: (_with(v, rest, bad) if k == head else v) for k, v in doc.items()}


def _stored(vbs: Vbs) -> list[Any]:
    """What a refused request must not have changed: the volumes, their comments and tags."""
    return sorted((v["volume_id"], v["comment"], sorted(v["tags"].items())) for v in vbs.all_volumes())


def _post_json(vbs: Vbs, path: str, body: Any) -> Any:
    # json.dumps writes a lone surrogate as the escape "\\ud800", as a hostile client would send it.
    return vbs.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


REST_CASES = [(path, leaf) for path, body in REST_BODIES for leaf in _string_leaves(body)]


REST_IDS = [f"{p}:{'.'.join(map(str, leaf))}" for p, leaf in REST_CASES]


@pytest.mark.parametrize(("path", "leaf"), REST_CASES, ids=REST_IDS)
def test_unstorable_text_in_any_rest_string_field_is_a_400(vbs: Vbs, path: str, leaf: tuple[Any, ...]) -> None:
    body = dict(REST_BODIES)[path]
    before = _stored(vbs)
    for bad in UNSTORABLE:
        r = _post_json(vbs, path, _with(body, leaf, bad))
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["code"] == "InvalidParameterValue", r.text
        assert "cannot be stored" in r.json()["error"]["message"], r.text
    assert _stored(vbs) == before


def test_the_probes_surrogate_tag_on_a_real_volume_is_a_400(vbs: Vbs) -> None:
    vol = vbs.create_volume(size_gib=1)["volume_id"]
    vbs.wait_volume(vol, "available")
    for path, body in (("/v1/volumes", {"size_gib": 1, "tags": {"k": "\ud800"}}),
                       ("/v1/volumes", {"size_gib": 1, "tags": {"\ud800": "v"}}),
                       ("/v1/tags", {"resource_ids": [vol], "tags": {"k": "\ud800"}}),
                       ("/v1/snapshots", {"volume_id": vol, "tags": {"\ud800": "v"}})):
        r = _post_json(vbs, path, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "InvalidParameterValue", (path, r.text)
    assert vbs.volume(vol)["tags"] == {}


EC2_ACTIONS: list[dict[str, str]] = [
    {"Action": "CreateVolume", "Size": "1", "AvailabilityZone": "us-east-1a", "VolumeType": "gp3",
     "ClientToken": "t", "KmsKeyId": "k", "TagSpecification.1.ResourceType": "volume",
     "TagSpecification.1.Tag.1.Key": "k", "TagSpecification.1.Tag.1.Value": "v"},
    {"Action": "CreateTags", "ResourceId.1": VOL, "Tag.1.Key": "k", "Tag.1.Value": "v"},
    {"Action": "DeleteTags", "ResourceId.1": VOL, "Tag.1.Key": "k", "Tag.1.Value": "v"},
    {"Action": "CreateSnapshot", "VolumeId": VOL, "Description": "d", "TagSpecification.1.ResourceType": "snapshot",
     "TagSpecification.1.Tag.1.Key": "k", "TagSpecification.1.Tag.1.Value": "v"},
    {"Action": "CopySnapshot", "SourceSnapshotId": SNAP, "SourceRegion": "us-east-1", "Description": "d"},
    {"Action": "DescribeVolumes", "Filter.1.Name": "tag:k", "Filter.1.Value.1": "v"},
    {"Action": "DescribeTags", "Filter.1.Name": "key", "Filter.1.Value.1": "v"},
    {"Action": "AttachVolume", "VolumeId": VOL, "InstanceId": "i-0123456789abcdef0", "Device": "/dev/sdf"},
    {"Action": "ModifySnapshotAttribute", "SnapshotId": SNAP, "Attribute": "createVolumePermission",
     "OperationType": "add", "UserId.1": "t"},
]
EC2_CASES = [(a["Action"], name) for a in EC2_ACTIONS for name in a if name != "Action"]
# Percent-encoded: a surrogate's UTF-8-like bytes (CESU), a lone continuation byte, NUL.
EC2_UNSTORABLE = [b"%ED%A0%80", b"a%ED%BF%BFb", b"%80", b"x%00y"]


@pytest.mark.parametrize(("action", "name"), EC2_CASES, ids=[f"{a}:{n}" for a, n in EC2_CASES])
def test_unstorable_text_in_any_ec2_parameter_is_a_400(vbs: Vbs, action: str, name: str) -> None:
    import urllib.parse

    params = {**next(a for a in EC2_ACTIONS if a["Action"] == action), "Version": "2016-11-15"}
    before = _stored(vbs)
    for bad in EC2_UNSTORABLE:
        body = b"&".join(urllib.parse.quote(k).encode() + b"=" + (bad if k == name else urllib.parse.quote(v).encode())
                         for k, v in params.items())
        r = vbs.http.post("/", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400 and "<Code>InvalidParameterValue</Code>" in r.text, (bad, r.text)
    assert _stored(vbs) == before
