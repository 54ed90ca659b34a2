"""The storage agent's metrics, read from its drivers at each scrape: its pools' bytes and its exports."""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from vbs.errors import VbsError
from vbs.net.metrics import ScrapeCollector, new_registry
from vbs.pools.backend import Backend
from vbs.pools.exports import ExportDriver

__all__ = ["storage_registry"]

log = logging.getLogger(__name__)


def storage_registry(backends: Mapping[str, Backend], exports: ExportDriver) -> CollectorRegistry:
    registry = new_registry()
    registry.register(ScrapeCollector(lambda: _driver_metrics(backends, exports)))
    return registry


def _driver_metrics(backends: Mapping[str, Backend], exports: ExportDriver) -> Iterator[Metric]:
    capacity = GaugeMetricFamily("vbs_storage_pool_capacity_bytes", "Each pool's size, as its backend reports it now.",
                                 labels=["pool"])
    used = GaugeMetricFamily("vbs_storage_pool_used_bytes", "Bytes used in each pool (capacity less free), now.",
                             labels=["pool"])
    free = GaugeMetricFamily("vbs_storage_pool_free_bytes", "Free bytes in each pool, now.", labels=["pool"])
    for name, backend in sorted(backends.items()):
        try:
            info = backend.pool_info()
        except VbsError as exc:  # a pool that does not answer now is left out of this scrape
            log.warning("metrics: pool %s: %s", name, exc.message)
            continue
        capacity.add_metric([name], info.capacity_bytes)
        used.add_metric([name], max(0, info.capacity_bytes - info.free_bytes))
        free.add_metric([name], info.free_bytes)
    yield from (capacity, used, free)
    served = GaugeMetricFamily("vbs_storage_exports", "Exports the export daemon serves now, by protocol.",
                               labels=["protocol"])
    try:
        for protocol, count in sorted(Tally(e.protocol for e in exports.list_exports()).items()):
            served.add_metric([protocol], count)
    except VbsError as exc:
        log.warning("metrics: listing exports: %s", exc.message)
    yield served
