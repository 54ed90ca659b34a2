"""The libvirt secrets of VBS's disks: credentials (iSCSI CHAP, Ceph) and LUKS passphrases, each in an
ephemeral, private secret whose value is set through the API (never in an XML), undefined when the disk goes.
"""

from __future__ import annotations

import base64

import libvirt
from pydantic import SecretStr

from vbs.connectors.base import LibvirtSource
from vbs.host.hypervisors.libvirt_xml import luks_secret_uuid, secret_uuid, secret_xml

__all__ = ["define_secret", "define_luks_secret", "drop_secret"]


def define_secret(conn: libvirt.virConnect, vm_id: str, serial: str, source: LibvirtSource) -> str:
    assert source.auth is not None
    uuid_ = secret_uuid(vm_id, serial)
    secret = conn.secretDefineXML(secret_xml(uuid_, vm_id, serial, source.auth.usage), 0)
    try:
        value = source.auth.secret.get_secret_value()
        secret.setValue(base64.b64decode(value, validate=True) if source.auth.encoding == "base64"
                        else value.encode(), 0)
    except libvirt.libvirtError:
        secret.undefine()
        raise
    return uuid_


def define_luks_secret(conn: libvirt.virConnect, vm_id: str, serial: str, luks: SecretStr) -> str:
    """An ephemeral, private secret with the passphrase, set through the API (never in an XML)."""
    uuid_ = luks_secret_uuid(vm_id, serial)
    secret = conn.secretDefineXML(secret_xml(uuid_, vm_id, serial, "volume"), 0)
    try:
        secret.setValue(luks.get_secret_value().encode(), 0)
    except libvirt.libvirtError:
        secret.undefine()
        raise
    return uuid_


def drop_secret(conn: libvirt.virConnect, vm_id: str, serial: str) -> None:
    for uuid_ in (secret_uuid(vm_id, serial), luks_secret_uuid(vm_id, serial)):
        try:
            conn.secretLookupByUUIDString(uuid_).undefine()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_SECRET:
                raise
