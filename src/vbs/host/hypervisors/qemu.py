"""The QEMU hypervisor driver: VMs are QMP sockets ``<vm_id>.qmp`` in one directory.

A disk is a chain of block nodes (protocol -> raw -> optional throttle) under a virtio-blk-pci device
(or a scsi-hd on VBS's virtio-scsi controller: ``qemu_disk_bus``), all ids derived from the virtio
serial, so attach, detach and crash cleanup read the VM's own state.
The protocol node and the objects it needs come from the connection's host connector
(``vbs.connectors``). The driver keeps one persistent QMP connection per VM (``vbs.qemu.qmp``):
QEMU serves one client per monitor, so tests talk to a second monitor of their own.

Online resize (measured on QEMU 7.2): the NBD and iSCSI block drivers cannot grow a node (their
export's size is fixed, and ``block_resize`` answers "Cannot grow NBD nodes"), and reopening a node
does not re-read the size. So ``resize`` opens a second protocol node on the refreshed export (the
other of two alternating generations of ids), points the raw node at it with ``blockdev-reopen``,
then ``block_resize``s the top node to exactly the new node's size. That is a no-op for the
protocol driver, but the truncate path notifies the device, so virtio-blk raises a config change
(scsi-hd a capacity change the guest reads) and the guest sees the new capacity at once. The old
protocol node is deleted last.

Point-in-time copy: ``blockdev-backup`` (sync full) from the disk's raw node into a target protocol
node. QEMU inserts a copy-before-write filter above the raw node, so the target receives the disk as
it was when the job started while the guest keeps writing. The job is made with auto-dismiss off:
once concluded it stays in ``query-jobs`` with its outcome (the target connection is closed then),
so a repeated ``ensure_copy`` answers that outcome instead of copying a later instant; ``remove_copy``
dismisses it.
"""


from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

from pydantic import SecretStr

from vbs.config import HostAgentConfig
from vbs.connectors import CONNECTORS
from vbs.connectors.tunnels import IscsiTunnels
from vbs.errors import InvalidParameter, VbsError
from vbs.host.hypervisors import qemu_copies as copies
from vbs.host.hypervisors import qemu_disk_bus as disk_bus_
from vbs.host.hypervisors import qemu_migration as migration
from vbs.host.hypervisors import qemu_mirror as mirror
from vbs.host.hypervisors import qemu_plug as plug
from vbs.host.hypervisors import qemu_qos as qos_
from vbs.host.hypervisors import qemu_slots as slots
from vbs.host.hypervisors.base import DiskStats, checked_iothreads
from vbs.host.hypervisors.qemu_blockdev import QemuHost, Vm, our_device, our_disks
from vbs.host.hypervisors.qemu_ids import copy_ids, disk_ids
from vbs.host.hypervisors.qemu_monitors import QemuMonitors
from vbs.host.hypervisors.qemu_resize import resize
from vbs.qemu.qmp import QmpGone
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.wire.connection import AnyConnection
from vbs.wire.host import DiskInfo, HypervisorCapabilities, MigrationInfo, QoS, StartMigration, VmInfo
from vbs.wire.storage import ItemStatus

__all__ = ["QemuDriver"]

log = logging.getLogger(__name__)


