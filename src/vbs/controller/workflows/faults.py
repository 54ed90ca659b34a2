"""Fault hooks of the workflow engine, for the tests that prove recovery and roll-back.

``VBS_CRASH_AT=<kind>:<step>:<started|done>`` makes the process SIGKILL itself at that point;
``inject_failure(kind, step, when)`` makes one step fail before or after its call; ``hold(kind, step)``
stops the next run of a step before its call until ``release``, so a test can remove its target
meanwhile. The last two are reachable over the internal API only with ``VBS_TEST_HOOKS=1``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Literal

from vbs.errors import DriverError

__all__ = ["FaultHooks", "HOLD_LIMIT_S"]

log = logging.getLogger(__name__)

HOLD_LIMIT_S = 300.0  # a held step goes on by itself after this, so a forgotten hold cannot wedge anything


def _crash_point() -> tuple[str, str, str] | None:
    spec = os.environ.get("VBS_CRASH_AT", "")
    parts = spec.split(":")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


class FaultHooks:
    """The crash point of this process and the failures and holds a test asked for, by (kind, step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._crash_at = _crash_point()
        self._fail_at: set[tuple[str, str, str]] = set()
        self._holds: dict[tuple[str, str], tuple[threading.Event, threading.Event]] = {}

    def inject_failure(self, kind: str, step: str, when: Literal["before", "after"]) -> None:
        """Make the next run of ``step`` in ``kind`` fail."""
        with self._lock:
            self._fail_at.add((kind, step, when))

    def hold(self, kind: str, step: str) -> None:
        """Stop the next run of ``step`` in ``kind`` before its call, until ``release``."""
        with self._lock:
            self._holds[(kind, step)] = (threading.Event(), threading.Event())

    def held(self, kind: str, step: str) -> bool:
        """Whether a run has reached the hold of ``step`` and waits there."""
        with self._lock:
            hold = self._holds.get((kind, step))
        return hold is not None and hold[0].is_set()

    def release(self, kind: str, step: str) -> None:
        with self._lock:
            hold = self._holds.pop((kind, step), None)
        if hold is not None:
            hold[1].set()

    def release_all(self) -> None:
        """Let every held run go on (the engine stops)."""
        with self._lock:
            for _reached, release in self._holds.values():
                release.set()

    def before_call(self, kind: str, step: str) -> None:
        """Where a step's run may be held, then fail (``when="before"``)."""
        self._maybe_hold(kind, step)
        self.maybe_fail(kind, step, "before")

    def _maybe_hold(self, kind: str, step: str) -> None:
        with self._lock:
            hold = self._holds.get((kind, step))
        if hold is None:
            return
        reached, release = hold
        reached.set()
        release.wait(HOLD_LIMIT_S)

    def maybe_fail(self, kind: str, step: str, when: str) -> None:
        with self._lock:
            if (kind, step, when) not in self._fail_at:
                return
            self._fail_at.discard((kind, step, when))
        raise DriverError(f"injected failure {when} step {step}")

    def maybe_crash(self, kind: str, step: str, moment: str) -> None:
        if self._crash_at == (kind, step, moment):
            log.warning("VBS_CRASH_AT reached (%s:%s:%s): killing the controller", kind, step, moment)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
