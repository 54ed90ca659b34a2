"""The host agent's HTTP API: hot-plug a connection into a VM and unplug it, keyed by the disk serial.

Like the storage agent it keeps no records: attaching an attached serial or detaching an absent one
succeeds, so the controller may repeat any call after a crash. Every body and answer is a
``vbs.wire`` model; errors keep their class across the wire (``DeviceBusy`` arrives as itself).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

from fastapi import APIRouter, FastAPI, Query
from starlette.responses import Response

from vbs import ids
from vbs.errors import IncorrectState, matching
from vbs.host.hypervisors.base import HypervisorDriver, LimitingDriver, MigratingDriver, MirroringDriver
from vbs.host.local_pools import CopyCredentials, LocalPools
from vbs.host.metrics import host_registry
from vbs.host.pauses import Pauses
from vbs.net.agent_app import agent_app
from vbs.net.web import Scope
from vbs.pools.routes import add_volume_routes
from vbs.wire.connection import AnyConnection, FileConnection, LocalConnection
from vbs.wire.host import (
    SERIAL_RE,
    VM_ID_RE,
    AttachDisk,
    CopyDisk,
    DiskInfo,
    DiskList,
    DiskQoS,
    FillVolume,
    MigrationInfo,
    MirrorDisk,
    PauseAnswer,
    PauseVm,
    ResizeDisk,
    StartMigration,
    VmList,
)
from vbs.wire.storage import ItemStatus, PoolList, Removed


def _serial(serial: str) -> str:
    return matching(SERIAL_RE, serial, "disk serial", shown=40, hint="expecting a volume id without its dash")


def _vm(vm_id: str) -> str:
    return matching(VM_ID_RE, vm_id, "VM id", shown=70)


class _Able:
    """What the node's hypervisor driver can do: the capabilities it declares (``capabilities``) are its
    contract, so a call it cannot do is refused by them alone, saying so."""

    def __init__(self, driver: HypervisorDriver, node_name: str) -> None:
        self.driver = driver
        self.caps = driver.capabilities
        self.node_name = node_name

    def check(self, what: str, can: bool) -> None:
        if not can:
            raise IncorrectState(f"the hypervisor driver of {self.node_name} cannot {what}")

    def migrating(self) -> MigratingDriver:
        self.check("live-migrate a VM", self.caps.live_migration)
        return cast(MigratingDriver, self.driver)  # a driver declaring live_migration fulfils MigratingDriver

    def mirroring(self) -> MirroringDriver:
        self.check("move a disk to another storage node", self.caps.mirror)
        return cast(MirroringDriver, self.driver)  # a driver declaring mirror fulfils MirroringDriver


def create_app(driver: HypervisorDriver, auth: Callable[[Scope], Response | None],
               node_name: str, pauses: Pauses | None = None, local: LocalPools | None = None) -> FastAPI:
    app = agent_app("VBS host agent", auth, node_name, host_registry(driver))
    router = APIRouter(prefix="/v1")
    able = _Able(driver, node_name)
    # No local pool: every local call answers that the pool does not exist, before any copy could start.
    local_pools = local or LocalPools({}, CopyCredentials(Path("/nonexistent")))
    add_disk_routes(router, able, local_pools)
    add_pause_routes(router, able, pauses)
    add_migration_routes(router, able)
    add_copy_routes(router, able)
    add_local_pool_routes(router, local_pools)
    add_mirror_routes(router, able)
    app.include_router(router)
    return app


def add_disk_routes(router: APIRouter, able: _Able, local_pools: LocalPools) -> None:
    """The VMs of the node and their disks: list, attach, detach, resize, new limits."""
    driver, caps = able.driver, able.caps

    @router.get("/vms")
    def list_vms() -> VmList:
        return VmList(vms=driver.list_vms())

    def opened(connection: AnyConnection | LocalConnection) -> AnyConnection:
        """What the hypervisor opens: a local volume is its pool's own file on this host."""
        if not isinstance(connection, LocalConnection):
            return connection
        return FileConnection(path=str(local_pools.path_of(connection.pool, connection.volume_id)))

    @router.put("/vms/{vm_id}/disks/{serial}")
    def attach(vm_id: str, serial: str, body: AttachDisk) -> DiskInfo:
        connection = opened(body.connection)
        able.check(f"open {body.connection.protocol} connections", connection.protocol in caps.protocols)
        if body.qos is not None:
            able.check("enforce QoS limits", caps.qos)
        if body.luks_passphrase is not None:
            able.check("open encrypted (LUKS) volumes", caps.luks)
        if body.pci_slot is not None:
            return able.migrating().attach(_vm(vm_id), _serial(serial), connection, read_only=body.read_only,
                                           qos=body.qos, luks=body.luks_passphrase, pci_slot=body.pci_slot)
        return driver.attach(_vm(vm_id), _serial(serial), connection, read_only=body.read_only, qos=body.qos,
                             luks=body.luks_passphrase)

    @router.delete("/vms/{vm_id}/disks/{serial}")
    def detach(vm_id: str, serial: str, force: bool = False,
               timeout: float = Query(10.0, gt=0, le=600)) -> Removed:
        driver.detach(_vm(vm_id), _serial(serial), force=force, timeout=timeout)
        return Removed()

    @router.put("/vms/{vm_id}/disks/{serial}/size")
    def resize(vm_id: str, serial: str, body: ResizeDisk) -> DiskInfo:
        """Move the disk onto a refreshed connection of its (grown) volume and show the guest the new size."""
        able.check("resize a disk online", caps.online_resize)
        return driver.resize(_vm(vm_id), _serial(serial), body.connection, body.size_bytes)

    @router.put("/vms/{vm_id}/disks/{serial}/qos")
    def set_qos(vm_id: str, serial: str, body: DiskQoS) -> DiskInfo:
        """New limits for an attached disk, live (ModifyVolume where the storage node cannot limit it)."""
        able.check("change a disk's limits", caps.qos)
        limiting = cast(LimitingDriver, driver)  # a driver declaring qos fulfils LimitingDriver
        return limiting.set_qos(_vm(vm_id), _serial(serial), body.qos)

    @router.get("/vms/{vm_id}/disks")
    def list_disks(vm_id: str) -> DiskList:
        return DiskList(disks=driver.list_disks(_vm(vm_id)))


