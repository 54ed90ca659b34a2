"""What the nbdkit driver keeps in ``exports.json``: per key, its source and one process per host.
No I/O here."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, Field

from vbs.storage.exports.supervised import ServedKey

STATE_VERSION = 1


class HostExport(BaseModel):
    """One host's export of the key: one nbdkit process, on ``port`` (TCP) or a unix socket."""

    host: str
    address: str  # the host's address when the export was made: what its trust anchor admits
    read_only: bool
    name: str  # the NBD export name: <key>-<128-bit random token>, the only one the process answers to
    port: int | None = Field(default=None, ge=1, le=65535)
    psk: str | None = None  # hex key of the host's PSK identity (TLS-PSK mode only)


class Served(ServedKey):
    """Everything that serves one key: its file (``ServedKey``) and the hosts' processes."""

    exports: list[HostExport] = Field(default_factory=list)

    def export_for(self, host: str) -> HostExport | None:
        return next((e for e in self.exports if e.host == host), None)


def process_id(key: str, host: str) -> str:
    """The name of the files of (key, host)'s process (pidfile, log, socket, TLS directory): short
    enough for a unix socket path, and never a secret."""
    return hashlib.sha256(f"{key}/{host}".encode()).hexdigest()[:24]
