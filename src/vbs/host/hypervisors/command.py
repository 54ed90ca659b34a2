"""The ``command`` hypervisor driver: the paper's (docs/architecture.md §1) command line extraction, as typed profiles.

Every action is a command of a profile (``vbs.profiles``): ``list_vms`` finds the VMs, ``attach`` and
``detach`` hot-plug, ``verify`` says whether a disk is in a VM (exit status 0 and its ``expect`` in
the output: present; exit 0 without it: absent; anything else: an error, never taken for absent).
Supporting a platform is writing a profile; the shipped ones are in ``vbs/profiles/hypervisor``.

What a profile's commands consume is its ``connection`` option:

- ``path``: a local file that opens the volume, made on this host by ``LocalPaths`` (a
  qemu-storage-daemon per volume, served through FUSE). TLS and CHAP end in that daemon, so this
  works with every export, including the secure defaults, and so does LUKS: an encrypted volume's
  path is its plaintext, decrypted on this host as a QEMU guest's disk is. ``{path}`` in the commands.
- ``nbd``: the platform opens an NBD export itself (``{nbd_host}``, ``{nbd_port}``, ``{nbd_export}``,
  ``{nbd_uri}``, or ``{nbd_socket}`` for a unix socket). Such tools cannot be given TLS
  credentials, so only a plaintext export is accepted; a TLS connection is refused with the reason.

With ``online_resize = "true"`` (``path`` profiles only), a volume grows while attached: the path is
moved onto the grown volume's refreshed connection and shows the new size (``LocalPaths.grow``). That
is for consumers that read the size of their file themselves (the ``csi-node`` profile: ``vbs csi``'s
NodeExpandVolume re-reads it into its loop device); a guest behind a ``phy:`` path would not notice.

The driver picks the guest device name (``{target}``: ``vdb``…, or ``xvdb``… with ``target_prefix``)
and the slot (``{index}``), and keeps what it attached in a private state file so that a restarted
agent finds its disks again. A failing command's output is in the error (``CommandFailed``), which
the controller keeps in the operation's step.
"""

from __future__ import annotations

import json
import logging
import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr

from vbs.config import HostAgentConfig
from vbs.connectors import CONNECTORS
from vbs.connectors.local_path import STATE_SUBDIR, LocalPaths
from vbs.errors import DeviceBusy, IncorrectState, InvalidParameter, NotFound
from vbs.host.hypervisors.luks import refuse_luks
from vbs.profiles import CommandSchema, Profile, ProfileSchema, load_profile
from vbs.qemu.tls import X509Files
from vbs.system.files import write_private
from vbs.wire.connection import AnyConnection, NbdConnection
from vbs.wire.host import SERIAL_RE, VM_ID_RE, DiskInfo, HypervisorCapabilities, QoS, VmInfo
from vbs.wire.storage import ItemStatus

__all__ = ["CommandDriver", "HYPERVISOR_PROFILES"]

log = logging.getLogger(__name__)

_DISK = frozenset({"vm", "serial", "volume", "target", "index", "access"})
_PATH = frozenset({"path"})
_NBD = frozenset({"nbd_uri", "nbd_host", "nbd_port", "nbd_export", "nbd_socket"})

HYPERVISOR_PROFILES = ProfileSchema(
    kind="hypervisor",
    commands={
        "list_vms": CommandSchema(frozenset(), description="print the running VMs; `lines` picks (?P<vm>…)"),
        "attach": CommandSchema(_DISK | _PATH | _NBD, description="hot-plug the disk"),
        "detach": CommandSchema(_DISK | _PATH, description="ask the guest to release the disk"),
        "verify": CommandSchema(_DISK | _PATH, description="exit 0 and print `expect` while the disk is there"),
    },
    options={
        "connection": (r"path|nbd", "path"),
        "target_prefix": (r"vd|xvd|sd", "vd"),
        "first_index": (r"[0-9]{1,2}", "1"),
        "online_resize": (r"true|false", "false"),
    },
)

_TARGETS = 24  # b..y after the prefix: the guest's own disk is the first


class _Disk(BaseModel):
    vm: str = Field(pattern=VM_ID_RE.pattern)
    serial: str = Field(pattern=SERIAL_RE.pattern)
    target: str = Field(pattern=r"^(?:vd|xvd|sd)[a-z]{1,2}$")
    index: int = Field(ge=0, le=255)
    read_only: bool = False
    connected: bool = True


