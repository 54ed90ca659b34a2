"""The host agent's metrics: each attached VBS volume's I/O, read from the hypervisor at each scrape
(QEMU's ``query-blockstats``), as counters per volume and VM."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vbs import ids
from vbs.host.hypervisors.base import BlockStatsSource, DiskStats, HypervisorDriver
from vbs.net.metrics import ScrapeCollector, new_registry

__all__ = ["host_registry", "VOLUME_COUNTERS"]

NS = 1e-9
# name, help, value of a disk's counters (bytes, operations, seconds: base units).
VOLUME_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("vbs_volume_read_bytes", "Bytes the VM read from the volume.", "read_bytes"),
    ("vbs_volume_written_bytes", "Bytes the VM wrote to the volume.", "write_bytes"),
    ("vbs_volume_read_operations", "Read requests the VM completed on the volume.", "read_ops"),
    ("vbs_volume_write_operations", "Write requests the VM completed on the volume.", "write_ops"),
    ("vbs_volume_flush_operations", "Flush requests the VM completed on the volume.", "flush_ops"),
    ("vbs_volume_read_time_seconds", "Time the volume's reads took, added up.", "read_time_ns"),
    ("vbs_volume_write_time_seconds", "Time the volume's writes took, added up.", "write_time_ns"),
    ("vbs_volume_flush_time_seconds", "Time the volume's flushes took, added up.", "flush_time_ns"),
)


def host_registry(driver: HypervisorDriver) -> CollectorRegistry:
    registry = new_registry()
    if isinstance(driver, BlockStatsSource):
        registry.register(ScrapeCollector(lambda: volume_metrics(driver.block_stats())))
    return registry


def volume_metrics(disks: list[DiskStats]) -> Iterator[Metric]:
    labels = ["volume_id", "vm_id"]
    attached = GaugeMetricFamily("vbs_host_attached_volumes", "VBS volumes attached to the VMs of this host now.",
                                 value=len(disks))
    families = [(CounterMetricFamily(name, doc, labels=labels), field) for name, doc, field in VOLUME_COUNTERS]
    for disk in sorted(disks, key=lambda d: (d.serial, d.vm_id)):
        volume_id = ids.volume_of_serial(disk.serial) or disk.serial
        for family, field in families:
            value: float = getattr(disk, field)
            family.add_metric([volume_id, disk.vm_id], value * NS if field.endswith("_ns") else value)
    yield attached
    yield from (family for family, _field in families)
