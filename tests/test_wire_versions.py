"""Every call between the services carries the sender's release and wire version, and a receiver refuses
a wire version it cannot serve on the request's head, naming both sides' versions (vbs.versions;
docs/install.md "Upgrades"). Unit tier: the agents' and the controller's real apps, in this process."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from vbs import versions
from vbs.controller.app import create_app as create_controller_app
from vbs.controller.db.tables import utcnow
from vbs.errors import VbsError
from vbs.net.agent_app import agent_app
from vbs.net.api_client import ApiClient
from vbs.net.web import agent_auth
from vbs.trust import credentials
from vbs.trust.node_credentials import NodeKeyring, TokenSource
from vbs.wire.storage import PoolInfo, StorageHeartbeat

pytestmark = pytest.mark.unit

TOKEN = "t0ken"
NEWER = str(versions.WIRE_VERSION + 1)
OLDER = str(versions.OLDEST_WIRE - 1)


def names_both_sides(message: str, peer_release: str, peer_wire: str) -> bool:
    return (f"VBS {versions.RELEASE}" in message and f"VBS {peer_release}" in message
            and f"wire version {peer_wire}" in message and f"wire versions {versions.WIRE_VERSION}" in message)


# -- reading what a caller says of itself ----------------------------------------------------------


def test_the_headers_a_service_sends_are_its_own_versions() -> None:
    sent = versions.sent_headers()
    assert sent == {"x-vbs-version": versions.RELEASE, "x-vbs-wire": str(versions.WIRE_VERSION)}
    peer = versions.peer_of_headers(sent["x-vbs-version"], sent["x-vbs-wire"], me="storage agent s1")
    assert (peer.release, peer.wire) == (versions.RELEASE, versions.WIRE_VERSION)


def test_a_caller_without_the_headers_is_vbs_0_1_0_on_wire_version_1() -> None:
    peer = versions.peer_of_headers("", "", me="the controller")
    assert (peer.release, peer.wire) == (versions.UNVERSIONED_RELEASE, versions.UNVERSIONED_WIRE) == ("0.1.0", 1)


def test_a_caller_that_names_only_its_wire_version_is_of_an_unknown_release() -> None:
    peer = versions.peer_of_headers("", "1", me="the controller")
    assert (peer.release, peer.wire) == (None, 1)


@pytest.mark.parametrize("wire", [NEWER, OLDER, "999999"])
def test_a_wire_version_out_of_range_is_refused_naming_both_sides(wire: str) -> None:
    with pytest.raises(versions.UnsupportedWireVersion) as refused:
        versions.peer_of_headers("9.8.7", wire, me="host agent h1")
    exc = refused.value
    assert exc.status == 400 and exc.code == "UnsupportedWireVersion"
    assert names_both_sides(exc.message, "9.8.7", wire) and exc.message.startswith("host agent h1 runs")
    assert exc.fields == {"peer_release": "9.8.7", "peer_wire": int(wire), "release": versions.RELEASE,
                          "wire": versions.WIRE_VERSION}


@pytest.mark.parametrize(("release", "wire"), [("0.1.0", "1.0"), ("0.1.0", "one"), ("0.1.0", "1234567"),
                                               ("0.1.0", " 1"), ("0.1.0\n", "1"), ("0.1 0", "1"),
                                               ("x" * 65, "1"), ("-1", "1")])
def test_versions_it_cannot_read_are_refused(release: str, wire: str) -> None:
    with pytest.raises(versions.UnsupportedWireVersion, match="cannot read the caller's"):
        versions.peer_of_headers(release, wire, me="the controller")


# -- an agent refuses the controller's call ---------------------------------------------------------


@pytest.fixture
def agent() -> Iterator[tuple[TestClient, list[str]]]:
    """An agent's app (the shared plumbing both agents start from) with one route that records each call
    it serves: a refused call must not reach it."""
    from prometheus_client import CollectorRegistry

    served: list[str] = []
    app = agent_app("test agent", agent_auth(TokenSource(TOKEN), insecure=False, me="storage agent s1"), "s1",
                    CollectorRegistry())

    @app.put("/v1/things/{name}")
    def put_thing(name: str) -> dict[str, str]:
        served.append(name)
        return {"status": "ok"}

    with TestClient(app) as http:
        yield http, served


def test_an_agent_serves_a_caller_of_its_own_wire_version(agent: tuple[TestClient, list[str]]) -> None:
    http, served = agent
    client = ApiClient("http://testserver", TOKEN, transport=http._transport)  # the product's client, its headers
    assert client.call("PUT", "/v1/things/a") == {"status": "ok"}
    # And one without the headers: VBS 0.1.0, which speaks wire version 1.
    r = http.put("/v1/things/b", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    assert served == ["a", "b"]


def test_an_agent_refuses_a_controller_of_another_wire_version_before_serving_it(
        agent: tuple[TestClient, list[str]]) -> None:
    http, served = agent
    for wire in (NEWER, OLDER):
        r = http.put("/v1/things/c", headers={"authorization": f"Bearer {TOKEN}", "x-vbs-version": "7.0.0",
                                              "x-vbs-wire": wire})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "UnsupportedWireVersion" and error["type"] == "UnsupportedWireVersion"
        assert error["message"].startswith("storage agent s1 runs")
        assert names_both_sides(error["message"], "7.0.0", wire)
    assert served == []


def test_the_refusal_keeps_its_class_across_the_wire(agent: tuple[TestClient, list[str]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from vbs.net import api_client

    http, served = agent
    # The product's client as a newer controller's would be: the same headers, a newer wire version.
    monkeypatch.setattr(api_client, "sent_headers", lambda: {**versions.sent_headers(), "x-vbs-wire": NEWER})
    client = ApiClient("http://testserver", TOKEN, transport=http._transport)
    with pytest.raises(versions.UnsupportedWireVersion) as refused:
        client.call("PUT", "/v1/things/d")
    assert refused.value.status == 400
    assert names_both_sides(refused.value.message, versions.RELEASE, NEWER)
    assert served == []


def test_an_unauthenticated_caller_learns_nothing_of_the_versions(agent: tuple[TestClient, list[str]]) -> None:
    http, served = agent
    r = http.put("/v1/things/e", headers={"x-vbs-wire": NEWER})
    assert r.status_code == 401 and "VBS" not in r.text
    assert served == []


# -- the controller refuses an agent's heartbeat -----------------------------------------------------


@pytest.fixture
def controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, Path]]:
    from vbs.config import ControllerConfig

    key = credentials.generate()
    monkeypatch.setenv("VBS_ACCESS_KEY_ID", key.access_key_id)
    monkeypatch.setenv("VBS_SECRET_ACCESS_KEY", key.secret_access_key)
    data_dir = tmp_path / "var"
    data_dir.mkdir(mode=0o700)
    app = create_controller_app(ControllerConfig(data_dir=data_dir, port=8770))
    with TestClient(app, headers={"authorization": f"Bearer {key.bearer}"}, client=("127.0.0.1", 50000)) as http:
        yield http, data_dir


def storage_heartbeat(name: str) -> dict[str, Any]:
    pool = PoolInfo(name="p", backend="file", capacity_bytes=1 << 30, free_bytes=1 << 30, clone_method="copy",
                    point_in_time=True)
    return StorageHeartbeat(name=name, url="http://127.0.0.1:1", address="127.0.0.1", started_at=utcnow(),
                            pools=[pool]).model_dump(mode="json")


def nodes(http: TestClient) -> dict[str, dict[str, Any]]:
    r = http.get("/v1/storage-nodes")
    assert r.status_code == 200, r.text
    return {n["name"]: n for n in r.json()["storage_nodes"]}


def test_the_controller_refuses_an_agent_of_another_wire_version_and_records_nothing(
        controller: tuple[TestClient, Path]) -> None:
    http, data_dir = controller
    token = NodeKeyring.for_data_dir(data_dir).ensure().token("storage", "s1")
    for wire in (NEWER, OLDER):
        r = http.post("/internal/v1/storage-heartbeat", json=storage_heartbeat("s1"),
                      headers={"authorization": f"Bearer {token}", "x-vbs-version": "7.0.0", "x-vbs-wire": wire})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("the controller runs") and names_both_sides(message, "7.0.0", wire)
    assert nodes(http) == {}


def test_the_node_list_shows_each_agents_version(controller: tuple[TestClient, Path]) -> None:
    http, data_dir = controller
    keyring = NodeKeyring.for_data_dir(data_dir).ensure()
    sent = versions.sent_headers()
    r = http.post("/internal/v1/storage-heartbeat", json=storage_heartbeat("s1"),
                  headers={"authorization": f"Bearer {keyring.token('storage', 's1')}", **sent})
    assert r.status_code == 200, r.text
    # An agent of VBS 0.1.0 sends no headers: release 0.1.0, wire version 1.
    r = http.post("/internal/v1/storage-heartbeat", json=storage_heartbeat("s2"),
                  headers={"authorization": f"Bearer {keyring.token('storage', 's2')}"})
    assert r.status_code == 200, r.text
    found = nodes(http)
    assert (found["s1"]["vbs_version"], found["s1"]["wire_version"]) == (versions.RELEASE, versions.WIRE_VERSION)
    assert (found["s2"]["vbs_version"], found["s2"]["wire_version"]) == ("0.1.0", 1)


def test_vbs_version_prints_the_release_and_the_wire_version() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "vbs", "--version"], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"vbs {versions.RELEASE} (wire version {versions.WIRE_VERSION})\n"
    # A PEP 440 release: 0.1.0, or a development one between releases (0.2.0.dev0).
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+(\.dev[0-9]+)?", versions.RELEASE)


def test_errors_module_knows_the_refusal_by_name() -> None:
    assert VbsError._by_name["UnsupportedWireVersion"] is versions.UnsupportedWireVersion
