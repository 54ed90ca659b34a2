"""Point-in-time copies of an attached disk: ``blockdev-backup`` (sync full) from its raw node into a
target protocol node, the job kept after it concludes so that a repeated call answers its outcome.
"""

from __future__ import annotations

import logging
from typing import Any

from vbs.connectors.nbd import NBD_RECONNECT_DELAY_S
from vbs.errors import IncorrectState, NotFound
from vbs.host.hypervisors import qemu_blockdev as bd
from vbs.host.hypervisors.qemu_blockdev import QemuHost, Vm
from vbs.host.hypervisors.qemu_ids import CopyIds, DiskIds, copy_ids_of
from vbs.qemu.qmp import QmpCommandError
from vbs.wire.connection import AnyConnection
from vbs.wire.storage import ItemStatus

__all__ = ["ensure", "status", "end", "end_all"]

log = logging.getLogger(__name__)


def ensure(vm: Vm, serial: str, ids: DiskIds, cids: CopyIds, target: AnyConnection, host: QemuHost) -> ItemStatus:
    ids = bd.settled(vm, ids)
    job = vm.jobs().get(cids.job)
    if job is not None:
        return status(vm, cids, job)
    nodes = vm.nodes()
    if cids.target.proto in nodes:
        # Made by a call that did not get to start the job: the copy's instant cannot be known.
        return ItemStatus(state="error", error="the copy's target is open but no copy job runs; "
                                               "remove the copy and take a new one")
    if ids.device not in vm.devices() or ids.raw not in nodes:
        raise NotFound(f"disk {serial} is not attached to VM {vm.vm_id}", code="InvalidAttachment.NotFound")
    if ids.dead in nodes:
        raise IncorrectState(f"disk {serial} of VM {vm.vm_id} was force-detached; it cannot be copied")
    if ids.mirror_job in vm.jobs():
        raise IncorrectState(f"disk {serial} of VM {vm.vm_id} is moving to another storage node; snapshot it "
                             "once it is there")
    if bd.is_luks(nodes, ids):
        # The copy would be of the plaintext the guest sees: an encrypted volume's snapshot is its node's.
        raise IncorrectState(f"disk {serial} of VM {vm.vm_id} is encrypted: its storage node snapshots it")
    vm.del_objects(cids.target.objects)  # leftovers of a crash before the target node was made
    with bd.undone_on_failure(vm, f"copy of {serial}") as undo:
        host.open_connection(vm, target, cids.target, False, undo)
        vm.cmd("blockdev-backup", {"job-id": cids.job, "device": ids.raw, "target": cids.target.proto,
                                   "sync": "full", "auto-dismiss": False, "filter-node-name": cids.filter})
    log.info("VM %s: point-in-time copy %s of disk %s started", vm.vm_id, cids.job, serial)
    job = vm.jobs().get(cids.job)
    return status(vm, cids, job) if job is not None else ItemStatus(state="copying")


def status(vm: Vm, cids: CopyIds, job: dict[str, Any]) -> ItemStatus:
    total = int(job.get("total-progress") or 0)
    done = int(job.get("current-progress") or 0)
    if job["status"] == "concluded":
        # The target is complete (or never will be): its connection is not needed any more.
        vm.del_nodes([cids.target.proto])
        vm.del_objects(cids.target.objects)
        if job.get("error"):
            return ItemStatus(state="error", size_bytes=total, error=f"the copy failed: {job['error']}"[:2000])
        return ItemStatus(state="ready", size_bytes=total, progress=100)
    if job["status"] == "aborting":
        return ItemStatus(state="error", size_bytes=total, error="the copy is being cancelled")
    return ItemStatus(state="copying", size_bytes=total, progress=min(99, done * 100 // total) if total else 0)


def end(vm: Vm, cids: CopyIds, qmp_timeout: float) -> bool:
    """Cancel the copy if it runs, close its target and dismiss its job; True if it was running."""
    job = vm.jobs().get(cids.job)
    running = job is not None and job["status"] != "concluded"
    if running:
        mark = vm.qmp.event_mark()
        try:
            vm.cmd("job-cancel", {"id": cids.job})
        except QmpCommandError as exc:  # it concluded meanwhile, or is being cancelled already
            log.debug("VM %s: job-cancel %s: %s", vm.vm_id, cids.job, exc.desc)
        # In-flight writes to a target whose server went wait for the NBD reconnect delay.
        bd.wait_concluded(vm, cids.job, mark, qmp_timeout + NBD_RECONNECT_DELAY_S)
    vm.del_nodes([cids.target.proto])
    vm.del_objects(cids.target.objects)
    if job is not None:
        try:
            vm.cmd("job-dismiss", {"id": cids.job})
        except QmpCommandError as exc:
            if exc.error_class != "GenericError" or "not found" not in exc.desc:
                raise
    return running


def end_all(vm: Vm, serial: str, ids: DiskIds, qmp_timeout: float) -> None:
    """End every copy of the disk: a detach must not fail because a snapshot is being taken."""
    for job_id in bd.copy_jobs(vm, ids):
        key = job_id.removeprefix(ids.copy_job_prefix)
        if end(vm, copy_ids_of(ids.copy_job_prefix, key), qmp_timeout):
            log.warning("VM %s: point-in-time copy %s of disk %s cancelled by its detach; that snapshot fails",
                        vm.vm_id, key, serial)
