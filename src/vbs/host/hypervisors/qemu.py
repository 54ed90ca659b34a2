"""The QEMU hypervisor driver: VMs are QMP sockets ``<vm_id>.qmp`` in one directory.

A disk is a chain of block nodes (protocol -> raw -> optional throttle) under a virtio-blk-pci device,
all ids derived from the virtio serial, so attach, detach and crash cleanup read the VM's own state.

Online resize (measured on QEMU 7.2): the NBD and iSCSI block drivers cannot grow a node (their
export's size is fixed, and ``block_resize`` answers "Cannot grow NBD nodes"), and reopening a node
does not re-read the size. So ``resize`` opens a second protocol node on the refreshed export (the
other of two alternating generations of ids), points the raw node at it with ``blockdev-reopen``,
then ``block_resize``s the top node to exactly the new node's size. That is a no-op for the
protocol driver, but the truncate path notifies the device, so virtio-blk raises a config change
and the guest sees the new capacity at once. The old protocol node is deleted last.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import tempfile
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from qemu.qmp import ConnectError, ExecuteError, QMPClient, QMPError

from vbs.connection import Connection, FileConnection, IscsiConnection, NbdConnection
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound, VbsError
from vbs.host.hypervisors.base import AttachedDisk, DeviceBusy, QoS, VmInfo

__all__ = ["QemuDriver", "QmpCommandError", "disk_ids", "DiskIds", "ProtoIds"]

log = logging.getLogger(__name__)

VM_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# A virtio-blk serial holds 20 bytes; ours also become parts of QEMU ids, so keep them alphanumeric.
SERIAL_RE = re.compile(r"^[A-Za-z0-9]{1,20}$")
_DEVICE_ID_RE = re.compile(r"^vbs-([A-Za-z0-9]{1,20})-dev$")
MIB = 1024 * 1024
# How long guest I/O waits for a lost NBD connection to come back (export daemon restarted).
NBD_RECONNECT_DELAY_S = 15
# How long a forced detach lets the guest release the disk before cutting its I/O path.
FORCE_GRACE_SECONDS = 1.0
# Probing many sockets must not take qmp_timeout each when a monitor is held by another client.
PROBE_TIMEOUT = 3.0

T = TypeVar("T")


@dataclass(frozen=True)
class ProtoIds:
    """Ids of one generation of a disk's connection: its protocol node and the objects it uses."""

    proto: str
    secret: str
    tls: str

    @property
    def objects(self) -> tuple[str, ...]:
        return (self.secret, self.tls)


@dataclass(frozen=True)
class DiskIds:
    """QEMU ids of one disk. Node names are limited to 31 characters: 4 + 20 + 7 fits.

    The connection has two generations of ids that alternate at each online resize: ``proto``,
    ``secret`` and ``tls`` (what attach uses), and the same with a ``2`` suffix.
    """

    device: str
    proto: str
    raw: str
    throttle: str
    dead: str  # the always-failing node a forced detach puts under the raw node
    throttle_group: str
    secret: str
    tls: str
    proto2: str
    secret2: str
    tls2: str

    @property
    def generations(self) -> tuple[ProtoIds, ProtoIds]:
        return ProtoIds(self.proto, self.secret, self.tls), ProtoIds(self.proto2, self.secret2, self.tls2)

    @property
    def nodes_top_down(self) -> tuple[str, ...]:
        return (self.throttle, self.raw, self.dead, self.proto, self.proto2)

    @property
    def objects(self) -> tuple[str, ...]:
        return (self.throttle_group, self.secret, self.tls, self.secret2, self.tls2)


def disk_ids(serial: str) -> DiskIds:
    if not SERIAL_RE.match(serial):
        raise InvalidParameter(f"invalid disk serial {serial!r} (1-20 letters and digits)")
    p = f"vbs-{serial}"
    return DiskIds(
        device=f"{p}-dev",
        proto=f"{p}-proto",
        raw=f"{p}-raw",
        throttle=f"{p}-thr",
        dead=f"{p}-dead",
        throttle_group=f"{p}-tg",
        secret=f"{p}-sec",
        tls=f"{p}-tls",
        proto2=f"{p}-proto2",
        secret2=f"{p}-sec2",
        tls2=f"{p}-tls2",
    )


