"""The long-poll's plumbing (``vbs.controller.rest.completion``): an ending signalled from a worker thread
wakes the waiter of that operation or resource, a settled read answers at once, and a wait that runs
out answers what it reads then. The daemons' side is in tests/test_long_poll.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from vbs.controller.rest.completion import OperationEnds, long_poll

pytestmark = pytest.mark.unit


class Row:
    """A stand-in for an operation row, ended by a 'workflow thread' as the engine would."""

    def __init__(self) -> None:
        self.status = "running"
        self.reads = 0

    def read(self) -> str:
        self.reads += 1
        return self.status


def end_from_a_thread(ends: OperationEnds, row: Row, key: str, when: threading.Event) -> threading.Thread:
    def run() -> None:
        when.wait(30)
        row.status = "succeeded"
        ends.signal("op-other", key)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_an_ending_signalled_by_another_thread_wakes_the_waiter_before_its_wait_or_recheck() -> None:
    ends, row, go = OperationEnds(), Row(), threading.Event()
    thread = end_from_a_thread(ends, row, "vol-1", go)

    async def wait() -> tuple[str, float]:
        started = time.monotonic()
        poll = asyncio.ensure_future(long_poll(ends, "vol-1", row.read, lambda s: s != "running", 30, 30))
        while row.reads == 0:  # it has read "running" (and registered before that): end it now
            await asyncio.sleep(0.01)
        go.set()
        return await poll, time.monotonic() - started

    status, took = asyncio.run(wait())
    thread.join()
    assert status == "succeeded"
    assert took < 30  # woken by the signal: neither its 30 s wait nor its 30 s re-read ran out
    assert row.reads == 2  # the first read, and one after the wake-up: no polling meanwhile
    assert ends.waiting() == 0


def test_a_settled_read_answers_at_once_without_waiting() -> None:
    ends, row = OperationEnds(), Row()
    row.status = "rolled-back"
    assert asyncio.run(long_poll(ends, "op-1", row.read, lambda s: s != "running", 30, 30)) == "rolled-back"
    assert row.reads == 1


def test_a_wait_that_runs_out_answers_the_current_state() -> None:
    ends, row = OperationEnds(), Row()
    started = time.monotonic()
    assert asyncio.run(long_poll(ends, "op-1", row.read, lambda s: s != "running", 0.3, 30)) == "running"
    assert time.monotonic() - started >= 0.3
    assert row.reads == 2


def test_without_a_signal_the_row_is_read_again_at_the_recheck_interval() -> None:
    """Another controller ended it: nothing is signalled here, the re-read sees it."""
    ends, row = OperationEnds(), Row()

    def finish_silently() -> None:
        while row.reads == 0:
            time.sleep(0.01)
        row.status = "succeeded"

    thread = threading.Thread(target=finish_silently)
    thread.start()
    assert asyncio.run(long_poll(ends, "op-1", row.read, lambda s: s != "running", 30, 0.05)) == "succeeded"
    thread.join()


def test_a_signal_for_another_key_does_not_wake_the_waiter() -> None:
    ends, row = OperationEnds(), Row()

    async def wait() -> str:
        poll = asyncio.ensure_future(long_poll(ends, "op-1", row.read, lambda s: s != "running", 0.3, 30))
        while ends.waiting() == 0:
            await asyncio.sleep(0.01)
        ends.signal("op-2", "vol-2")
        return await poll

    assert asyncio.run(wait()) == "running"
    assert row.reads == 2  # the first read and the one when the wait ran out
