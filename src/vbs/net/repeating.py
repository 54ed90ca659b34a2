"""Work repeated in a background thread until stopped: the agents' heartbeat, the host's RTT probes, and
the services' periodic passes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class Repeating:
    """A daemon thread named ``name`` that runs ``_run_once`` again and again, from when ``ready()`` says
    so, waiting after each run the seconds it returns, until ``stop()`` (which waits up to 5 s for a run
    under way)."""

    def __init__(self, name: str, *, ready: Callable[[], bool] = lambda: True) -> None:
        self._ready = ready
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _run_once(self) -> float:
        """One run of the work; the seconds until the next."""
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._ready() and not self._stop.wait(0.02):
            pass
        while not self._stop.is_set():
            self._stop.wait(self._run_once())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Periodic:
    """``work`` in a daemon thread named ``name``, every ``interval()`` seconds from one interval after
    ``start()`` until ``stop()``: the background passes of the reconciler, the lifecycle policies and the
    snapshot store's collection. A run that raises is logged on ``log`` as ``what``; the next comes on time."""

    def __init__(self, name: str, interval: Callable[[], float], work: Callable[[], None], *,
                 log: logging.Logger, what: str) -> None:
        self.stopping = threading.Event()
        self._interval, self._work, self._log, self._what = interval, work, log, what
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (again: nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """No run after the one under way; ``timeout``: wait up to that long for it to end."""
        self.stopping.set()
        if timeout is not None and self._thread.ident is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self.stopping.wait(self._interval()):
            try:
                self._work()
            except Exception:
                self._log.exception(self._what)
