"""Several endpoints and when a client may move on to the next one (unit tier).

``vbs.net.web.ApiClient`` with a list of URLs: a connection error moves any request on (nothing was
sent); a request that was sent and then lost, or answered 5xx, moves on only when it may be
repeated (GET, PUT, DELETE, a POST with a client token, or a caller that says so). Shown with
httpx's MockTransport for each kind of failure, and with real sockets on loopback: a port where
nothing listens, a server that reads a request and hangs up, and a server that answers. Also the
URL lists of the CLI, the agents' configuration and ``vbs up``'s bounds.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import VBS, free_port
from vbs import config
from vbs.cli.up import Shape
from vbs.errors import AgentUnavailable, AgentUnreachable, InvalidParameter
from vbs.net.endpoints import MAX_URLS, is_idempotent, parse
from vbs.net.web import ApiClient

pytestmark = pytest.mark.unit

A, B, C = "http://a.test:8770", "http://b.test:8770", "http://c.test:8770"
TOKEN = {"client_token": "t-1"}


class Servers:
    """A MockTransport whose answer per host the test sets: a JSON body, an HTTP status, or an exception."""

    def __init__(self) -> None:
        self.behaviour: dict[str, Callable[[httpx.Request], httpx.Response]] = {}
        self.seen: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((f"http://{request.url.host}:{request.url.port}", request.method))
        return self.behaviour[f"http://{request.url.host}:{request.url.port}"](request)

    def answers(self, url: str) -> None:
        self.behaviour[url] = lambda request: httpx.Response(200, json={"from": url})

    def fails(self, url: str, exc: type[httpx.TransportError]) -> None:
        def fail(request: httpx.Request) -> httpx.Response:
            raise exc("simulated", request=request)

        self.behaviour[url] = fail

    def status(self, url: str, code: int) -> None:
        self.behaviour[url] = lambda request: httpx.Response(
            code, json={"error": {"code": "InternalError", "message": f"{url} is unwell"}})

    def hosts(self) -> list[str]:
        return [url for url, _method in self.seen]


@pytest.fixture
def servers() -> Servers:
    return Servers()


def client(servers: Servers, *urls: str) -> ApiClient:
    return ApiClient(list(urls), "t0ken", transport=httpx.MockTransport(servers))


# -- a connection error: nothing was sent, any request moves on ----------------------------------------


@pytest.mark.parametrize("exc", [httpx.ConnectError, httpx.ConnectTimeout])
def test_a_request_that_never_connected_moves_on_whatever_its_method(servers: Servers,
                                                                     exc: type[httpx.TransportError]) -> None:
    servers.fails(A, exc)
    servers.answers(B)
    api = client(servers, A, B)
    assert api.call("POST", "/v1/volumes", {"size_gib": 1}) == {"from": B}
    assert servers.seen == [(A, "POST"), (B, "POST")]


def test_the_next_call_starts_at_the_url_that_answered(servers: Servers) -> None:
    servers.fails(A, httpx.ConnectError)
    servers.answers(B)
    api = client(servers, A, B)
    api.call("GET", "/v1/volumes")
    servers.answers(A)  # back, but B answers: no reason to move
    api.call("GET", "/v1/volumes")
    assert servers.hosts() == [A, B, B]
    assert api.base_url == B


def test_urls_are_tried_round_robin_and_every_failure_is_reported(servers: Servers) -> None:
    for url in (A, B, C):
        servers.fails(url, httpx.ConnectError)
    api = client(servers, A, B, C)
    with pytest.raises(AgentUnreachable) as err:
        api.call("POST", "/v1/volumes", {"size_gib": 1})
    assert servers.hosts() == [A, B, C]
    assert "none of 3 URLs answered" in err.value.message
    assert all(f"{url}: connection refused" in err.value.message for url in (A, B, C))
    servers.answers(A)
    assert api.call("GET", "/v1/volumes") == {"from": A}
    assert servers.hosts()[3:] == [C, A], "the next call went on from where the last one stopped"


# -- a request that was sent: only a repeatable one moves on ---------------------------------------------


@pytest.mark.parametrize("exc", [httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError])
def test_a_create_lost_after_it_was_sent_is_not_repeated_elsewhere(servers: Servers,
                                                                   exc: type[httpx.TransportError]) -> None:
    servers.fails(A, exc)
    servers.answers(B)
    api = client(servers, A, B)
    with pytest.raises(AgentUnavailable, match="not repeated at another URL, as it may have been carried out"):
        api.call("POST", "/v1/volumes", {"size_gib": 1})
    assert servers.seen == [(A, "POST")], "B never saw the create: it might have made a second volume"


@pytest.mark.parametrize(("method", "body", "idempotent"), [
    ("GET", None, None), ("PUT", {"x": 1}, None), ("DELETE", None, None), ("POST", {"size_gib": 1, **TOKEN}, None),
    ("POST", {"report": 1}, True)])
@pytest.mark.parametrize("exc", [httpx.ReadTimeout, httpx.RemoteProtocolError])
def test_a_repeatable_request_lost_after_it_was_sent_moves_on(servers: Servers, method: str, body: Any,
                                                              idempotent: bool | None,
                                                              exc: type[httpx.TransportError]) -> None:
    servers.fails(A, exc)
    servers.answers(B)
    api = client(servers, A, B)
    assert api.call(method, "/v1/x", body, idempotent=idempotent) == {"from": B}
    assert servers.seen == [(A, method), (B, method)]


def test_a_5xx_moves_a_read_on_and_answers_a_create_with_its_error(servers: Servers) -> None:
    servers.status(A, 503)
    servers.answers(B)
    api = client(servers, A, B)
    assert api.call("GET", "/v1/volumes") == {"from": B}

    servers.seen.clear()
    servers.status(B, 500)
    servers.answers(A)
    with pytest.raises(Exception, match="is unwell") as err:
        api.call("POST", "/v1/volumes", {"size_gib": 1})
    assert err.value.status == 500  # type: ignore[attr-defined]
    assert servers.seen == [(B, "POST")]


def test_a_4xx_is_an_answer_not_a_failure(servers: Servers) -> None:
    servers.behaviour[A] = lambda request: httpx.Response(
        404, json={"error": {"code": "InvalidVolume.NotFound", "message": "no such volume", "type": "NotFound"}})
    servers.answers(B)
    api = client(servers, A, B)
    with pytest.raises(Exception, match="no such volume"):
        api.call("GET", "/v1/volumes/vol-0123456789abcdef0")
    assert servers.hosts() == [A]


def test_one_url_behaves_as_before(servers: Servers) -> None:
    servers.fails(A, httpx.ConnectError)
    with pytest.raises(AgentUnreachable) as err:
        client(servers, A).call("POST", "/v1/volumes", {"size_gib": 1})
    assert err.value.message == f"{A}: connection refused (POST /v1/volumes)"
    servers.fails(A, httpx.ReadTimeout)
    with pytest.raises(AgentUnavailable) as lost:
        client(servers, A).call("POST", "/v1/volumes", {"size_gib": 1})
    assert lost.value.message == f"{A}: no answer in time (POST /v1/volumes)"


def test_a_switch_is_logged_once_until_a_call_succeeds(servers: Servers, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vbs.net.api_client")
    servers.fails(A, httpx.ConnectError)
    servers.fails(B, httpx.ConnectError)
    api = ApiClient([A, B], None, transport=httpx.MockTransport(servers), label="storage agent storage-2")
    for _ in range(3):
        with pytest.raises(AgentUnreachable):
            api.call("GET", "/v1/x")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"storage agent storage-2: {A} failed (connection refused): switching to {B}"]
    servers.answers(A)
    api.call("GET", "/v1/x")
    assert caplog.records[-1].getMessage() == f"storage agent storage-2: {A} answers"


def test_idempotence_by_method_and_client_token() -> None:
    assert all(is_idempotent(m) for m in ("GET", "get", "HEAD", "PUT", "DELETE", "OPTIONS"))
    assert not is_idempotent("POST", {"size_gib": 1})
    assert not is_idempotent("POST", {"client_token": ""})
    assert is_idempotent("POST", TOKEN)
    assert not is_idempotent("PATCH", TOKEN)


# -- the same over real sockets ------------------------------------------------------------------------------


class Answering(ThreadingHTTPServer):
    """Answers every request with 200 and its own name; counts what it was asked."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                outer.requests.append(self.command)
                body = json.dumps({"from": "answering"}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class HangingUp:
    """Reads a whole request, then resets the connection without a word: the request was sent."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.requests = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.requests += 1
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def answering() -> Iterator[Answering]:
    server = Answering()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hanging_up() -> Iterator[HangingUp]:
    server = HangingUp()
    try:
        yield server
    finally:
        server.close()


def test_a_port_where_nothing_listens_sends_even_a_create_on(answering: Answering) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    api = ApiClient([dead, answering.url], None, timeout=5)
    assert api.call("POST", "/v1/volumes", {"size_gib": 1}) == {"from": "answering"}
    assert answering.requests == ["POST"]


def test_a_server_that_hangs_up_after_the_request_gets_no_second_create(answering: Answering,
                                                                        hanging_up: HangingUp) -> None:
    api = ApiClient([hanging_up.url, answering.url], None, timeout=5)
    with pytest.raises(AgentUnavailable, match="not repeated at another URL"):
        api.call("POST", "/v1/volumes", {"size_gib": 1})
    assert (hanging_up.requests, answering.requests) == (1, [])

    assert api.call("POST", "/v1/volumes", {"size_gib": 1, **TOKEN}) == {"from": "answering"}
    assert api.call("GET", "/v1/volumes") == {"from": "answering"}
    assert answering.requests == ["POST", "GET"]


# -- URL lists ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "urls"), [
    ("http://127.0.0.1:8770", ("http://127.0.0.1:8770",)),
    ("http://127.0.0.1:8770/ , https://ctl-2.example.org:8443", ("http://127.0.0.1:8770",
                                                                  "https://ctl-2.example.org:8443")),
    (["http://a:1", "http://b:2,http://c:3"], ("http://a:1", "http://b:2", "http://c:3")),
    ("http://[::1]:8770", ("http://[::1]:8770",)),
    ("https://vbs.example.org/api/", ("https://vbs.example.org/api",)),
])
def test_url_lists_that_are_accepted(given: str | list[str], urls: tuple[str, ...]) -> None:
    assert parse(given) == urls


@pytest.mark.parametrize(("given", "says"), [
    ("", "at least one"),
    ([], "at least one"),
    ("http://a:1,,http://b:2", "an empty item"),
    ("http://a:1,", "an empty item"),
    ("ftp://a", "is not an http(s)://host"),
    ("127.0.0.1:8770", "is not an http(s)://host"),
    ("http://", "is not an http(s)://host"),
    ("http://a:1?x=1", "is not an http(s)://host"),
    ("http://a:1#frag", "is not an http(s)://host"),
    ("http://a b:1", "is not an http(s)://host"),
    ("http://a-.b:1", "is not a host name"),
    ("http://a..b:1", "is not a host name"),
    ("http://[1:2:3]:1", "is not an IPv6 address"),
    ("http://a:0", "port 0 is not in 1-65535"),
    ("http://a:65536", "port 65536 is not in 1-65535"),
    ("http://a:1,http://a:1/", "is listed twice"),
    ("http://" + "a" * 600, "longer than"),
    (",".join(f"http://h{k}:1" for k in range(MAX_URLS + 1)), f"at most {MAX_URLS} URLs"),
])
def test_url_lists_that_are_refused(given: str | list[str], says: str) -> None:
    with pytest.raises(InvalidParameter, match="^--endpoint: ") as err:
        parse(given, what="--endpoint")
    assert says in err.value.message


def test_a_url_with_a_password_is_refused_without_showing_it() -> None:
    with pytest.raises(InvalidParameter) as err:
        parse("http://127.0.0.1:1,http://admin:hunter2@127.0.0.1:2")
    assert "user:password@" in err.value.message and "hunter2" not in err.value.message


def test_agents_read_one_controller_url_or_several(tmp_path: Path) -> None:
    toml = tmp_path / "vbs.toml"
    toml.write_text('[storage_agent]\ncontroller_url = ["http://10.0.0.1:8770", "http://10.0.0.2:8770"]\n'
                    '[host_agent]\ncontroller_url = "http://10.0.0.1:8770"\n')
    storage = config.load(config.StorageAgentConfig, "storage_agent", config_file=toml, environ={})
    assert storage.controller_url == ("http://10.0.0.1:8770", "http://10.0.0.2:8770")
    host = config.load(config.HostAgentConfig, "host_agent", config_file=toml, environ={})
    assert host.controller_url == ("http://10.0.0.1:8770",)
    from_env = config.load(config.HostAgentConfig, "host_agent", config_file=toml,
                           environ={"VBS_HOST_AGENT_CONTROLLER_URL": "http://10.0.0.3:1,http://10.0.0.4:1"})
    assert from_env.controller_url == ("http://10.0.0.3:1", "http://10.0.0.4:1")
    flags = config.load(config.HostAgentConfig, "host_agent", environ={},
                        overrides={"controller_url": ["http://10.0.0.5:1", "http://10.0.0.6:1"]})
    assert flags.controller_url == ("http://10.0.0.5:1", "http://10.0.0.6:1")
    assert config.load(config.HostAgentConfig, "host_agent", environ={}).controller_url == (
        "http://127.0.0.1:8770",)


def test_a_bad_controller_url_in_the_config_is_refused_without_echoing_it() -> None:
    with pytest.raises(InvalidParameter) as err:
        config.load(config.StorageAgentConfig, "storage_agent", environ={},
                    overrides={"controller_url": ["http://10.0.0.1:1", "http://vbs:s3cret@10.0.0.2:1"]})
    assert "controller_url" in err.value.message and "s3cret" not in err.value.message
    with pytest.raises(InvalidParameter, match="a URL or a list of URLs"):
        config.load(config.StorageAgentConfig, "storage_agent", environ={}, overrides={"controller_url": 8770})


def test_the_cli_refuses_a_bad_endpoint_list_naming_it() -> None:
    proc = subprocess.run([*VBS, "--endpoint", "http://127.0.0.1:8770,ftp://x", "describe-volumes"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "--endpoint (VBS_ENDPOINT): 'ftp://x' is not an http(s)://host" in proc.stderr


@pytest.mark.parametrize(("controllers", "storage_nodes", "says"), [
    (0, 1, "--controllers is 1-8, not 0"), (9, 1, "--controllers is 1-8, not 9"),
    (1, 0, "--storage-nodes is 1-16, not 0"), (1, 17, "--storage-nodes is 1-16, not 17")])
def test_vbs_up_counts_are_bounded(controllers: int, storage_nodes: int, says: str) -> None:
    with pytest.raises(InvalidParameter, match=says):
        Shape(controllers, storage_nodes)
    assert Shape(8, 16).storage_names[-1] == "storage-16"
