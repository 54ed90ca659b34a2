"""The request body's rate floor (docs/security.md): it counts the time the server waits for the body, so a
server that is busy before it reads a body never answers 408 for its own delay; a slow client still gets one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from vbs.net.web import BodyLimit, RequestBounds

pytestmark = pytest.mark.unit

BOUNDS = RequestBounds(body_min_rate=1024.0, body_grace_s=0.2)


async def _serve(app: Any, chunks: list[bytes], gap_s: float) -> list[dict[str, Any]]:
    """Run ``app`` behind BodyLimit on a POST whose body comes in ``chunks``, ``gap_s`` apart; what it sent."""
    queue = list(chunks)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(gap_s)
        body = queue.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(queue)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    await BodyLimit(app, BOUNDS)(scope, receive, send)
    return sent


async def _reads_late_then_answers(scope: Any, receive: Any, send: Any) -> None:
    await asyncio.sleep(0.6)  # busy elsewhere (a queue, the database) before it reads the body: 3x the grace
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _status(sent: list[dict[str, Any]]) -> int:
    return int(next(m["status"] for m in sent if m["type"] == "http.response.start"))


def test_a_server_that_reads_the_body_late_does_not_blame_the_client() -> None:
    assert _status(asyncio.run(_serve(_reads_late_then_answers, [b"x" * 100, b"y" * 100], gap_s=0.0))) == 200


def test_a_body_that_trickles_in_gets_408() -> None:
    # One byte every 0.1 s: 10 bytes a second against a floor of 1024, past the 0.2 s grace.
    assert _status(asyncio.run(_serve(_reads_late_then_answers, [b"z"] * 20, gap_s=0.1))) == 408
