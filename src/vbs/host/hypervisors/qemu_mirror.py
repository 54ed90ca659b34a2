"""Moving an attached disk onto another storage node's export while the guest runs: ``blockdev-mirror``
of the whole chain below the device onto a new one (the format node under its other name), then a pivot.
"""

from __future__ import annotations

import logging
from typing import Any

from vbs.connectors import connector_for
from vbs.connectors.nbd import NBD_RECONNECT_DELAY_S
from vbs.errors import IncorrectState, MirrorLost, NotFound
from vbs.host.hypervisors import qemu_blockdev as bd
from vbs.host.hypervisors.qemu_blockdev import QemuHost, Vm
from vbs.host.hypervisors.qemu_ids import DiskIds
from vbs.qemu.qmp import QmpCommandError
from vbs.wire.connection import AnyConnection
from vbs.wire.storage import ItemStatus

__all__ = ["ensure", "status", "end"]

log = logging.getLogger(__name__)


def ensure(vm: Vm, serial: str, ids: DiskIds, target: AnyConnection, pivot: bool, host: QemuHost) -> ItemStatus:
    job = vm.jobs().get(ids.mirror_job)
    if job is not None:
        return status(vm, serial, ids, target, job, pivot, host.qmp_timeout)
    ids = bd.settled(vm, ids)
    nodes = vm.nodes()
    if ids.device not in vm.devices() or ids.raw not in nodes:
        raise NotFound(f"disk {serial} is not attached to VM {vm.vm_id}", code="InvalidAttachment.NotFound")
    if ids.dead in nodes:
        raise IncorrectState(f"disk {serial} of VM {vm.vm_id} was force-detached; it cannot be moved")
    current, _ = bd.current_generation(vm, serial, ids)
    nodes = vm.nodes()
    if connector_for(target).qemu_node_opens(nodes[current.proto], target):
        return ItemStatus(state="ready", progress=100)  # switched already (its job dismissed)
    if bd.is_luks(nodes, ids):
        # QEMU mirrors from the disk's root node only: what it reads there is the guest's plaintext.
        raise IncorrectState(f"disk {serial} of VM {vm.vm_id} is encrypted: it moves while detached only")
    if pivot:
        raise MirrorLost(f"disk {serial} of VM {vm.vm_id} has no mirror to complete (cancelled, or the VM "
                         "restarted): it is still on its old storage")
    if any(j["status"] != "concluded" for j in bd.copy_jobs(vm, ids).values()):
        raise IncorrectState(f"a point-in-time copy of disk {serial} of VM {vm.vm_id} is running; move it once "
                             "the snapshot is complete")
    new, new_raw = bd.other_generation(ids, current), ids.raw2
    vm.del_objects(new.objects)  # leftovers of a crash before its node was made
    read_only = bool(nodes[ids.raw].get("ro"))
    with bd.undone_on_failure(vm, f"mirror of {serial}") as undo:
        host.open_connection(vm, target, new, read_only, undo)
        vm.cmd("blockdev-add", {**bd.format_options(ids, new.proto, read_only, False), "node-name": new_raw})
        undo.append(lambda: vm.cmd("blockdev-del", {"node-name": new_raw}))
        # QEMU mirrors from a root node only, and replaces a node only by one that shows the same
        # data: the whole chain below the device (or below the QoS throttle, which counts the
        # copy's reads too) moves, the format node under its other name.
        args: dict[str, Any] = {"job-id": ids.mirror_job, "target": new_raw, "sync": "full",
                                "auto-dismiss": False}
        if ids.throttle in nodes:
            args.update({"device": ids.throttle, "replaces": ids.raw})
        else:
            args["device"] = ids.raw
        vm.cmd("blockdev-mirror", args)
    log.info("VM %s: mirror of disk %s onto %s started", vm.vm_id, serial, new.proto)
    job = vm.jobs().get(ids.mirror_job)
    return status(vm, serial, ids, target, job, pivot, host.qmp_timeout) if job else ItemStatus(state="copying")


def status(vm: Vm, serial: str, ids: DiskIds, target: AnyConnection, job: dict[str, Any], pivot: bool,
           qmp_timeout: float) -> ItemStatus:
    total = int(job.get("total-progress") or 0)
    done = int(job.get("current-progress") or 0)
    if job["status"] == "ready" and pivot:
        mark = vm.qmp.event_mark()
        vm.cmd("job-complete", {"id": ids.mirror_job})
        bd.wait_concluded(vm, ids.mirror_job, mark, qmp_timeout + NBD_RECONNECT_DELAY_S)
        job = vm.jobs().get(ids.mirror_job) or {"status": "concluded"}
    if job["status"] == "concluded":
        vm.cmd("job-dismiss", {"id": ids.mirror_job})
        ids = bd.settled(vm, ids)  # closes the chain not in use
        current, _ = bd.current_generation(vm, serial, ids)
        if connector_for(target).qemu_node_opens(vm.nodes()[current.proto], target):
            log.info("VM %s: disk %s switched onto its new export", vm.vm_id, serial)
            return ItemStatus(state="ready", size_bytes=total, progress=100)
        return ItemStatus(state="error", size_bytes=total,
                          error=f"the mirror ended without switching: {job.get('error') or 'cancelled'}"[:2000])
    if job["status"] == "ready":
        return ItemStatus(state="ready", size_bytes=total, progress=100)
    if job["status"] == "aborting":
        return ItemStatus(state="error", size_bytes=total, error="the mirror is being cancelled")
    return ItemStatus(state="copying", size_bytes=total, progress=min(99, done * 100 // total) if total else 0)


def end(vm: Vm, serial: str, ids: DiskIds, qmp_timeout: float) -> None:
    """Cancel a mirror that has not switched (one in step ends without switching) and close its
    target, whichever chain the disk does not use; nothing there is success."""
    job = vm.jobs().get(ids.mirror_job)
    if job is not None:
        if job["status"] != "concluded":
            mark = vm.qmp.event_mark()
            try:
                vm.cmd("job-cancel", {"id": ids.mirror_job})
            except QmpCommandError as exc:  # it concluded meanwhile
                log.debug("VM %s: job-cancel %s: %s", vm.vm_id, ids.mirror_job, exc.desc)
            bd.wait_concluded(vm, ids.mirror_job, mark, qmp_timeout + NBD_RECONNECT_DELAY_S)
        vm.cmd("job-dismiss", {"id": ids.mirror_job})
        log.warning("VM %s: mirror of disk %s cancelled", vm.vm_id, serial)
    ids = bd.settled(vm, ids)
    nodes = vm.nodes()
    if ids.raw in nodes and all(g.proto in nodes for g in ids.generations):
        bd.current_generation(vm, serial, ids)
