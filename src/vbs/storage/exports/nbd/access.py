"""Who may open an NBD session on an export of the driver: over TCP, each host's export has an
nbdkit front of its own (``vbs.storage.exports.perhost``: its trust anchor admits that host's
certificate only, or its PSK file holds that host's key only), which reaches qemu-storage-daemon
on its unix socket in a 0700 directory; under ``vbs up`` the host's QEMU opens that socket itself.

Exports made before the fronts (release 0.1.0's state file: no port, no address) were told the
daemon's own TCP port, ``nbd_port``, and their hosts' QEMU reconnects there. While the desired state
holds any, one more nbdkit process, the *legacy front*, listens on ``nbd_port``: the nbd plugin
passing the client's export name through to the daemon (``dynamic-export``), under the exportname
filter in strict mode with those exports' names only, listing none; with X.509 it admits any
certificate of the install's CA (the hosts' addresses are not known: no anchor of one address),
with TLS-PSK the keys of the hosts that hold such exports. So a host of the install that knows one
of those 128-bit names opens it, as under 0.1.0 (where every admitted host could even list them);
never a newer export. When such an export goes, the front restarts with the names left (its
clients reconnect), and it stops with the last one.

Here: the TLS-PSK key of every host with an export (``<state_dir>/tls/keys.psk``, 0600: one key per
host, written into each of its fronts' one-host key files), the fronts' processes, and the
connection a host is told (the socket, or its front's port)."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from vbs.connectors.nbd import NBD_RECONNECT_DELAY_S
from vbs.qemu.tls import X509Files
from vbs.storage.exports.perhost import OneHost, Processes, TlsMode
from vbs.system.files import write_private
from vbs.wire.connection import NbdConnection

from .state import Book, HostExport, hashed

log = logging.getLogger("vbs.storage.exports.nbd.driver")  # the records keep the driver's name

FRONT_THREADS = 16
# A front rides out a restart of the daemon: a request that fails (the daemon died under it) is
# tried again on a new session with the daemon, every second, for as long as the host's client
# itself waits for a server that went away (NBD_RECONNECT_DELAY_S).
RETRY = ("retry",)
RETRY_PARAMS = (f"retries={NBD_RECONNECT_DELAY_S}", "retry-delay=1", "retry-exponential=no")
LEGACY = "legacy"  # the legacy front's files: "legacy-<hash of its names>"


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

    def legacy(self, exp: HostExport) -> bool:
        """Whether ``exp`` was made before the fronts: its host reaches it through the legacy front."""
        return self.fronts is not None and exp.port is None

    def front(self, key: str, exp: HostExport) -> OneHost:
        """What the front of ``exp`` serves: the daemon's export of it, through the nbd plugin, under
        the same name, to its host only (or the legacy front, for an export made before fronts)."""
        if self.legacy(exp) and (legacy := self._legacy_front()) is not None:
            return legacy
        return OneHost(pid=front_id(exp), what=key, host=exp.host, address=exp.address, name=exp.name,
                       read_only=exp.read_only, port=exp.port, psk=self.keys.get(exp.host),
                       filters=RETRY, plugin=("nbd", f"socket={self.socket}", f"export={exp.name}", *RETRY_PARAMS))

    def _legacy_front(self) -> OneHost | None:
        """What the legacy front serves (None: no export made before the fronts is left)."""
        if self.fronts is None:
            return None
        exps = sorted((e for s in self._book.desired().values() for e in s.exports if e.port is None),
                      key=lambda e: e.name)
        if not exps:
            return None
        names = tuple(e.name for e in exps)
        keys = tuple((h, self.keys[h]) for h in sorted({e.host for e in exps}) if h in self.keys)
        first = keys[0] if keys else ("any host of the install's CA", None)
        return OneHost(pid=f"{LEGACY}-{hashed(' '.join(names))}", what=f"{len(names)} export(s) made before the fronts",
                       host=first[0], address="", name=names[0], more_names=names[1:], read_only=False,
                       port=self.fronts.ports.start, psk=first[1], any_host_of_ca=True, more_keys=keys[1:],
                       filters=RETRY, plugin=("nbd", f"socket={self.socket}", "dynamic-export=true", *RETRY_PARAMS))

    def run_legacy(self) -> None:
        """The legacy front as the desired state has it: running with the names of the exports made
        before the fronts (one with another list of names is stopped first: it holds the port), or
        stopped when none is left."""
        if self.fronts is None:
            return
        want = self._legacy_front()
        for pid in self.fronts.ids():
            if pid.startswith(f"{LEGACY}-") and (want is None or pid != want.pid):
                self.fronts.end(pid)
                log.info("stopped the NBD legacy front %s (%s)", pid,
                         "its list of exports changed" if want else "no export made before the fronts is left")
        if want is not None:
            self.fronts.run(want)

    def free_port(self) -> int | None:
        """A port for a new front (None without fronts); the legacy front's while it has exports."""
        if self.fronts is None:
            return None
        taken = {e.port for s in self._book.desired().values() for e in s.exports}
        if None in taken:
            taken.add(self.fronts.ports.start)
        return self.fronts.free_port(taken)

    def run_front(self, key: str, exp: HostExport) -> None:
        """The front of ``exp`` running (adopted, or started again with the same port, name and key)."""
        if self.legacy(exp):
            self.run_legacy()
        elif self.fronts is not None:
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
        if (legacy := self._legacy_front()) is not None:
            known.add(legacy.pid)
        for pid in self.fronts.end_unknown(known):
            log.warning("stopped NBD front %s: it served no export this agent knows", pid)

    def stop_fronts(self) -> None:
        if self.fronts is not None:
            for served in self._book.desired().values():
                for exp in served.exports:
                    if not self.legacy(exp):
                        self.fronts.stop(self.front(served.key, exp))
            if (legacy := self._legacy_front()) is not None:
                self.fronts.stop(legacy)

    def forget_fronts(self) -> None:
        if self.fronts is not None:
            self.fronts.forget()

    def connection(self, key: str, exp: HostExport, host: str) -> NbdConnection:
        """What the host of ``exp`` connects with: the socket, or its front's address and TLS."""
        if self.fronts is None:
            return NbdConnection(socket=str(self.socket), export=exp.name)
        if self.legacy(exp):  # the legacy front's port, the export's name, its host's key
            return self.fronts.connection(OneHost(
                pid=LEGACY, what=key, host=exp.host, address="", name=exp.name, read_only=exp.read_only,
                port=self.fronts.ports.start, psk=self.keys.get(exp.host), plugin=()), host)
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
