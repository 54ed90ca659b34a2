"""The QEMU hypervisor driver: VMs are QMP sockets ``<vm_id>.qmp`` in one directory.

A disk is a chain of block nodes (protocol -> raw -> optional throttle) under a virtio-blk-pci device,
all ids derived from the virtio serial, so attach, detach and crash cleanup read the VM's own state.
The protocol node and the objects it needs come from the connection's host connector
(``vbs.connectors``). The driver keeps one persistent QMP connection per VM (``vbs.qemu.qmp``):
QEMU serves one client per monitor, so tests talk to a second monitor of their own.

Online resize (measured on QEMU 7.2): the NBD and iSCSI block drivers cannot grow a node (their
export's size is fixed, and ``block_resize`` answers "Cannot grow NBD nodes"), and reopening a node
does not re-read the size. So ``resize`` opens a second protocol node on the refreshed export (the
other of two alternating generations of ids), points the raw node at it with ``blockdev-reopen``,
then ``block_resize``s the top node to exactly the new node's size. That is a no-op for the
protocol driver, but the truncate path notifies the device, so virtio-blk raises a config change
and the guest sees the new capacity at once. The old protocol node is deleted last.

Point-in-time copy: ``blockdev-backup`` (sync full) from the disk's raw node into a target protocol
node. QEMU inserts a copy-before-write filter above the raw node, so the target receives the disk as
it was when the job started while the guest keeps writing. The job is made with auto-dismiss off:
once concluded it stays in ``query-jobs`` with its outcome (the target connection is closed then),
so a repeated ``ensure_copy`` answers that outcome instead of copying a later instant; ``remove_copy``
dismisses it.
"""

from __future__ import annotations

import logging
import re
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import SecretStr

from vbs.config import HostAgentConfig
from vbs.connectors import CONNECTORS, QemuIds, connector_for
from vbs.connectors.base import open_in_qemu
from vbs.connectors.nbd import NBD_RECONNECT_DELAY_S
from vbs.connectors.tunnels import IscsiTunnels
from vbs.errors import DeviceBusy, DriverError, IncorrectState, InvalidParameter, MirrorLost, NotFound, VbsError
from vbs.host.hypervisors import qemu_migration as migration
from vbs.host.hypervisors import qemu_slots as slots
from vbs.host.hypervisors.base import DiskStats, counter
from vbs.host.hypervisors.luks import qemu_luks_node, qemu_secret
from vbs.qemu.qmp import QmpClient, QmpCommandError, QmpConnectionError, QmpError, QmpGone
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.wire.connection import AnyConnection
from vbs.wire.host import (
    SERIAL_RE,
    VM_ID_RE,
    DiskInfo,
    HypervisorCapabilities,
    MigrationInfo,
    QoS,
    StartMigration,
    VmInfo,
)
from vbs.wire.qos import throttle_limits
from vbs.wire.storage import ItemStatus

__all__ = ["QemuDriver", "disk_ids", "DiskIds", "copy_ids", "CopyIds", "PROBE_TIMEOUT"]

log = logging.getLogger(__name__)

_DEVICE_ID_RE = re.compile(r"^vbs-(vol[0-9a-f]{17})-dev$")
_RUN_STATE_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
# A copy id (a snapshot id) without its dash becomes part of node names: at most 22 characters.
_COPY_ID_RE = re.compile(r"^[A-Za-z0-9]{1,8}-?[A-Za-z0-9]{1,17}$")
MIB = 1024 * 1024
# How long a forced detach lets the guest release the disk before cutting its I/O path.
FORCE_GRACE_SECONDS = 1.0
# Probing many sockets must not take qmp_timeout each when a monitor does not answer.
PROBE_TIMEOUT = 3.0
# Deciding whether a VM went during a call: a connect is refused at once when nothing listens.
_GONE_CHECK_TIMEOUT = 1.0
_PROBE_THREADS = 8

T = TypeVar("T")
Undo = list[Callable[[], object]]


@dataclass(frozen=True)
class DiskIds:
    """QEMU ids of one disk. Node names are limited to 31 characters: 4 + 20 + 7 fits.

    The connection has two generations of ids that alternate at each online resize: ``proto``,
    ``secret`` and ``tls`` (what attach uses), and the same with a ``2`` suffix. The format node has
    two names that alternate at each move to another storage node (a mirror replaces the whole chain
    under the device): ``raw`` is the one in use once ``settled`` resolved it, ``raw2`` the other.
    """

    device: str
    proto: str
    raw: str
    raw2: str
    throttle: str
    dead: str  # the always-failing node a forced detach puts under the raw node
    throttle_group: str
    secret: str
    tls: str
    proto2: str
    secret2: str
    tls2: str
    copy_job_prefix: str  # every point-in-time copy job of this disk has an id starting so
    luks_secret: str  # the passphrase of an encrypted volume's LUKS container (its format node is ``raw``)
    mirror_job: str  # the job that moves the disk onto another storage node's export

    @property
    def generations(self) -> tuple[QemuIds, QemuIds]:
        return QemuIds(self.proto, self.secret, self.tls), QemuIds(self.proto2, self.secret2, self.tls2)

    @property
    def nodes_top_down(self) -> tuple[str, ...]:
        return (self.throttle, self.raw, self.raw2, self.dead, self.proto, self.proto2)

    @property
    def objects(self) -> tuple[str, ...]:
        return (self.throttle_group, self.secret, self.tls, self.secret2, self.tls2, self.luks_secret)


