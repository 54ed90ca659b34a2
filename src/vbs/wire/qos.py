"""Per-volume I/O limits as they cross the wire, and how QEMU's throttle groups take them.

One ``QoS`` says what a volume may do (IOPS, MiB/s, EBS's units); ``throttle_limits`` turns it into
the ``limits`` of a QEMU ``throttle-group`` — the storage node's (NBD export) and the hypervisor's
(other protocols) alike, so a volume is limited the same way wherever it is enforced.
"""

from __future__ import annotations

from pydantic import Field

from vbs.wire.base import Wire

__all__ = ["QoS", "ExportLimits", "LimitsAnswer", "throttle_limits", "IOPS_SIZE", "MIB", "VOLUME_TYPE_RE"]

MIB = 1 << 20
# EBS counts an I/O larger than 256 KiB as several operations; QEMU's ``iops-size`` does the same.
IOPS_SIZE = 256 << 10
VOLUME_TYPE_RE = r"^[a-z][a-z0-9]{0,15}$"


class QoS(Wire):
    """Per-disk limits; ``mbps`` is MiB/s, as EBS counts throughput."""

    iops: int | None = Field(None, ge=1, le=1_000_000)
    mbps: int | None = Field(None, ge=1, le=100_000)

    def limits_anything(self) -> bool:
        return self.iops is not None or self.mbps is not None


class ExportLimits(Wire):
    """What a storage node enforces on every export of one volume: its own limits (None: unlimited)
    and its type, which names the node's shared fair-dispatch group (if the node has one for it)."""

    qos: QoS | None = None
    volume_type: str | None = Field(None, pattern=VOLUME_TYPE_RE)


class LimitsAnswer(Wire):
    """Whether the limits are enforced where they were sent (False: the caller must enforce them
    elsewhere, at the hypervisor)."""

    enforced: bool


def throttle_limits(qos: QoS | None) -> dict[str, int]:
    """A throttle group's ``limits``, every field given (QEMU keeps a field left out: zero clears it).
    ``iops-size`` only with an IOPS limit (QEMU refuses it alone)."""
    iops = qos.iops if qos is not None and qos.iops is not None else 0
    mbps = qos.mbps if qos is not None and qos.mbps is not None else 0
    return {"iops-total": iops, "bps-total": mbps * MIB, "iops-size": IOPS_SIZE if iops else 0}
