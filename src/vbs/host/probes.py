"""The host agent's RTT probes: round trip and throughput to each storage node, every minute.

The controller names the storage nodes and gives a ticket for each (``GET
/internal/v1/probe-targets``). The round trip is the median of a few TCP connects to the node's
agent (the network's delay, not the agent's Python); the throughput is one bounded transfer from
the storage agent's probe endpoint (``GET /probe``). The latest result per node goes out in each heartbeat.
"""

from __future__ import annotations

import logging
import socket
import ssl
import statistics
import threading
import time
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx

from vbs.errors import VbsError
from vbs.net.repeating import Repeating
from vbs.net.web import ApiClient
from vbs.versions import sent_headers
from vbs.wire.probes import MAX_PROBES, PROBE_PATH, PROBE_TICKET_HEADER, Probe, ProbeTarget, ProbeTargets

log = logging.getLogger(__name__)

MIB = 1 << 20
CONNECTS = 5
TIMEOUT_S = 10.0
RETRY_S = 5.0


def connect_rtt_ms(url: str, *, samples: int = CONNECTS) -> float:
    """The median time of ``samples`` TCP connects to the host and port of ``url``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def transfer_mbps(client: httpx.Client, target: ProbeTarget, size: int) -> float:
    """MiB/s of one ``size``-byte answer from the node's probe endpoint (after a warm-up round trip)."""
    headers = sent_headers()
    if target.ticket:
        headers[PROBE_TICKET_HEADER] = target.ticket
    url = target.url.rstrip("/") + PROBE_PATH
    client.get(url, params={"bytes": "0"}, headers=headers).raise_for_status()
    start = time.perf_counter()
    got = 0
    with client.stream("GET", url, params={"bytes": str(size)}, headers=headers) as resp:
        resp.raise_for_status()
        for chunk in resp.iter_bytes():
            got += len(chunk)
    elapsed = time.perf_counter() - start
    return got / MIB / max(elapsed, 1e-6)


class Prober(Repeating):
    """Probes every storage node the controller names, every ``interval_s``; ``latest()`` for heartbeats."""

    def __init__(self, controller: ApiClient, *, interval_s: float, probe_bytes: int,
                 verify: ssl.SSLContext | bool = True) -> None:
        super().__init__("rtt-probes")
        self._controller = controller
        self._interval = interval_s
        self._bytes = probe_bytes
        self._verify = verify
        self._results: dict[str, Probe] = {}
        self._lock = threading.Lock()
        self._reached = False  # the controller answered once (before that it may still be starting)

    def latest(self) -> list[Probe]:
        with self._lock:
            return sorted(self._results.values(), key=lambda p: p.storage_node)[:MAX_PROBES]

    def probe(self, target: ProbeTarget, client: httpx.Client) -> Probe:
        rtt = connect_rtt_ms(target.url)
        mbps = transfer_mbps(client, target, self._bytes)
        return Probe(storage_node=target.storage_node, rtt_ms=round(rtt, 4), mbps=round(mbps, 2),
                     probe_bytes=self._bytes, measured_at=datetime.now(UTC))

    def round(self) -> int:
        """Probe each named node once (a node that fails keeps no stale result); how many were named."""
        targets = self._controller.request("GET", "/internal/v1/probe-targets", ProbeTargets, timeout=10).targets
        named = {t.storage_node for t in targets}
        with httpx.Client(timeout=TIMEOUT_S, verify=self._verify) as client:
            for target in targets:
                try:
                    result = self.probe(target, client)
                except (OSError, httpx.HTTPError, ValueError) as exc:  # ValueError: an answer too short to time
                    log.warning("probing storage node %s failed: %s", target.storage_node, exc)
                    with self._lock:
                        self._results.pop(target.storage_node, None)
                    continue
                with self._lock:
                    self._results[target.storage_node] = result
        with self._lock:
            for gone in set(self._results) - named:
                del self._results[gone]
        return len(targets)

    def _run_once(self) -> float:
        named = 0
        try:
            named = self.round()
            self._reached = True
        except VbsError as exc:
            log.log(logging.WARNING if self._reached else logging.INFO, "RTT probes: %s", exc.message)
        # Soon again while there is nothing to probe yet (the controller or its nodes starting).
        return self._interval if named else min(self._interval, RETRY_S)