def add_pause_routes(router: APIRouter, able: _Able, pauses: Pauses | None) -> None:
    """Pausing a VM for at most a few seconds: one instant for every disk's snapshot."""

    @router.put("/vms/{vm_id}/pause")
    def pause(vm_id: str, body: PauseVm) -> PauseAnswer:
        """Pause the VM (its I/O drained) for at most ``hold_s``: one instant for every disk's snapshot."""
        able.check("pause a VM", pauses is not None and able.caps.pause)
        assert pauses is not None
        return PauseAnswer(paused_by_vbs=pauses.pause(_vm(vm_id), body.hold_s))

    @router.delete("/vms/{vm_id}/pause")
    def resume(vm_id: str) -> Removed:
        if pauses is not None:
            pauses.resume(_vm(vm_id))
        return Removed()


def add_migration_routes(router: APIRouter, able: _Able) -> None:
    """Live migration of a VM, each side's call answering its side as it is now."""

    @router.get("/vms/{vm_id}/migration")
    def migration_info(vm_id: str) -> MigrationInfo:
        return able.migrating().migration_info(_vm(vm_id))

    @router.put("/vms/{vm_id}/migration/incoming")
    def listen_for_migration(vm_id: str) -> MigrationInfo:
        """A destination VM (``inmigrate``) waits for the stream; the answer's ``uri`` says where."""
        return able.migrating().listen_for_migration(_vm(vm_id))

    @router.put("/vms/{vm_id}/migration")
    def migrate(vm_id: str, body: StartMigration) -> MigrationInfo:
        """Stream the source VM to a destination's ``uri``; answers its progress."""
        return able.migrating().migrate(_vm(vm_id), body)

    @router.delete("/vms/{vm_id}/migration")
    def cancel_migration(vm_id: str, resume: bool = False) -> MigrationInfo:
        return able.migrating().cancel_migration(_vm(vm_id), resume=resume)


