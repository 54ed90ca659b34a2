"""What the NBD daemon lets each key do: the key's own throttle group, the fair-dispatch group a
volume type shares on this node (``fair_share``), and limits set before a key's first export."""

from __future__ import annotations

import re

from vbs.errors import InvalidParameter
from vbs.wire.qos import VOLUME_TYPE_RE, ExportLimits, QoS, throttle_limits

from .daemon import Monitor
from .state import Chain, Live, Served, fair_group_id, group_id

MAX_PENDING_LIMITS = 4096  # limits set for keys whose export has not been asked for yet


def checked_fair_share(fair_share: dict[str, QoS]) -> dict[str, QoS]:
    for volume_type, qos in fair_share.items():
        if not re.fullmatch(VOLUME_TYPE_RE, volume_type):
            raise InvalidParameter(f"fair_share: invalid volume type {volume_type[:20]!r}")
        if not qos.limits_anything():
            raise InvalidParameter(f"fair_share.{volume_type}: give iops, mbps or both")
    return dict(fair_share)


class Limits:
    """The throttle groups of one daemon and the throttle nodes of each chain."""

    def __init__(self, fair_share: dict[str, QoS] | None, monitor: Monitor) -> None:
        self.fair_share = checked_fair_share(fair_share or {})
        self.pending: dict[str, ExportLimits] = {}  # set before the key's first export
        self._monitor = monitor

    def keep_pending(self, key: str, limits: ExportLimits) -> None:
        """Limits of a key not served yet, until its first export."""
        self.pending.pop(key, None)
        self.pending[key] = limits
        while len(self.pending) > MAX_PENDING_LIMITS:
            # Keys never exported after all (a native RBD connection): the oldest go.
            del self.pending[next(iter(self.pending))]

    def take_pending(self, key: str) -> ExportLimits | None:
        return self.pending.pop(key, None)

    def open_throttles(self, served: Served, chain: Chain, live: Live) -> None:
        """The key's throttle node on the raw node, the fair-dispatch one on it; their groups first.
        A point-in-time copy's filter goes above them (below, QEMU 7.2 aborts when two stacked
        filters are dropped): the copy reads through the volume's limits, as a hypervisor's would."""
        if chain.throttle_node is None:
            return
        group = group_id(served.key)
        self.set_group(group, served.limits.qos if served.limits else None, live)
        self._monitor.q("blockdev-add", {"driver": "throttle", "node-name": chain.throttle_node,
                                         "throttle-group": group, "file": chain.raw_node,
                                         "read-only": chain.read_only})
        live.nodes[chain.throttle_node] = None
        if chain.fair_node is None or chain.fair_group is None:
            return
        fair_type = chain.fair_group.removeprefix(fair_group_id(""))
        self.set_group(chain.fair_group, self.fair_share.get(fair_type), live)
        self._monitor.q("blockdev-add", {"driver": "throttle", "node-name": chain.fair_node,
                                         "throttle-group": chain.fair_group, "file": chain.throttle_node,
                                         "read-only": chain.read_only})
        live.nodes[chain.fair_node] = None

    def set_group(self, group: str, qos: QoS | None, live: Live) -> None:
        """Make the throttle group, or change its limits in place (members keep their queued I/O)."""
        limits = throttle_limits(qos)
        if group in live.groups:
            self._monitor.q("qom-set", {"path": f"/objects/{group}", "property": "limits", "value": limits})
            return
        self._monitor.q("object-add", {"qom-type": "throttle-group", "id": group, "limits": limits})
        live.groups.add(group)

    def fair_group(self, served: Served) -> str | None:
        volume_type = served.limits.volume_type if served.limits else None
        return fair_group_id(volume_type) if volume_type in self.fair_share else None
