"""The libvirt hypervisor driver: VMs are the domains of one libvirt connection (``--libvirt-uri``).

A VM is a domain, named by its domain name (its UUID is reported beside it). The driver keeps the
list of domains from libvirt's lifecycle events (a libvirt event loop runs in a thread of its own),
re-reading it whole only when it (re)connects; a libvirtd that restarts is reconnected to by itself.

A disk is a ``<disk type='network'>`` whose ``<source>`` comes from the connection's host connector
(``HostConnector.libvirt_source``), hot-plugged with ``attachDeviceFlags(…, LIVE)``: virtio, the
volume's serial, and the user alias ``ua-<serial>`` by which every later call finds it. The alias is
in libvirt's state of the domain, so a disk attached before a libvirtd restart is found again, and a
repeated attach answers the disk that is there. Credentials (iSCSI CHAP) go into a libvirt secret
object, ephemeral and private, its value set through the API; the disk names it by UUID. The secret
never appears in the disk XML, and it is undefined when the disk goes.

Detach is ``detachDeviceAlias`` and a wait for libvirt's ``DEVICE_REMOVED`` event (the guest
acknowledged the unplug), its waiter registered before the request; no event within the timeout is
``DeviceBusy``. A forced detach of a disk the guest still holds does what the QEMU driver does, as
libvirt has no call for it: through libvirt's QEMU monitor passthrough (which marks the domain
tainted, "custom-monitor") it puts an always-failing node under the disk's format node
(``libvirt-<index>-format``) and deletes libvirt's protocol node, which closes the NBD or iSCSI
session; the device stays, its I/O failing, until the guest lets go (libvirt then removes it).
Which disks were cut is known to this agent's process only (``connected=False`` in ``list_disks``).

Limits (libvirt 9.0, QEMU 7.2): online resize is not offered. ``blockResize`` is QEMU's
``block_resize``, which cannot grow an NBD node ("Cannot grow NBD nodes", see the qemu driver); an
iSCSI disk grows only when its LUN does in place, while VBS's exports give a grown volume a
refreshed connection (a new LUN), to which libvirt cannot move
an attached disk. NBD over X.509 TLS: libvirt's ``tls='yes'`` takes the client certificate from
qemu.conf's one ``nbd_tls_x509_cert_dir`` (a setting of the libvirtd, for all its domains: this
host's own certificate belongs there). With ``nbd_tls_dir`` (that same directory) the driver writes
this host's certificate, key and CA there as QEMU wants them and opens such exports; without it
they are refused, saying so. libvirt knows no TLS-PSK. NBD disks have no reconnect delay in libvirt
9.0: a restarted export daemon is not waited for.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import libvirt
import libvirt_qemu
from pydantic import SecretStr

from vbs.config import HostAgentConfig
from vbs.connectors import connector_for
from vbs.connectors.base import LibvirtSource
from vbs.connectors.tunnels import IscsiTunnels
from vbs.errors import DeviceBusy, DriverError, IncorrectState, InvalidParameter, NotFound
from vbs.host.hypervisors.base import DiskStats, checked_iothreads
from vbs.host.hypervisors.libvirt_iothreads import drop_unused_threads, ensure_thread, thread_for_disk
from vbs.host.hypervisors.libvirt_secrets import define_luks_secret, define_secret, drop_secret
from vbs.host.hypervisors.libvirt_session import LibvirtSession, message, no_domain
from vbs.host.hypervisors.libvirt_xml import disk_alias, disk_xml, free_target, iotune_limits, our_disks, secret_uuid
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.wire.connection import AnyConnection
from vbs.wire.host import VM_ID_RE, DiskInfo, HypervisorCapabilities, QoS, VmInfo
from vbs.wire.storage import ItemStatus

# The driver, and the names its modules' users have always found here.
__all__ = ["LibvirtDriver", "disk_alias", "disk_xml", "secret_uuid", "FORCE_GRACE_SECONDS"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# How long a forced detach lets the guest release the disk before it gives up on it.
FORCE_GRACE_SECONDS = 1.0


def _domain_stats(conn: libvirt.virConnect, vm_id: str) -> list[DiskStats]:
    """The VBS disks' counters of a running domain (libvirt's ``blockStatsFlags``, which asks QEMU's
    ``query-blockstats``); none for a domain that is gone or stopped."""
    try:
        dom = conn.lookupByName(vm_id)
        if not dom.isActive():
            return []
    except libvirt.libvirtError as exc:
        if no_domain(exc):
            return []
        raise
    found = []
    for serial, disk in sorted(our_disks(ET.fromstring(dom.XMLDesc(0))).items()):
        target = disk.find("target")
        dev = target.get("dev") if target is not None else None
        if not dev:
            continue
        found.append(DiskStats.of(vm_id, serial, dom.blockStatsFlags(dev, 0), times="_total_times"))
    return found


# libvirt's message when a domain has no free PCI address for a hot-plugged device (an internal
# error by its code, so the message is what tells it).
_NO_SLOT = "No more available PCI slots"


class LibvirtDriver:
    """Hot-plug volumes into the domains of the libvirt connection ``uri``.

    Synchronous and thread-safe: calls on one domain are serialised. With ``persist``, an attach and
    a detach also change the persistent configuration of a persistent domain.
    """

    capabilities = HypervisorCapabilities.model_validate(
        {"protocols": ["iscsi", "nbd", "rbd"], "online_resize": True, "online_resize_protocols": ["rbd"], "qos": True,
         "point_in_time_copy": False, "luks": True}
    )

    def __init__(self, uri: str = "qemu:///system", *, persist: bool = False, state_dir: Path | None = None,
                 x509: X509Files | None = None, nbd_tls_dir: Path | None = None, iothreads: bool | None = None) -> None:
        self.uri = uri
        self.persist = persist
        self.iothreads = checked_iothreads(iothreads, "libvirt")
        if nbd_tls_dir is not None:
            if x509 is None:
                raise InvalidParameter("libvirt_nbd_tls_dir needs this host's certificate: set tls_cert, tls_key "
                                       "and tls_ca of [host_agent]")
            # Where the libvirtd's qemu.conf (nbd_tls_x509_cert_dir) has QEMU read its NBD client's.
            qemu_x509_dir(x509, nbd_tls_dir, "client")
        self.nbd_tls = nbd_tls_dir is not None
        # iSCSI served through TLS: libvirt's QEMU dials this host's end of a tunnel to the portal.
        self.tunnels = IscsiTunnels((state_dir or Path("./var/host-state")) / "tunnels", x509)
        self._guard = threading.Lock()  # guards the locks
        self._locks: dict[str, threading.Lock] = {}
        self._forced: set[tuple[str, str]] = set()  # (vm id, serial) cut by a forced detach, held by the guest
        self.session = LibvirtSession(uri)

    @classmethod
    def from_config(cls, cfg: HostAgentConfig) -> LibvirtDriver:
        options = dict(cfg.options.get("libvirt", {}))
        iothreads = options.pop("iothreads", None)
        if options:
            raise InvalidParameter(f"unknown options of the libvirt hypervisor driver: {', '.join(sorted(options))}")
        state = cfg.state_dir.resolve() if cfg.state_dir is not None else cfg.vm_dir.resolve() / ".vbs-secrets"
        return cls(cfg.libvirt_uri, persist=cfg.libvirt_persist, state_dir=state,
                   x509=X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca),
                   nbd_tls_dir=cfg.libvirt_nbd_tls_dir.resolve() if cfg.libvirt_nbd_tls_dir else None,
                   iothreads=iothreads)

    # -- the HypervisorDriver contract -----------------------------------------------------------

    def list_vms(self) -> list[VmInfo]:
        return self.session.list_vms()

    def attach(self, vm_id: str, serial: str, connection: AnyConnection, *, read_only: bool = False,
               qos: QoS | None = None, luks: SecretStr | None = None) -> DiskInfo:
        disk_alias(serial)
        dialled = self.tunnels.local(connection)
        source = connector_for(dialled).libvirt_source(dialled)
        if source.tls and not self.nbd_tls:
            raise IncorrectState(
                "this host's libvirt driver does not open NBD over X.509 TLS: libvirt takes the client "
                "certificate from the libvirtd's qemu.conf (nbd_tls_x509_cert_dir); set libvirt_nbd_tls_dir of "
                "[host_agent] to that directory (the agent writes this host's certificate there)")
        return _present(self._on_vm(
            vm_id, lambda conn, dom: self._attach(conn, dom, vm_id, serial, source, read_only, qos, luks), need=True))

    def detach(self, vm_id: str, serial: str, *, force: bool = False, timeout: float = 10.0) -> None:
        disk_alias(serial)
        found = self._on_vm(vm_id, lambda conn, dom: self._detach(conn, dom, vm_id, serial, force, timeout),
                            need=False)
        if found is None:
            log.info("VM %s is gone: disk %s went with it", vm_id, serial)
            self.session.with_conn(lambda conn: drop_secret(conn, vm_id, serial))

    def list_disks(self, vm_id: str) -> list[DiskInfo]:
        return _present(self._on_vm(vm_id, lambda _conn, dom: self._disks(vm_id, dom), need=True))

    def block_stats(self) -> list[DiskStats]:
        vm_ids = self.session.vm_ids()
        found: list[DiskStats] = []
        for vm_id in vm_ids:
            lock = self._vm_lock(vm_id)
            if not lock.acquire(blocking=False):
                continue  # busy with an attach or a detach: left out of this scrape rather than waited for
            try:
                found += self.session.with_conn(functools.partial(_domain_stats, vm_id=vm_id))
            except DriverError as exc:
                log.warning("VM %s: block statistics: %s", vm_id, exc.message)
            finally:
                lock.release()
        return found

    def resize(self, vm_id: str, serial: str, connection: AnyConnection, size_bytes: int) -> DiskInfo:
        """``blockResize`` of a disk whose open node sees its volume grow (RBD: librbd reads the new
        size); an NBD or iSCSI disk keeps the size its export had, and libvirt cannot move an attached
        disk to a refreshed export (``online_resize_protocols`` says so to the controller)."""
        if not connector_for(connection).qemu_node_sees_growth:
            raise IncorrectState(
                f"the libvirt driver cannot show a guest a grown {connection.protocol} disk: libvirt cannot move an "
                "attached disk to its volume's refreshed export; detach and attach it again")
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0 or size_bytes % 512:
            raise InvalidParameter(f"size_bytes must be a positive multiple of 512, not {size_bytes!r}")

        def grow(_conn: libvirt.virConnect, dom: libvirt.virDomain) -> DiskInfo:
            dev = _attached_dev(dom, vm_id, serial)
            try:
                dom.blockResize(dev, size_bytes, libvirt.VIR_DOMAIN_BLOCK_RESIZE_BYTES)
            except libvirt.libvirtError as exc:
                raise DriverError(f"VM {vm_id}: resize of {serial} failed: {message(exc)}") from exc
            return self._disk(vm_id, dom, serial)

        return _present(self._on_vm(vm_id, grow, need=True))

    def set_qos(self, vm_id: str, serial: str, qos: QoS | None) -> DiskInfo:
        """``setBlockIoTune`` on the live domain: new limits for the disk without detaching it."""

        def tune(_conn: libvirt.virConnect, dom: libvirt.virDomain) -> DiskInfo:
            dev = _attached_dev(dom, vm_id, serial)
            try:
                dom.setBlockIoTune(dev, iotune_limits(qos), libvirt.VIR_DOMAIN_AFFECT_LIVE)
            except libvirt.libvirtError as exc:
                raise DriverError(f"VM {vm_id}: new limits for {serial} refused: {message(exc)}") from exc
            return self._disk(vm_id, dom, serial)

        return _present(self._on_vm(vm_id, tune, need=True))

    def ensure_copy(self, vm_id: str, serial: str, copy_id: str, target: AnyConnection) -> ItemStatus:
        raise IncorrectState("the libvirt driver does not make point-in-time copies of attached disks")

    def remove_copy(self, vm_id: str, serial: str, copy_id: str) -> None:
        return None  # it never makes one: there is nothing to remove

    def close(self) -> None:
        self.session.close()
        self.tunnels.close()

    # -- calls on one domain ---------------------------------------------------------------------

    def _vm_lock(self, vm_id: str) -> threading.Lock:
        if not isinstance(vm_id, str) or not VM_ID_RE.fullmatch(vm_id):
            raise InvalidParameter(f"invalid VM id {vm_id!r}")
        with self._guard:
            return self._locks.setdefault(vm_id, threading.Lock())

    def _on_vm(self, vm_id: str, call: Callable[[libvirt.virConnect, libvirt.virDomain], T], *,
               need: bool) -> T | None:
        """Run ``call`` on the running domain ``vm_id``, serialised with this driver's other calls on
        it. A domain that is not there or not running: ``NotFound`` if ``need``, else None."""

        def on_domain(conn: libvirt.virConnect) -> T | None:
            try:
                dom = conn.lookupByName(vm_id)
                active = dom.isActive()
            except libvirt.libvirtError as exc:
                if not no_domain(exc):
                    raise
                active = False
            if not active:
                if need:
                    raise NotFound(f"VM {vm_id} not found (no running libvirt domain of that name)",
                                   code="InvalidInstanceID.NotFound", vm_id=vm_id)
                return None
            return call(conn, dom)

        with self._vm_lock(vm_id):
            return self.session.with_conn(on_domain)

    def _attach(self, conn: libvirt.virConnect, dom: libvirt.virDomain, vm_id: str, serial: str,
                source: LibvirtSource, read_only: bool, qos: QoS | None, luks: SecretStr | None) -> DiskInfo:
        live = our_disks(ET.fromstring(dom.XMLDesc(0))).get(serial)
        if live is not None:
            if (vm_id, serial) in self._forced:
                raise IncorrectState(
                    f"disk {serial} of VM {vm_id} was force-detached and the guest has not released it yet; "
                    "detach it again once the guest lets go, or restart the VM")
            if self._flags(dom, config=True) & libvirt.VIR_DOMAIN_AFFECT_CONFIG and not self._in_config(dom, serial):
                # Attached live only (by an agent without --libvirt-persist, or before a crash): the
                # configuration gets the same disk.
                live_source = live.find("source")
                if live_source is not None:
                    live_source.attrib.pop("index", None)  # libvirt's runtime numbering of block nodes
                thread = live.find("driver")
                if thread is not None and thread.get("iothread", "").isdigit():
                    ensure_thread(dom, int(thread.get("iothread", "")), libvirt.VIR_DOMAIN_AFFECT_CONFIG)
                dom.attachDeviceFlags(ET.tostring(live, encoding="unicode"), libvirt.VIR_DOMAIN_AFFECT_CONFIG)
            return self._disk(vm_id, dom, serial)
        self._forced.discard((vm_id, serial))
        secret = define_secret(conn, vm_id, serial, source) if source.auth is not None else None
        flags = self._flags(dom, config=True)
        config = bool(flags & libvirt.VIR_DOMAIN_AFFECT_CONFIG)
        try:
            luks_secret = define_luks_secret(conn, vm_id, serial, luks) if luks is not None else None
            iothread = thread_for_disk(dom, config=config) if self.iothreads else None
            xml = disk_xml(serial, free_target(ET.fromstring(dom.XMLDesc(0))), source, read_only=read_only,
                           qos=qos, secret=secret, luks_secret=luks_secret, iothread=iothread)
            dom.attachDeviceFlags(xml, flags)
        except libvirt.libvirtError as exc:
            drop_secret(conn, vm_id, serial)
            self._drop_threads(dom, vm_id, config)
            if _NO_SLOT in message(exc):
                raise IncorrectState(
                    f"VM {vm_id} has no free slot for another disk: libvirt found no free PCI slot (a q35 domain "
                    "hot-plugs disks only into empty PCIe root ports; define spare ones: <controller type='pci' "
                    "model='pcie-root-port'/>)", code="IncorrectInstanceState") from exc
            raise DriverError(f"VM {vm_id}: attach of {serial} failed: {message(exc)}") from exc
        log.info("VM %s: disk %s attached", vm_id, serial)
        return self._disk(vm_id, dom, serial)

    def _detach(self, conn: libvirt.virConnect, dom: libvirt.virDomain, vm_id: str, serial: str, force: bool,
                timeout: float) -> bool:
        alias = disk_alias(serial)
        if serial not in our_disks(ET.fromstring(dom.XMLDesc(0))):
            drop_secret(conn, vm_id, serial)
            return True
        key = (dom.UUIDString(), alias)
        removed = self.session.expect_removal(key)  # before the request: its event may come at once
        try:
            try:
                dom.detachDeviceAlias(alias, self._flags(dom, config=self._in_config(dom, serial)))
            except libvirt.libvirtError as exc:
                # A request the guest has not answered yet may be refused as a repeat; one that raced
                # with the guest's answer finds the disk gone. Either way the domain says which.
                log.info("VM %s: detach request of %s: %s", vm_id, serial, message(exc))
                if serial in our_disks(ET.fromstring(dom.XMLDesc(0))) and "unplug" not in message(exc):
                    raise DriverError(f"VM {vm_id}: detach of {serial} failed: {message(exc)}") from exc
            wait = min(timeout, FORCE_GRACE_SECONDS) if force else timeout
            gone = removed.wait(wait) or serial not in our_disks(ET.fromstring(dom.XMLDesc(0)))
        finally:
            self.session.forget_removal(key)
        config = self.persist and dom.isPersistent()
        if gone:
            self._forced.discard((vm_id, serial))
            drop_secret(conn, vm_id, serial)
            self._drop_threads(dom, vm_id, config)
            log.info("VM %s: disk %s detached", vm_id, serial)
            return True
        if not force:
            raise DeviceBusy(f"guest of VM {vm_id} did not release disk {serial} within {timeout:g}s",
                             vm_id=vm_id, serial=serial)
        _cut_io(dom, vm_id, serial)
        self._forced.add((vm_id, serial))
        drop_secret(conn, vm_id, serial)  # QEMU keeps its own copy while the device stays
        self._drop_threads(dom, vm_id, config)  # the device keeps its thread; the configuration's goes
        log.warning("VM %s: forced detach of %s: the guest still holds the device, its I/O now fails and the "
                    "storage connection is closed", vm_id, serial)
        return True

    @staticmethod
    def _drop_threads(dom: libvirt.virDomain, vm_id: str, config: bool) -> None:
        """VBS's I/O threads no disk names deleted; one that cannot be is a leftover the next call takes."""
        try:
            drop_unused_threads(dom, config=config)
        except libvirt.libvirtError as exc:
            log.warning("VM %s: an unused I/O thread of VBS's stays: %s", vm_id, message(exc))

    def _flags(self, dom: libvirt.virDomain, *, config: bool) -> int:
        flags = libvirt.VIR_DOMAIN_AFFECT_LIVE
        if config and self.persist and dom.isPersistent():
            flags |= libvirt.VIR_DOMAIN_AFFECT_CONFIG
        return int(flags)

    def _in_config(self, dom: libvirt.virDomain, serial: str) -> bool:
        if not dom.isPersistent():
            return False
        return serial in our_disks(ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)))

    def _disks(self, vm_id: str, dom: libvirt.virDomain) -> list[DiskInfo]:
        return [self._disk(vm_id, dom, serial) for serial in sorted(our_disks(ET.fromstring(dom.XMLDesc(0))))]

    def _disk(self, vm_id: str, dom: libvirt.virDomain, serial: str) -> DiskInfo:
        disk = our_disks(ET.fromstring(dom.XMLDesc(0))).get(serial)
        if disk is None:
            raise DriverError(f"VM {vm_id}: disk {serial} vanished")
        target = disk.find("target")
        size: int | None = None
        if target is not None and target.get("dev"):
            try:
                size = int(dom.blockInfo(target.get("dev"))[0])
            except libvirt.libvirtError as exc:
                log.warning("VM %s: size of disk %s unknown: %s", vm_id, serial, message(exc))
        return DiskInfo(serial=serial, read_only=disk.find("readonly") is not None, size_bytes=size,
                        connected=(vm_id, serial) not in self._forced)