class CommandDriver:
    """A hypervisor driven by a command profile (see the module docstring)."""

    def __init__(self, profile: Profile, state_dir: Path, *, x509: X509Files | None = None,
                 detach_poll_s: float = 0.2) -> None:
        self.profile = profile
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._state_file = self.state_dir / f"command-{profile.name}-disks.json"
        self.form = profile.options["connection"]
        self.prefix = profile.options["target_prefix"]
        self.first_index = int(profile.options["first_index"])
        self.detach_poll_s = detach_poll_s
        self.paths = LocalPaths(self.state_dir / STATE_SUBDIR, secrets_dir=self.state_dir / "secrets", x509=x509)
        protocols = sorted(CONNECTORS) if self.form == "path" else ["nbd"]
        online_resize = profile.options["online_resize"] == "true"
        if online_resize and self.form != "path":
            raise InvalidParameter(f"profile {profile.name}: online_resize needs connection = \"path\"")
        self.capabilities = HypervisorCapabilities.model_validate({"protocols": protocols,
                                                                    "online_resize": online_resize,
                                                                    "luks": self.form == "path"})
        self._lock = threading.Lock()
        self._vm_locks: dict[str, threading.Lock] = {}

    @classmethod
    def from_config(cls, cfg: HostAgentConfig) -> CommandDriver:
        if not cfg.profile:
            raise InvalidParameter("the command hypervisor driver needs a profile (--hypervisor-profile NAME or PATH)")
        profile = load_profile(HYPERVISOR_PROFILES, cfg.profile, cfg.profile_dirs)
        state = cfg.state_dir.resolve() if cfg.state_dir is not None else cfg.vm_dir.resolve() / ".vbs-command"
        return cls(profile, state, x509=X509Files.from_config(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))

    # -- the HypervisorDriver contract -----------------------------------------------------------

    def list_vms(self) -> list[VmInfo]:
        out = self.profile.run("list_vms", {})
        names = sorted({m["vm"] for m in out.matches(self.profile.commands["list_vms"])
                        if VM_ID_RE.fullmatch(m.get("vm", ""))})
        return [VmInfo(vm_id=name, name=name, running=True) for name in names]

    def attach(self, vm_id: str, serial: str, connection: AnyConnection, *, read_only: bool = False,
               qos: QoS | None = None, luks: SecretStr | None = None) -> DiskInfo:
        if self.form != "path":
            refuse_luks(luks, f"the {self.profile.name} profile of the command driver")
        _check(vm_id, serial)
        if qos is not None and (qos.iops is not None or qos.mbps is not None):
            raise IncorrectState(f"the {self.profile.name} profile cannot limit a disk's I/O (no QoS)")
        with self._vm(vm_id):
            disks = self._load()
            known = disks.get(serial)
            if known is not None and known.vm != vm_id:
                raise IncorrectState(f"disk {serial} is attached to VM {known.vm} on this host, not {vm_id}")
            if known is not None and self._present(known):
                return self._info(known)
            if not self._vm_running(vm_id):
                raise NotFound(f"VM {vm_id} is not running on this host", code="InvalidInstanceID.NotFound")
            disk = known or self._new_disk(disks, vm_id, serial, read_only)
            values = self._values(disk)
            if self.form == "path":
                values["path"] = str(self.paths.open(serial, connection, read_only=read_only, luks=luks))
            else:
                values.update(_nbd_values(connection))
            disks[serial] = disk
            self._save(disks)  # before the command: a crash in it leaves a record to clean up
            try:
                self.profile.run("attach", values)
                if not self._present(disk):
                    raise IncorrectState(f"the {self.profile.name} profile's attach succeeded but verify does not "
                                         f"find disk {serial} in VM {vm_id}")
            except BaseException:
                self._forget(disk)
                raise
            log.info("attached %s to %s as %s through profile %s", serial, vm_id, disk.target, self.profile.name)
            return self._info(disk)

    def detach(self, vm_id: str, serial: str, *, force: bool = False, timeout: float = 10.0) -> None:
        _check(vm_id, serial)
        with self._vm(vm_id):
            disk = self._load().get(serial)
            if disk is None or disk.vm != vm_id:
                return  # not a disk this driver attached there: nothing to undo
            if not self._vm_running(vm_id):
                self._forget(disk)
                return
            if self._present(disk):
                self.profile.run("detach", self._values(disk))
            deadline = time.monotonic() + timeout
            while self._present(disk):
                if time.monotonic() >= deadline:
                    if not force:
                        raise DeviceBusy(f"the guest in VM {vm_id} did not release disk {serial} within "
                                         f"{timeout:g}s", vm=vm_id, serial=serial)
                    # Forced: the path stops serving (the guest's I/O on it fails); the record
                    # stays, disconnected, until the guest lets go and a detach finds it gone.
                    self.paths.close(serial)
                    disks = self._load()
                    disks[serial] = disk.model_copy(update={"connected": False})
                    self._save(disks)
                    return
                time.sleep(self.detach_poll_s)
            self._forget(disk)
            log.info("detached %s from %s through profile %s", serial, vm_id, self.profile.name)

    def list_disks(self, vm_id: str) -> list[DiskInfo]:
        if not VM_ID_RE.fullmatch(vm_id):
            raise InvalidParameter(f"invalid VM id {vm_id[:70]!r}")
        with self._vm(vm_id):
            if not self._vm_running(vm_id):
                raise NotFound(f"VM {vm_id} is not running on this host", code="InvalidInstanceID.NotFound")
            return [self._info(d) for d in sorted(self._load().values(), key=lambda d: d.serial)
                    if d.vm == vm_id and self._present(d)]

    def resize(self, vm_id: str, serial: str, connection: AnyConnection, size_bytes: int) -> DiskInfo:
        if not self.capabilities.online_resize:
            raise IncorrectState(f"the {self.profile.name} profile cannot show a guest a grown disk; detach it first")
        _check(vm_id, serial)
        with self._vm(vm_id):
            disk = self._load().get(serial)
            if disk is None or disk.vm != vm_id or not self._present(disk):
                raise NotFound(f"disk {serial} is not attached to VM {vm_id}", code="InvalidAttachment.NotFound")
            if disk.read_only or not disk.connected:
                raise IncorrectState(f"disk {serial} of VM {vm_id} is {'read-only' if disk.read_only else 'cut off'}: "
                                     "it cannot grow while attached")
            self.paths.grow(serial, connection, size_bytes)
            log.info("disk %s of %s grown to %d bytes through profile %s", serial, vm_id, size_bytes,
                     self.profile.name)
            return self._info(disk)

    def ensure_copy(self, vm_id: str, serial: str, copy_id: str, target: AnyConnection) -> ItemStatus:
        raise IncorrectState(f"the {self.profile.name} profile cannot copy an attached disk at one instant")

    def remove_copy(self, vm_id: str, serial: str, copy_id: str) -> None:
        return None  # it never makes one

    def close(self) -> None:
        self.paths.release()  # the paths serve on: attached guests keep their disks

    # -- inside ------------------------------------------------------------------------------------

    @contextmanager
    def _vm(self, vm_id: str) -> Iterator[None]:
        with self._lock:
            lock = self._vm_locks.setdefault(vm_id, threading.Lock())
        with lock:
            yield

    def _vm_running(self, vm_id: str) -> bool:
        return vm_id in {vm.vm_id for vm in self.list_vms()}

    def _present(self, disk: _Disk) -> bool:
        values = self._values(disk)
        if self.form == "path":
            values["path"] = str(self.paths.root / disk.serial / "disk")
        return self.profile.probe("verify", values)

    def _values(self, disk: _Disk) -> dict[str, object]:
        return {"vm": disk.vm, "serial": disk.serial, "volume": f"vol-{disk.serial[3:]}", "target": disk.target,
                "index": disk.index, "access": "ro" if disk.read_only else "rw"}

    def _info(self, disk: _Disk) -> DiskInfo:
        size = self.paths.size_of(disk.serial) if self.form == "path" else None
        return DiskInfo(serial=disk.serial, read_only=disk.read_only, size_bytes=size, connected=disk.connected)

    def _new_disk(self, disks: dict[str, _Disk], vm_id: str, serial: str, read_only: bool) -> _Disk:
        used = {d.index for d in disks.values() if d.vm == vm_id}
        free = next((i for i in range(_TARGETS) if i + self.first_index not in used), None)
        if free is None:
            raise IncorrectState(f"VM {vm_id} has no free device name left for the {self.profile.name} profile")
        return _Disk(vm=vm_id, serial=serial, target=self.prefix + string.ascii_lowercase[free + 1],
                     index=free + self.first_index, read_only=read_only)

    def _forget(self, disk: _Disk) -> None:
        if self.form == "path":
            self.paths.close(disk.serial)
        disks = self._load()
        if disk.serial in disks and disks[disk.serial].vm == disk.vm:
            del disks[disk.serial]
            self._save(disks)

    def _load(self) -> dict[str, _Disk]:
        try:
            raw: dict[str, Any] = json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise IncorrectState(f"{self._state_file} is damaged: {exc}") from exc
        return {serial: _Disk.model_validate(d) for serial, d in raw.items()}

    def _save(self, disks: dict[str, _Disk]) -> None:
        write_private(self._state_file, json.dumps({s: d.model_dump() for s, d in sorted(disks.items())},
                                                   indent=1) + "\n")


def _check(vm_id: str, serial: str) -> None:
    if not isinstance(vm_id, str) or not VM_ID_RE.fullmatch(vm_id):
        raise InvalidParameter(f"invalid VM id {str(vm_id)[:70]!r}")
    if not isinstance(serial, str) or not SERIAL_RE.fullmatch(serial):
        raise InvalidParameter(f"invalid disk serial {str(serial)[:70]!r}")


def _nbd_values(connection: AnyConnection) -> dict[str, object]:
    if not isinstance(connection, NbdConnection):
        raise IncorrectState(f"this profile opens NBD exports only, not {connection.protocol}")
    if connection.tls is not None:
        raise IncorrectState("this profile's tool cannot be given TLS credentials: the export is served over TLS. "
                             "Use a profile whose connection is 'path' (TLS then ends on this host)")
    if connection.socket is not None:
        return {"nbd_socket": connection.socket, "nbd_export": connection.export}
    host = f"[{connection.host}]" if ":" in str(connection.host) else str(connection.host)
    return {"nbd_host": str(connection.host), "nbd_port": connection.port, "nbd_export": connection.export,
            "nbd_uri": f"nbd://{host}:{connection.port}/{connection.export}"}

