"""The storage agent's heartbeat: reports its pools (capacity, clone method) to the controller."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime

from vbs.errors import VbsError
from vbs.storage.backends.base import Backend
from vbs.web import ApiClient

log = logging.getLogger(__name__)


class Heartbeat:
    """Posts the inventory at once, then every ``interval`` seconds, until stopped."""

    def __init__(
        self, controller: ApiClient, *, name: str, url: str, address: str, backends: dict[str, Backend],
        interval: float, ready: Callable[[], bool] = lambda: True,
    ) -> None:
        self._ready = ready
        self._controller = controller
        self._body = {"name": name, "url": url, "address": address, "started_at": datetime.now(UTC).isoformat()}
        self._backends = backends
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def beat(self) -> None:
        pools = []
        for b in self._backends.values():
            info = asdict(b.pool_info())
            info["path"] = str(info["path"])
            pools.append(info)
        self._controller.call("POST", "/internal/v1/storage-heartbeat", {**self._body, "pools": pools}, timeout=5)

    def _loop(self) -> None:
        failing = False
        # The controller calls back as soon as it hears of us: announce only once the API listens.
        while not self._ready() and not self._stop.wait(0.02):
            pass
        while not self._stop.is_set():
            try:
                self.beat()
                if failing:
                    log.info("heartbeat: controller reachable again")
                failing = False
            except VbsError as exc:
                if not failing:
                    log.warning("heartbeat failed: %s", exc.message)
                failing = True
            self._stop.wait(1.0 if failing else self._interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
