"""Free TCP ports for the daemons one process plans and starts itself.

The kernel says a port is free only while nobody has bound it: a port picked for a service that has
not started yet is free again to the next ``bind(0)``, which can hand the same number out twice (one
``vbs up`` once gave its storage agent the port its controller was about to listen on).
:class:`PortPicker` remembers what it handed out and never gives a port twice.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

__all__ = ["PortPicker", "free_port"]

_ATTEMPTS = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing on ``host`` is bound to now."""
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
