"""The contract every hypervisor driver of the host agent fulfils.

A driver finds the VMs of its node and hot-plugs / unplugs a volume's connection into one of them,
identifying each disk by its virtio serial (the volume id without its dash). Both calls are idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vbs.connection import Connection
from vbs.errors import IncorrectState

__all__ = ["HypervisorDriver", "VmInfo", "QoS", "AttachedDisk", "DeviceBusy"]


@dataclass(frozen=True)
class VmInfo:
    vm_id: str
    name: str
    running: bool


@dataclass(frozen=True)
class QoS:
    """Per-disk limits; ``mbps`` is MiB/s, as EBS counts throughput."""

    iops: int | None = None
    mbps: int | None = None


@dataclass(frozen=True)
class AttachedDisk:
    """A disk VBS attached. The guest names it (``vdb``…); the serial is how anyone finds it."""

    serial: str
    device_id: str
    node_name: str
    read_only: bool


class DeviceBusy(IncorrectState):
    """The guest did not release an unplugged disk in time (attachment state ``busy``)."""


class HypervisorDriver(Protocol):
    def list_vms(self) -> list[VmInfo]:
        """The VMs on this node that the driver can manage."""
        ...

    def attach(
        self,
        vm_id: str,
        connection: Connection,
        serial: str,
        *,
        read_only: bool = False,
        qos: QoS | None = None,
    ) -> AttachedDisk:
        """Hot-plug ``connection`` into the VM as a virtio disk; a disk already there with this
        serial is returned as it is."""
        ...

    def detach(self, vm_id: str, serial: str, *, force: bool = False, timeout: float = 10.0) -> None:
        """Unplug the disk and release its connection; an absent disk is success. Raises
        ``DeviceBusy`` if the guest does not release it within ``timeout``."""
        ...

    def list_disks(self, vm_id: str) -> list[AttachedDisk]:
        """The disks VBS attached to the VM (recognised by their ids), for reconciliation."""
        ...

    def resize(self, vm_id: str, serial: str, connection: Connection, size_bytes: int) -> AttachedDisk:
        """Online resize: move the attached disk to ``connection`` (a refreshed export of its grown
        volume) without unplugging it, and make the guest see ``size_bytes``. Idempotent (a disk on
        that connection with that size is left alone); on failure the disk keeps its old connection.
        Raises ``NotFound`` if the disk is not attached, ``IncorrectState`` if it cannot be resized
        online (read-only, force-detached)."""
        ...
