"""Who may open an NBD session on the daemon: the TLS-PSK key file (one key per host with an
export here) or the X.509 ``tls-authz`` list, and the connection each host is told to use."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from pydantic import SecretStr

from vbs.errors import DriverError
from vbs.qemu.qmp import QmpCommandError
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.system.files import write_private
from vbs.wire.connection import NbdConnection

from .daemon import AUTHZ_ID, Monitor, TlsMode
from .state import Book, HostExport

log = logging.getLogger(__name__)


class Access:
    """The session boundary of one daemon in its ``tls`` mode (see the package's driver docstring)."""

    def __init__(self, tls: TlsMode, state_dir: Path, x509: X509Files | None, monitor: Monitor, book: Book) -> None:
        self.tls = tls
        self.x509 = x509
        self.x509_dir = state_dir / "x509"
        self.tls_dir = state_dir / "tls"
        self.keys_path = self.tls_dir / "keys.psk"
        self.keys: dict[str, str] = {}  # host name -> hex PSK
        self._monitor, self._book = monitor, book

    def prepare(self, socket_dir: Path | None, socket: Path | None) -> None:
        """The credentials the daemon reads as it starts, from the desired state just loaded; the
        directories of a unix ``socket`` (``socket_dir`` and the one it is in)."""
        if socket_dir is not None and socket is not None:
            # The boundary of a unix-socket export: only this user may enter the directory.
            for d in {socket_dir, socket.parent}:
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
                d.chmod(0o700)
        if self.tls == "x509":
            assert self.x509 is not None
            qemu_x509_dir(self.x509, self.x509_dir, "server")
        if self.tls != "psk":
            return
        # A host with no export keeps no key (a crash came between removing its last export and
        # dropping the key); one with exports and no key (TLS was just turned on) gets one. The
        # file is written even when empty: QSD refuses to start without it.
        keys = self.read_keys()
        self.keys = {h: keys.get(h) or secrets.token_hex(32) for h in sorted(self._book.hosts_with_exports())}
        self.write_keys()

    def connection(self, exp: HostExport, *, socket: Path | None, host: str, port: int) -> NbdConnection:
        """What the host of ``exp`` connects with: the socket, or the address and its TLS."""
        if socket is not None:
            return NbdConnection(socket=str(socket), export=exp.name)
        if self.tls == "x509":
            return NbdConnection(host=host, port=port, export=exp.name, tls="x509")
        key = self.keys.get(exp.host) if self.tls == "psk" else None
        return NbdConnection(host=host, port=port, export=exp.name,
                             tls_psk_identity=exp.host if key else None,
                             tls_psk_key=SecretStr(key) if key else None)

    def needs_key(self, host: str) -> bool:
        return self.tls == "psk" and host not in self.keys

    def is_new_host(self, host: str) -> bool:
        return self.tls == "x509" and host not in self._book.hosts_with_exports()

    def host_gone(self, host_name: str, running: bool) -> None:
        """The host's last export here went: it may not even open a TLS session any more."""
        if self.tls == "psk" and host_name in self.keys:
            del self.keys[host_name]
            self.write_keys()
        if self.tls == "x509" and running and self._monitor.client is not None:  # else made at its next start
            self.write_authz()

    def read_keys(self) -> dict[str, str]:
        keys: dict[str, str] = {}
        try:
            text = self.keys_path.read_text()
        except FileNotFoundError:
            return keys
        for line in text.splitlines():
            ident, sep, key = line.strip().partition(":")
            if sep and ident and key:
                keys[ident] = key
        return keys

    def write_authz(self) -> None:
        """Replace the daemon's authz list with the hosts that have an export here (QEMU cannot change
        an authz-list's rules in place; it looks the object up by id at each handshake, and refuses
        every client while it is missing)."""
        rules = [{"match": f"CN={h}", "policy": "allow", "format": "exact"}
                 for h in sorted(self._book.hosts_with_exports())]
        try:
            self._monitor.q("object-del", {"id": AUTHZ_ID})
        except QmpCommandError as exc:
            if "not found" not in exc.desc:
                raise
        self._monitor.q("object-add", {"qom-type": "authz-list", "id": AUTHZ_ID, "policy": "deny", "rules": rules})

    def write_authz_best_effort(self) -> None:
        try:
            self.write_authz()
        except DriverError as exc:
            log.error("could not update the NBD authz list: %s", exc.message)

    def write_keys(self) -> None:
        # The GnuTLS password-file format that psktool writes: "identity:hexkey" per line.
        self.tls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(self.keys_path, "".join(f"{h}:{k}\n" for h, k in sorted(self.keys.items())))
