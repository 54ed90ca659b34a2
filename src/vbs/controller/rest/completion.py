"""Completion without polling: a GET that waits (``?wait=N``) until an operation or resource settles.

The workflow engine ends operations in its worker threads; ``OperationEnds.signal`` (called once the
ending committed) wakes the requests of this controller that wait on that operation or its resource.
Another controller on the same PostgreSQL database may end it instead, and no notification crosses
controllers, so a waiter also re-reads its row every ``recheck_s`` (a short read in a worker thread:
no DB connection and no thread is held while waiting, only an ``asyncio.Event``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from vbs.controller.db.states import SnapshotState, VolumeState

__all__ = ["MAX_WAIT_S", "VOLUME_BUSY", "SNAPSHOT_BUSY", "OperationEnds", "long_poll", "recheck_interval"]

MAX_WAIT_S = 60
# Another controller's ending is seen by reading the row again: often on PostgreSQL (several controllers),
# rarely on SQLite (one controller: every ending is signalled here; the re-read is a safety net only).
POSTGRES_RECHECK_S = 0.2
SQLITE_RECHECK_S = 2.0
# The states a resource leaves when its operation ends: a wait on the resource answers once it is in another.
VOLUME_BUSY = frozenset({VolumeState.CREATING, VolumeState.DELETING})
SNAPSHOT_BUSY = frozenset({SnapshotState.PENDING, SnapshotState.DELETING})

T = TypeVar("T")


def recheck_interval(dialect: str) -> float:
    return SQLITE_RECHECK_S if dialect == "sqlite" else POSTGRES_RECHECK_S


class OperationEnds:
    """Wakes the waiters of an operation id or a resource id when an operation ends (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    @contextmanager
    def watch(self, key: str) -> Iterator[asyncio.Event]:
        """An event set at each ending under ``key``, from the moment this block begins (read the
        current state inside the block, so an ending between the read and the wait is not missed)."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.setdefault(key, set()).add(entry)
        try:
            yield entry[1]
        finally:
            with self._lock:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.discard(entry)
                    if not waiters:
                        del self._waiters[key]

    def signal(self, *keys: str) -> None:
        """An operation ended (its transaction committed): wake whoever waits on one of ``keys``."""
        with self._lock:
            entries = [e for k in keys for e in self._waiters.get(k, ())]
        for loop, event in entries:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that request's loop closed meanwhile (shutdown): nobody to wake
                pass

    def waiting(self) -> int:
        """How many waits are registered (for tests and metrics)."""
        with self._lock:
            return sum(len(w) for w in self._waiters.values())


async def long_poll(ends: OperationEnds, key: str, read: Callable[[], T], settled: Callable[[T], bool],
                    wait_s: float, recheck_s: float) -> T:
    """``read()`` (a short sync DB read, run in a worker thread) once ``settled``, or after ``wait_s``
    seconds with what it reads then; woken by endings under ``key``, and re-reading every ``recheck_s``."""
    deadline = time.monotonic() + wait_s
    with ends.watch(key) as ended:
        body = await run_in_threadpool(read)
        while not settled(body):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(ended.wait(), min(left, recheck_s))
            except TimeoutError:
                pass
            ended.clear()
            body = await run_in_threadpool(read)
    return body
