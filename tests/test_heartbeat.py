"""An agent's heartbeat outlives a report that cannot be made: a pool whose storage fails in a way its
driver did not foresee must not make the whole node look dead for good (docs/operations.md "A lost pool")."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from vbs.net.heartbeat import Heartbeat
from vbs.wire.base import Ack

pytestmark = pytest.mark.unit


class Controller:
    """Takes heartbeats: what it was sent, in order."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.twice = threading.Event()

    def request(self, method: str, path: str, answer: type[Ack], body: Any, **_: Any) -> Ack:
        self.sent.append(body)
        if len(self.sent) >= 2:
            self.twice.set()
        return Ack()


def test_a_report_that_raises_is_tried_again_and_the_heartbeat_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    controller = Controller()
    reports = iter([FileNotFoundError("the pool directory is gone"), "first", "second"])

    def report() -> Any:
        item = next(reports, "more")
        if isinstance(item, Exception):
            raise item
        return item

    beat = Heartbeat(controller, "/internal/v1/storage-heartbeat", report, interval=0.01)  # type: ignore[arg-type]
    beat.start()
    try:
        assert controller.twice.wait(60), "the heartbeat stopped after the failed report"
    finally:
        beat.stop()
    assert controller.sent[:2] == ["first", "second"]
    assert "its report could not be made" in caplog.text
