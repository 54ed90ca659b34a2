"""The libvirt XML of VBS's disks and secrets: a hot-plugged ``<disk>`` with the user alias ``ua-<serial>``
by which every later call finds it, and the ephemeral, private ``<secret>`` its credentials go into.
"""

from __future__ import annotations

import re
import uuid
import xml.etree.ElementTree as ET

from vbs.connectors.base import LibvirtSource
from vbs.errors import IncorrectState, InvalidParameter
from vbs.wire.host import SERIAL_RE, QoS
from vbs.wire.qos import throttle_limits

__all__ = ["ALIAS_PREFIX", "disk_alias", "secret_uuid", "luks_secret_uuid", "iotune_limits", "disk_xml", "secret_xml",
           "free_target", "our_disks"]

ALIAS_PREFIX = "ua-"  # libvirt keeps user aliases only with this prefix
_ALIAS_RE = re.compile(r"^ua-(vol[0-9a-f]{17})$")
# Secrets of VBS's disks have UUIDs derived from (domain name, serial): found again after a restart.
_SECRET_NAMESPACE = uuid.UUID("0b6f4a52-52a3-4e0c-9a49-7d0c3d2f1a61")


def disk_alias(serial: str) -> str:
    if not isinstance(serial, str) or not SERIAL_RE.fullmatch(serial):
        raise InvalidParameter(f"invalid disk serial {serial!r} (a volume id without its dash)")
    return ALIAS_PREFIX + serial


def secret_uuid(vm_id: str, serial: str) -> str:
    """The UUID of the libvirt secret holding the credentials of disk ``serial`` of domain ``vm_id``."""
    return str(uuid.uuid5(_SECRET_NAMESPACE, f"{vm_id}/{serial}"))


def luks_secret_uuid(vm_id: str, serial: str) -> str:
    """The UUID of the libvirt secret holding the LUKS passphrase of an encrypted disk."""
    return str(uuid.uuid5(_SECRET_NAMESPACE, f"{vm_id}/{serial}/luks"))


def iotune_limits(qos: QoS | None) -> dict[str, int]:
    """libvirt's names for QEMU's throttle limits (``vbs.wire.qos.throttle_limits``), zero: none."""
    limits = throttle_limits(qos)
    return {"total_iops_sec": limits["iops-total"], "total_bytes_sec": limits["bps-total"],
            "size_iops_sec": limits["iops-size"]}


def disk_xml(serial: str, target: str, source: LibvirtSource, *, read_only: bool = False, qos: QoS | None = None,
             secret: str | None = None, luks_secret: str | None = None, iothread: int | None = None) -> str:
    """The ``<disk>`` that attaches ``source`` as virtio disk ``target`` with ``serial`` (xml.etree
    escapes every value; each was validated by its wire model before). ``luks_secret``: the volume is a
    LUKS container, opened by QEMU with the passphrase in that libvirt secret. ``iothread``: the id of
    the domain's I/O thread the disk runs in (none: QEMU's main loop)."""
    disk = ET.Element("disk", {"type": "network", "device": "disk"})
    driver = {"name": "qemu", "type": "raw", "discard": "unmap"}
    if iothread is not None:
        driver["iothread"] = str(int(iothread))
    ET.SubElement(disk, "driver", driver)
    source_el = source.element(secret)
    if luks_secret is not None:
        encryption = ET.SubElement(source_el, "encryption", {"format": "luks", "engine": "qemu"})
        ET.SubElement(encryption, "secret", {"type": "passphrase", "uuid": luks_secret})
    disk.append(source_el)
    ET.SubElement(disk, "target", {"dev": target, "bus": "virtio"})
    if qos is not None and (qos.iops is not None or qos.mbps is not None):
        iotune = ET.SubElement(disk, "iotune")
        for name, value in iotune_limits(qos).items():
            if value:
                ET.SubElement(iotune, name).text = str(value)
    if read_only:
        ET.SubElement(disk, "readonly")
    ET.SubElement(disk, "serial").text = serial
    ET.SubElement(disk, "alias", {"name": disk_alias(serial)})
    return ET.tostring(disk, encoding="unicode")


def secret_xml(uuid_: str, vm_id: str, serial: str, usage: str) -> str:
    secret = ET.Element("secret", {"ephemeral": "yes", "private": "yes"})
    ET.SubElement(secret, "uuid").text = uuid_
    ET.SubElement(secret, "description").text = f"VBS: credentials of disk {serial} of domain {vm_id}"
    usage_el = ET.SubElement(secret, "usage", {"type": usage})
    # The usage id must be unique among the libvirtd's secrets of that type.
    ET.SubElement(usage_el, {"iscsi": "target", "volume": "volume"}.get(usage, "name")).text = f"vbs-{uuid_}"
    return ET.tostring(secret, encoding="unicode")


def free_target(domain: ET.Element) -> str:
    """The first virtio disk name (vdb, vdc… vdaa…) no disk of the domain uses."""
    used = {t.get("dev") for t in domain.iterfind("devices/disk/target")}
    for k in range(1, 26 * 27):
        name = "vd" + (chr(ord("a") + k) if k < 26 else chr(ord("a") + k // 26 - 1) + chr(ord("a") + k % 26))
        if name not in used:
            return name
    raise IncorrectState("the domain has no free virtio disk name left")


def our_disks(domain: ET.Element) -> dict[str, ET.Element]:
    """The disks VBS attached, by serial: those with its user alias."""
    found: dict[str, ET.Element] = {}
    for disk in domain.iterfind("devices/disk"):
        alias = disk.find("alias")
        match = _ALIAS_RE.fullmatch(alias.get("name", "")) if alias is not None else None
        if match is not None:
            found[match.group(1)] = disk
    return found
