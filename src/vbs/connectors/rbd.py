"""Ceph RBD: QEMU's own librbd client opens the image, as the attachment's cephx user.

The key reaches QEMU as a ``secret`` object whose data it reads from a file (``file=``, base64)
in a fresh private directory that exists only while the object is made; the ``rbd`` node names
that secret (``key-secret``) and insists on cephx. The key is never in a QMP log line, an argv, an
exception text or the node's options.

Online resize (measured, QEMU 7.2 with Ceph 16): an open rbd node keeps reporting the size it was
opened with, and ``block_resize`` to the image's new size succeeds (librbd resizes to the size it
already has) and tells the device: the guest sees the new capacity on the node it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from vbs.connectors.base import (
    HostConnector,
    KeyFile,
    LibvirtAuth,
    LibvirtSource,
    QemuBlockdev,
    QemuIds,
    QemuObject,
    json_filename,
)
from vbs.wire.connection import RbdConnection

__all__ = ["RbdConnector"]


class RbdConnector(HostConnector[RbdConnection]):
    protocol: ClassVar[str] = "rbd"
    qemu_node_sees_growth: ClassVar[bool] = True

    def qemu_blockdev(self, connection: RbdConnection, ids: QemuIds) -> QemuBlockdev:
        options: dict[str, Any] = {
            "driver": "rbd",
            "pool": connection.pool,
            "image": connection.image,
            "server": [_server(m) for m in connection.monitors],
            "user": connection.user,
            "key-secret": ids.secret,
            "auth-client-required": ["cephx"],
        }
        if connection.namespace:
            options["namespace"] = connection.namespace
        secret = QemuObject(qom_type="secret", id=ids.secret, props={"format": "base64"},
                            key_files=(KeyFile("key", connection.key),), key_file_arg="file")
        return QemuBlockdev(options=options, objects=(secret,))

    def libvirt_source(self, connection: RbdConnection) -> LibvirtSource:
        """``<source protocol='rbd' name='pool[/namespace]/image'>`` with the monitors as hosts;
        the cephx key goes into a libvirt secret of usage ``ceph`` only."""
        name = "/".join(p for p in (connection.pool, connection.namespace, connection.image) if p)
        hosts = tuple({"name": s["host"], "port": s["port"]} for s in map(_server, connection.monitors))
        return LibvirtSource(protocol="rbd", name=name, hosts=hosts,
                             auth=LibvirtAuth(username=connection.user, secret=connection.key, usage="ceph",
                                              encoding="base64"))

    def qemu_node_opens(self, node: Mapping[str, Any], connection: RbdConnection) -> bool:
        # QEMU names an rbd node opened from options json:{...} (its servers flattened).
        if node.get("drv") != "rbd":
            return False
        opts = json_filename(node) or {}
        return (opts.get("pool"), opts.get("namespace") or None, opts.get("image"), opts.get("user")) == (
            connection.pool, connection.namespace, connection.image, connection.user)


def _server(monitor: str) -> dict[str, str]:
    """A monitor ``address:port`` (``[v6]:port``) as QEMU's ``InetSocketAddressBase``."""
    host, _, port = monitor.rpartition(":")
    return {"host": host.removeprefix("[").removesuffix("]"), "port": port}