class QemuDriver:
    """Hot-plug volumes into QEMU VMs found as ``<vm_id>.qmp`` sockets in ``vm_dir``.

    Synchronous and thread-safe: call it from plain threads (``asyncio.to_thread`` from async code).
    Calls on one VM are serialised; each VM's monitor is held by one persistent connection, made on
    first use and dropped when the VM is gone.
    """

    capabilities = HypervisorCapabilities.model_validate(
        {"protocols": sorted(CONNECTORS), "online_resize": True, "qos": True, "point_in_time_copy": True,
         "luks": True, "pause": True, "live_migration": True, "mirror": True}
    )

    def __init__(self, vm_dir: Path, qmp_timeout: float = 10.0, secrets_dir: Path | None = None,
                 x509: X509Files | None = None, protocols: Collection[str] | None = None,
                 migration_address: str = "127.0.0.1", migration_mibps: int | None = None,
                 disk_bus: str | None = None, iothreads: bool | None = None) -> None:
        if protocols is not None:
            # Fewer than it has connectors for: a QEMU built without a block driver (rbd comes with
            # Debian's qemu-block-extra), or an operator who wants volumes served through exports.
            unknown = sorted(set(protocols) - set(CONNECTORS))
            if unknown or not protocols:
                raise InvalidParameter(f"protocols of the qemu driver: some of {', '.join(sorted(CONNECTORS))}, "
                                       f"not {', '.join(unknown) or 'none'}")
            self.capabilities = self.capabilities.model_copy(update={"protocols": sorted(set(protocols))})
        self.vm_dir = Path(vm_dir)
        # Where a destination VM of this host listens for a live migration's stream.
        self.migration_address = migration_address
        # The live migration stream's cap in MiB/s (None: QEMU's own default, 128 MiB/s).
        self.migration_mibps = migration.checked_mibps(migration_mibps)
        # virtio-blk-pci devices, or scsi-hd on one virtio-scsi controller a VM (qemu_disk_bus); the latter's
        # VMs are not live-migrated, so the host says so and the controller refuses a migration up front.
        self.disk_bus = disk_bus_.checked_bus(disk_bus)
        if self.disk_bus != "virtio-blk":
            self.capabilities = self.capabilities.model_copy(update={"live_migration": False})
        # An I/O thread for each disk (for the virtio-scsi controller) instead of QEMU's main loop; on
        # unless turned off.
        self.iothreads = checked_iothreads(iothreads, "qemu")
        self.qmp_timeout = qmp_timeout
        # TLS-PSK keys must be in a file for QEMU; it reads a client key once, when the object is made.
        self.secrets_dir = Path(secrets_dir) if secrets_dir else self.vm_dir / ".vbs-secrets"
        # This host's certificate as QEMU's NBD client presents it to X.509 export servers.
        self.x509_dir = qemu_x509_dir(x509, self.secrets_dir / "x509", "client") if x509 else None
        # The same certificate as a live migration's destination presents it (it serves both ways).
        self.x509_server_dir = qemu_x509_dir(x509, self.secrets_dir / "x509-server", "server") if x509 else None
        # iSCSI served through TLS: QEMU dials this host's end of a tunnel to the storage portal.
        self.tunnels = IscsiTunnels(self.secrets_dir / "tunnels", x509)
        self.monitors = QemuMonitors(self.vm_dir, qmp_timeout)
        # Which slot of each VM a disk was put in or taken from, when: a new disk goes where none was for longest.
        self.placements = slots.Placements()

    @classmethod
    def from_config(cls, cfg: HostAgentConfig) -> QemuDriver:
        options = dict(cfg.options.get("qemu", {}))
        secrets_dir = options.pop("secrets_dir", None)
        protocols = options.pop("protocols", None)
        migration_mibps = options.pop("migration_mibps", None)
        disk_bus = options.pop("disk_bus", None)
        iothreads = options.pop("iothreads", None)
        if protocols is not None and not (isinstance(protocols, list) and all(isinstance(p, str) for p in protocols)):
            raise InvalidParameter("protocols of the qemu driver is a list of protocol names")
        if options:
            raise InvalidParameter(f"unknown options of the qemu hypervisor driver: {', '.join(sorted(options))}")
        return cls(cfg.vm_dir.resolve(), qmp_timeout=cfg.qmp_timeout_s,
                   secrets_dir=Path(secrets_dir) if secrets_dir else None, protocols=protocols,
                   x509=X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca), migration_address=cfg.address,
                   migration_mibps=migration_mibps, disk_bus=disk_bus, iothreads=iothreads)

    # -- the HypervisorDriver contract -----------------------------------------------------------

    def list_vms(self) -> list[VmInfo]:
        return self.monitors.list_vms()

    def attach(self, vm_id: str, serial: str, connection: AnyConnection, *, read_only: bool = False,
               qos: QoS | None = None, luks: SecretStr | None = None, pci_slot: str | None = None) -> DiskInfo:
        ids = disk_ids(serial)
        connection = self._dialled(connection)
        return self.monitors.on_present_vm(vm_id, lambda vm: plug.attach(vm, serial, ids, connection, read_only,
                                                                         qos, luks, pci_slot, self._host()))

    # -- live migration (see qemu_migration) -----------------------------------------------------

    def migration_info(self, vm_id: str) -> MigrationInfo:
        return self.monitors.on_present_vm(vm_id, lambda vm: migration.migration_info(vm.cmd, vm_id))

    def listen_for_migration(self, vm_id: str) -> MigrationInfo:
        return self.monitors.on_present_vm(vm_id, lambda vm: migration.listen(vm.cmd, vm_id,
                                                                                   self.migration_address,
                                                                                   self.x509_server_dir))

    def migrate(self, vm_id: str, target: StartMigration) -> MigrationInfo:
        def send(vm: Vm) -> MigrationInfo:
            disk_bus_.refuse_migration(vm)
            return migration.send(vm.cmd, vm_id, target, self.x509_dir, self.migration_mibps)

        return self.monitors.on_present_vm(vm_id, send)

    def cancel_migration(self, vm_id: str, *, resume: bool) -> MigrationInfo:
        return self.monitors.on_present_vm(vm_id, lambda vm: migration.cancel(vm.cmd, vm_id, resume=resume))

    def set_qos(self, vm_id: str, serial: str, qos: QoS | None) -> DiskInfo:
        """New limits for the disk's throttle group, live (its queued I/O stays queued). A disk
        attached without limits has no throttle node to change: ``IncorrectState`` (re-attach it)."""
        ids = disk_ids(serial)
        return self.monitors.on_present_vm(vm_id, lambda vm: qos_.set_limits(vm, serial, ids, qos))

    def pause(self, vm_id: str) -> bool:
        """Stop the VM's vCPUs (QMP ``stop``, which drains the in-flight I/O of every disk first); whether this
        call paused it (False: it was not running)."""

        def stop(vm: Vm) -> bool:
            if vm.cmd("query-status").get("status") != "running":
                return False
            vm.cmd("stop")
            return True

        return self.monitors.on_present_vm(vm_id, stop)

    def resume(self, vm_id: str) -> None:
        """Let the VM run again; a VM that is gone (or running) is left as it is."""
        try:
            self.monitors.on_vm(vm_id, lambda vm: vm.cmd("cont"))
        except QmpGone:
            log.info("VM %s is gone: nothing to resume", vm_id)

    def resume_paused_for_space(self) -> list[str]:
        """QEMU stops a VM whose write to a disk answers ENOSPC (virtio-blk's default ``werror=enospc``: the
        guest sees no error, the write waits); ``cont`` retries it. Only VMs in run state ``io-error``
        whose failed disks are all VBS disks that ran out of space are resumed: a VM its operator paused,
        or one stopped by another disk's error, is left as it is."""
        resumed = []
        for vm_id in self.monitors.vm_ids():
            try:
                # A VM this driver is busy with is looked at next round rather than waited for.
                if self.monitors.on_idle_vm(vm_id, _cont_if_paused_for_space):
                    resumed.append(vm_id)
            except QmpGone:
                continue
            except VbsError as exc:
                log.warning("VM %s: cannot tell whether it waits for space: %s", vm_id, exc.message)
        return resumed

    def detach(self, vm_id: str, serial: str, *, force: bool = False, timeout: float = 10.0) -> None:
        ids = disk_ids(serial)
        try:
            self.monitors.on_vm(vm_id, lambda vm: plug.detach(vm, serial, ids, force, timeout, self._host()))
        except QmpGone:
            log.info("VM %s is gone: disk %s went with it", vm_id, serial)

    def list_disks(self, vm_id: str) -> list[DiskInfo]:
        return self.monitors.on_present_vm(vm_id, our_disks)

    def block_stats(self) -> list[DiskStats]:
        return self.monitors.block_stats()

    def resize(self, vm_id: str, serial: str, connection: AnyConnection, size_bytes: int) -> DiskInfo:
        """Move the attached disk to ``connection`` (a refreshed export of its volume) and make the
        guest see ``size_bytes``; see the module docstring. Idempotent: a disk that already uses
        ``connection`` at that size is left alone. On failure the disk stays on its old connection.
        """
        ids = disk_ids(serial)
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0 or size_bytes % 512:
            raise InvalidParameter(f"size_bytes must be a positive multiple of 512, not {size_bytes!r}")
        connection = self._dialled(connection)
        return self.monitors.on_present_vm(vm_id, lambda vm: resize(vm, serial, ids, connection, size_bytes,
                                                                    self._host()))

    def ensure_copy(self, vm_id: str, serial: str, copy_id: str, target: AnyConnection) -> ItemStatus:
        """Copy the disk as it is now into ``target`` (see the module docstring); answers the copy's
        progress, ``ready`` once it is complete, ``error`` if it failed (its instant is lost)."""
        ids, cids = disk_ids(serial), copy_ids(serial, copy_id)
        target = self._dialled(target)
        return self.monitors.on_present_vm(vm_id, lambda vm: copies.ensure(vm, serial, ids, cids, target, self._host()))

    def remove_copy(self, vm_id: str, serial: str, copy_id: str) -> None:
        cids = copy_ids(serial, copy_id)
        try:
            self.monitors.on_vm(vm_id, lambda vm: copies.end(vm, cids, self.qmp_timeout))
        except QmpGone:
            log.info("VM %s is gone: copy %s of %s went with it", vm_id, copy_id, serial)

    def ensure_mirror(self, vm_id: str, serial: str, target: AnyConnection, *, pivot: bool) -> ItemStatus:
        """Mirror the disk onto ``target``, then with ``pivot`` switch its protocol node there (see
        ``MirroringDriver``). Not an encrypted disk: QEMU would copy the plaintext its guest sees."""
        ids = disk_ids(serial)
        target = self._dialled(target)
        return self.monitors.on_present_vm(vm_id, lambda vm: mirror.ensure(vm, serial, ids, target, pivot,
                                                                           self._host()))

    def remove_mirror(self, vm_id: str, serial: str) -> None:
        ids = disk_ids(serial)
        try:
            self.monitors.on_vm(vm_id, lambda vm: mirror.end(vm, serial, ids, self.qmp_timeout))
        except QmpGone:
            log.info("VM %s is gone: the mirror of %s went with it", vm_id, serial)

    def close(self) -> None:
        self.monitors.close()
        self.tunnels.close()

    def _dialled(self, connection: AnyConnection) -> AnyConnection:
        """What QEMU opens: an iSCSI connection served through TLS goes through this host's tunnel."""
        return self.tunnels.local(connection)

    def _host(self) -> QemuHost:
        return QemuHost(self.secrets_dir, self.x509_dir, self.qmp_timeout, self.disk_bus, self.iothreads,
                        self.placements)


def _cont_if_paused_for_space(vm: Vm) -> bool:
    """``cont`` the VM if only VBS disks' writes that found no space stopped it; whether it did."""
    if vm.cmd("query-status").get("status") != "io-error":
        return False
    waiting = False
    for blk in vm.cmd("query-block"):
        io_status = blk.get("io-status", "ok")
        if io_status == "ok":
            continue
        if our_device(blk.get("qdev", "")) is None or io_status != "nospace":
            return False  # another disk's error, or not a lack of space: the operator's to handle
        waiting = True
    if waiting:
        vm.cmd("cont")
    return waiting