def disk_ids(serial: str) -> DiskIds:
    if not isinstance(serial, str) or not SERIAL_RE.match(serial):
        raise InvalidParameter(f"invalid disk serial {serial!r} (a volume id without its dash)")
    p = f"vbs-{serial}"
    return DiskIds(
        device=f"{p}-dev",
        proto=f"{p}-proto",
        raw=f"{p}-raw",
        raw2=f"{p}-raw2",
        throttle=f"{p}-thr",
        dead=f"{p}-dead",
        throttle_group=f"{p}-tg",
        secret=f"{p}-sec",
        tls=f"{p}-tls",
        proto2=f"{p}-proto2",
        secret2=f"{p}-sec2",
        tls2=f"{p}-tls2",
        copy_job_prefix=f"{p}-copy-",
        luks_secret=f"{p}-key",
        mirror_job=f"{p}-mirror",
    )


@dataclass(frozen=True)
class CopyIds:
    """QEMU ids of one point-in-time copy of a disk: its job, the copy-before-write filter QEMU
    inserts above the raw node, and the target's protocol node and objects (29 characters at most)."""

    job: str
    filter: str
    target: QemuIds


def copy_ids(serial: str, copy_id: str) -> CopyIds:
    prefix = disk_ids(serial).copy_job_prefix
    if not isinstance(copy_id, str) or not _COPY_ID_RE.match(copy_id):
        raise InvalidParameter(f"invalid copy id {copy_id!r} (a snapshot id)")
    return _copy_ids(prefix, copy_id.replace("-", ""))


def _copy_ids(job_prefix: str, key: str) -> CopyIds:
    p = f"vbs-{key}"
    return CopyIds(job=f"{job_prefix}{key}", filter=f"{p}-cbw", target=QemuIds(f"{p}-tgt", f"{p}-sec", f"{p}-tls"))


