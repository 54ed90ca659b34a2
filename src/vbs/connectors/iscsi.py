"""iSCSI: QEMU's libiscsi initiator, with CHAP whose secret travels only inside the QMP session."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from vbs.connectors import base
from vbs.errors import InvalidParameter
from vbs.wire.connection import IscsiConnection

__all__ = ["IscsiConnector"]


class IscsiConnector(base.HostConnector[IscsiConnection]):
    protocol: ClassVar[str] = "iscsi"

    def qemu_blockdev(self, connection: IscsiConnection, ids: base.QemuIds) -> base.QemuBlockdev:
        options: dict[str, Any] = {
            "driver": "iscsi",
            "transport": "tcp",
            "portal": _portal(connection),
            "target": connection.iqn,
            "lun": connection.lun,
        }
        if connection.initiator_name:
            options["initiator-name"] = connection.initiator_name
        if not connection.chap_user:
            return base.QemuBlockdev(options=options)
        if connection.chap_secret is None:
            raise InvalidParameter("iSCSI CHAP user given without a secret")
        # A QEMU secret object made over QMP: never on a command line or on disk.
        secret = base.QemuObject(qom_type="secret", id=ids.secret, secret_props={"data": connection.chap_secret})
        options.update({"user": connection.chap_user, "password-secret": ids.secret})
        return base.QemuBlockdev(options=options, objects=(secret,))

    def qemu_node_opens(self, node: Mapping[str, Any], connection: IscsiConnection) -> bool:
        # QEMU names an iSCSI node opened from options json:{...}.
        if node.get("drv") != "iscsi":
            return False
        opts = base.json_filename(node) or {}
        return (opts.get("portal"), opts.get("target"), str(opts.get("lun")), opts.get("user")) == (
            _portal(connection),
            connection.iqn,
            str(connection.lun),
            connection.chap_user,
        )

    def libvirt_source(self, connection: IscsiConnection) -> base.LibvirtSource:
        auth = None
        if connection.chap_user:
            if connection.chap_secret is None:
                raise InvalidParameter("iSCSI CHAP user given without a secret")
            auth = base.LibvirtAuth(username=connection.chap_user, secret=connection.chap_secret, usage="iscsi")
        return base.LibvirtSource(protocol="iscsi", name=f"{connection.iqn}/{connection.lun}",
                             hosts=({"name": connection.host, "port": str(connection.port)},),
                             initiator_iqn=connection.initiator_name, auth=auth)


def _portal(connection: IscsiConnection) -> str:
    return f"{base.bracketed(connection.host)}:{connection.port}"
