"""Attach and detach: a disk's chain of block nodes (protocol -> format -> optional throttle) under a
virtio-blk-pci or scsi-hd device (qemu_disk_bus), and its removal; a forced detach cuts the I/O of a disk
the guest will not release.
"""

from __future__ import annotations

import logging

from pydantic import SecretStr

from vbs.connectors.nbd import NBD_RECONNECT_DELAY_S
from vbs.errors import DeviceBusy, IncorrectState
from vbs.host.hypervisors import qemu_blockdev as bd
from vbs.host.hypervisors import qemu_copies as copies
from vbs.host.hypervisors import qemu_disk_bus as disk_bus
from vbs.host.hypervisors import qemu_mirror as mirror
from vbs.host.hypervisors import qemu_qos as qos_
from vbs.host.hypervisors import qemu_slots as slots
from vbs.host.hypervisors.qemu_blockdev import QemuHost, Undo, Vm
from vbs.host.hypervisors.qemu_ids import DiskIds
from vbs.qemu.luks_nodes import LUKS_OPEN_TIMEOUT_S, qemu_secret
from vbs.qemu.qmp import QmpCommandError, QmpConnectionError
from vbs.wire.connection import AnyConnection
from vbs.wire.host import DiskInfo, QoS

__all__ = ["attach", "detach", "FORCE_GRACE_SECONDS"]

log = logging.getLogger(__name__)

# How long a forced detach lets the guest release the disk before cutting its I/O path.
FORCE_GRACE_SECONDS = 1.0


def attach(vm: Vm, serial: str, ids: DiskIds, connection: AnyConnection, read_only: bool, qos: QoS | None,
           luks: SecretStr | None, pci_slot: str | None, host: QemuHost) -> DiskInfo:
    if ids.device in vm.devices():
        if ids.dead in vm.nodes():
            raise IncorrectState(
                f"disk {serial} of VM {vm.vm_id} was force-detached and the guest has not released "
                "it yet; detach it again once the guest lets go, or restart the VM"
            )
        for disk in bd.our_disks(vm):
            if disk.serial == serial:
                return disk
    # Nodes without a device: a crashed attach or detach. Start from a clean slate.
    copies.end_all(vm, serial, ids, host.qmp_timeout)
    mirror.end(vm, serial, ids, host.qmp_timeout)
    bd.remove_nodes(vm, ids)
    with bd.undone_on_failure(vm, f"attach of {serial}") as undo:
        top = _build_chain(vm, connection, ids, read_only, qos, luks, undo, host)
        vm.cmd("device_add", disk_bus.device(vm, host, ids, top, serial, pci_slot, undo))
    return DiskInfo(serial=serial, read_only=read_only, size_bytes=vm.node_size(ids.raw),
                    pci_slot=slots.device_slot(vm.cmd, ids.device))


def _build_chain(vm: Vm, connection: AnyConnection, ids: DiskIds, read_only: bool, qos: QoS | None,
                 luks: SecretStr | None, undo: Undo, host: QemuHost) -> str:
    gen = ids.generations[0]
    host.open_connection(vm, connection, gen, read_only, undo)
    if luks is not None:
        # The guest's plaintext exists only in this process: the export and the network carry ciphertext.
        vm.cmd("object-add", qemu_secret(ids.luks_secret, luks))
        undo.append(lambda: vm.cmd("object-del", {"id": ids.luks_secret}))
    vm.cmd("blockdev-add", bd.format_options(ids, gen.proto, read_only, luks is not None),
           timeout=None if luks is None else max(host.qmp_timeout, LUKS_OPEN_TIMEOUT_S))
    undo.append(lambda: vm.cmd("blockdev-del", {"node-name": ids.raw}))
    return qos_.add_throttle(vm, ids, qos, read_only, undo)


