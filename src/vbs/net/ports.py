"""Free TCP ports for the daemons one process plans and starts itself.

The kernel says a port is free only while nobody has bound it: a port picked for a service that has
not started yet is free again to the next ``bind(0)``, which can hand the same number out twice (one
``vbs up`` once gave its storage agent the port its controller was about to listen on).
:class:`PortPicker` remembers what it handed out and never gives a port twice.

Nor is a port from ``bind(0)`` safe until the service binds it: it comes from the kernel's ephemeral
range, which every outgoing connection on the machine draws its local port from, so a client
connecting anywhere in between can hold it (a test's second host agent once failed with "address
already in use" that way). :func:`free_port` therefore picks below the ephemeral range, where only
an explicit ``bind`` lands, and falls back to ``bind(0)`` when that range starts too low.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

__all__ = ["PortPicker", "free_port"]

_ATTEMPTS = 64
# Below the ephemeral range and above the ports services are registered on by habit (< 10000).
_LISTEN_FLOOR = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_floor() -> int:
    """The first port the kernel hands outgoing connections (32768 when it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing on ``host`` is bound to now, outside the ephemeral range when possible."""
    ceiling = _ephemeral_floor()
    if ceiling - _LISTEN_FLOOR >= 1024:
        for _ in range(_ATTEMPTS):
            port = random.randrange(_LISTEN_FLOOR, ceiling)
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class PortPicker:
    """Free ports on ``host``, none of them in ``taken`` (ports planned but not bound yet) nor handed out
    before by this picker."""

    def __init__(self, host: str = "127.0.0.1", taken: Iterable[int] = ()) -> None:
        self.host = host
        self.taken = set(taken)

    def __call__(self) -> int:
        for _ in range(_ATTEMPTS):
            port = free_port(self.host)
            if port not in self.taken:
                self.taken.add(port)
                return port
        raise RuntimeError(f"no free port on {self.host} after {_ATTEMPTS} tries")
