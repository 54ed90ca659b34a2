"""TLS around iSCSI, which has none of its own: one supervised ``stunnel`` per tunnel end.

The storage agent runs the server end: TLS on the export address, the client certificate checked
against the install's CA and against the names of the hosts that hold an export there
(``checkHost``, rewritten and reloaded with SIGHUP as hosts come and go), plaintext handed to tgtd
on 127.0.0.1. A host agent runs one client end per storage portal: a port on its own loopback
that QEMU's iSCSI initiator dials, TLS with the host's certificate to the storage node, whose
certificate is checked against the CA and the address dialled.

The config files hold paths only (no secret: keys stay in their 0600 files). Each stunnel runs in
its own session with a minimal environment, is adopted from its pidfile by a restarted agent and
stopped by PID (``vbs.system.daemons``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from vbs.errors import DriverError
from vbs.qemu.tls import X509Files
from vbs.system.daemons import START_TIMEOUT_S, Daemon, DaemonSpec, argv0_is
from vbs.system.files import write_private
from vbs.system.processes import catches, minimal_environment

__all__ = ["STUNNEL", "Tunnel", "server_config", "client_config", "listening"]

STUNNEL = "stunnel"
# A checkHost no VBS host name can match (they start with a letter or digit): with no host
# holding an export, stunnel must refuse every client rather than accept any CA certificate.
NO_HOST = "-no-host-"
# What stunnel logs (at its default level, 5) at the end of reading its config, after a SIGHUP too.
_RELOADED = "Configuration successful"
_RELOAD_FAILED = "Configuration failed"
_ACCEPT_RE = re.compile(r"^accept = 127\.0\.0\.1:(\d+)$", re.MULTILINE)


def _endpoint(host: str, port: int) -> str:
    return f"{host}:{port}"


def _common(files: X509Files) -> str:
    return (f"cert = {files.cert}\nkey = {files.key}\nCAfile = {files.ca}\n"
            "verifyChain = yes\nsslVersionMin = TLSv1.2\n")


def server_config(accept: tuple[str, int], connect_port: int, files: X509Files, hosts: list[str]) -> str:
    """The storage end: TLS on ``accept``, only certificates of ``hosts``, plaintext to tgtd."""
    checks = "".join(f"checkHost = {h}\n" for h in sorted(hosts) or [NO_HOST])
    return ("foreground = yes\npid =\n[iscsi]\n"
            f"accept = {_endpoint(*accept)}\nconnect = 127.0.0.1:{connect_port}\n" + _common(files) + checks)


def client_config(local_port: int, connect: tuple[str, int], files: X509Files) -> str:
    """A host's end: 127.0.0.1:``local_port`` for QEMU, TLS with the host's certificate to ``connect``."""
    host = connect[0]
    try:
        ipaddress.ip_address(host)
        check = f"checkIP = {host}\n"
    except ValueError:
        check = f"checkHost = {host}\n"
    return ("foreground = yes\npid =\n[iscsi]\nclient = yes\n"
            f"accept = 127.0.0.1:{local_port}\nconnect = {_endpoint(*connect)}\n" + _common(files) + check)


def accept_port(conf: Path) -> int | None:
    """The loopback port a client config file accepts on (a restarted agent keeps it)."""
    try:
        m = _ACCEPT_RE.search(conf.read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def listening(host: str, port: int) -> bool:
    """Whether a socket on this machine listens on ``host``:``port`` (read from /proc)."""
    want = ipaddress.ip_address(host)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr_hex, port_hex = fields[1].rsplit(":", 1)
            if fields[3] != "0A" or int(port_hex, 16) != port:
                continue
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(bytes.fromhex(addr_hex[i:i + 8])[::-1] for i in range(0, len(addr_hex), 8))
            if ipaddress.ip_address(raw) in (want, ipaddress.ip_address("0.0.0.0" if len(raw) == 4 else "::")):
                return True
    return False


@dataclass
class Tunnel:
    """One stunnel process and its config file ``conf`` (pidfile and log beside it)."""

    conf: Path

    def __post_init__(self) -> None:
        conf = str(self.conf)
        self.daemon = Daemon(DaemonSpec(
            name=STUNNEL, argv=(STUNNEL, conf), pid_path=self.conf.with_suffix(".pid"),
            log_path=self.conf.with_suffix(".log"), owns=lambda pid: argv0_is(pid, STUNNEL, mentions=conf),
            env=minimal_environment(), start_timeout=START_TIMEOUT_S))

    @property
    def pid(self) -> int | None:
        return self.daemon.pid

    def ensure(self, text: str, listen: tuple[str, int]) -> None:
        """Run stunnel with ``text`` as its config, listening on ``listen``: started, adopted, or
        reloaded (SIGHUP) when the config changed."""
        try:
            changed = self.conf.read_text() != text
        except OSError:
            changed = True
        if changed:
            self.conf.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(self.conf, text)
        if self.daemon.running() or self.daemon.adopt():
            if changed:
                self._reload()
            return
        self.daemon.spawn(lambda _deadline: self._ready(*listen))

    def _ready(self, host: str, port: int) -> None:
        # stunnel listens before it installs its signal handlers: a reload (SIGHUP) sent in between
        # would end it (SIGHUP's default) or be lost (ignored by inheritance). Ready is both.
        _ready(host, port)
        pid = self.daemon.pid
        if pid is None or not catches(pid, signal.SIGHUP):
            raise DriverError(f"{STUNNEL} does not take reloads yet")

    def _reload(self) -> None:
        """Make stunnel re-read its config (open sessions stay) and wait until it has: a host added is
        admitted, and a host removed refused, when this returns (``DriverError`` if the new config was
        refused or not read within the start timeout)."""
        deadline = time.monotonic() + self.daemon.spec.start_timeout
        pid = self.daemon.pid
        while pid is not None and not catches(pid, signal.SIGHUP) and time.monotonic() < deadline:
            time.sleep(0.02)  # an stunnel another agent just started
        if pid is None:
            raise DriverError(f"{STUNNEL} is not running: its config cannot be reloaded")
        start = self.daemon.log_size()
        os.kill(pid, signal.SIGHUP)
        while True:
            logged = self.daemon.log_since(start) or ""
            if _RELOAD_FAILED in logged:
                raise DriverError(f"{STUNNEL} refused its new config: {self.daemon.log_tail(start)}")
            if _RELOADED in logged:
                return
            if time.monotonic() >= deadline or not self.daemon.running():
                raise DriverError(f"{STUNNEL} did not reload its config: {self.daemon.log_tail(start)}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop it by PID (also one only found by its pidfile)."""
        self.daemon.stop(None, grace=0.0)

    def forget(self) -> None:
        """Let go without stopping it (an agent restart: the next one adopts it)."""
        self.daemon.forget()


def _ready(host: str, port: int) -> None:
    if not listening(host, port):
        raise DriverError(f"{STUNNEL} does not listen on {host}:{port} yet")
