"""The remote-access cost model of placement advice: throughput and IOPS as functions of RTT.

Block protocols keep a bounded amount of data in flight (a TCP window, a queue of requests), so
moving one MiB costs a fixed part (the link) plus a part per round trip::

    1/throughput(rtt) = 1/link + rtt/window        (MiB/s; rtt in seconds, window in MiB)
    1/iops(rtt)       = service + rtt/depth        (seconds per I/O, depth I/Os in flight)

Both are lines in (rtt, 1/y), fitted by least squares to measured points: the bench's table per
protocol (bench/rtt.py writes it, ``rtt_calibration_file``) where there is one, else the RTT
probes every host reports (an HTTP transfer, i.e. one TCP stream, to each storage node). Points
at a single RTT fix no slope: the model then says so (``window_mib`` None) and keeps the
measured throughput whatever the RTT, and IOPS are bounded by one I/O per measured round trip.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from vbs.errors import InvalidParameter

# RTTs closer than this (ms) count as one: their spread is noise, not a slope.
MIN_RTT_SPREAD_MS = 0.2
IO_BYTES = 4096
MIB = 1 << 20


@dataclass(frozen=True)
class Point:
    rtt_ms: float
    value: float  # MiB/s, or I/Os per second


@dataclass(frozen=True)
class Line:
    """``1/y = intercept + slope * rtt_s``, fitted to ``points`` measurements."""

    intercept: float
    slope: float | None  # None: all points at one RTT
    points: int

    def at(self, rtt_ms: float) -> float:
        inverse = self.intercept + (self.slope or 0.0) * rtt_ms / 1000
        return 1 / inverse if inverse > 0 else float("inf")


def fit(points: Sequence[Point]) -> Line:
    """Least squares of 1/value against RTT; slope and intercept kept non-negative (a faster link or
    a shorter round trip never costs more)."""
    usable = [p for p in points if p.value > 0 and p.rtt_ms >= 0]
    if not usable:
        raise InvalidParameter("no measurement to fit the RTT model to")
    xs = [p.rtt_ms / 1000 for p in usable]
    ys = [1 / p.value for p in usable]
    if max(xs) - min(xs) < MIN_RTT_SPREAD_MS / 1000:
        return Line(intercept=statistics.fmean(ys), slope=None, points=len(usable))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 0.0)
    intercept = max(my - slope * mx, 0.0)
    if intercept == 0.0:  # the line passes below the origin: keep the fastest measured rate as the link
        intercept = min(ys)
    return Line(intercept=intercept, slope=slope, points=len(usable))


@dataclass(frozen=True)
class RemoteModel:
    """Throughput and 4 KiB IOPS of one protocol against RTT, and where the figures come from."""

    source: str
    throughput: Line
    iops: Line

    @property
    def link_mbps(self) -> float:
        return 1 / self.throughput.intercept

    @property
    def window_mib(self) -> float | None:
        s = self.throughput.slope
        return 1 / s if s else None

    def mbps(self, rtt_ms: float) -> float:
        return self.throughput.at(rtt_ms)

    def iops_at(self, rtt_ms: float) -> float:
        return self.iops.at(rtt_ms)

    def io_seconds(self, rtt_ms: float, *, mib: float, ios: int) -> float:
        """Time to move ``mib`` MiB in large requests plus ``ios`` 4 KiB random I/Os at ``rtt_ms``."""
        return mib / self.mbps(rtt_ms) + (ios / self.iops_at(rtt_ms) if ios else 0.0)


def from_probes(samples: Sequence[tuple[float, float]]) -> RemoteModel:
    """The model of the probes of all hosts: (rtt_ms, MiB/s) pairs. IOPS at queue depth 1: one round
    trip plus a 4 KiB transfer at the fitted link rate per I/O."""
    line = fit([Point(r, m) for r, m in samples])
    service = IO_BYTES / MIB * line.intercept
    return RemoteModel(source=f"probes ({line.points})", throughput=line,
                       iops=Line(intercept=service, slope=1.0, points=line.points))


class CalibrationPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rtt_ms: float = Field(ge=0, le=60_000)
    mbps: float = Field(gt=0)
    iops: float = Field(gt=0)


class Calibration(BaseModel):
    """What bench/rtt.py measured: per protocol, throughput and 4 KiB IOPS at each RTT, and the
    throughput of a volume copy between storage nodes (MiB/s) where it measured one."""

    model_config = ConfigDict(extra="forbid")
    protocols: dict[str, list[CalibrationPoint]] = Field(default_factory=dict, max_length=8)
    copy_mbps: float | None = Field(None, gt=0)

    def model(self, protocol: str) -> RemoteModel | None:
        pts = self.protocols.get(protocol)
        if not pts:
            return None
        return RemoteModel(source=f"calibration {protocol} ({len(pts)})",
                           throughput=fit([Point(p.rtt_ms, p.mbps) for p in pts]),
                           iops=fit([Point(p.rtt_ms, p.iops) for p in pts]))


def load_calibration(path: Path | None) -> Calibration | None:
    if path is None or not path.exists():
        return None
    try:
        return Calibration.model_validate(json.loads(path.read_text()))
    except ValueError as exc:
        raise InvalidParameter(f"the RTT calibration file {path} is not one: {str(exc)[:200]}") from exc
