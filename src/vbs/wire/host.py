"""What the controller and a host agent say to each other: disks, VMs, capabilities, the heartbeat."""

from __future__ import annotations

import re
from datetime import datetime

from pydantic import Field, SecretStr, field_serializer, field_validator

from vbs.wire.base import Wire
from vbs.wire.connection import ADDRESS_RE, HOST_NAME_RE, IQN_RE, Connection, ProtocolName
from vbs.wire.storage import NODE_URL_RE

__all__ = [
    "MirrorDisk",
    "QoS",
    "VmInfo",
    "VmList",
    "DiskInfo",
    "DiskList",
    "AttachDisk",
    "ResizeDisk",
    "CopyDisk",
    "HypervisorCapabilities",
    "HostHeartbeat",
    "SERIAL_RE",
    "VM_ID_RE",
    "CLOUD_SCHEME_RE",
    "CLOUD_ID_RE",
]

# A disk's serial is its volume id without the dash (20 bytes: all a virtio-blk serial holds).
SERIAL_RE = re.compile(r"^vol[0-9a-f]{17}$")
VM_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# An external cloud's scheme ("nova") and one of its ids, as host agents report them.
CLOUD_SCHEME_RE = re.compile(r"[a-z][a-z0-9-]{0,31}")
CLOUD_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class QoS(Wire):
    """Per-disk limits; ``mbps`` is MiB/s, as EBS counts throughput."""

    iops: int | None = Field(None, ge=1, le=1_000_000)
    mbps: int | None = Field(None, ge=1, le=100_000)


class VmInfo(Wire):
    vm_id: str = Field(pattern=VM_ID_RE.pattern)
    name: str = Field("", max_length=255)
    running: bool
    # The hypervisor's own id of the VM, where it has one (a libvirt domain's UUID).
    uuid: str | None = Field(None, pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    # The ids an external cloud gives the VM, by the cloud's scheme ("nova" → the Nova instance
    # UUID), as the hypervisor knows them (a libvirt domain's <metadata>); instance-id resolvers
    # look them up.
    cloud_ids: dict[str, str] = Field(default_factory=dict, max_length=8)

    @field_validator("cloud_ids")
    @classmethod
    def _cloud_ids(cls, value: dict[str, str]) -> dict[str, str]:
        for scheme, cloud_id in value.items():
            if not CLOUD_SCHEME_RE.fullmatch(scheme) or not CLOUD_ID_RE.fullmatch(cloud_id):
                raise ValueError(f"invalid cloud id {scheme[:40]!r}: {cloud_id[:140]!r}")
        return value


class VmList(Wire):
    vms: list[VmInfo] = Field(max_length=4096)


class DiskInfo(Wire):
    """A disk VBS attached to a VM. The guest names it (``vdb``…); the serial is how anyone finds it.

    ``connected`` is False for what a forced detach leaves while the guest still holds the device:
    its storage connection is closed and its I/O fails until the guest lets go.
    """

    serial: str = Field(pattern=SERIAL_RE.pattern)
    read_only: bool
    size_bytes: int | None = Field(None, ge=0)
    connected: bool = True


class DiskList(Wire):
    disks: list[DiskInfo]


class AttachDisk(Wire):
    connection: Connection
    read_only: bool = False
    qos: QoS | None = None
    # An encrypted volume: the passphrase of its LUKS container (capabilities.luks).
    luks_passphrase: SecretStr | None = Field(None, min_length=16, max_length=256)

    @field_serializer("luks_passphrase", when_used="json")
    def _reveal(self, v: SecretStr | None) -> str | None:
        return v.get_secret_value() if v is not None else None


class PauseVm(Wire):
    """Pause the VM; the agent resumes it by itself after ``hold_s`` if no one does first."""

    hold_s: int = Field(ge=1, le=300, strict=True)


class PauseAnswer(Wire):
    # False: the VM was not running (paused by someone else): resuming it is not VBS's to do.
    paused_by_vbs: bool


class ResizeDisk(Wire):
    """Move the attached disk to ``connection`` (a refreshed export of its grown volume) and show the
    guest ``size_bytes``."""

    connection: Connection
    size_bytes: int = Field(ge=512, le=64 << 40, multiple_of=512, strict=True)


class CopyDisk(Wire):
    """Copy the disk, as it is at the instant the copy starts, into ``target`` (a snapshot file the
    storage node made writable for this host)."""

    target: Connection


class MirrorDisk(Wire):
    """Mirror the disk, while its guest runs on, onto ``target`` (the volume's new export on another
    storage node); ``pivot``: once the copy is in step, switch the guest's disk onto the target."""

    target: Connection
    pivot: bool = False


class HypervisorCapabilities(Wire):
    """What a host's hypervisor driver can do: workflows ask these instead of assuming QEMU.

    ``protocols``: connection kinds it opens itself. ``online_resize``: it can show a guest a grown
    disk. ``qos``: it enforces iops/throughput limits. ``point_in_time_copy``: it can copy an
    attached disk at one instant into a target (``CopyDisk``).
    """

    protocols: list[ProtocolName]
    online_resize: bool = False
    # The connections it grows online, where not all (None: every protocol it opens). A libvirt
    # disk on RBD grows in place (blockResize); one on an NBD or iSCSI export keeps its size.
    online_resize_protocols: list[ProtocolName] | None = None
    qos: bool = False
    point_in_time_copy: bool = False
    # It opens encrypted volumes (LUKS containers) itself with the passphrase an attach brings.
    luks: bool = False
    # It pauses a VM (I/O drained) for a crash-consistent snapshot set of its disks (PauseVm).
    pause: bool = False
    # It mirrors an attached disk onto another export and switches the guest onto it (MirrorDisk):
    # a volume in use moves to another storage node.
    mirror: bool = False


class HostHeartbeat(Wire):
    """What a host agent reports: its address for export ACLs, what it can do and its VMs.

    ``vms`` is None when listing them failed this time: the controller keeps what it knew.
    """

    name: str = Field(pattern=HOST_NAME_RE.pattern)
    url: str = Field(pattern=NODE_URL_RE)
    address: str = Field(pattern=ADDRESS_RE)
    initiator_name: str | None = Field(None, pattern=IQN_RE)
    hypervisor: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")
    capabilities: HypervisorCapabilities
    started_at: datetime
    vms: list[VmInfo] | None = Field(None, max_length=4096)
