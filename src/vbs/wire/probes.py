"""RTT probes: what the controller tells a host to probe, and what the host reports it measured.

A host probes each storage node it is told of (``ProbeTargets``, from the controller) against the
node's agent (``GET /probe``), authenticated by a short-lived ticket the controller signs with that
storage node's own token (``vbs.trust.probe_tickets``), and reports the results in its heartbeat.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from vbs.wire.base import Wire
from vbs.wire.connection import HOST_NAME_RE
from vbs.wire.storage import NODE_URL_RE

__all__ = ["Probe", "ProbeTarget", "ProbeTargets", "MAX_PROBE_BYTES", "MAX_PROBES", "PROBE_PATH",
           "PROBE_TICKET_HEADER"]

# What one probe transfer may ask of a storage agent: enough to see a window's worth at a few ms.
MAX_PROBE_BYTES = 4 << 20
# Storage nodes a host probes and reports (a heartbeat stays small).
MAX_PROBES = 64
PROBE_PATH = "/probe"
PROBE_TICKET_HEADER = "x-vbs-probe-ticket"
TICKET_RE = r"^[a-z0-9][a-z0-9.-]{0,62}:[0-9]{1,12}:[A-Za-z0-9_-]{43}$"


class ProbeTarget(Wire):
    storage_node: str = Field(pattern=HOST_NAME_RE.pattern)
    url: str = Field(pattern=NODE_URL_RE)
    # None: the controller runs --insecure and the storage agent asks for nothing.
    ticket: str | None = Field(None, pattern=TICKET_RE)


class ProbeTargets(Wire):
    targets: list[ProbeTarget] = Field(max_length=MAX_PROBES)


class Probe(Wire):
    """One storage node as a host last measured it: round trip (median of small requests) and the
    throughput of a bounded transfer (MiB/s)."""

    storage_node: str = Field(pattern=HOST_NAME_RE.pattern)
    rtt_ms: float = Field(ge=0, le=60_000)
    mbps: float = Field(gt=0, le=1_000_000)
    probe_bytes: int = Field(ge=0, le=MAX_PROBE_BYTES)
    measured_at: datetime
