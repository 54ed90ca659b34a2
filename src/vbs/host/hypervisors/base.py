"""The contract every hypervisor driver of the host agent fulfils.

A driver finds the VMs of its node and hot-plugs / unplugs a volume's connection into one of them,
identifying each disk by its virtio serial (the volume id without its dash). It says what it can do
(``capabilities``: the protocols it opens, online resize, QoS, point-in-time copies) and the
controller's workflows ask that instead of assuming QEMU. A call a driver cannot do raises
``IncorrectState`` saying so.

Every call is idempotent and works from the VM's own state. A VM that is gone holds no disk: detach
and ``remove_copy`` then succeed (there is nothing left to undo), attach raises ``NotFound``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import SecretStr

from vbs.config import HostAgentConfig
from vbs.errors import InvalidParameter
from vbs.wire.connection import AnyConnection
from vbs.wire.host import DiskInfo, HypervisorCapabilities, MigrationInfo, QoS, StartMigration, VmInfo
from vbs.wire.storage import ItemStatus

__all__ = ["HypervisorDriver", "PausingDriver", "SpaceWaitingDriver", "LimitingDriver", "MigratingDriver",
           "MirroringDriver", "DiskStats", "BlockStatsSource", "counter", "checked_iothreads"]


@runtime_checkable
class HypervisorDriver(Protocol):
    capabilities: HypervisorCapabilities

    @classmethod
    def from_config(cls, cfg: HostAgentConfig) -> HypervisorDriver: ...

    def list_vms(self) -> list[VmInfo]:
        """The VMs on this node that the driver can manage."""
        ...

    def attach(self, vm_id: str, serial: str, connection: AnyConnection, *, read_only: bool = False,
               qos: QoS | None = None, luks: SecretStr | None = None) -> DiskInfo:
        """Hot-plug ``connection`` into the running VM as a virtio disk; a disk already there with
        this serial is answered as it is. ``luks``: the volume is a LUKS container this passphrase opens
        (``capabilities.luks``; a driver without it raises ``IncorrectState``)."""
        ...

    def detach(self, vm_id: str, serial: str, *, force: bool = False, timeout: float = 10.0) -> None:
        """Unplug the disk and close its connection; an absent disk or VM is success. Raises
        ``DeviceBusy`` if the guest does not release it within ``timeout``; with ``force`` the
        connection is closed anyway (the guest's I/O on it fails)."""
        ...

    def list_disks(self, vm_id: str) -> list[DiskInfo]:
        """The disks VBS attached to the VM, for reconciliation."""
        ...

    def resize(self, vm_id: str, serial: str, connection: AnyConnection, size_bytes: int) -> DiskInfo:
        """Online resize (``capabilities.online_resize``): move the disk to ``connection`` (a
        refreshed connection of its grown volume) and make the guest see ``size_bytes``."""
        ...

    def ensure_copy(self, vm_id: str, serial: str, copy_id: str, target: AnyConnection) -> ItemStatus:
        """Point-in-time copy (``capabilities.point_in_time_copy``): copy the disk as it is when the
        copy starts into ``target`` while the guest keeps writing. Idempotent: answers progress,
        ``ready`` once complete."""
        ...

    def remove_copy(self, vm_id: str, serial: str, copy_id: str) -> None:
        """Cancel the copy if it runs and close the target; absent (or a gone VM) is success."""
        ...

    def close(self) -> None:
        """Release connections to VMs (the VMs are not touched)."""
        ...


@dataclass(frozen=True)
class DiskStats:
    """A VBS disk's I/O since the hypervisor opened it (QEMU's ``query-blockstats``): cumulative."""

    vm_id: str
    serial: str
    read_bytes: int
    write_bytes: int
    read_ops: int
    write_ops: int
    flush_ops: int
    read_time_ns: int
    write_time_ns: int
    flush_time_ns: int

    @classmethod
    def of(cls, vm_id: str, serial: str, stats: Mapping[str, Any], *, times: str) -> DiskStats:
        """The disk's counters (``counter``) in a hypervisor's answer, whose times end in ``times``: QEMU's
        ``query-blockstats`` says ``rd_total_time_ns``, libvirt's ``blockStatsFlags`` ``rd_total_times``."""
        return cls(vm_id=vm_id, serial=serial, read_bytes=counter(stats, "rd_bytes"),
                   write_bytes=counter(stats, "wr_bytes"), read_ops=counter(stats, "rd_operations"),
                   write_ops=counter(stats, "wr_operations"), flush_ops=counter(stats, "flush_operations"),
                   read_time_ns=counter(stats, f"rd{times}"), write_time_ns=counter(stats, f"wr{times}"),
                   flush_time_ns=counter(stats, f"flush{times}"))


def counter(values: Mapping[str, Any], key: str) -> int:
    """A cumulative counter from a hypervisor's answer: 0 where it is absent or not a count (QEMU and
    libvirt leave out what a device does not track)."""
    value = values.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def checked_iothreads(value: object, driver: str) -> bool:
    """A driver's ``iothreads`` option (each disk in an I/O thread of its own): a boolean, None: True."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise InvalidParameter(f"iothreads of the {driver} driver: true or false, not {value!r}")
    return value


@runtime_checkable
class BlockStatsSource(Protocol):
    """A hypervisor driver that can tell its VBS disks' I/O counters (the host agent's metrics)."""

    def block_stats(self) -> list[DiskStats]:
        """Every VBS disk of every VM it can ask now; a VM that is busy or does not answer is left out."""
        ...


@runtime_checkable
class LimitingDriver(Protocol):
    """A driver that changes an attached disk's limits live (``capabilities.qos``): ModifyVolume's new
    IOPS or throughput where the storage node does not enforce them."""

    def set_qos(self, vm_id: str, serial: str, qos: QoS | None) -> DiskInfo:
        """New limits (None: unlimited) for the disk, without detaching it."""
        ...


@runtime_checkable
class PausingDriver(Protocol):
    """A driver that pauses VMs (``capabilities.pause``): crash-consistent snapshot sets of several disks."""

    def pause(self, vm_id: str) -> bool:
        """Pause the VM once its in-flight I/O is drained; whether this call paused it (False: not running)."""
        ...

    def resume(self, vm_id: str) -> None:
        """Let it run again; a VM that is gone is success."""
        ...


@runtime_checkable
class SpaceWaitingDriver(Protocol):
    """A driver whose hypervisor pauses a VM when a write to a VBS disk finds its storage full (QEMU's
    ``werror=enospc``), and can let it retry (docs/operations.md "A full pool")."""

    def resume_paused_for_space(self) -> list[str]:
        """Resume every VM paused only because a write to a VBS disk found no space (the write is retried;
        a pool still full pauses it again at once); the VMs it resumed."""
        ...


@runtime_checkable
class MigratingDriver(Protocol):
    """A driver that live-migrates VMs (``capabilities.live_migration``): the destination is a VM the
    orchestrator started waiting for the migration; VBS plugs the disks into it in the source's PCI
    slots, then has the source stream its state. Every call answers the VM's side as it is now."""

    def attach(self, vm_id: str, serial: str, connection: AnyConnection, *, read_only: bool = False,
               qos: QoS | None = None, luks: SecretStr | None = None, pci_slot: str | None = None) -> DiskInfo:
        """``HypervisorDriver.attach``, the device placed in ``pci_slot`` where given."""
        ...

    def migration_info(self, vm_id: str) -> MigrationInfo: ...

    def listen_for_migration(self, vm_id: str) -> MigrationInfo:
        """Have the destination VM wait for the stream; its answer's ``uri`` says where."""
        ...

    def migrate(self, vm_id: str, target: StartMigration) -> MigrationInfo:
        """Start streaming the source VM to ``target`` (not again if it migrates, or migrated, already)."""
        ...

    def cancel_migration(self, vm_id: str, *, resume: bool) -> MigrationInfo:
        """Stop a migration that has not completed; with ``resume``, run a migrated source again."""
        ...


@runtime_checkable
class MirroringDriver(Protocol):
    """A driver that moves an attached disk onto another export while its guest runs (``capabilities.mirror``)."""

    def ensure_mirror(self, vm_id: str, serial: str, target: AnyConnection, *, pivot: bool) -> ItemStatus:
        """Start (or report) the mirror of the disk onto ``target``: ``copying`` with progress, ``ready``
        once in step. With ``pivot``, a ready mirror is completed: the disk reads and writes ``target``
        from then on, its old connection is closed, and the answer is ``ready`` (also when repeated)."""
        ...

    def remove_mirror(self, vm_id: str, serial: str) -> None:
        """Cancel a mirror that has not pivoted and close its target; nothing there is success."""
        ...
