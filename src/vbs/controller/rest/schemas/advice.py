"""The REST models of the placement advice: remote access, or moving the VM or the volume, costed from
the hosts' RTT probes, with the model and the measurements the answer came from."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel


class AdviceOption(BaseModel):
    """One way to run the workload: where the VM and the data would be, what the move costs, what the
    I/O costs there (seconds, from the RTT model), and the command that does it."""

    action: Literal["stay-remote", "migrate-instance", "migrate-volume"]
    host: str
    storage_node: str
    rtt_ms: float
    mbps: float
    iops: float
    move_s: float
    io_s: float
    total_s: float
    # The I/O (GiB, at the asked mix) from which this move costs less than staying remote; None
    # when it never does (no faster than staying) or for staying itself.
    breakeven_io_gib: float | None = None
    command: str | None = None


class AdviceModelOut(BaseModel):
    source: str
    protocol: str
    link_mbps: float
    # Data in flight per round trip (MiB); None when the measurements span one RTT only.
    window_mib: float | None
    copy_mbps: float
    copy_source: str


class MeasuredProbe(BaseModel):
    host: str
    storage_node: str
    rtt_ms: float
    mbps: float
    measured_at: datetime


class AdviceOut(BaseModel):
    volume_id: str
    instance_id: str
    io_gib: float
    random_ios: int
    memory_mib: int
    model: AdviceModelOut
    options: list[AdviceOption]
    recommended: str
    notes: list[str] = []
    # The probes the answer was computed from (every live host's latest of each storage node).
    measured: list[MeasuredProbe] = []
