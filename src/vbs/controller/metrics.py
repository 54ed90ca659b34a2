"""The controller's metrics: operations and reconciler drift as counters, and what the DB knows
(resources by state, pools, exports, heartbeats) read at each scrape with a few aggregate queries."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from vbs.controller.db import Attachment, Database, Node, Snapshot, Volume
from vbs.controller.db.states import VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import GIB, host_info, storage_info
from vbs.controller.placement.room import is_full
from vbs.net.metrics import ScrapeCollector, new_registry

__all__ = ["ControllerMetrics", "OPERATION_BUCKETS_S"]

# Operations take from a tenth of a second (a DB-only step) to minutes (a copy, a slow agent).
OPERATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# Findings that are not drift between the DB and the agents.
NOT_DRIFT = frozenset({"unreachable"})

# Each pool's figures, labelled by storage node and pool, as its node last reported them.
POOL_GAUGES = {
    "vbs_pool_capacity_bytes": "Each pool's size, as its storage node last reported it.",
    "vbs_pool_used_bytes": "Bytes used in each pool (capacity less free), as last reported.",
    "vbs_pool_free_bytes": "Free bytes in each pool, as its storage node last reported them.",
    "vbs_pool_full": "1 while a pool's free bytes are below its reserve: it takes no new volumes or snapshots "
                     "(docs/operations.md \"A full pool\").",
    "vbs_pool_provisioned_bytes": "The sizes of the volumes in each pool, added up.",
}


class ControllerMetrics:
    """The registry of one controller app and the counters its engine and reconciler move."""

    def __init__(self, db: Database) -> None:
        self.registry: CollectorRegistry = new_registry()
        self.operations = Counter("vbs_operations", "Operations (workflows) that ended, by kind and outcome.",
                                  ["kind", "outcome"], registry=self.registry)
        self.operation_duration = Histogram("vbs_operation_duration_seconds",
                                            "Time from an operation's start to its end, by kind and outcome.",
                                            ["kind", "outcome"], buckets=OPERATION_BUCKETS_S, registry=self.registry)
        self.drift_found = Counter("vbs_reconciler_drift_found",
                                   "Differences between the DB and the agents a reconciliation pass found, by kind.",
                                   ["kind"], registry=self.registry)
        self.drift_repaired = Counter("vbs_reconciler_drift_repaired",
                                      "Differences a reconciliation pass repaired, by kind.", ["kind"],
                                      registry=self.registry)
        self.registry.register(ScrapeCollector(lambda: state_metrics(db, utcnow())))

    def operation_ended(self, kind: str, outcome: str, started_at: datetime | None) -> None:
        """Count an operation that ended ``outcome`` (succeeded, rolled-back, failed)."""
        self.operations.labels(kind, outcome).inc()
        if started_at is not None:
            seconds = max(0.0, (utcnow() - started_at).total_seconds())
            self.operation_duration.labels(kind, outcome).observe(seconds)

    def drift(self, findings: list[tuple[str, str]]) -> None:
        """Count a pass's findings, given as (kind, action) pairs."""
        for kind, action in findings:
            if kind in NOT_DRIFT:
                continue
            self.drift_found.labels(kind).inc()
            if action == "repaired":
                self.drift_repaired.labels(kind).inc()


def _by_state(name: str, doc: str, rows: list[tuple[str, int]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["state"])
    for state, count in sorted(rows):
        family.add_metric([state], count)
    return family


def _count_by_state(s: Session, table: type[Volume] | type[Snapshot] | type[Attachment]) -> list[tuple[str, int]]:
    return [(str(state), int(n)) for state, n in s.execute(select(table.status, func.count()).group_by(table.status))]


def state_metrics(db: Database, now: datetime) -> Iterator[Metric]:
    """What the DB says now: resources by state, each node's heartbeat age, pools and exports."""
    with db.read() as s:
        volumes, snapshots, attachments = (_count_by_state(s, table) for table in (Volume, Snapshot, Attachment))
        provisioned = {(str(node), str(pool)): int(gib or 0) * GIB for node, pool, gib in s.execute(
            select(Volume.storage_node, Volume.pool, func.sum(Volume.size_gib))
            .where(Volume.status != VolumeState.DELETED).group_by(Volume.storage_node, Volume.pool))}
        nodes = list(s.scalars(select(Node)))
    yield _by_state("vbs_volumes", "Volumes by state (deleted ones until they are purged).", volumes)
    yield _by_state("vbs_snapshots", "Snapshots by state.", snapshots)
    yield _by_state("vbs_attachments", "Attachments by state.", attachments)

    age = GaugeMetricFamily("vbs_node_heartbeat_age_seconds", "Seconds since each agent's last heartbeat.",
                            labels=["kind", "node"])
    pools = {name: GaugeMetricFamily(name, doc, labels=["node", "pool"]) for name, doc in POOL_GAUGES.items()}
    exports = GaugeMetricFamily("vbs_exports", "Exports each storage node reported in its last heartbeat, by protocol.",
                                labels=["node", "protocol"])
    rtt = GaugeMetricFamily("vbs_host_storage_rtt_seconds", "Each host's last measured round trip to each storage "
                            "node (docs/placement.md).", labels=["host", "storage_node"])
    probe_rate = GaugeMetricFamily("vbs_host_storage_probe_bytes_per_second", "Each host's last probe throughput "
                                   "from each storage node.", labels=["host", "storage_node"])
    for node in sorted(nodes, key=lambda n: (n.kind, n.name)):
        age.add_metric([node.kind, node.name], max(0.0, (now - node.last_heartbeat).total_seconds()))
        if node.kind == "host":
            for probe in host_info(node).probes:
                rtt.add_metric([node.name, probe.storage_node], probe.rtt_ms / 1000)
                probe_rate.add_metric([node.name, probe.storage_node], probe.mbps * (1 << 20))
        if node.kind != "storage":
            continue
        info = storage_info(node)
        for pool in info.pools:
            for name, value in (("vbs_pool_capacity_bytes", pool.capacity_bytes),
                                ("vbs_pool_used_bytes", max(0, pool.capacity_bytes - pool.free_bytes)),
                                ("vbs_pool_free_bytes", pool.free_bytes),
                                ("vbs_pool_full", 1 if is_full(pool) else 0),
                                ("vbs_pool_provisioned_bytes", provisioned.get((node.name, pool.name), 0))):
                pools[name].add_metric([node.name, pool.name], value)
        for protocol, count in sorted(Tally(e.protocol for e in info.exports).items()):
            exports.add_metric([node.name, protocol], count)
    yield from (age, *pools.values(), exports, rtt, probe_rate)
