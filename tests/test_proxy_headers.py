"""X-Forwarded-For / X-Forwarded-Proto are believed only from the proxies the config names.

uvicorn's default trusts them from 127.0.0.1: a local client could claim ``https`` (and so send a
bearer key over plain HTTP as if it came from off-loopback over TLS) or a new address per request
(and so escape the per-address budget). VBS's servers read them from no one unless told."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from tests.conftest import free_port, wait_until
from vbs.config import ControllerConfig, load
from vbs.errors import InvalidParameter
from vbs.net.web import bounded_server

pytestmark = pytest.mark.unit

FORGED = {"x-forwarded-for": "203.0.113.5", "x-forwarded-proto": "https"}


def _serve(trusted: list[str]) -> Iterator[str]:
    app = FastAPI()

    @app.get("/who")
    def who(request: Request) -> dict[str, Any]:
        assert request.client is not None
        return {"client": request.client.host, "scheme": request.url.scheme}

    port = free_port()
    srv = bounded_server(app, "127.0.0.1", port, trusted_proxies=trusted)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, 10, what="the server")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


@pytest.fixture
def untrusting() -> Iterator[str]:
    yield from _serve([])


@pytest.fixture
def trusting_loopback() -> Iterator[str]:
    yield from _serve(["127.0.0.1"])


def test_forwarded_headers_from_loopback_are_ignored_by_default(untrusting: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")  # uvicorn's own switch changes nothing either
    seen = httpx.get(f"{untrusting}/who", headers=FORGED).json()
    assert seen == {"client": "127.0.0.1", "scheme": "http"}


def test_forwarded_headers_are_read_from_a_named_proxy(trusting_loopback: str) -> None:
    seen = httpx.get(f"{trusting_loopback}/who", headers=FORGED).json()
    assert seen == {"client": "203.0.113.5", "scheme": "https"}


def test_trusted_proxies_config_takes_addresses_and_networks_only() -> None:
    cfg = load(ControllerConfig, "controller", environ={"VBS_CONTROLLER_TRUSTED_PROXIES": "10.0.0.5,fd00::/64"})
    assert cfg.trusted_proxies == ["10.0.0.5", "fd00::/64"]
    assert load(ControllerConfig, "controller", environ={}).trusted_proxies == []
    for bad in ("*", "proxy.example", "10.0.0.5,*"):
        with pytest.raises(InvalidParameter):
            load(ControllerConfig, "controller", environ={"VBS_CONTROLLER_TRUSTED_PROXIES": bad})
