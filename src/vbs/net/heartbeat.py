"""Agents' heartbeat: report what this node has to the controller at once, then every few seconds.

The controller learns of an agent (its URL, pools, VMs, exports, capabilities) only from this
report, so the first one is sent as soon as the agent's API listens; a failing controller is
retried every second. With several controllers the report goes to the current one and, when that
fails, to the next (``vbs.net.web.ApiClient`` moves on and says so once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vbs.errors import VbsError
from vbs.net.repeating import Repeating
from vbs.net.web import ApiClient
from vbs.wire.base import Ack, Wire

log = logging.getLogger(__name__)


class Heartbeat(Repeating):
    def __init__(self, controller: ApiClient, path: str, report: Callable[[], Wire], *,
                 interval: float, ready: Callable[[], bool] = lambda: True) -> None:
        super().__init__("heartbeat", ready=ready)
        self._controller = controller
        self._path = path
        self._report = report
        self._interval = interval
        self._failing = False

    def beat(self) -> None:
        # A report says what is, not what to do: sent twice, or to another controller, it changes nothing.
        self._controller.request("POST", self._path, Ack, self._report(), timeout=5, idempotent=True)

    def _run_once(self) -> float:
        try:
            self.beat()
            if self._failing:
                log.info("heartbeat: controller reachable again")
            self._failing = False
        except VbsError as exc:
            if not self._failing:
                log.warning("heartbeat failed: %s", exc.message)
            self._failing = True
        except Exception:
            # A report that cannot be made (a pool's storage failing in a way its driver did not foresee)
            # must not end the heartbeat for good: the node would look dead while it serves its other pools.
            if not self._failing:
                log.exception("heartbeat failed: its report could not be made")
            self._failing = True
        return 1.0 if self._failing else self._interval