def _attached_dev(dom: libvirt.virDomain, vm_id: str, serial: str) -> str:
    """The target device (``vdb``…) the running domain gives the disk ``serial``: NotFound where it has none."""
    disk = our_disks(ET.fromstring(dom.XMLDesc(0))).get(serial)
    target = disk.find("target") if disk is not None else None
    dev = target.get("dev") if target is not None else None
    if not dev:
        raise NotFound(f"disk {serial} is not attached to VM {vm_id}", code="InvalidAttachment.NotFound")
    return dev


def _monitor(dom: libvirt.virDomain, command: str, args: dict[str, object] | None = None) -> object:
    """One QMP command through libvirt's monitor passthrough (forced detach only)."""
    try:
        reply = json.loads(libvirt_qemu.qemuMonitorCommand(
            dom, json.dumps({"execute": command, "arguments": args or {}}), 0))
    except libvirt.libvirtError as exc:
        raise DriverError(f"QEMU monitor of the domain: {command}: {message(exc)}") from exc
    if "error" in reply:
        raise DriverError(f"QEMU monitor of the domain: {command}: {reply['error'].get('desc', reply['error'])}")
    return reply.get("return")


def _cut_io(dom: libvirt.virDomain, vm_id: str, serial: str) -> None:
    """Close the storage connection of a disk the guest holds (see the module docstring)."""
    disk = our_disks(ET.fromstring(dom.XMLDesc(0))).get(serial)
    source = disk.find("source") if disk is not None else None
    index = source.get("index") if source is not None else None
    if index is None or not index.isdigit():
        raise DriverError(f"VM {vm_id}: libvirt names no block nodes of disk {serial}; it cannot be cut off")
    fmt, storage, dead = f"libvirt-{index}-format", f"libvirt-{index}-storage", f"vbs-{serial}-dead"
    raw_nodes = _monitor(dom, "query-named-block-nodes", {"flat": True})
    nodes = {n["node-name"]: n for n in raw_nodes} if isinstance(raw_nodes, list) else {}
    if fmt not in nodes:
        raise DriverError(f"VM {vm_id}: disk {serial} has no block node {fmt}")
    if dead not in nodes:
        _monitor(dom, "blockdev-add", {
            "driver": "blkdebug", "node-name": dead,
            "image": {"driver": "null-co", "size": int(nodes[fmt]["image"]["virtual-size"])},
            "inject-error": [{"event": "read_aio", "errno": 5}, {"event": "write_aio", "errno": 5}]})
    try:
        _monitor(dom, "blockdev-reopen", {"options": [{"driver": "raw", "node-name": fmt, "file": dead,
                                                       "read-only": bool(nodes[fmt].get("ro")),
                                                       "discard": "unmap"}]})
    except DriverError as exc:
        if "Error flushing" not in exc.message:
            raise
        # The storage is unreachable already (export gone): every request on it fails by now.
        log.warning("VM %s: the storage of %s is already unreachable: %s", vm_id, serial, exc.message)
        return
    if storage in nodes:
        _monitor(dom, "blockdev-del", {"node-name": storage})


def _present(value: T | None) -> T:
    assert value is not None  # a call with need=True raises NotFound instead
    return value
