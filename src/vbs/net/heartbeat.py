"""Agents' heartbeat: report what this node has to the controller at once, then every few seconds.

The controller learns of an agent (its URL, pools, VMs, exports, capabilities) only from this
report, so the first one is sent as soon as the agent's API listens; a failing controller is
retried every second (every quarter second until it first answers: an embedded install starts its
agents together with its controller). With several controllers the report goes to the current one and, when that
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

FIRST_RETRY_S = 0.25  # retries before the controller first answered
STARTING_S = 5.0  # how long a controller that never answered may be starting before it is a warning


class Heartbeat(Repeating):
    def __init__(self, controller: ApiClient, path: str, report: Callable[[], Wire], *,
                 interval: float, ready: Callable[[], bool] = lambda: True) -> None:
        super().__init__("heartbeat", ready=ready)
        self._controller = controller
        self._path = path
        self._report = report
        self._interval = interval
        self._failures = 0  # in a row
        self._answered = False  # until the first report is taken: the controller may still be starting

    def beat(self) -> None:
        # A report says what is, not what to do: sent twice, or to another controller, it changes nothing.
        self._controller.request("POST", self._path, Ack, self._report(), timeout=5, idempotent=True)

    def _run_once(self) -> float:
        try:
            self.beat()
            if self._failures:
                log.info("heartbeat: controller reachable%s", " again" if self._answered else "")
            self._failures = 0
            self._answered = True
            return self._interval
        except VbsError as exc:
            self._failures += 1
            # A first controller still starting is no news; one silent for STARTING_S is.
            if self._failures == (1 if self._answered else int(STARTING_S / FIRST_RETRY_S)):
                log.warning("heartbeat failed: %s", exc.message)
        except Exception:
            # A report that cannot be made (a pool's storage failing in a way its driver did not foresee)
            # must not end the heartbeat for good: the node would look dead while it serves its other pools.
            self._failures += 1
            if self._failures == 1:
                log.exception("heartbeat failed: its report could not be made")
        return 1.0 if self._answered else FIRST_RETRY_S