def add_copy_routes(router: APIRouter, able: _Able) -> None:
    """Point-in-time copies of an attached disk into a snapshot target."""
    driver = able.driver

    @router.put("/vms/{vm_id}/disks/{serial}/copies/{copy_id}")
    def ensure_copy(vm_id: str, serial: str, copy_id: str, body: CopyDisk) -> ItemStatus:
        """Copy the disk at one instant into a snapshot target; answers progress, ready when done."""
        able.check("copy a disk at one instant", able.caps.point_in_time_copy)
        return driver.ensure_copy(_vm(vm_id), _serial(serial), ids.check("snapshot", copy_id), body.target)

    @router.delete("/vms/{vm_id}/disks/{serial}/copies/{copy_id}")
    def remove_copy(vm_id: str, serial: str, copy_id: str) -> Removed:
        driver.remove_copy(_vm(vm_id), _serial(serial), ids.check("snapshot", copy_id))
        return Removed()


def add_local_pool_routes(router: APIRouter, local_pools: LocalPools) -> None:
    """The node's local pools (semi-shared storage): their volumes, and copies to and from shared storage."""

    @router.get("/local-pools")
    def list_local_pools() -> PoolList:
        return PoolList(pools=[b.pool_info() for b in local_pools.backends.values()])

    add_volume_routes(router, local_pools.pool, prefix="/local-pools")

    @router.put("/local-pools/{pool_name}/volumes/{volume_id}/fill")
    def fill_volume(pool_name: str, volume_id: str, body: FillVolume) -> ItemStatus:
        """Fill the new local volume from a shared snapshot's export; answers progress, ready when done."""
        return local_pools.fill(pool_name, ids.check("volume", volume_id), body.source)

    @router.delete("/local-pools/{pool_name}/volumes/{volume_id}/fill")
    def forget_fill(pool_name: str, volume_id: str) -> Removed:
        local_pools.remove_copy(ids.check("volume", volume_id))
        return Removed()

    @router.put("/local-pools/{pool_name}/volumes/{volume_id}/copies/{copy_id}")
    def copy_out(pool_name: str, volume_id: str, copy_id: str, body: CopyDisk) -> ItemStatus:
        """Copy the local volume (attached to no VM) into a shared volume's export, for a snapshot."""
        return local_pools.copy_out(pool_name, ids.check("volume", volume_id), ids.check("snapshot", copy_id),
                                    body.target)

    @router.delete("/local-pools/{pool_name}/volumes/{volume_id}/copies/{copy_id}")
    def forget_copy_out(pool_name: str, volume_id: str, copy_id: str) -> Removed:
        local_pools.remove_copy(ids.check("snapshot", copy_id))
        return Removed()


def add_mirror_routes(router: APIRouter, able: _Able) -> None:
    """Moving an attached disk onto another storage node's export while its guest runs."""

    @router.put("/vms/{vm_id}/disks/{serial}/mirror")
    def ensure_mirror(vm_id: str, serial: str, body: MirrorDisk) -> ItemStatus:
        """Mirror the disk onto another export while the guest runs; with ``pivot``, switch it there."""
        able.check(f"open {body.target.protocol} connections", body.target.protocol in able.caps.protocols)
        return able.mirroring().ensure_mirror(_vm(vm_id), _serial(serial), body.target, pivot=body.pivot)

    @router.delete("/vms/{vm_id}/disks/{serial}/mirror")
    def remove_mirror(vm_id: str, serial: str) -> Removed:
        vm, disk = _vm(vm_id), _serial(serial)
        if able.caps.mirror:
            able.mirroring().remove_mirror(vm, disk)
        return Removed()  # a driver that cannot mirror has none to remove
