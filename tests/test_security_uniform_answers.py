"""Small leaks, closed: ids matched whole, API docs not served, one answer for every bad credential.

Each test runs the attack against a real ``vbs up`` (controller, storage agent, host agent) and
shows it refused with nothing changed: no volume, snapshot or pool file appears.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests.conftest import Vbs, node_token, running_vbs_up
from vbs.errors import InvalidParameter
from vbs.trust.credentials import AccessKey

NEWLINE_VOLUME = "vol-0123456789abcdef0\n"
NEWLINE_SNAPSHOT = "snap-0123456789abcdef0\n"
FORM = "application/x-www-form-urlencoded; charset=utf-8"
EC2_REFUSALS = {"InvalidParameterValue", "InvalidVolumeID.Malformed", "InvalidSnapshotID.Malformed", "InvalidID"}


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    with running_vbs_up(tmp_path_factory.mktemp("uniform")) as vbs:
        yield vbs


def world(vbs: Vbs) -> tuple[Any, ...]:
    """Everything an attack could have changed: rows the API shows and files in the pool."""
    snaps = vbs.http.get("/v1/snapshots").json()["snapshots"]
    return (sorted(v["volume_id"] for v in vbs.all_volumes()), sorted(s["snapshot_id"] for s in snaps),
            sorted(p.name for p in vbs.pool.rglob("*")))


def agent_urls(vbs: Vbs) -> tuple[str, str]:
    storage = vbs.http.get("/v1/storage-nodes").json()["storage_nodes"][0]["url"]
    host = vbs.http.get("/v1/hosts").json()["hosts"][0]["url"]
    return storage.rstrip("/"), host.rstrip("/")


class AgentClient:
    """Calls to the install's two agents, each with its own node token."""

    def __init__(self, vbs: Vbs) -> None:
        storage, host = agent_urls(vbs)
        self.tokens = {storage: node_token(vbs.data_dir, "storage", "storage-1"),
                       host: node_token(vbs.data_dir, "host", "host-1")}
        self.http = httpx.Client(timeout=30)

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        token = next(t for base, t in self.tokens.items() if url.startswith(base))
        return self.http.request(method, url, headers={"authorization": f"Bearer {token}"}, **kwargs)

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def put(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("PUT", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.http.close()


def agent_client(vbs: Vbs) -> AgentClient:
    return AgentClient(vbs)


def assert_refused(r: httpx.Response, status: int = 400) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] in ("InvalidParameterValue", "InvalidVolume.NotFound", "InvalidSnapshot.NotFound")


# -- ids with a trailing newline ------------------------------------------------------------------------


def test_volume_id_with_trailing_newline_is_refused_on_rest_paths_and_bodies(vbs: Vbs) -> None:
    before = world(vbs)
    encoded = "vol-0123456789abcdef0%0A"
    for method, path, body in (("GET", f"/v1/volumes/{encoded}", None), ("DELETE", f"/v1/volumes/{encoded}", None),
                               ("POST", f"/v1/volumes/{encoded}/detach", {}),
                               ("POST", f"/v1/volumes/{encoded}/modify", {"size_gib": 2}),
                               ("POST", f"/v1/volumes/{encoded}/attach", {"instance_id": "i-0123456789abcdef0"})):
        r = vbs.http.request(method, path, json=body)
        assert_refused(r)
    assert_refused(vbs.http.get("/v1/volumes", params={"volume_id": NEWLINE_VOLUME}))
    assert_refused(vbs.http.post("/v1/snapshots", json={"volume_id": NEWLINE_VOLUME}))
    assert_refused(vbs.http.post("/v1/volumes", json={"size_gib": 1, "snapshot_id": NEWLINE_SNAPSHOT}))
    r = vbs.http.post("/v1/tags", json={"resource_ids": [NEWLINE_VOLUME], "tags": {"k": "v"}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "InvalidID", r.text
    assert world(vbs) == before


def test_text_with_trailing_newline_is_refused(vbs: Vbs) -> None:
    before = world(vbs)
    for body in ({"size_gib": 1, "comment": "ok\n"}, {"size_gib": 1, "tags": {"team\n": "db"}},
                 {"size_gib": 1, "tags": {"team": "db\n"}}):
        r = vbs.http.post("/v1/volumes", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "InvalidParameterValue", (body, r.text)
    assert world(vbs) == before


def test_volume_id_with_trailing_newline_is_refused_on_ec2(vbs: Vbs) -> None:
    before = world(vbs)
    for params in ({"Action": "DescribeVolumes", "VolumeId.1": NEWLINE_VOLUME},
                   {"Action": "DeleteVolume", "VolumeId": NEWLINE_VOLUME},
                   {"Action": "CreateSnapshot", "VolumeId": NEWLINE_VOLUME},
                   {"Action": "CreateVolume", "SnapshotId": NEWLINE_SNAPSHOT},
                   {"Action": "DeleteSnapshot", "SnapshotId": NEWLINE_SNAPSHOT},
                   {"Action": "CreateTags", "ResourceId.1": NEWLINE_VOLUME, "Tag.1.Key": "k"}):
        r = vbs.http.post("/", data={**params, "Version": "2016-11-15"})
        assert r.status_code == 400, (params, r.text)
        code = re.search(r"<Code>([^<]+)</Code>", r.text)
        assert code is not None and code.group(1) in EC2_REFUSALS, r.text
    assert world(vbs) == before


def test_ids_with_trailing_newline_are_refused_by_the_agents(vbs: Vbs) -> None:
    before = world(vbs)
    storage, host = agent_urls(vbs)
    with agent_client(vbs) as agent:
        r = agent.put(f"{storage}/v1/pools/default/volumes/vol-0123456789abcdef0%0A.raw", json={"size_bytes": 1 << 20})
        assert r.status_code == 400, r.text
        r = agent.put(f"{storage}/v1/pools/default/volumes/vol-0123456789abcdef0%0A", json={"size_bytes": 1 << 20})
        assert r.status_code == 400, r.text
        r = agent.put(f"{storage}/v1/pools/default/snapshots/snap-0123456789abcdef0%0A",
                      json={"volume_id": "vol-0123456789abcdef0"})
        assert r.status_code == 400, r.text
        r = agent.delete(f"{host}/v1/vms/vm-1/disks/vol0123456789abcdef0%0A")
        assert r.status_code == 400, r.text
        r = agent.delete(f"{host}/v1/vms/vm-1%0A/disks/vol0123456789abcdef0")
        assert r.status_code == 400, r.text
        r = agent.put(f"{storage}/v1/pools/default/volumes/vol-0123456789abcdef0/connections/host-1%0A",
                      json={"host": {"name": "host-1", "address": "127.0.0.1"}})
        assert r.status_code == 400, r.text
    assert world(vbs) == before
    assert not any("\n" in p.name for p in vbs.pool.rglob("*"))


# -- API docs --------------------------------------------------------------------------------------------


def test_api_docs_are_not_served_and_the_schema_needs_a_key(vbs: Vbs) -> None:
    storage, host = agent_urls(vbs)
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert vbs.http.get(path).status_code == 404, path
    for base in (storage, host):
        # An agent answers nothing but /health without its token, and has no docs with it.
        with agent_client(vbs) as agent:
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert httpx.get(f"{base}{path}").status_code == 401, (base, path)
                assert agent.get(f"{base}{path}").status_code == 404, (base, path)
    r = httpx.get(f"{vbs.endpoint}/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "AuthFailure"
    r = vbs.http.get("/openapi.json")
    assert r.status_code == 200 and "/v1/volumes" in r.json()["paths"]
    assert httpx.get(f"{vbs.endpoint}/health").status_code == 200


# -- one answer for every bad credential -----------------------------------------------------------------


def _answer(r: httpx.Response) -> tuple[int, str]:
    """Status and body without the per-request id."""
    text = r.text
    if "<RequestID>" in text:
        text = text[:text.index("<RequestID>")] + text[text.index("</RequestID>"):]
    return r.status_code, text


@pytest.mark.parametrize("path", ["/", "/v1/volumes"])
def test_sigv4_answers_alike_for_unknown_key_wrong_secret_and_bad_signature(vbs: Vbs, path: str) -> None:
    url = f"{vbs.endpoint}{path}"
    body = "Action=DescribeVolumes&Version=2016-11-15" if path == "/" else ""
    method = "POST" if path == "/" else "GET"

    def send(key_id: str, secret: str, tamper: bool = False) -> tuple[int, str]:
        request = AWSRequest(method=method, url=url, data=body or None,
                             headers={"Content-Type": FORM} if body else {})
        SigV4Auth(Credentials(key_id, secret), "ec2", "us-east-1").add_auth(request)
        headers = dict(request.headers)
        if tamper:
            auth = headers["Authorization"]
            headers["Authorization"] = auth[:-1] + ("0" if auth[-1] != "0" else "1")
        return _answer(httpx.request(method, url, content=body.encode(), headers=headers))

    key = vbs.key
    unknown = send("VBSKUNKNOWNKEY000000", key.secret_access_key)
    wrong_secret = send(key.access_key_id, "x" * 40)
    bad_signature = send(key.access_key_id, key.secret_access_key, tamper=True)
    assert unknown[0] == 401
    assert unknown == wrong_secret == bad_signature
    assert "VBSKUNKNOWNKEY000000" not in unknown[1]
    assert send(key.access_key_id, key.secret_access_key)[0] == 200


def test_bearer_answers_alike_for_unknown_key_and_wrong_secret(vbs: Vbs) -> None:
    key = vbs.key
    answers = {_answer(httpx.get(f"{vbs.endpoint}/v1/volumes", headers={"authorization": f"Bearer {value}"}))
               for value in ("VBSKUNKNOWNKEY000000:" + key.secret_access_key, f"{key.access_key_id}:" + "x" * 40,
                             f"{key.access_key_id}:", "garbage")}
    assert len(answers) == 1
    assert next(iter(answers))[0] == 401


def test_access_key_with_trailing_newline_is_refused() -> None:
    with pytest.raises(InvalidParameter):
        AccessKey("VBSKAAAAAAAAAAAAAAAA\n", "s" * 40)
    with pytest.raises(InvalidParameter):
        AccessKey("VBSKAAAAAAAAAAAAAAAA", "s" * 40 + "\n")
