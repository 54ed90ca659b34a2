"""Requests in progress are budgeted per principal as well as per address, against a real ``vbs up``.

Under ``vbs up`` every user and both agents call from 127.0.0.1: a budget per address alone let one
user key hold it all with slow bodies (other tenants and ``/health`` got 503, the agents' heartbeats
failed and the storage node went ``down``). The limits are small here so the attack is quick.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Vbs, VbsUp

pytestmark = pytest.mark.integration

PER_KEY = 4
ATTACKERS = 66  # as many as the probe opened: more than the per-address budget (64)
ATTACK_S = 8.0
HEARTBEAT_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Vbs, VbsUp]]:
    tmp: Path = tmp_path_factory.mktemp("budgets")
    env = {"VBS_CONTROLLER_MAX_REQUESTS_PER_KEY": str(PER_KEY), "VBS_CONTROLLER_MAX_REQUESTS_PER_TENANT": "6",
           "VBS_CONTROLLER_BODY_GRACE_S": "1", "VBS_CONTROLLER_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
           "VBS_STORAGE_AGENT_HEARTBEAT_INTERVAL_S": "0.5", "VBS_HOST_AGENT_HEARTBEAT_INTERVAL_S": "0.5"}
    proc = VbsUp(tmp / "var", tmp / "vbs-up.log", env=env)
    try:
        yield proc.start(), proc
    finally:
        proc.stop()


def _key(vbs: Vbs, tenant: str) -> str:
    made = vbs.cli("create-key", "--tenant", tenant, "--role", "user")
    return f"Bearer {made['access_key_id']}:{made['secret_access_key']}"


def _slow_post(port: int, auth: str, stop: threading.Event) -> bytes:
    """``POST /v1/volumes`` whose body trickles a byte a second: the answer's status line."""
    head = (f"POST /v1/volumes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 64\r\n"
            f"Authorization: {auth}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        s.settimeout(1.0)
        for byte in b'{"size_gib": 1, "comment": "' + b"x" * 64:
            try:
                answer = s.recv(4096)
                return answer.split(b"\r\n", 1)[0] + b" " + answer[-200:]
            except TimeoutError:
                pass
            if stop.is_set():
                return b"stopped"
            try:
                s.sendall(bytes([byte]))
            except OSError:
                return b"closed"
    return b"body sent whole"


def test_one_keys_slow_bodies_leave_other_tenants_health_and_heartbeats_alone(up: tuple[Vbs, VbsUp]) -> None:
    vbs, _ = up
    port = int(vbs.endpoint.rsplit(":", 1)[1])
    attacker, victim = _key(vbs, "attacker"), _key(vbs, "victim")
    stop = threading.Event()
    answers: list[bytes] = []

    def attack() -> None:
        while not stop.is_set():  # each reopened after its answer, as the probe did
            answers.append(_slow_post(port, attacker, stop))

    threads = [threading.Thread(target=attack, daemon=True) for _ in range(ATTACKERS)]
    for t in threads:
        t.start()
    served: list[tuple[str, int, str]] = []
    states: list[Any] = []
    try:
        with httpx.Client(base_url=vbs.endpoint, timeout=10, headers={"authorization": victim}) as other:
            deadline = time.monotonic() + ATTACK_S
            while time.monotonic() < deadline:
                for method, path in (("GET", "/v1/volumes"), ("GET", "/health")):
                    r = other.request(method, path)
                    served.append((path, r.status_code, r.text[:200]))
                r = other.post("/v1/volumes", json={"size_gib": 1})
                served.append(("POST /v1/volumes", r.status_code, r.text[:200]))
                states += [n["state"] for n in vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]]
                states += [h["state"] for h in vbs.http.get("/v1/hosts").json()["hosts"]]
                time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    refused = [s for s in served if s[1] != 200]
    assert not refused, f"another tenant was refused during the attack: {refused[:5]}"
    assert states and set(states) == {"up"}, f"a node left 'up' during the attack: {sorted(set(states))}"
    codes = {re.split(rb" ", a, maxsplit=2)[1] if a.startswith(b"HTTP/") else a for a in answers}
    # The attacker's own slow bodies were cut by the floor rate (408), its extra requests refused (503).
    assert codes <= {b"408", b"503", b"stopped"}, answers[:5]
    assert b"408" in codes and b"503" in codes, codes
    assert any(b"slower than" in a for a in answers)
    assert any(b"for one key" in a for a in answers)


def test_forwarded_headers_from_a_local_client_are_not_believed(up: tuple[Vbs, VbsUp]) -> None:
    """A bearer key over plain HTTP that claims, by proxy headers, to come from afar over TLS: the
    controller sees the real peer (loopback, plain HTTP), so the claim changes nothing."""
    vbs, _ = up
    user = _key(vbs, "forger")
    for forged in ({"x-forwarded-for": "203.0.113.5"},
                   {"x-forwarded-for": "203.0.113.5", "x-forwarded-proto": "https"}):
        r = httpx.get(f"{vbs.endpoint}/v1/volumes", headers={"authorization": user, **forged})
        # Believed, the first would be refused as a bearer key off loopback; it is accepted as what it is.
        assert r.status_code == 200, r.text
    # A new X-Forwarded-For per request does not make a new address: the per-key budget still holds.
    stop = threading.Event()
    port = int(vbs.endpoint.rsplit(":", 1)[1])
    held = [threading.Thread(target=_slow_post, args=(port, user, stop), daemon=True) for _ in range(PER_KEY)]
    for t in held:
        t.start()
    try:
        time.sleep(0.5)  # well within the grace period (1 s) of the held bodies
        r = httpx.get(f"{vbs.endpoint}/v1/volumes", headers={"authorization": user, "x-forwarded-for": "198.51.100.7"})
        assert r.status_code == 503 and "RequestLimitExceeded" in r.text, r.text
    finally:
        stop.set()
        for t in held:
            t.join(30)


def test_every_answer_of_every_service_says_nosniff(up: tuple[Vbs, VbsUp]) -> None:
    vbs, proc = up
    agents = re.findall(r"serving on (https?://[0-9.:]+)", proc.log_path.read_text())
    assert len(agents) >= 2, "the storage and host agents' URLs"
    answers = [vbs.http.get("/v1/volumes"), vbs.http.get("/v1/volumes/vol-0123456789abcdef0"),
               vbs.http.post("/", data={"Action": "DescribeVolumes", "Version": "2016-11-15"}),
               vbs.http.post("/", data={"Action": "NoSuchAction"}), httpx.get(f"{vbs.endpoint}/v1/volumes"),
               httpx.post(f"{vbs.endpoint}/"), vbs.http.get("/health"), vbs.http.get("/console")]
    answers += [httpx.get(f"{url}/health") for url in agents] + [httpx.get(f"{url}/v1/exports") for url in agents]
    for r in answers:
        assert r.headers.get("x-content-type-options") == "nosniff", (r.request.url, r.status_code, r.headers)
