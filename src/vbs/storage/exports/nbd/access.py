"""Who may open an NBD session on an export of the driver: over TCP, each host's export has an
nbdkit front of its own (``vbs.storage.exports.perhost``: its trust anchor admits that host's
certificate only, or its PSK file holds that host's key only), which reaches qemu-storage-daemon
on its unix socket in a 0700 directory; under ``vbs up`` the host's QEMU opens that socket itself.

Here: the TLS-PSK key of every host with an export (``<state_dir>/tls/keys.psk``, 0600: one key per
host, written into each of its fronts' one-host key files), the fronts' processes, and the
connection a host is told (the socket, or its front's port)."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from vbs.qemu.tls import X509Files
from vbs.storage.exports.perhost import OneHost, Processes, TlsMode
from vbs.system.files import write_private
from vbs.wire.connection import NbdConnection

from .state import Book, HostExport, hashed

log = logging.getLogger("vbs.storage.exports.nbd.driver")  # the records keep the driver's name

FRONT_THREADS = 16


class Access:
    """The session boundary of the driver's exports in its ``tls`` mode (see the package's driver
    docstring). ``socket``: the daemon's unix socket; ``ports``: those fronts take over TCP (None:
    the socket is the hosts' own, no fronts)."""

    def __init__(self, tls: TlsMode, state_dir: Path, x509: X509Files | None, book: Book, *, socket: Path,
                 listen_host: str, ports: range | None, start_timeout: float) -> None:
        self.tls = tls
        self.x509 = x509
        self.socket = socket
        self.tls_dir = state_dir / "tls"
        self.keys_path = self.tls_dir / "keys.psk"
        self.keys: dict[str, str] = {}  # host name -> hex PSK
        self._book = book
        self.fronts = None if ports is None else Processes(
            state_dir / "fronts", listen_host=listen_host, ports=ports, tls=tls, x509=x509, socket_dir=None,
            threads=FRONT_THREADS, start_timeout=start_timeout, logger=log.name,
            ports_option="[storage_agent.options.nbd] ports")

    def prepare(self) -> None:
        """The directory of the daemon's socket (0700: the boundary of the socket), and the hosts'
        PSK keys from the desired state just loaded."""
        self.socket.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.socket.parent.chmod(0o700)
        if self.tls != "psk" or self.fronts is None:
            return
        # A host with no export keeps no key (a crash came between removing its last export and
        # dropping the key); one with exports and no key (TLS was just turned on) gets one.
        keys = self.read_keys()
        self.keys = {h: keys.get(h) or secrets.token_hex(32) for h in sorted(self._book.hosts_with_exports())}
        self.write_keys()

    # -- the fronts --------------------------------------------------------------------------------

    def front(self, key: str, exp: HostExport) -> OneHost:
        """What the front of ``exp`` serves: the daemon's export of it, through the nbd plugin, under
        the same name, to its host only."""
        return OneHost(pid=front_id(exp), what=key, host=exp.host, address=exp.address, name=exp.name,
                       read_only=exp.read_only, port=exp.port, psk=self.keys.get(exp.host),
                       plugin=("nbd", f"socket={self.socket}", f"export={exp.name}"))

    def free_port(self) -> int | None:
        """A port for a new front (None without fronts)."""
        if self.fronts is None:
            return None
        return self.fronts.free_port({e.port for s in self._book.desired().values() for e in s.exports})

    def run_front(self, key: str, exp: HostExport) -> None:
        """The front of ``exp`` running (adopted, or started again with the same port, name and key)."""
        if self.fronts is not None:
            self.fronts.run(self.front(key, exp))

    def end_front(self, exp: HostExport) -> None:
        """Stop the front of ``exp`` and remove its files: its clients are cut off."""
        if self.fronts is not None:
            self.fronts.end(front_id(exp))

    def end_unknown_fronts(self) -> None:
        """Stop the fronts of exports the desired state does not have (an agent died between
        forgetting an export and stopping its front): none outlives its attachment."""
        if self.fronts is None:
            return
        known = {front_id(e) for s in self._book.desired().values() for e in s.exports}
        for pid in self.fronts.end_unknown(known):
            log.warning("stopped NBD front %s: it served no export this agent knows", pid)

    def stop_fronts(self) -> None:
        if self.fronts is not None:
            for served in self._book.desired().values():
                for exp in served.exports:
                    self.fronts.stop(self.front(served.key, exp))

    def forget_fronts(self) -> None:
        if self.fronts is not None:
            self.fronts.forget()

    def connection(self, key: str, exp: HostExport, host: str) -> NbdConnection:
        """What the host of ``exp`` connects with: the socket, or its front's address and TLS."""
        if self.fronts is None:
            return NbdConnection(socket=str(self.socket), export=exp.name)
        return self.fronts.connection(self.front(key, exp), host)

    # -- PSK keys ----------------------------------------------------------------------------------

    def needs_key(self, host: str) -> bool:
        return self.tls == "psk" and self.fronts is not None and host not in self.keys

    def host_gone(self, host_name: str) -> None:
        """The host's last export here went: its key goes too."""
        if host_name in self.keys:
            del self.keys[host_name]
            self.write_keys()

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

    def write_keys(self) -> None:
        # The GnuTLS password-file format that psktool writes: "identity:hexkey" per line.
        self.tls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(self.keys_path, "".join(f"{h}:{k}\n" for h, k in sorted(self.keys.items())))


def front_id(exp: HostExport) -> str:
    """The name of the files of ``exp``'s front (pidfile, log, TLS directory): never a secret."""
    return hashed(exp.id)
