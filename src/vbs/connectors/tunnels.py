"""The host's ends of iSCSI TLS tunnels: one stunnel per storage portal, on this host's loopback.

QEMU's iSCSI initiator (libiscsi) speaks no TLS. A connection marked ``tls="stunnel"`` is opened
through a local stunnel client that presents this host's certificate and checks the storage
node's; QEMU dials ``127.0.0.1:<local port>`` instead of the portal. A tunnel is kept per portal
for the life of the host (a restarted agent adopts it, keeping its port, so QEMU's sessions
reconnect); its config names only files (see ``vbs.net.stunnel``).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from vbs.errors import InvalidParameter
from vbs.net.ports import free_port
from vbs.net.stunnel import Tunnel, accept_port, client_config
from vbs.qemu.tls import X509Files
from vbs.wire.connection import AnyConnection, IscsiConnection

__all__ = ["IscsiTunnels"]


class IscsiTunnels:
    """This host's tunnel ends, in ``directory`` (0700), with its own certificate ``x509``."""

    def __init__(self, directory: Path, x509: X509Files | None) -> None:
        self.directory = directory
        self.x509 = x509
        self._lock = threading.Lock()
        self._tunnels: dict[tuple[str, int], Tunnel] = {}

    def local(self, connection: AnyConnection) -> AnyConnection:
        """``connection`` as QEMU dials it: itself, or (an iSCSI portal served through TLS) this
        host's end of a tunnel to it."""
        if not isinstance(connection, IscsiConnection) or connection.tls != "stunnel":
            return connection
        if self.x509 is None:
            raise InvalidParameter("this iSCSI export is served through TLS: set tls_cert, tls_key and tls_ca "
                                   "of [host_agent]")
        portal = (connection.host, connection.port)
        name = hashlib.sha256(f"{connection.host}:{connection.port}".encode()).hexdigest()[:16]
        conf = self.directory / f"iscsi-{name}.conf"
        with self._lock:
            tunnel = self._tunnels.setdefault(portal, Tunnel(conf))
            port = accept_port(conf) or free_port()
            tunnel.ensure(client_config(port, portal, self.x509), ("127.0.0.1", port))
        return connection.model_copy(update={"host": "127.0.0.1", "port": port, "tls": None})

    def pids(self) -> list[int]:
        with self._lock:
            return [pid for t in self._tunnels.values() if (pid := t.pid) is not None]

    def stop(self) -> None:
        """Stop every tunnel (by PID)."""
        with self._lock:
            for tunnel in self._tunnels.values():
                tunnel.stop()

    def close(self) -> None:
        """Let go of them, running: the next agent adopts them and QEMU's sessions go on."""
        with self._lock:
            for tunnel in self._tunnels.values():
                tunnel.forget()
