"""QoS of an attached disk: a throttle node over its raw node, in a throttle group whose limits change live.

A disk attached without limits has no throttle node; only attaching it again gives it one.
"""

from __future__ import annotations

from vbs.errors import IncorrectState, NotFound
from vbs.host.hypervisors.qemu_blockdev import Undo, Vm, our_disks
from vbs.host.hypervisors.qemu_ids import DiskIds
from vbs.wire.host import DiskInfo, QoS
from vbs.wire.qos import throttle_limits

__all__ = ["add_throttle", "set_limits"]


def add_throttle(vm: Vm, ids: DiskIds, qos: QoS | None, read_only: bool, undo: Undo) -> str:
    """The disk's top node: ``ids.raw`` when ``qos`` limits nothing, else a throttle node made over it."""
    if qos is None or not qos.limits_anything():
        return ids.raw
    vm.cmd("object-add", {"qom-type": "throttle-group", "id": ids.throttle_group, "limits": throttle_limits(qos)})
    undo.append(lambda: vm.cmd("object-del", {"id": ids.throttle_group}))
    vm.cmd("blockdev-add", {"driver": "throttle", "node-name": ids.throttle, "throttle-group": ids.throttle_group,
                            "file": ids.raw, "read-only": read_only})
    undo.append(lambda: vm.cmd("blockdev-del", {"node-name": ids.throttle}))
    return ids.throttle


def set_limits(vm: Vm, serial: str, ids: DiskIds, qos: QoS | None) -> DiskInfo:
    """New limits for the disk's throttle group (its queued I/O stays queued)."""
    vm_id = vm.vm_id
    disk = next((d for d in our_disks(vm) if d.serial == serial), None)
    if disk is None:
        raise NotFound(f"disk {serial} is not attached to VM {vm_id}", code="InvalidAttachment.NotFound")
    if ids.throttle not in vm.nodes():
        if qos is None or not qos.limits_anything():
            return disk  # unlimited already
        raise IncorrectState(f"disk {serial} of VM {vm_id} was attached without limits; detach and "
                             "attach it again to limit it")
    vm.cmd("qom-set", {"path": f"/objects/{ids.throttle_group}", "property": "limits",
                       "value": throttle_limits(qos)})
    return disk
