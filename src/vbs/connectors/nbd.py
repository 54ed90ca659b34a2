"""NBD: QEMU's own NBD client, over TCP with TLS (X.509 or a pre-shared key) or over a unix socket."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import SecretStr

from vbs.connectors.base import (
    HostConnector,
    KeyFile,
    LibvirtSource,
    QemuBlockdev,
    QemuIds,
    QemuObject,
    bracketed,
    json_filename,
)
from vbs.errors import IncorrectState, InvalidParameter
from vbs.wire.connection import NbdConnection

__all__ = ["NbdConnector", "NBD_RECONNECT_DELAY_S"]

# How long guest I/O waits for a lost NBD connection to come back (export daemon restarted).
NBD_RECONNECT_DELAY_S = 15
_HEX_KEY_RE = re.compile(r"[0-9a-fA-F]{2,1024}")


class NbdConnector(HostConnector[NbdConnection]):
    protocol: ClassVar[str] = "nbd"

    def qemu_blockdev(self, connection: NbdConnection, ids: QemuIds) -> QemuBlockdev:
        options: dict[str, Any] = {
            "driver": "nbd",
            "server": _server(connection),
            "export": connection.export,
            # A restarted export daemon comes back with the same export: wait for it, not EIO.
            "reconnect-delay": NBD_RECONNECT_DELAY_S,
        }
        if connection.tls == "x509":
            # The host's certificate from the install's CA; QEMU checks the server's certificate
            # against the CA and the address it connects to.
            creds = QemuObject(qom_type="tls-creds-x509", id=ids.tls,
                               props={"endpoint": "client", "verify-peer": True}, host_x509=True)
            return QemuBlockdev(options={**options, "tls-creds": ids.tls}, objects=(creds,))
        if connection.tls != "psk" or connection.tls_psk_key is None:
            return QemuBlockdev(options=options)
        key = connection.tls_psk_key.get_secret_value()
        if not _HEX_KEY_RE.fullmatch(key):
            raise InvalidParameter("TLS-PSK key must be hexadecimal")
        identity = connection.tls_psk_identity or "qemu"
        # QEMU wants a directory holding exactly "keys.psk"; a client reads it once, when the object
        # is made, so the file exists only for that moment.
        psk = QemuObject(
            qom_type="tls-creds-psk",
            id=ids.tls,
            props={"endpoint": "client", "username": identity},
            key_files=(KeyFile("keys.psk", SecretStr(f"{identity}:{key}\n")),),
        )
        return QemuBlockdev(options={**options, "tls-creds": ids.tls}, objects=(psk,))

    def qemu_node_opens(self, node: Mapping[str, Any], connection: NbdConnection) -> bool:
        # QEMU names an NBD node nbd://host:port/export (nbd+unix:///export?socket=path), or
        # json:{...} when a URL cannot say it all.
        if node.get("drv") != "nbd":
            return False
        opts = json_filename(node)
        if opts is not None:
            server = opts.get("server") or {}
            if connection.socket is not None:
                return (server.get("type"), server.get("path"), opts.get("export")) == (
                    "unix", connection.socket, connection.export)
            return (str(server.get("host")), str(server.get("port")), opts.get("export")) == (
                connection.host,
                str(connection.port),
                connection.export,
            )
        return node.get("file") == _url(connection)

    def libvirt_source(self, connection: NbdConnection) -> LibvirtSource:
        if connection.tls == "psk":
            raise IncorrectState("libvirt cannot open NBD over TLS-PSK (its NBD disks know X.509 only)")
        if connection.socket is not None:
            hosts: tuple[dict[str, str], ...] = ({"transport": "unix", "socket": connection.socket},)
        else:
            hosts = ({"name": str(connection.host), "port": str(connection.port)},)
        return LibvirtSource(protocol="nbd", name=connection.export, hosts=hosts, tls=connection.tls == "x509")


def _server(connection: NbdConnection) -> dict[str, str]:
    if connection.socket is not None:
        return {"type": "unix", "path": connection.socket}
    assert connection.host is not None and connection.port is not None  # the model guarantees one
    return {"type": "inet", "host": connection.host, "port": str(connection.port)}


def _url(connection: NbdConnection) -> str:
    if connection.socket is not None:
        return f"nbd+unix:///{connection.export}?socket={connection.socket}"
    assert connection.host is not None
    return f"nbd://{bracketed(connection.host)}:{connection.port}/{connection.export}"