def detach(vm: Vm, serial: str, ids: DiskIds, force: bool, timeout: float, host: QemuHost) -> None:
    qmp_timeout = host.qmp_timeout
    copies.end_all(vm, serial, ids, qmp_timeout)
    mirror.end(vm, serial, ids, qmp_timeout)
    ids = bd.settled(vm, ids)
    if ids.device in vm.devices():
        wait = min(timeout, FORCE_GRACE_SECONDS) if force else timeout
        where = slots.device_slot(vm.cmd, ids.device)
        unplugged = _unplug(vm, ids.device, wait)
        if where is not None:
            host.placements.touch(vm.vm_id, where)  # the guest may still have an eject request for it
        if not unplugged:
            if not force:
                raise DeviceBusy(f"guest of VM {vm.vm_id} did not release disk {serial} within {timeout:g}s",
                                 vm_id=vm.vm_id, serial=serial)
            _cut_io(vm, ids, qmp_timeout)
            log.warning(
                "VM %s: forced detach of %s: the guest still holds the device, its I/O now "
                "fails and the storage connection is closed",
                vm.vm_id,
                serial,
            )
            return
    bd.remove_nodes(vm, ids)


def _unplug(vm: Vm, device: str, wait: float) -> bool:
    """Ask the guest to release ``device``; True once QEMU reports it deleted within ``wait`` s."""
    mark = vm.qmp.event_mark()
    try:
        vm.cmd("device_del", {"id": device})
    except QmpCommandError as exc:
        if exc.error_class == "DeviceNotFound":
            return True
        # A repeated request while the guest has not answered the first one is not an error.
        if "already in the process of unplug" not in exc.desc and "pending" not in exc.desc:
            raise
    try:
        # QEMU also reports the virtio backend, with a path only; ours carries the id.
        vm.qmp.wait_event("DEVICE_DELETED", lambda e: e.get("data", {}).get("device") == device, since=mark,
                          timeout=wait)
        return True
    except QmpConnectionError:
        # No event in time, or it was missed across a reconnect: the VM's state is the truth.
        return device not in vm.devices()


def _cut_io(vm: Vm, ids: DiskIds, qmp_timeout: float) -> None:
    """Detach the storage from a disk the guest will not release.

    QEMU cannot remove a PCI device without the guest's consent, and a node under a device cannot be
    deleted. What it can do is swap the raw node's child for a node that fails every request
    (``blockdev-reopen``), after which the protocol node (the NBD/iSCSI session) can be deleted and the
    export removed safely. The device stays, reporting I/O errors, until the guest lets it go.
    """
    nodes = vm.nodes()
    added = ids.dead not in nodes
    if added:
        vm.cmd("blockdev-add", {
            "driver": "blkdebug",
            "node-name": ids.dead,
            "image": {"driver": "null-co", "size": vm.node_size(ids.raw)},
            # raw raises these events for every read and write it passes down.
            "inject-error": [{"event": "read_aio", "errno": 5}, {"event": "write_aio", "errno": 5}],
        })
    # Always (re)do the swap: an earlier attempt may have timed out after adding the dead node. The
    # reopen drains in-flight requests, which wait up to the NBD reconnect delay if the export is gone.
    ro = bool(nodes[ids.raw].get("ro")) if ids.raw in nodes else False
    try:
        vm.cmd("blockdev-reopen", {"options": [bd.format_options(ids, ids.dead, ro, bd.is_luks(nodes, ids))]},
               timeout=max(qmp_timeout, NBD_RECONNECT_DELAY_S + 5))
    except QmpCommandError as exc:
        if "Error flushing" in exc.desc:
            # The reopen flushes the old connection first, and its storage is already gone (export
            # removed, node down): every request on it fails by now, which is all force promises.
            # It stays until the guest lets go; the caller then removes the export for good, so the
            # client cannot reconnect to it.
            log.warning("VM %s: the storage of %s is already unreachable: its I/O fails; leaving the dead "
                        "connection until the guest releases the device", vm.vm_id, ids.raw)
            return
        if added:
            vm.cmd("blockdev-del", {"node-name": ids.dead})
        raise
    # After a resize the connection may be either generation.
    vm.del_nodes(gen.proto for gen in ids.generations)
    vm.del_objects(obj for gen in ids.generations for obj in gen.objects)
