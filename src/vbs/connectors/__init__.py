"""Host connectors: turn a volume's connection into what a hypervisor driver consumes.

One module per protocol (``nbd``, ``iscsi``, ``rbd``, ``file``) behind the small contract of ``base``
(os-brick's idea, typed). A driver never looks at the connection's class; it asks::

    connector = connector_for(connection)
    blockdev = connector.qemu_blockdev(connection, QemuIds(proto=..., secret=..., tls=...))
    for obj in blockdev.objects:
        with obj.qmp_arguments(secrets_dir) as args:   # key files exist only inside the block
            qmp.execute("object-add", args)
    qmp.execute("blockdev-add", {**blockdev.options, "node-name": ..., "read-only": ...})
    connector.qemu_node_opens(node, connection)        # is this reported node open on it?
"""

from __future__ import annotations

from typing import Any

from vbs.connectors.base import HostConnector, KeyFile, QemuBlockdev, QemuIds, QemuObject
from vbs.connectors.file import FileConnector
from vbs.connectors.iscsi import IscsiConnector
from vbs.connectors.nbd import NbdConnector
from vbs.connectors.rbd import RbdConnector
from vbs.errors import InvalidParameter
from vbs.wire.connection import AnyConnection

__all__ = [
    "connector_for",
    "CONNECTORS",
    "HostConnector",
    "QemuIds",
    "QemuBlockdev",
    "QemuObject",
    "KeyFile",
]

CONNECTORS: dict[str, HostConnector[Any]] = {c.protocol: c for c in (NbdConnector(), IscsiConnector(), RbdConnector(),
                                                                            FileConnector())}


def connector_for(connection: AnyConnection) -> HostConnector[Any]:
    """The connector of ``connection``'s protocol."""
    protocol = getattr(connection, "protocol", None)
    connector = CONNECTORS.get(str(protocol))
    if connector is None:
        raise InvalidParameter(f"no host connector for protocol {protocol!r}")
    return connector
