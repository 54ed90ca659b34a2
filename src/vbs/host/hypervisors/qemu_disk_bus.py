"""The device a disk is in the guest: ``virtio-blk`` (the default) or ``virtio-scsi``.

With ``virtio-blk`` each disk is a ``virtio-blk-pci`` device of its own, a PCI hot-plug. On a ``pc``
(i440fx) machine that hot-plug is ACPI's: the guest evaluates the bus's methods and rescans bus 0, and
under TCG that grows with the devices already on it (docs/benchmarks-history.md, "Attach on pc with
many disks: the virtio-scsi bus").

With ``virtio-scsi`` (``[host_agent.options.qemu] disk_bus``) the first disk brings one
``virtio-scsi-pci`` controller, ``vbs-scsi`` (placed as any PCI device: ``qemu_slots.placement``), and
every disk is a ``scsi-hd`` on it: a new disk reaches the guest as a virtio-scsi event, with no PCI
hot-plug after the first. The guest names it ``sdX``; its serial is the volume's, in the disk's VPD
page 0x80 (``/dev/disk/by-id/scsi-0QEMU_QEMU_HARDDISK_<serial>`` under udev). The controller stays
when its last disk goes (removing it would be a PCI unplug on the detach path).

A VM with the controller is not live-migrated: the destination would need the controller in the same
slot and each disk at the same target and LUN, which the migration's per-disk slot does not carry yet.
A driver on ``virtio-scsi`` reports no ``live_migration`` capability, so the controller refuses
``migrate-instance`` before it starts; ``refuse_migration`` also stops a VM that got the controller
while the host was on ``virtio-scsi`` and is asked to migrate after it went back to ``virtio-blk``.
A disk attached with a ``pci_slot`` (a live migration's destination of a ``virtio-blk`` source) is a
``virtio-blk-pci`` device in that slot whatever this host's bus, so that the two VMs' devices match.

I/O threads (``[host_agent.options.qemu] iothreads``, on unless set to false): each ``virtio-blk`` disk gets an
``iothread`` object of its own (``DiskIds.iothread``, made before its device and deleted after its
nodes), and VBS's virtio-scsi controller one for all its disks (``vbs-scsi-io``, when the controller
is made). The disk's virtqueue and its block nodes, the storage client's socket among them, then run
in that thread instead of QEMU's main loop, which also serves the monitor, the other devices and
every other disk: 4 KiB random reads in a TCG guest 1.3-1.6x of the main loop's, sequential ones about
the same (docs/drivers.md, "I/O threads"). The thread is not part of the device's migration state, so a
live migration's destination may have one or not.
"""

from __future__ import annotations

from typing import Any

from vbs.errors import IncorrectState, InvalidParameter
from vbs.host.hypervisors import qemu_slots as slots
from vbs.host.hypervisors.qemu_blockdev import QemuHost, Undo, Vm
from vbs.host.hypervisors.qemu_ids import DiskIds

__all__ = ["DISK_BUSES", "SCSI_CONTROLLER", "SCSI_IOTHREAD", "checked_bus", "device",
           "refuse_migration"]

DISK_BUSES = ("virtio-blk", "virtio-scsi")
SCSI_CONTROLLER = "vbs-scsi"
SCSI_IOTHREAD = "vbs-scsi-io"


def checked_bus(value: object) -> str:
    """The ``disk_bus`` option: one of ``DISK_BUSES`` (None: ``virtio-blk``)."""
    if value is None:
        return DISK_BUSES[0]
    if not isinstance(value, str) or value not in DISK_BUSES:
        raise InvalidParameter(f"disk_bus of the qemu driver: one of {', '.join(DISK_BUSES)}, not {value!r}")
    return value


def device(vm: Vm, host: QemuHost, ids: DiskIds, top: str, serial: str, pci_slot: str | None,
           undo: Undo) -> dict[str, Any]:
    """The ``device_add`` arguments of a new disk on the host's bus (the controller, and with
    ``iothreads`` the disk's I/O thread, made first if need be; the thread is undone with the attach)."""
    if host.disk_bus == "virtio-blk" or pci_slot is not None:
        thread = {"iothread": _iothread(vm, ids.iothread, undo)} if host.iothreads else {}
        return {"driver": "virtio-blk-pci", "id": ids.device, "drive": top, "serial": serial, **thread,
                **slots.placement(vm.cmd, vm.vm_id, pci_slot, host.placements)}
    if SCSI_CONTROLLER not in vm.devices():
        controller = {"driver": "virtio-scsi-pci", "id": SCSI_CONTROLLER,
                      **slots.placement(vm.cmd, vm.vm_id, None, host.placements)}
        if host.iothreads:
            controller["iothread"] = _iothread(vm, SCSI_IOTHREAD, [])  # it stays with the controller
        vm.cmd("device_add", controller)
    return {"driver": "scsi-hd", "id": ids.device, "drive": top, "serial": serial, "bus": f"{SCSI_CONTROLLER}.0"}


def _iothread(vm: Vm, object_id: str, undo: Undo) -> str:
    """``object_id``, an ``iothread`` object of the VM (made unless a crashed attach left it)."""
    if object_id not in vm.objects():
        vm.cmd("object-add", {"qom-type": "iothread", "id": object_id})
        undo.append(lambda: vm.cmd("object-del", {"id": object_id}))
    return object_id


def refuse_migration(vm: Vm) -> None:
    """``IncorrectState`` for a VM with VBS's virtio-scsi controller (see the module's docstring)."""
    if SCSI_CONTROLLER in vm.devices():
        raise IncorrectState(
            f"VM {vm.vm_id} has VBS's virtio-scsi controller ({SCSI_CONTROLLER}): live migration is offered "
            "for VMs whose VBS disks are on virtio-blk (the controller goes when the VM restarts)",
            code="IncorrectInstanceState")
