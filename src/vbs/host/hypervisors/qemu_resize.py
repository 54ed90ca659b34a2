"""Online resize of an attached disk: a second protocol node on the refreshed export (the other
generation of ids), the raw node pointed at it with ``blockdev-reopen``, then ``block_resize`` of the
top node to exactly the new size, so that the guest sees it at once (see ``qemu``'s docstring).
"""

from __future__ import annotations

import logging

from vbs.connectors import connector_for
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound, VbsError
from vbs.host.hypervisors import qemu_blockdev as bd
from vbs.host.hypervisors.qemu_blockdev import QemuHost, Vm
from vbs.host.hypervisors.qemu_ids import DiskIds
from vbs.wire.connection import AnyConnection
from vbs.wire.host import DiskInfo

__all__ = ["resize"]

log = logging.getLogger(__name__)


def resize(vm: Vm, serial: str, ids: DiskIds, connection: AnyConnection, size_bytes: int, host: QemuHost
           ) -> DiskInfo:
    vm_id = vm.vm_id
    ids = bd.settled(vm, ids)
    disk = next((d for d in bd.our_disks(vm) if d.serial == serial), None)
    if disk is None:
        raise NotFound(f"disk {serial} is not attached to VM {vm_id}", code="InvalidAttachment.NotFound")
    nodes = vm.nodes()
    if ids.dead in nodes:
        raise IncorrectState(f"disk {serial} of VM {vm_id} was force-detached; it cannot be resized")
    if ids.raw not in nodes:
        raise DriverError(f"VM {vm_id}: disk {serial} has no node {ids.raw}: not a disk VBS attached")
    if bd.is_luks(nodes, ids):
        raise IncorrectState(f"disk {serial} of VM {vm_id} is encrypted: it grows while detached only")
    if disk.read_only:
        # Measured: QEMU refuses block_resize on a read-only node ("Image is read-only"), and only
        # a truncate tells the device. The guest would never see the new size.
        raise IncorrectState(
            f"disk {serial} of VM {vm_id} is attached read-only: QEMU cannot show the guest a new "
            "size; detach and attach it again"
        )
    if any(j["status"] != "concluded" for j in bd.copy_jobs(vm, ids).values()):
        raise IncorrectState(f"a point-in-time copy of disk {serial} of VM {vm_id} is running; resize it "
                             "once the snapshot is complete")
    top = ids.throttle if ids.throttle in nodes else ids.raw
    current = int(nodes[top]["image"]["virtual-size"])
    if size_bytes < current:
        raise InvalidParameter(f"disk {serial} of VM {vm_id} has {current} bytes; it cannot shrink to {size_bytes}")

    old, interrupted = bd.current_generation(vm, serial, ids)
    nodes = vm.nodes()
    new = bd.other_generation(ids, old)

    connector = connector_for(connection)
    if connector.qemu_node_opens(nodes[old.proto], connection):
        # A node that sees its volume grow, or an export that already has the size: the disk
        # was moved already. Only the notification may be missing (an interrupted resize).
        if connector.qemu_node_sees_growth or nodes[old.proto]["image"]["virtual-size"] >= size_bytes:
            if interrupted or current != size_bytes:
                vm.cmd("block_resize", {"node-name": top, "size": size_bytes})
            return disk.model_copy(update={"size_bytes": vm.node_size(ids.raw)})
        # Same export, but this node was opened before it grew (the export daemon restarted
        # under it, say): a fresh node on the same connection sees the new size.

    vm.del_objects(new.objects)  # leftovers of a crash before its node was made
    with bd.undone_on_failure(vm, f"resize of {serial}") as undo:
        host.open_connection(vm, connection, new, False, undo)
        # Every option of the raw node: blockdev-reopen resets the ones left out to defaults.
        vm.cmd("blockdev-reopen", {"options": [bd.format_options(ids, new.proto, False, False)]})
        undo.append(lambda: vm.cmd("blockdev-reopen", {"options": [bd.format_options(ids, old.proto, False,
                                                                                    False)]}))
        # Exactly the size: more than the export has fails ("Cannot grow"), and is refused here.
        vm.cmd("block_resize", {"node-name": top, "size": size_bytes})
    # The guest is on the new connection: the old one goes (a failure here leaves a node that
    # the next resize or the detach removes).
    try:
        vm.cmd("blockdev-del", {"node-name": old.proto})
        vm.del_objects(old.objects)
    except VbsError as exc:
        log.warning("VM %s: could not release the old connection of %s: %s", vm_id, serial, exc)
    log.info("VM %s: disk %s moved to its refreshed export, now %d bytes", vm_id, serial, size_bytes)
    return disk.model_copy(update={"size_bytes": vm.node_size(ids.raw)})
