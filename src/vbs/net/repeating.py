"""Work repeated in a background thread until stopped: the agents' heartbeat, the host's RTT probes."""

from __future__ import annotations

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