class QmpCommandError(DriverError):
    """QEMU refused a QMP command; ``error_class`` is QMP's (``GenericError``, ``DeviceNotFound``…)."""

    def __init__(self, command: str, error_class: str, desc: str) -> None:
        super().__init__(f"QMP {command}: {desc}")
        self.command = command
        self.error_class = error_class
        self.desc = desc


class _Monitor:
    """One QMP session with one VM; every step is bounded by ``timeout``."""

    def __init__(self, vm_id: str, path: Path, timeout: float) -> None:
        self.vm_id = vm_id
        self.path = path
        self.timeout = timeout
        self.client = QMPClient(f"vbs-{vm_id}")
        # The library logs each failed connect at ERROR; we raise (and the caller logs) instead,
        # so a stale socket probed at every heartbeat does not flood the log.
        self.client.logger.setLevel(logging.CRITICAL)

    async def __aenter__(self) -> _Monitor:
        try:
            await asyncio.wait_for(self.client.connect(str(self.path)), self.timeout)
        except ConnectError as exc:
            if isinstance(exc.exc, FileNotFoundError | ConnectionRefusedError):
                raise NotFound(
                    f"VM {self.vm_id} not found (no QEMU behind {self.path.name})",
                    code="InvalidInstanceID.NotFound",
                ) from exc
            raise DriverError(f"VM {self.vm_id}: QMP connection failed: {exc}") from exc
        except TimeoutError as exc:
            # QEMU serves one QMP client at a time: another one holding the monitor looks like this.
            raise DriverError(
                f"VM {self.vm_id}: QMP monitor did not answer within {self.timeout:g}s (busy with another client?)"
            ) from exc
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await asyncio.wait_for(self.client.disconnect(), self.timeout)
        except (QMPError, OSError, TimeoutError) as err:
            log.debug("VM %s: QMP disconnect: %s", self.vm_id, err)

    async def cmd(self, command: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        limit = timeout if timeout is not None else self.timeout
        try:
            return await asyncio.wait_for(self.client.execute(command, args), limit)
        except ExecuteError as exc:
            raise QmpCommandError(command, exc.error_class, str(exc)) from exc
        except TimeoutError as exc:
            raise DriverError(f"VM {self.vm_id}: QMP {command}: no answer within {limit:g}s") from exc
        except QMPError as exc:
            raise DriverError(f"VM {self.vm_id}: QMP {command}: {exc}") from exc

    # -- what the VM holds -----------------------------------------------------------------------

    async def devices(self) -> set[str]:
        children = await self.cmd("qom-list", {"path": "/machine/peripheral"})
        return {c["name"] for c in children if c["type"].startswith("child<")}

    async def node_names(self) -> set[str]:
        nodes = await self.cmd("query-named-block-nodes", {"flat": True})
        return {n["node-name"] for n in nodes}

    async def objects(self) -> set[str]:
        children = await self.cmd("qom-list", {"path": "/objects"})
        return {c["name"] for c in children if c["type"].startswith("child<")}

    async def node_size(self, node: str) -> int:
        for n in await self.cmd("query-named-block-nodes", {"flat": True}):
            if n["node-name"] == node:
                return int(n["image"]["virtual-size"])
        raise DriverError(f"VM {self.vm_id}: block node {node} vanished")

    async def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node-name"]: n for n in await self.cmd("query-named-block-nodes", {"flat": True})}


class QemuDriver:
    """Hot-plug volumes into QEMU VMs found as ``<vm_id>.qmp`` sockets in ``vm_dir``.

    Synchronous: each call runs its own asyncio loop (``asyncio.run``) in the calling thread, so call
    it from plain threads; from async code use ``await asyncio.to_thread(driver.attach, ...)``. Calls
    on one VM are serialised in this process, as QEMU serves one QMP client at a time anyway.
    """

    def __init__(self, vm_dir: Path, qmp_timeout: float = 10.0, secrets_dir: Path | None = None) -> None:
        self.vm_dir = Path(vm_dir)
        self.qmp_timeout = qmp_timeout
        # TLS-PSK keys must be in a file for QEMU; it reads a client key once, when the object is made.
        self.secrets_dir = Path(secrets_dir) if secrets_dir else self.vm_dir / ".vbs-secrets"
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._last_seen: dict[str, VmInfo] = {}

    # -- the HypervisorDriver contract -----------------------------------------------------------

    def list_vms(self) -> list[VmInfo]:
        vm_ids = (
            sorted(p.stem for p in self.vm_dir.glob("*.qmp") if VM_ID_RE.match(p.stem) and _is_socket(p))
            if self.vm_dir.is_dir()
            else []
        )
        # A VM this driver is busy with cannot be probed (QEMU serves one QMP client at a time):
        # report what was last seen rather than wait for, or misreport, it.
        free, busy = [], []
        for vm_id in vm_ids:
            (free if self._vm_lock(vm_id).acquire(blocking=False) else busy).append(vm_id)

        async def probe_all() -> list[VmInfo | None]:
            return await asyncio.gather(*(self._probe(vm_id) for vm_id in free))

        try:
            probed = [vm for vm in _run(probe_all()) if vm is not None]
        finally:
            for vm_id in free:
                self._vm_lock(vm_id).release()
        with self._locks_guard:
            self._last_seen.update((vm.vm_id, vm) for vm in probed)
            in_use = [self._last_seen.get(v, VmInfo(vm_id=v, name=v, running=True)) for v in busy]
        return sorted(probed + in_use, key=lambda vm: vm.vm_id)

    def attach(
        self,
        vm_id: str,
        connection: Connection,
        serial: str,
        *,
        read_only: bool = False,
        qos: QoS | None = None,
    ) -> AttachedDisk:
        ids = disk_ids(serial)
        _check_qos(qos)
        with self._vm_lock(vm_id):
            return _run(self._attach(vm_id, connection, serial, ids, read_only, qos))

    def detach(self, vm_id: str, serial: str, *, force: bool = False, timeout: float = 10.0) -> None:
        ids = disk_ids(serial)
        with self._vm_lock(vm_id):
            _run(self._detach(vm_id, serial, ids, force, timeout))

    def list_disks(self, vm_id: str) -> list[AttachedDisk]:
        with self._vm_lock(vm_id):
            return _run(self._list_disks(vm_id))

    def resize(self, vm_id: str, serial: str, connection: Connection, size_bytes: int) -> AttachedDisk:
        """Move the attached disk to ``connection`` (a refreshed export of its volume) and make the
        guest see ``size_bytes``; see the module docstring. Idempotent: a disk that already uses
        ``connection`` at that size is left alone. On failure the disk stays on its old connection.
        """
        ids = disk_ids(serial)
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0 or size_bytes % 512:
            raise InvalidParameter(f"size_bytes must be a positive multiple of 512, not {size_bytes!r}")
        with self._vm_lock(vm_id):
            return _run(self._resize(vm_id, serial, ids, connection, size_bytes))

    # -- internals -------------------------------------------------------------------------------

    def _vm_lock(self, vm_id: str) -> threading.Lock:
        self._socket(vm_id)  # validates the id before it names anything
        with self._locks_guard:
            return self._locks.setdefault(vm_id, threading.Lock())

    def _socket(self, vm_id: str) -> Path:
        if not isinstance(vm_id, str) or not VM_ID_RE.match(vm_id):
            raise InvalidParameter(f"invalid VM id {vm_id!r}")
        return self.vm_dir / f"{vm_id}.qmp"

    def _monitor(self, vm_id: str, timeout: float | None = None) -> _Monitor:
        return _Monitor(vm_id, self._socket(vm_id), timeout or self.qmp_timeout)

    async def _probe(self, vm_id: str) -> VmInfo | None:
        try:
            async with self._monitor(vm_id, min(self.qmp_timeout, PROBE_TIMEOUT)) as m:
                status = await m.cmd("query-status")
                name = (await m.cmd("query-name")).get("name") or vm_id
                return VmInfo(vm_id=vm_id, name=name, running=bool(status.get("running")))
        except NotFound:
            return None  # a stale socket left by a QEMU that is gone
        except DriverError as exc:
            # The process is there but its monitor does not answer us: list it, but not as running.
            log.warning("VM %s: %s", vm_id, exc)
            return VmInfo(vm_id=vm_id, name=vm_id, running=False)

    async def _list_disks(self, vm_id: str) -> list[AttachedDisk]:
        async with self._monitor(vm_id) as m:
            return await _our_disks(m)

    async def _attach(
        self,
        vm_id: str,
        connection: Connection,
        serial: str,
        ids: DiskIds,
        read_only: bool,
        qos: QoS | None,
    ) -> AttachedDisk:
        async with self._monitor(vm_id) as m:
            if ids.device in await m.devices():
                if ids.dead in await m.node_names():
                    raise IncorrectState(
                        f"disk {serial} of VM {vm_id} was force-detached and the guest has not released "
                        "it yet; detach it again once the guest lets go, or restart the VM"
                    )
                for disk in await _our_disks(m):
                    if disk.serial == serial:
                        return disk
            # Nodes without a device: a crashed attach or detach. Start from a clean slate.
            await _remove_nodes(m, ids)
            undo: list[Callable[[], Awaitable[Any]]] = []
            try:
                top = await self._build_chain(m, connection, ids, read_only, qos, undo)
                await m.cmd(
                    "device_add",
                    {"driver": "virtio-blk-pci", "id": ids.device, "drive": top, "serial": serial},
                )
            except Exception as exc:
                for step in reversed(undo):
                    try:
                        await step()
                    except (VbsError, QMPError) as err:
                        log.warning("VM %s: undo after failed attach of %s: %s", vm_id, serial, err)
                if isinstance(exc, VbsError):
                    raise
                raise DriverError(f"VM {vm_id}: attach of {serial} failed: {exc}") from exc
            return AttachedDisk(serial=serial, device_id=ids.device, node_name=top, read_only=read_only)

    async def _build_chain(
        self,
        m: _Monitor,
        connection: Connection,
        ids: DiskIds,
        read_only: bool,
        qos: QoS | None,
        undo: list[Callable[[], Awaitable[Any]]],
    ) -> str:
        async def add_object(args: dict[str, Any]) -> None:
            await m.cmd("object-add", args)
            undo.append(lambda: m.cmd("object-del", {"id": args["id"]}))

        async def add_node(args: dict[str, Any]) -> None:
            await m.cmd("blockdev-add", args)
            undo.append(lambda: m.cmd("blockdev-del", {"node-name": args["node-name"]}))

        gen = ids.generations[0]
        await self._add_protocol_node(connection, gen, read_only, add_object, add_node)
        await add_node(_raw_options(ids, gen.proto, read_only))
        if qos is None or (qos.iops is None and qos.mbps is None):
            return ids.raw
        limits: dict[str, int] = {}
        if qos.iops is not None:
            limits["iops-total"] = qos.iops
        if qos.mbps is not None:
            limits["bps-total"] = qos.mbps * MIB
        await add_object({"qom-type": "throttle-group", "id": ids.throttle_group, "limits": limits})
        await add_node(
            {
                "driver": "throttle",
                "node-name": ids.throttle,
                "throttle-group": ids.throttle_group,
                "file": ids.raw,
                "read-only": read_only,
            }
        )
        return ids.throttle

    async def _add_protocol_node(
        self,
        connection: Connection,
        gen: ProtoIds,
        read_only: bool,
        add_object: Callable[[dict[str, Any]], Awaitable[None]],
        add_node: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        proto = await self._protocol_node(connection, gen, add_object)
        await add_node({**proto, "node-name": gen.proto, "read-only": read_only, "discard": "unmap"})

    async def _protocol_node(
        self,
        connection: Connection,
        ids: ProtoIds,
        add_object: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> dict[str, Any]:
        if isinstance(connection, FileConnection):
            return {"driver": "file", "filename": connection.path}
        if isinstance(connection, NbdConnection):
            node: dict[str, Any] = {
                "driver": "nbd",
                "server": {"type": "inet", "host": connection.host, "port": str(connection.port)},
                "export": connection.export,
                # A restarted export daemon comes back with the same export: wait for it, not EIO.
                "reconnect-delay": NBD_RECONNECT_DELAY_S,
            }
            if connection.tls_psk_key is not None:
                await self._add_psk_creds(connection, ids, add_object)
                node["tls-creds"] = ids.tls
            return node
        if isinstance(connection, IscsiConnection):
            host = f"[{connection.host}]" if ":" in connection.host else connection.host
            node = {
                "driver": "iscsi",
                "transport": "tcp",
                "portal": f"{host}:{connection.port}",
                "target": connection.iqn,
                "lun": connection.lun,
            }
            if connection.initiator_name:
                node["initiator-name"] = connection.initiator_name
            if connection.chap_user:
                if connection.chap_secret is None:
                    raise InvalidParameter("iSCSI CHAP user given without a secret")
                # The secret travels inside the QMP session only, never on a command line or disk.
                secret = connection.chap_secret.get_secret_value()
                await add_object({"qom-type": "secret", "id": ids.secret, "data": secret})
                node["user"] = connection.chap_user
                node["password-secret"] = ids.secret
            return node
        raise InvalidParameter(f"QEMU driver cannot attach protocol {getattr(connection, 'protocol', '?')}")

    async def _add_psk_creds(
        self,
        connection: NbdConnection,
        ids: ProtoIds,
        add_object: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        assert connection.tls_psk_key is not None
        key = connection.tls_psk_key.get_secret_value()
        if not re.fullmatch(r"[0-9a-fA-F]{2,1024}", key):
            raise InvalidParameter("TLS-PSK key must be hexadecimal")
        identity = connection.tls_psk_identity or "qemu"
        self.secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.secrets_dir, 0o700)
        # One private directory per attach: QEMU wants a directory holding exactly "keys.psk".
        key_dir = Path(tempfile.mkdtemp(prefix=f"{ids.tls}-", dir=self.secrets_dir))
        key_file = key_dir / "keys.psk"
        try:
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{identity}:{key}\n")
            await add_object(
                {
                    "qom-type": "tls-creds-psk",
                    "id": ids.tls,
                    "endpoint": "client",
                    "dir": str(key_dir),
                    "username": identity,
                }
            )
        finally:
            # A client reads its key when the object is created: the file is not needed afterwards.
            key_file.unlink(missing_ok=True)
            key_dir.rmdir()

    async def _resize(
        self, vm_id: str, serial: str, ids: DiskIds, connection: Connection, size_bytes: int
    ) -> AttachedDisk:
        async with self._monitor(vm_id) as m:
            disk = next((d for d in await _our_disks(m) if d.serial == serial), None)
            if disk is None:
                raise NotFound(f"disk {serial} is not attached to VM {vm_id}", code="InvalidAttachment.NotFound")
            nodes = await m.nodes()
            if ids.dead in nodes:
                raise IncorrectState(f"disk {serial} of VM {vm_id} was force-detached; it cannot be resized")
            if ids.raw not in nodes or disk.node_name not in nodes:
                raise DriverError(f"VM {vm_id}: disk {serial} has no node {ids.raw}: not a disk VBS attached")
            if disk.read_only:
                # Measured: QEMU refuses block_resize on a read-only node ("Image is read-only"), and only
                # a truncate tells the device. The guest would never see the new size.
                raise IncorrectState(
                    f"disk {serial} of VM {vm_id} is attached read-only: QEMU cannot show the guest a new "
                    "size; detach and attach it again"
                )
            current = int(nodes[disk.node_name]["image"]["virtual-size"])
            if size_bytes < current:
                raise InvalidParameter(
                    f"disk {serial} of VM {vm_id} has {current} bytes; it cannot shrink to {size_bytes}"
                )

            # Which generation the raw node reads from. Two protocol nodes exist only after an
            # interrupted resize; blockdev-del refuses the one in use, so trying both keeps that one.
            present = [g for g in ids.generations if g.proto in nodes]
            interrupted = len(present) == 2
            if interrupted:
                for gen in present:
                    try:
                        await m.cmd("blockdev-del", {"node-name": gen.proto})
                    except QmpCommandError as exc:
                        log.debug("VM %s: %s is in use: %s", vm_id, gen.proto, exc.desc)
                nodes = await m.nodes()
                await _del_objects(m, [g for g in present if g.proto not in nodes])
                present = [g for g in ids.generations if g.proto in nodes]
            if len(present) != 1:
                raise DriverError(f"VM {vm_id}: disk {serial} has {len(present)} protocol nodes, expected one")
            old = present[0]
            new = ids.generations[1] if old == ids.generations[0] else ids.generations[0]

            if _uses(nodes[old.proto], connection):
                # A local file grows under its node (and a second node on it would not get the write
                # lock); an export that already has the size means the disk was moved already.
                if isinstance(connection, FileConnection) or nodes[old.proto]["image"]["virtual-size"] >= size_bytes:
                    # Only the notification may be missing (an interrupted resize).
                    if interrupted or current != size_bytes:
                        await m.cmd("block_resize", {"node-name": disk.node_name, "size": size_bytes})
                    return disk
                # Same export, but this node was opened before it grew (the export daemon restarted
                # under it, say): a fresh node on the same connection sees the new size.

            await _del_objects(m, [new])  # leftovers of a crash before its node was made
            undo: list[Callable[[], Awaitable[Any]]] = []

            async def add_object(args: dict[str, Any]) -> None:
                await m.cmd("object-add", args)
                undo.append(lambda: m.cmd("object-del", {"id": args["id"]}))

            async def add_node(args: dict[str, Any]) -> None:
                await m.cmd("blockdev-add", args)
                undo.append(lambda: m.cmd("blockdev-del", {"node-name": args["node-name"]}))

            try:
                await self._add_protocol_node(connection, new, False, add_object, add_node)
                # Every option of the raw node: blockdev-reopen resets the ones left out to defaults.
                await m.cmd("blockdev-reopen", {"options": [_raw_options(ids, new.proto, False)]})
                undo.append(lambda: m.cmd("blockdev-reopen", {"options": [_raw_options(ids, old.proto, False)]}))
                # Exactly the size: more than the export has fails ("Cannot grow"), and is refused here.
                await m.cmd("block_resize", {"node-name": disk.node_name, "size": size_bytes})
            except Exception as exc:
                for step in reversed(undo):
                    try:
                        await step()
                    except (VbsError, QMPError) as err:
                        log.warning("VM %s: undo after failed resize of %s: %s", vm_id, serial, err)
                if isinstance(exc, VbsError):
                    raise
                raise DriverError(f"VM {vm_id}: resize of {serial} failed: {exc}") from exc
            # The guest is on the new connection: the old one goes (a failure here leaves a node that
            # the next resize or the detach removes).
            try:
                await m.cmd("blockdev-del", {"node-name": old.proto})
                await _del_objects(m, [old])
            except VbsError as exc:
                log.warning("VM %s: could not release the old connection of %s: %s", vm_id, serial, exc)
            log.info("VM %s: disk %s moved to its refreshed export, now %d bytes", vm_id, serial, size_bytes)
            return disk

    async def _detach(self, vm_id: str, serial: str, ids: DiskIds, force: bool, timeout: float) -> None:
        async with self._monitor(vm_id) as m:
            if ids.device in await m.devices():
                wait = min(timeout, FORCE_GRACE_SECONDS) if force else timeout
                if not await _unplug(m, ids.device, wait):
                    if not force:
                        raise DeviceBusy(f"guest of VM {vm_id} did not release disk {serial} within {timeout:g}s")
                    await _cut_io(m, ids)
                    log.warning(
                        "VM %s: forced detach of %s: the guest still holds the device, its I/O now "
                        "fails and the storage connection is closed",
                        vm_id,
                        serial,
                    )
                    return
            await _remove_nodes(m, ids)


async def _our_disks(m: _Monitor) -> list[AttachedDisk]:
    by_device: dict[str, dict[str, Any]] = {}
    for blk in await m.cmd("query-block"):
        qdev = blk.get("qdev", "")
        parts = qdev.split("/")
        if qdev.startswith("/machine/peripheral/") and len(parts) > 3 and "inserted" in blk:
            by_device[parts[3]] = blk["inserted"]
    disks = []
    for dev in sorted(await m.devices()):
        match = _DEVICE_ID_RE.match(dev)
        if match and dev in by_device:
            inserted = by_device[dev]
            disks.append(
                AttachedDisk(
                    serial=match.group(1),
                    device_id=dev,
                    node_name=inserted.get("node-name", ""),
                    read_only=bool(inserted.get("ro")),
                )
            )
    return disks


async def _unplug(m: _Monitor, device: str, wait: float) -> bool:
    """Ask the guest to release ``device``; True once QEMU reports it deleted within ``wait`` s."""
    with m.client.listener("DEVICE_DELETED") as events:
        try:
            await m.cmd("device_del", {"id": device})
        except QmpCommandError as exc:
            if exc.error_class == "DeviceNotFound":
                return True
            # A repeated request while the guest has not answered the first one is not an error.
            if "already in the process of unplug" not in exc.desc and "pending" not in exc.desc:
                raise

        async def deleted() -> None:
            while True:
                event = await events.get()
                # QEMU also reports the virtio backend, with a path only; ours carries the id.
                if event.get("data", {}).get("device") == device:
                    return

        try:
            await asyncio.wait_for(deleted(), wait)
            return True
        except TimeoutError:
            # An event can be missed across reconnects; the VM's state is the truth.
            return device not in await m.devices()


async def _cut_io(m: _Monitor, ids: DiskIds) -> None:
    """Detach the storage from a disk the guest will not release.

    QEMU cannot remove a PCI device without the guest's consent, and a node under a device cannot be
    deleted. What it can do is swap the raw node's child for a node that fails every request
    (``blockdev-reopen``), after which the protocol node (the NBD/iSCSI session) can be deleted and the
    export removed safely. The device stays, reporting I/O errors, until the guest lets it go.
    """
    nodes = await m.node_names()
    added = ids.dead not in nodes
    if added:
        size = await m.node_size(ids.raw)
        await m.cmd(
            "blockdev-add",
            {
                "driver": "blkdebug",
                "node-name": ids.dead,
                "image": {"driver": "null-co", "size": size},
                # raw raises these events for every read and write it passes down.
                "inject-error": [{"event": "read_aio", "errno": 5}, {"event": "write_aio", "errno": 5}],
            },
        )
    # Always (re)do the swap: an earlier attempt may have timed out after adding the dead node. The
    # reopen drains in-flight requests, which wait up to the NBD reconnect delay if the export is gone.
    ro = ids.raw in nodes and await _read_only(m, ids.raw)
    try:
        await m.cmd("blockdev-reopen", {"options": [_raw_options(ids, ids.dead, ro)]},
                    timeout=max(m.timeout, NBD_RECONNECT_DELAY_S + 5))
    except QmpCommandError as exc:
        if "Error flushing" in exc.desc:
            # The reopen flushes the old connection first, and its storage is already gone (export
            # removed, node down): every request on it fails by now, which is all force promises.
            # It stays until the guest lets go; the caller then removes the export for good, so the
            # client cannot reconnect to it.
            log.warning("VM %s: the storage of %s is already unreachable: its I/O fails; leaving the dead "
                        "connection until the guest releases the device", m.vm_id, ids.raw)
            return
        if added:
            await m.cmd("blockdev-del", {"node-name": ids.dead})
        raise
    nodes = await m.node_names()
    for gen in ids.generations:  # after a resize the connection may be either generation
        if gen.proto in nodes:
            await m.cmd("blockdev-del", {"node-name": gen.proto})
    await _del_objects(m, ids.generations)


def _raw_options(ids: DiskIds, file: str, read_only: bool) -> dict[str, Any]:
    """The raw node's options: attach adds it with these, every blockdev-reopen repeats them all."""
    return {"driver": "raw", "node-name": ids.raw, "file": file, "read-only": read_only, "discard": "unmap"}


async def _del_objects(m: _Monitor, gens: Iterable[ProtoIds]) -> None:
    existing = await m.objects()
    for gen in gens:
        for obj in gen.objects:
            if obj in existing:
                await m.cmd("object-del", {"id": obj})


def _uses(node: dict[str, Any], connection: Connection) -> bool:
    """Whether a protocol node (as query-named-block-nodes shows it) is open on ``connection``.

    QEMU names an NBD node ``nbd://host:port/export`` (``json:{...}`` for IPv6), an iSCSI node opened
    from options ``json:{...}``, a file node by its path. Anything else counts as another connection.
    """
    filename = str(node.get("file", ""))
    opts: dict[str, Any] = {}
    if filename.startswith("json:"):
        try:
            opts = json.loads(filename[5:])
        except ValueError:
            return False
    if isinstance(connection, FileConnection):
        return node.get("drv") == "file" and filename == connection.path
    if isinstance(connection, NbdConnection):
        if node.get("drv") != "nbd":
            return False
        if opts:
            server = opts.get("server", {})
            return (str(server.get("host")), str(server.get("port")), opts.get("export")) == (
                connection.host,
                str(connection.port),
                connection.export,
            )
        host = f"[{connection.host}]" if ":" in connection.host else connection.host
        return filename == f"nbd://{host}:{connection.port}/{connection.export}"
    if isinstance(connection, IscsiConnection):
        host = f"[{connection.host}]" if ":" in connection.host else connection.host
        return node.get("drv") == "iscsi" and (
            opts.get("portal"),
            opts.get("target"),
            str(opts.get("lun")),
            opts.get("user"),
        ) == (f"{host}:{connection.port}", connection.iqn, str(connection.lun), connection.chap_user)
    return False


async def _read_only(m: _Monitor, node: str) -> bool:
    for n in await m.cmd("query-named-block-nodes", {"flat": True}):
        if n["node-name"] == node:
            return bool(n.get("ro"))
    return False


async def _remove_nodes(m: _Monitor, ids: DiskIds) -> None:
    """Delete this disk's nodes (top-down, as each holds the next) and objects, whichever exist."""
    nodes = await m.node_names()
    for node in ids.nodes_top_down:
        if node in nodes:
            await m.cmd("blockdev-del", {"node-name": node})
    existing = await m.objects()
    for obj in ids.objects:
        if obj in existing:
            await m.cmd("object-del", {"id": obj})


def _check_qos(qos: QoS | None) -> None:
    if qos is None:
        return
    for name, value in (("iops", qos.iops), ("mbps", qos.mbps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise InvalidParameter(f"QoS {name} must be a positive integer, not {value!r}")


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("QemuDriver is synchronous: call it from a thread (asyncio.to_thread), not a loop")
