"""A VBS disk's block nodes in one VM: the monitor as a driver call uses it, and what attach, resize,
copies and mirrors share (the format node's options, which generation of connection is in use, undo).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vbs.connectors import QemuIds, connector_for
from vbs.connectors.base import open_in_qemu
from vbs.errors import DriverError, VbsError
from vbs.host.hypervisors import qemu_slots as slots
from vbs.host.hypervisors.qemu_ids import DiskIds, disk_ids
from vbs.qemu.luks_nodes import qemu_luks_node
from vbs.qemu.qmp import QmpClient, QmpCommandError, QmpConnectionError
from vbs.wire.connection import AnyConnection
from vbs.wire.host import DiskInfo

__all__ = ["Vm", "QemuHost", "Undo", "DEVICE_ID_RE", "our_device", "our_disks", "copy_jobs", "wait_concluded",
           "current_generation", "settled", "other_generation", "format_options", "is_luks", "remove_nodes",
           "undone_on_failure"]

log = logging.getLogger(__name__)

DEVICE_ID_RE = re.compile(r"^vbs-(vol[0-9a-f]{17})-dev$")

Undo = list[Callable[[], object]]


class Vm:
    """One VM's monitor as a driver call uses it, under the driver's lock for that VM."""

    def __init__(self, vm_id: str, qmp: QmpClient) -> None:
        self.vm_id = vm_id
        self.qmp = qmp

    def cmd(self, command: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        return self.qmp.execute(command, args, timeout=timeout)

    def devices(self) -> set[str]:
        children = self.cmd("qom-list", {"path": "/machine/peripheral"})
        return {c["name"] for c in children if c["type"].startswith("child<")}

    def objects(self) -> set[str]:
        children = self.cmd("qom-list", {"path": "/objects"})
        return {c["name"] for c in children if c["type"].startswith("child<")}

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node-name"]: n for n in self.cmd("query-named-block-nodes", {"flat": True})}

    def jobs(self) -> dict[str, dict[str, Any]]:
        return {j["id"]: j for j in self.cmd("query-jobs")}

    def node_size(self, node: str) -> int:
        found = self.nodes().get(node)
        if found is None:
            raise DriverError(f"VM {self.vm_id}: block node {node} vanished")
        return int(found["image"]["virtual-size"])

    def del_nodes(self, names: Iterable[str]) -> None:
        """Delete those of ``names`` that exist, in order (each may hold the next)."""
        existing = self.nodes()
        for node in names:
            if node in existing:
                self.cmd("blockdev-del", {"node-name": node})

    def del_objects(self, ids: Iterable[str]) -> None:
        existing = self.objects()
        for obj in ids:
            if obj in existing:
                self.cmd("object-del", {"id": obj})


@dataclass(frozen=True)
class QemuHost:
    """What a driver call needs of this host besides the VM: where QEMU reads key files, the host's
    X.509 client credentials, how long a QMP command may take, the bus its disks go on
    (``qemu_disk_bus``), and which slots of its VMs were touched when (the driver's, kept across calls)."""

    secrets_dir: Path
    x509_dir: Path | None
    qmp_timeout: float
    disk_bus: str = "virtio-blk"
    iothreads: bool = True  # as the driver's option (base.checked_iothreads)
    placements: slots.Placements = field(default_factory=slots.Placements)

    def open_connection(self, vm: Vm, connection: AnyConnection, ids: QemuIds, read_only: bool, undo: Undo) -> None:
        """Make the connection's objects and protocol node ``ids.proto``, as its connector says."""
        open_in_qemu(vm.cmd, connector_for(connection).qemu_blockdev(connection, ids), ids.proto,
                     read_only=read_only, secrets_dir=self.secrets_dir, x509_dir=self.x509_dir, undo=undo)


def our_device(qdev: object) -> re.Match[str] | None:
    """The VBS device (its id's match: group 1 is the serial) that the ``qdev`` of a ``query-block`` or
    ``query-blockstats`` entry names. QEMU names the device holding the backend by its id where it has
    one (a scsi-hd), else by its QOM path (a virtio-blk-pci's backend is its unnamed child:
    ``/machine/peripheral/<id>/virtio-backend``)."""
    parts = str(qdev).split("/")
    device = parts[3] if len(parts) > 3 and parts[:3] == ["", "machine", "peripheral"] else str(qdev)
    return DEVICE_ID_RE.fullmatch(device)


def our_disks(vm: Vm) -> list[DiskInfo]:
    """The disks VBS attached: devices with our ids and a medium, read from their raw nodes."""
    inserted: dict[str, dict[str, Any]] = {}
    for blk in vm.cmd("query-block"):
        device = our_device(blk.get("qdev", ""))
        if device is not None and "inserted" in blk:
            inserted[device.group(0)] = blk["inserted"]
    nodes = vm.nodes()
    disks = []
    for dev in sorted(vm.devices()):
        match = DEVICE_ID_RE.fullmatch(dev)
        if match is None or dev not in inserted:
            continue
        # The raw node, not the device's top node: a copy's filter may sit on top of it.
        ids = disk_ids(match.group(1))
        raw = nodes.get(ids.raw) or nodes.get(ids.raw2)
        node = raw if raw is not None else inserted[dev]
        size = raw["image"].get("virtual-size") if raw is not None else None
        # A forced detach the guest has not acknowledged leaves the device on the always-failing node.
        disks.append(DiskInfo(serial=match.group(1), read_only=bool(node.get("ro")),
                              size_bytes=int(size) if size is not None else None, connected=ids.dead not in nodes,
                              pci_slot=slots.device_slot(vm.cmd, dev)))
    return disks


def copy_jobs(vm: Vm, ids: DiskIds) -> dict[str, dict[str, Any]]:
    return {job_id: job for job_id, job in vm.jobs().items() if job_id.startswith(ids.copy_job_prefix)}


def wait_concluded(vm: Vm, job_id: str, mark: int, limit: float) -> None:
    deadline = time.monotonic() + limit
    while True:
        job = vm.jobs().get(job_id)
        if job is None or job["status"] == "concluded":
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DriverError(f"VM {vm.vm_id}: copy job {job_id} did not stop within {limit:g}s")
        try:
            vm.qmp.wait_event("JOB_STATUS_CHANGE", lambda e: e.get("data", {}).get("id") == job_id, since=mark,
                              timeout=min(remaining, 1.0))
        except QmpConnectionError:
            pass  # no news within a second: look again
        mark = vm.qmp.event_mark()


def current_generation(vm: Vm, serial: str, ids: DiskIds) -> tuple[QemuIds, bool]:
    """The generation of protocol node the raw node reads from, and whether a second one was left
    (an interrupted resize or mirror): blockdev-del refuses the one in use, so trying both keeps it."""
    nodes = vm.nodes()
    present = [g for g in ids.generations if g.proto in nodes]
    interrupted = len(present) == 2
    if interrupted:
        for gen in present:
            try:
                vm.cmd("blockdev-del", {"node-name": gen.proto})
            except QmpCommandError as exc:
                log.debug("VM %s: %s is in use: %s", vm.vm_id, gen.proto, exc.desc)
        nodes = vm.nodes()
        vm.del_objects(obj for g in present if g.proto not in nodes for obj in g.objects)
        present = [g for g in ids.generations if g.proto in nodes]
    if len(present) != 1:
        raise DriverError(f"VM {vm.vm_id}: disk {serial} has {len(present)} protocol nodes, expected one")
    return present[0], interrupted


def settled(vm: Vm, ids: DiskIds) -> DiskIds:
    """``ids`` with ``raw`` naming the format node the disk uses. Both exist only while a mirror runs
    (then the original is in use) or after one that switched or stopped (then the one not in use is
    deleted here: blockdev-del refuses the other)."""
    nodes = vm.nodes()
    if ids.raw2 not in nodes:
        return ids
    swapped = replace(ids, raw=ids.raw2, raw2=ids.raw)
    if ids.raw not in nodes:
        return swapped
    if ids.mirror_job in vm.jobs():
        return ids
    for name in (ids.raw2, ids.raw):
        try:
            vm.cmd("blockdev-del", {"node-name": name})
            return ids if name == ids.raw2 else swapped
        except QmpCommandError as exc:
            log.debug("VM %s: %s is in use: %s", vm.vm_id, name, exc.desc)
    raise DriverError(f"VM {vm.vm_id}: both format nodes of {ids.device} are in use")


def other_generation(ids: DiskIds, gen: QemuIds) -> QemuIds:
    return ids.generations[1] if gen == ids.generations[0] else ids.generations[0]


def format_options(ids: DiskIds, file: str, read_only: bool, luks: bool) -> dict[str, Any]:
    """The format node's options (``raw``, or ``luks`` for an encrypted volume): attach adds it with these,
    every blockdev-reopen repeats them all."""
    if luks:
        return qemu_luks_node(ids.raw, file, ids.luks_secret, read_only)
    return {"driver": "raw", "node-name": ids.raw, "file": file, "read-only": read_only, "discard": "unmap"}


def is_luks(nodes: dict[str, dict[str, Any]], ids: DiskIds) -> bool:
    return ids.raw in nodes and nodes[ids.raw].get("drv") == "luks"


def remove_nodes(vm: Vm, ids: DiskIds) -> None:
    """Delete this disk's nodes (top-down, as each holds the next) and objects, whichever exist."""
    vm.del_nodes(ids.nodes_top_down)
    vm.del_objects(ids.objects)


@contextmanager
def undone_on_failure(vm: Vm, what: str) -> Iterator[Undo]:
    """Collects undo steps; if the block fails they run in reverse and the error is re-raised (as a
    ``DriverError`` unless it is a VBS error already)."""
    undo: Undo = []
    try:
        yield undo
    except Exception as exc:
        for step in reversed(undo):
            try:
                step()
            except VbsError as err:
                log.warning("VM %s: undo after failed %s: %s", vm.vm_id, what, err)
        if isinstance(exc, VbsError):
            raise
        raise DriverError(f"VM {vm.vm_id}: {what} failed: {exc}") from exc
