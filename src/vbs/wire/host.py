"""What the controller and a host agent say to each other: disks, VMs, capabilities, the heartbeat."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import (
    Field,
    SecretStr,
    field_serializer,
    field_validator,
)

from vbs.wire.base import Wire, left_out_while_empty
from vbs.wire.connection import ADDRESS_RE, HOST_NAME_RE, IQN_RE, Connection, HostConnection, ProtocolName
from vbs.wire.probes import MAX_PROBES, Probe
from vbs.wire.qos import QoS
from vbs.wire.storage import MAX_POOLS, NODE_URL_RE, PoolInfo

__all__ = [
    "MirrorDisk",
    "QoS",
    "VmInfo",
    "VmList",
    "DiskInfo",
    "DiskList",
    "AttachDisk",
    "DiskQoS",
    "ResizeDisk",
    "CopyDisk",
    "FillVolume",
    "HypervisorCapabilities",
    "HostHeartbeat",
    "VmStatus",
    "MigrationInfo",
    "StartMigration",
    "PCI_SLOT_RE",
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
# Where a disk's device sits on the VM's PCI bus, as QEMU's ``addr`` takes it ("slot.function", hex),
# after the id of the PCIe port it is plugged into, if any ("rp1/00.0"): a live migration's
# destination must place each device exactly where the source has it.
PCI_SLOT_RE = re.compile(r"^(?:(?P<bus>[A-Za-z][A-Za-z0-9_.-]{0,62})/)?(?P<addr>[0-9a-f]{2}\.[0-7])$")
# A hypervisor's run state of a VM, lower case (QEMU's RunState: "running", "paused", "inmigrate",
# "postmigrate", ...): what a live migration's steps read.
VmStatus = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,31}$")]


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
    # The hypervisor's run state where it tells one: "inmigrate" is a destination VM waiting for a
    # live migration (started with ``-incoming``), "postmigrate" a source whose guest went elsewhere.
    status: VmStatus | None = None

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
    # Its device's PCI slot (drivers that place devices themselves): a live migration's destination copies it.
    pci_slot: str | None = Field(None, pattern=PCI_SLOT_RE.pattern)


class DiskList(Wire):
    disks: list[DiskInfo]


class AttachDisk(Wire):
    connection: HostConnection
    read_only: bool = False
    qos: QoS | None = None
    # An encrypted volume: the passphrase of its LUKS container (capabilities.luks).
    luks_passphrase: SecretStr | None = Field(None, min_length=16, max_length=256)
    # Put the device in this PCI slot (the source's, for a live migration's destination); None: any free one.
    pci_slot: str | None = Field(None, pattern=PCI_SLOT_RE.pattern)

    @field_serializer("luks_passphrase", when_used="json")
    def _reveal(self, v: SecretStr | None) -> str | None:
        return v.get_secret_value() if v is not None else None


class DiskQoS(Wire):
    """An attached disk's new limits (None: unlimited), changed live."""

    qos: QoS | None = None


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


class FillVolume(Wire):
    """Fill a volume of the host's local pool from ``source`` (a shared snapshot's data, which the
    storage node exports to this host read-only)."""

    source: Connection


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
    # It live-migrates a VM to a destination VM waiting as "inmigrate" on another host (MigrationInfo).
    live_migration: bool = False
    # It mirrors an attached disk onto another export and switches the guest onto it (MirrorDisk):
    # a volume in use moves to another storage node.
    mirror: bool = False


class StartMigration(Wire):
    """Send the VM's running state to ``uri``: the destination host's incoming migration (``tcp:ADDR:PORT``)."""

    uri: str = Field(pattern=r"^tcp:(\[[0-9a-fA-F:]{2,45}\]|[0-9.]{7,15}|[a-z0-9][a-z0-9.-]{0,252}):[0-9]{1,5}$")


# ``MigrationInfo.state`` of a migration under way (QEMU's MigrationStatus): what the host agent waits out
# and the controller's migrate-instance workflow reads as "in flight".
MIGRATION_ACTIVE_STATES = frozenset({"setup", "active", "pre-switchover", "device", "wait-unplug", "cancelling",
                                     "postcopy-active", "postcopy-paused", "postcopy-recover"})


class MigrationInfo(Wire):
    """A VM's side of a live migration: its run state and its migration's (QEMU's ``query-migrate``).

    ``state``: None when no migration was started on it; else "setup", "active", "completed",
    "failed", "cancelled"... ``uri``: where a destination listens (``tcp:ADDR:PORT``), once it does.
    """

    vm_id: str = Field(pattern=VM_ID_RE.pattern)
    status: VmStatus
    state: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,31}$")
    uri: str | None = Field(None, max_length=300)
    transferred_bytes: int = Field(0, ge=0)
    remaining_bytes: int = Field(0, ge=0)
    total_bytes: int = Field(0, ge=0)
    # Of a completed migration (the source's): how long it took, and how long the guest was stopped.
    total_time_ms: int | None = Field(None, ge=0)
    downtime_ms: int | None = Field(None, ge=0)
    error: str | None = Field(None, max_length=2000)


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
    # The latest RTT probe of each storage node (vbs.host.probes).
    probes: list[Probe] = Field(default_factory=list, max_length=MAX_PROBES)
    # Its local pools (semi-shared storage): volumes on this node's own disks, attached with no network hop.
    local_pools: list[PoolInfo] = Field(default_factory=list, max_length=MAX_POOLS)

    _older_controllers = left_out_while_empty("local_pools")