class _Vm:
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
                 migration_address: str = "127.0.0.1", migration_mibps: int | None = None) -> None:
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
        self.qmp_timeout = qmp_timeout
        # TLS-PSK keys must be in a file for QEMU; it reads a client key once, when the object is made.
        self.secrets_dir = Path(secrets_dir) if secrets_dir else self.vm_dir / ".vbs-secrets"
        # This host's certificate as QEMU's NBD client presents it to X.509 export servers.
        self.x509_dir = qemu_x509_dir(x509, self.secrets_dir / "x509", "client") if x509 else None
        # The same certificate as a live migration's destination presents it (it serves both ways).
        self.x509_server_dir = qemu_x509_dir(x509, self.secrets_dir / "x509-server", "server") if x509 else None
        # iSCSI served through TLS: QEMU dials this host's end of a tunnel to the storage portal.
        self.tunnels = IscsiTunnels(self.secrets_dir / "tunnels", x509)
        self._guard = threading.Lock()  # guards the three dicts below
        self._locks: dict[str, threading.Lock] = {}
        self._clients: dict[str, QmpClient] = {}
        self._last_seen: dict[str, VmInfo] = {}

    @classmethod
    def from_config(cls, cfg: HostAgentConfig) -> QemuDriver:
        options = dict(cfg.options.get("qemu", {}))
        secrets_dir = options.pop("secrets_dir", None)
        protocols = options.pop("protocols", None)
        migration_mibps = options.pop("migration_mibps", None)
        if protocols is not None and not (isinstance(protocols, list) and all(isinstance(p, str) for p in protocols)):
            raise InvalidParameter("protocols of the qemu driver is a list of protocol names")
        if options:
            raise InvalidParameter(f"unknown options of the qemu hypervisor driver: {', '.join(sorted(options))}")
        return cls(cfg.vm_dir.resolve(), qmp_timeout=cfg.qmp_timeout_s,
                   secrets_dir=Path(secrets_dir) if secrets_dir else None, protocols=protocols,
                   x509=X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca), migration_address=cfg.address,
                   migration_mibps=migration_mibps)

    # -- the HypervisorDriver contract -----------------------------------------------------------

    def _vm_ids(self) -> list[str]:
        """The VMs whose QMP sockets are in the VM directory."""
        if not self.vm_dir.is_dir():
            return []
        return sorted(p.stem for p in self.vm_dir.glob("*.qmp") if VM_ID_RE.match(p.stem) and _is_socket(p))

    def list_vms(self) -> list[VmInfo]:
        vm_ids = self._vm_ids()
        with self._guard:
            vanished = [(v, c) for v, c in self._clients.items() if v not in vm_ids]
        for vm_id, client in vanished:  # a call busy with one finds out for itself
            if self._vm_lock(vm_id).acquire(blocking=False):
                try:
                    self._forget(vm_id, client)
                finally:
                    self._vm_lock(vm_id).release()
        # A VM this driver is busy with is not probed: report what was last seen rather than wait.
        free: list[str] = []
        busy: list[str] = []
        for vm_id in vm_ids:
            (free if self._vm_lock(vm_id).acquire(blocking=False) else busy).append(vm_id)
        try:
            if len(free) > 1:
                with ThreadPoolExecutor(min(_PROBE_THREADS, len(free)), thread_name_prefix="vbs-probe") as pool:
                    found = list(pool.map(self._probe, free))
            else:
                found = [self._probe(vm_id) for vm_id in free]
        finally:
            for vm_id in free:
                self._vm_lock(vm_id).release()
        probed = [vm for vm in found if vm is not None]
        with self._guard:
            self._last_seen.update((vm.vm_id, vm) for vm in probed)
            in_use = [self._last_seen.get(v, VmInfo(vm_id=v, name=v, running=True)) for v in busy]
        return sorted(probed + in_use, key=lambda vm: vm.vm_id)

    def attach(self, vm_id: str, serial: str, connection: AnyConnection, *, read_only: bool = False,
               qos: QoS | None = None, luks: SecretStr | None = None, pci_slot: str | None = None) -> DiskInfo:
        ids = disk_ids(serial)
        connection = self._dialled(connection)
        return self._on_present_vm(vm_id, lambda vm: self._attach(vm, serial, ids, connection, read_only, qos,
                                                                  luks, pci_slot))

    # -- live migration (see qemu_migration) -----------------------------------------------------

    def migration_info(self, vm_id: str) -> MigrationInfo:
        return self._on_present_vm(vm_id, lambda vm: migration.migration_info(vm.cmd, vm_id))

    def listen_for_migration(self, vm_id: str) -> MigrationInfo:
        return self._on_present_vm(vm_id, lambda vm: migration.listen(vm.cmd, vm_id, self.migration_address,
                                                                      self.x509_server_dir))

    def migrate(self, vm_id: str, target: StartMigration) -> MigrationInfo:
        return self._on_present_vm(vm_id, lambda vm: migration.send(vm.cmd, vm_id, target, self.x509_dir,
                                                                               self.migration_mibps))

    def cancel_migration(self, vm_id: str, *, resume: bool) -> MigrationInfo:
        return self._on_present_vm(vm_id, lambda vm: migration.cancel(vm.cmd, vm_id, resume=resume))

    def set_qos(self, vm_id: str, serial: str, qos: QoS | None) -> DiskInfo:
        """New limits for the disk's throttle group, live (its queued I/O stays queued). A disk
        attached without limits has no throttle node to change: ``IncorrectState`` (re-attach it)."""
        ids = disk_ids(serial)

        def change(vm: _Vm) -> DiskInfo:
            disk = next((d for d in _our_disks(vm) if d.serial == serial), None)
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

        return self._on_present_vm(vm_id, change)

    def pause(self, vm_id: str) -> bool:
        """Stop the VM's vCPUs (QMP ``stop``, which drains the in-flight I/O of every disk first); whether this
        call paused it (False: it was not running)."""

        def stop(vm: _Vm) -> bool:
            if vm.cmd("query-status").get("status") != "running":
                return False
            vm.cmd("stop")
            return True

        return self._on_present_vm(vm_id, stop)

    def resume(self, vm_id: str) -> None:
        """Let the VM run again; a VM that is gone (or running) is left as it is."""
        try:
            self._on_vm(vm_id, lambda vm: vm.cmd("cont"))
        except QmpGone:
            log.info("VM %s is gone: nothing to resume", vm_id)

    def detach(self, vm_id: str, serial: str, *, force: bool = False, timeout: float = 10.0) -> None:
        ids = disk_ids(serial)
        try:
            self._on_vm(vm_id, lambda vm: self._detach(vm, serial, ids, force, timeout))
        except QmpGone:
            log.info("VM %s is gone: disk %s went with it", vm_id, serial)

    def list_disks(self, vm_id: str) -> list[DiskInfo]:
        return self._on_present_vm(vm_id, _our_disks)

    def block_stats(self) -> list[DiskStats]:
        found: list[DiskStats] = []
        limit = min(self.qmp_timeout, PROBE_TIMEOUT)
        for vm_id in self._vm_ids():
            lock = self._vm_lock(vm_id)
            if not lock.acquire(blocking=False):
                continue  # busy with an attach or a detach: left out of this scrape rather than waited for
            client = self._client(vm_id)
            try:
                client.connect(timeout=limit)
                found += disk_stats(vm_id, client.execute("query-blockstats", timeout=limit))
            except QmpGone:
                self._forget(vm_id, client)
            except QmpError as exc:
                log.warning("VM %s: block statistics: %s", vm_id, exc)
            finally:
                lock.release()
        return found

    def resize(self, vm_id: str, serial: str, connection: AnyConnection, size_bytes: int) -> DiskInfo:
        """Move the attached disk to ``connection`` (a refreshed export of its volume) and make the
        guest see ``size_bytes``; see the module docstring. Idempotent: a disk that already uses
        ``connection`` at that size is left alone. On failure the disk stays on its old connection.
        """
        ids = disk_ids(serial)
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0 or size_bytes % 512:
            raise InvalidParameter(f"size_bytes must be a positive multiple of 512, not {size_bytes!r}")
        connection = self._dialled(connection)
        return self._on_present_vm(vm_id, lambda vm: self._resize(vm, serial, ids, connection, size_bytes))

    def ensure_copy(self, vm_id: str, serial: str, copy_id: str, target: AnyConnection) -> ItemStatus:
        """Copy the disk as it is now into ``target`` (see the module docstring); answers the copy's
        progress, ``ready`` once it is complete, ``error`` if it failed (its instant is lost)."""
        ids, cids = disk_ids(serial), copy_ids(serial, copy_id)
        target = self._dialled(target)
        return self._on_present_vm(vm_id, lambda vm: self._ensure_copy(vm, serial, ids, cids, target))

    def remove_copy(self, vm_id: str, serial: str, copy_id: str) -> None:
        cids = copy_ids(serial, copy_id)
        try:
            self._on_vm(vm_id, lambda vm: self._end_copy(vm, cids))
        except QmpGone:
            log.info("VM %s is gone: copy %s of %s went with it", vm_id, copy_id, serial)

    def ensure_mirror(self, vm_id: str, serial: str, target: AnyConnection, *, pivot: bool) -> ItemStatus:
        """Mirror the disk onto ``target``, then with ``pivot`` switch its protocol node there (see
        ``MirroringDriver``). Not an encrypted disk: QEMU would copy the plaintext its guest sees."""
        ids = disk_ids(serial)
        target = self._dialled(target)
        return self._on_present_vm(vm_id, lambda vm: self._ensure_mirror(vm, serial, ids, target, pivot))

    def remove_mirror(self, vm_id: str, serial: str) -> None:
        ids = disk_ids(serial)
        try:
            self._on_vm(vm_id, lambda vm: self._end_mirror(vm, serial, ids))
        except QmpGone:
            log.info("VM %s is gone: the mirror of %s went with it", vm_id, serial)

    def close(self) -> None:
        with self._guard:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        self.tunnels.close()

    def _dialled(self, connection: AnyConnection) -> AnyConnection:
        """What QEMU opens: an iSCSI connection served through TLS goes through this host's tunnel."""
        return self.tunnels.local(connection)

    # -- VMs and their monitors ------------------------------------------------------------------

    def _vm_lock(self, vm_id: str) -> threading.Lock:
        self._socket(vm_id)  # validates the id before it names anything
        with self._guard:
            return self._locks.setdefault(vm_id, threading.Lock())

    def _socket(self, vm_id: str) -> Path:
        if not isinstance(vm_id, str) or not VM_ID_RE.match(vm_id):
            raise InvalidParameter(f"invalid VM id {vm_id!r}")
        return self.vm_dir / f"{vm_id}.qmp"

    def _client(self, vm_id: str) -> QmpClient:
        with self._guard:
            client = self._clients.get(vm_id)
            if client is None:
                client = QmpClient(self._socket(vm_id), name=f"vbs-{vm_id}", connect_timeout=self.qmp_timeout,
                                   timeout=self.qmp_timeout)
                self._clients[vm_id] = client
            return client

    def _forget(self, vm_id: str, client: QmpClient) -> None:
        """Drop the connection of a VM that is gone (a new QEMU on that socket gets a new one)."""
        with self._guard:
            if self._clients.get(vm_id) is client:
                del self._clients[vm_id]
                self._last_seen.pop(vm_id, None)
        client.close()

    def _on_vm(self, vm_id: str, call: Callable[[_Vm], T]) -> T:
        """Run ``call`` on the VM's monitor, serialised with this driver's other calls on the VM.

        Raises ``QmpGone`` if no QEMU listens on the VM's socket, also when it went during the call.
        A VM that is there but does not answer raises ``QmpConnectionError`` (a ``DriverError``).
        """
        with self._vm_lock(vm_id):
            client = self._client(vm_id)
            try:
                return call(_Vm(vm_id, client))
            except QmpGone:
                self._forget(vm_id, client)
                raise
            except QmpConnectionError as exc:
                if self._went(client):
                    self._forget(vm_id, client)
                    raise QmpGone(f"VM {vm_id} went during the call: {exc}") from exc
                raise

    def _on_present_vm(self, vm_id: str, call: Callable[[_Vm], T]) -> T:
        """``_on_vm`` for calls that need the VM: one that is gone is ``NotFound``."""
        try:
            return self._on_vm(vm_id, call)
        except QmpGone as exc:
            raise NotFound(f"VM {vm_id} not found (no QEMU behind {vm_id}.qmp)", code="InvalidInstanceID.NotFound",
                           vm_id=vm_id) from exc

    @staticmethod
    def _went(client: QmpClient) -> bool:
        try:
            client.connect(timeout=_GONE_CHECK_TIMEOUT)
        except QmpGone:
            return True
        except QmpError:
            return False  # there, but busy or hung
        return False

    def _probe(self, vm_id: str) -> VmInfo | None:
        client = self._client(vm_id)
        limit = min(self.qmp_timeout, PROBE_TIMEOUT)
        try:
            client.connect(timeout=limit)
            status = client.execute("query-status", timeout=limit)
            name = client.execute("query-name", timeout=limit).get("name") or vm_id
            return VmInfo(vm_id=vm_id, name=name, running=bool(status.get("running")),
                          status=_run_state(status.get("status")))
        except QmpGone:
            self._forget(vm_id, client)
            return None  # a stale socket left by a QEMU that is gone
        except QmpError as exc:
            # The process is there but its monitor does not answer us: list it, but not as running.
            log.warning("VM %s: %s", vm_id, exc)
            return VmInfo(vm_id=vm_id, name=vm_id, running=False)

    # -- attach ----------------------------------------------------------------------------------

    def _attach(self, vm: _Vm, serial: str, ids: DiskIds, connection: AnyConnection, read_only: bool,
                qos: QoS | None, luks: SecretStr | None, pci_slot: str | None) -> DiskInfo:
        if ids.device in vm.devices():
            if ids.dead in vm.nodes():
                raise IncorrectState(
                    f"disk {serial} of VM {vm.vm_id} was force-detached and the guest has not released "
                    "it yet; detach it again once the guest lets go, or restart the VM"
                )
            for disk in _our_disks(vm):
                if disk.serial == serial:
                    return disk
        # Nodes without a device: a crashed attach or detach. Start from a clean slate.
        self._end_copies(vm, serial, ids)
        self._end_mirror(vm, serial, ids)
        _remove_nodes(vm, ids)
        with _undone_on_failure(vm, f"attach of {serial}") as undo:
            top = self._build_chain(vm, connection, ids, read_only, qos, luks, undo)
            device = {"driver": "virtio-blk-pci", "id": ids.device, "drive": top, "serial": serial}
            vm.cmd("device_add", {**device, **slots.placement(vm.cmd, vm.vm_id, pci_slot)})
        return DiskInfo(serial=serial, read_only=read_only, size_bytes=vm.node_size(ids.raw),
                        pci_slot=slots.device_slot(vm.cmd, ids.device))

    def _build_chain(self, vm: _Vm, connection: AnyConnection, ids: DiskIds, read_only: bool, qos: QoS | None,
                     luks: SecretStr | None, undo: Undo) -> str:
        gen = ids.generations[0]
        self._open_connection(vm, connection, gen, read_only, undo)
        if luks is not None:
            # The guest's plaintext exists only in this process: the export and the network carry ciphertext.
            vm.cmd("object-add", qemu_secret(ids.luks_secret, luks))
            undo.append(lambda: vm.cmd("object-del", {"id": ids.luks_secret}))
        vm.cmd("blockdev-add", _format_options(ids, gen.proto, read_only, luks is not None))
        undo.append(lambda: vm.cmd("blockdev-del", {"node-name": ids.raw}))
        if qos is None or not qos.limits_anything():
            return ids.raw
        vm.cmd("object-add", {"qom-type": "throttle-group", "id": ids.throttle_group, "limits": throttle_limits(qos)})
        undo.append(lambda: vm.cmd("object-del", {"id": ids.throttle_group}))
        vm.cmd("blockdev-add", {"driver": "throttle", "node-name": ids.throttle, "throttle-group": ids.throttle_group,
                                "file": ids.raw, "read-only": read_only})
        undo.append(lambda: vm.cmd("blockdev-del", {"node-name": ids.throttle}))
        return ids.throttle

    def _open_connection(self, vm: _Vm, connection: AnyConnection, ids: QemuIds, read_only: bool, undo: Undo) -> None:
        """Make the connection's objects and protocol node ``ids.proto``, as its connector says."""
        open_in_qemu(vm.cmd, connector_for(connection).qemu_blockdev(connection, ids), ids.proto,
                     read_only=read_only, secrets_dir=self.secrets_dir, x509_dir=self.x509_dir, undo=undo)

    # -- resize ----------------------------------------------------------------------------------

    def _resize(self, vm: _Vm, serial: str, ids: DiskIds, connection: AnyConnection, size_bytes: int) -> DiskInfo:
        vm_id = vm.vm_id
        ids = _settled(vm, ids)
        disk = next((d for d in _our_disks(vm) if d.serial == serial), None)
        if disk is None:
            raise NotFound(f"disk {serial} is not attached to VM {vm_id}", code="InvalidAttachment.NotFound")
        nodes = vm.nodes()
        if ids.dead in nodes:
            raise IncorrectState(f"disk {serial} of VM {vm_id} was force-detached; it cannot be resized")
        if ids.raw not in nodes:
            raise DriverError(f"VM {vm_id}: disk {serial} has no node {ids.raw}: not a disk VBS attached")
        if _is_luks(nodes, ids):
            raise IncorrectState(f"disk {serial} of VM {vm_id} is encrypted: it grows while detached only")
        if disk.read_only:
            # Measured: QEMU refuses block_resize on a read-only node ("Image is read-only"), and only
            # a truncate tells the device. The guest would never see the new size.
            raise IncorrectState(
                f"disk {serial} of VM {vm_id} is attached read-only: QEMU cannot show the guest a new "
                "size; detach and attach it again"
            )
        if any(j["status"] != "concluded" for j in _copy_jobs(vm, ids).values()):
            raise IncorrectState(f"a point-in-time copy of disk {serial} of VM {vm_id} is running; resize it "
                                 "once the snapshot is complete")
        top = ids.throttle if ids.throttle in nodes else ids.raw
        current = int(nodes[top]["image"]["virtual-size"])
        if size_bytes < current:
            raise InvalidParameter(f"disk {serial} of VM {vm_id} has {current} bytes; it cannot shrink to {size_bytes}")

        old, interrupted = _current_generation(vm, serial, ids)
        nodes = vm.nodes()
        new = _other_generation(ids, old)

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
        with _undone_on_failure(vm, f"resize of {serial}") as undo:
            self._open_connection(vm, connection, new, False, undo)
            # Every option of the raw node: blockdev-reopen resets the ones left out to defaults.
            vm.cmd("blockdev-reopen", {"options": [_format_options(ids, new.proto, False, False)]})
            undo.append(lambda: vm.cmd("blockdev-reopen", {"options": [_format_options(ids, old.proto, False,
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

    # -- detach ----------------------------------------------------------------------------------

    def _detach(self, vm: _Vm, serial: str, ids: DiskIds, force: bool, timeout: float) -> None:
        self._end_copies(vm, serial, ids)
        self._end_mirror(vm, serial, ids)
        ids = _settled(vm, ids)
        if ids.device in vm.devices():
            wait = min(timeout, FORCE_GRACE_SECONDS) if force else timeout
            if not _unplug(vm, ids.device, wait):
                if not force:
                    raise DeviceBusy(f"guest of VM {vm.vm_id} did not release disk {serial} within {timeout:g}s",
                                     vm_id=vm.vm_id, serial=serial)
                _cut_io(vm, ids, self.qmp_timeout)
                log.warning(
                    "VM %s: forced detach of %s: the guest still holds the device, its I/O now "
                    "fails and the storage connection is closed",
                    vm.vm_id,
                    serial,
                )
                return
        _remove_nodes(vm, ids)

    # -- point-in-time copies --------------------------------------------------------------------

    def _ensure_copy(self, vm: _Vm, serial: str, ids: DiskIds, cids: CopyIds, target: AnyConnection) -> ItemStatus:
        ids = _settled(vm, ids)
        job = vm.jobs().get(cids.job)
        if job is not None:
            return self._copy_status(vm, cids, job)
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
        if _is_luks(nodes, ids):
            # The copy would be of the plaintext the guest sees: an encrypted volume's snapshot is its node's.
            raise IncorrectState(f"disk {serial} of VM {vm.vm_id} is encrypted: its storage node snapshots it")
        vm.del_objects(cids.target.objects)  # leftovers of a crash before the target node was made
        with _undone_on_failure(vm, f"copy of {serial}") as undo:
            self._open_connection(vm, target, cids.target, False, undo)
            vm.cmd("blockdev-backup", {"job-id": cids.job, "device": ids.raw, "target": cids.target.proto,
                                       "sync": "full", "auto-dismiss": False, "filter-node-name": cids.filter})
        log.info("VM %s: point-in-time copy %s of disk %s started", vm.vm_id, cids.job, serial)
        job = vm.jobs().get(cids.job)
        return self._copy_status(vm, cids, job) if job is not None else ItemStatus(state="copying")

    def _copy_status(self, vm: _Vm, cids: CopyIds, job: dict[str, Any]) -> ItemStatus:
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

    def _end_copy(self, vm: _Vm, cids: CopyIds) -> bool:
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
            _wait_concluded(vm, cids.job, mark, self.qmp_timeout + NBD_RECONNECT_DELAY_S)
        vm.del_nodes([cids.target.proto])
        vm.del_objects(cids.target.objects)
        if job is not None:
            try:
                vm.cmd("job-dismiss", {"id": cids.job})
            except QmpCommandError as exc:
                if exc.error_class != "GenericError" or "not found" not in exc.desc:
                    raise
        return running

    def _end_copies(self, vm: _Vm, serial: str, ids: DiskIds) -> None:
        """End every copy of the disk: a detach must not fail because a snapshot is being taken."""
        for job_id in _copy_jobs(vm, ids):
            key = job_id.removeprefix(ids.copy_job_prefix)
            if self._end_copy(vm, _copy_ids(ids.copy_job_prefix, key)):
                log.warning("VM %s: point-in-time copy %s of disk %s cancelled by its detach; that snapshot fails",
                            vm.vm_id, key, serial)

    # -- mirrors onto another storage node -----------------------------------------------------------

    def _ensure_mirror(self, vm: _Vm, serial: str, ids: DiskIds, target: AnyConnection, pivot: bool) -> ItemStatus:
        job = vm.jobs().get(ids.mirror_job)
        if job is not None:
            return self._mirror_status(vm, serial, ids, target, job, pivot)
        ids = _settled(vm, ids)
        nodes = vm.nodes()
        if ids.device not in vm.devices() or ids.raw not in nodes:
            raise NotFound(f"disk {serial} is not attached to VM {vm.vm_id}", code="InvalidAttachment.NotFound")
        if ids.dead in nodes:
            raise IncorrectState(f"disk {serial} of VM {vm.vm_id} was force-detached; it cannot be moved")
        current, _ = _current_generation(vm, serial, ids)
        nodes = vm.nodes()
        if connector_for(target).qemu_node_opens(nodes[current.proto], target):
            return ItemStatus(state="ready", progress=100)  # switched already (its job dismissed)
        if _is_luks(nodes, ids):
            # QEMU mirrors from the disk's root node only: what it reads there is the guest's plaintext.
            raise IncorrectState(f"disk {serial} of VM {vm.vm_id} is encrypted: it moves while detached only")
        if pivot:
            raise MirrorLost(f"disk {serial} of VM {vm.vm_id} has no mirror to complete (cancelled, or the VM "
                             "restarted): it is still on its old storage")
        if any(j["status"] != "concluded" for j in _copy_jobs(vm, ids).values()):
            raise IncorrectState(f"a point-in-time copy of disk {serial} of VM {vm.vm_id} is running; move it once "
                                 "the snapshot is complete")
        new, new_raw = _other_generation(ids, current), ids.raw2
        vm.del_objects(new.objects)  # leftovers of a crash before its node was made
        read_only = bool(nodes[ids.raw].get("ro"))
        with _undone_on_failure(vm, f"mirror of {serial}") as undo:
            self._open_connection(vm, target, new, read_only, undo)
            vm.cmd("blockdev-add", {**_format_options(ids, new.proto, read_only, False), "node-name": new_raw})
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
        return self._mirror_status(vm, serial, ids, target, job, pivot) if job else ItemStatus(state="copying")

    def _mirror_status(self, vm: _Vm, serial: str, ids: DiskIds, target: AnyConnection, job: dict[str, Any],
                       pivot: bool) -> ItemStatus:
        total = int(job.get("total-progress") or 0)
        done = int(job.get("current-progress") or 0)
        if job["status"] == "ready" and pivot:
            mark = vm.qmp.event_mark()
            vm.cmd("job-complete", {"id": ids.mirror_job})
            _wait_concluded(vm, ids.mirror_job, mark, self.qmp_timeout + NBD_RECONNECT_DELAY_S)
            job = vm.jobs().get(ids.mirror_job) or {"status": "concluded"}
        if job["status"] == "concluded":
            vm.cmd("job-dismiss", {"id": ids.mirror_job})
            ids = _settled(vm, ids)  # closes the chain not in use
            current, _ = _current_generation(vm, serial, ids)
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

    def _end_mirror(self, vm: _Vm, serial: str, ids: DiskIds) -> None:
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
                _wait_concluded(vm, ids.mirror_job, mark, self.qmp_timeout + NBD_RECONNECT_DELAY_S)
            vm.cmd("job-dismiss", {"id": ids.mirror_job})
            log.warning("VM %s: mirror of disk %s cancelled", vm.vm_id, serial)
        ids = _settled(vm, ids)
        nodes = vm.nodes()
        if ids.raw in nodes and all(g.proto in nodes for g in ids.generations):
            _current_generation(vm, serial, ids)

def _copy_jobs(vm: _Vm, ids: DiskIds) -> dict[str, dict[str, Any]]:
    return {job_id: job for job_id, job in vm.jobs().items() if job_id.startswith(ids.copy_job_prefix)}


def _wait_concluded(vm: _Vm, job_id: str, mark: int, limit: float) -> None:
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


def disk_stats(vm_id: str, blockstats: list[dict[str, Any]]) -> list[DiskStats]:
    """The VBS disks' counters in a ``query-blockstats`` answer (devices with our ids)."""
    found = []
    for entry in blockstats:
        parts = str(entry.get("qdev", "")).split("/")
        match = _DEVICE_ID_RE.match(parts[3]) if len(parts) > 3 and parts[1:3] == ["machine", "peripheral"] else None
        stats = entry.get("stats")
        if match is None or not isinstance(stats, dict):
            continue
        found.append(DiskStats(vm_id=vm_id, serial=match.group(1), read_bytes=counter(stats, "rd_bytes"),
                               write_bytes=counter(stats, "wr_bytes"), read_ops=counter(stats, "rd_operations"),
                               write_ops=counter(stats, "wr_operations"), flush_ops=counter(stats, "flush_operations"),
                               read_time_ns=counter(stats, "rd_total_time_ns"),
                               write_time_ns=counter(stats, "wr_total_time_ns"),
                               flush_time_ns=counter(stats, "flush_total_time_ns")))
    return found


def _our_disks(vm: _Vm) -> list[DiskInfo]:
    """The disks VBS attached: devices with our ids and a medium, read from their raw nodes."""
    inserted: dict[str, dict[str, Any]] = {}
    for blk in vm.cmd("query-block"):
        parts = blk.get("qdev", "").split("/")
        if len(parts) > 3 and parts[1:3] == ["machine", "peripheral"] and "inserted" in blk:
            inserted[parts[3]] = blk["inserted"]
    nodes = vm.nodes()
    disks = []
    for dev in sorted(vm.devices()):
        match = _DEVICE_ID_RE.match(dev)
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


def _run_state(status: object) -> str | None:
    return status if isinstance(status, str) and _RUN_STATE_RE.match(status) else None


def _unplug(vm: _Vm, device: str, wait: float) -> bool:
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


def _cut_io(vm: _Vm, ids: DiskIds, qmp_timeout: float) -> None:
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
        vm.cmd("blockdev-reopen", {"options": [_format_options(ids, ids.dead, ro, _is_luks(nodes, ids))]},
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


def _current_generation(vm: _Vm, serial: str, ids: DiskIds) -> tuple[QemuIds, bool]:
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


def _settled(vm: _Vm, ids: DiskIds) -> DiskIds:
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


def _other_generation(ids: DiskIds, gen: QemuIds) -> QemuIds:
    return ids.generations[1] if gen == ids.generations[0] else ids.generations[0]


def _format_options(ids: DiskIds, file: str, read_only: bool, luks: bool) -> dict[str, Any]:
    """The format node's options (``raw``, or ``luks`` for an encrypted volume): attach adds it with these,
    every blockdev-reopen repeats them all."""
    if luks:
        return qemu_luks_node(ids.raw, file, ids.luks_secret, read_only)
    return {"driver": "raw", "node-name": ids.raw, "file": file, "read-only": read_only, "discard": "unmap"}


def _is_luks(nodes: dict[str, dict[str, Any]], ids: DiskIds) -> bool:
    return ids.raw in nodes and nodes[ids.raw].get("drv") == "luks"


def _remove_nodes(vm: _Vm, ids: DiskIds) -> None:
    """Delete this disk's nodes (top-down, as each holds the next) and objects, whichever exist."""
    vm.del_nodes(ids.nodes_top_down)
    vm.del_objects(ids.objects)


@contextmanager
def _undone_on_failure(vm: _Vm, what: str) -> Iterator[Undo]:
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


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False
