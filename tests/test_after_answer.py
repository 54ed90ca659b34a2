"""Unit tests of ``after_answer``: work a request's handler hands on (an operation's workflow) starts only
once the answer is sent, also from a handler run in a worker thread and when the handler fails; outside
a request it runs at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI

from vbs.controller.rest.after_answer import AfterAnswer, after_answer

pytestmark = pytest.mark.unit


def make_app(events: list[str]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(AfterAnswer)

    @app.post("/sync")
    def in_a_thread() -> dict[str, str]:  # FastAPI runs a plain def in a worker thread
        after_answer(lambda: events.append("work"))
        events.append("handler")
        return {"ok": "yes"}

    @app.post("/async")
    async def in_the_loop() -> dict[str, str]:
        after_answer(lambda: events.append("work"))
        after_answer(lambda: events.append("more work"))
        return {"ok": "yes"}

    @app.post("/fails")
    def failing() -> None:
        after_answer(lambda: events.append("work"))
        raise RuntimeError("boom")

    return app


def call(app: FastAPI, path: str, events: list[str]) -> int:
    """One request through the ASGI app; ``events`` gets "answered" when the last body chunk is sent."""
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            events.append("answered")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": [], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except RuntimeError:
            pass

    asyncio.run(run())
    return status[0] if status else 0


def test_work_handed_on_by_a_threaded_handler_starts_after_its_answer() -> None:
    events: list[str] = []
    assert call(make_app(events), "/sync", events) == 200
    assert events == ["handler", "answered", "work"]


def test_work_handed_on_in_the_event_loop_starts_after_the_answer_in_order() -> None:
    events: list[str] = []
    assert call(make_app(events), "/async", events) == 200
    assert events == ["answered", "work", "more work"]


def test_work_handed_on_by_a_failing_handler_still_starts() -> None:
    events: list[str] = []
    assert call(make_app(events), "/fails", events) == 500
    # (Its 500 is sent by Starlette's outermost error middleware, after the work was started.)
    assert events.count("work") == 1


def test_outside_a_request_the_work_runs_at_once() -> None:
    events: list[str] = []
    after_answer(lambda: events.append("work"))
    assert events == ["work"]
