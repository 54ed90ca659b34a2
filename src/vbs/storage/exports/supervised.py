"""What every export driver with a daemon shares: one lock, the desired state, the daemon's life.

``SupervisedExportDriver`` implements the ``ExportDriver`` contract around hooks: it checks every
request, starts or adopts the daemon, checks and restarts it and brings it back to the desired
state (those three on ``SupervisedDaemon``, supervised_daemon.py); a protocol module (nbd, iscsi)
supplies only how to run and talk to its daemon and how to serve one key to one host.
"""

from __future__ import annotations

import logging
import re
from abc import abstractmethod
from pathlib import Path

from vbs.errors import IdempotentParameterMismatch, InvalidParameter, NotFound
from vbs.pools.exports import ExportSource, FileSource, RbdSource
from vbs.storage.exports.supervised_daemon import (
    DesiredExports,
    ItemT,
    ServedImage,
    ServedKey,
    SupervisedDaemon,
    ViewT,
    check_host,
    check_key,
)
from vbs.system.desired_state import DesiredState
from vbs.wire.connection import Connection, HostIdentity
from vbs.wire.storage import ExportInfo

__all__ = [
    "DesiredExports",
    "ServedKey",
    "ServedImage",
    "SupervisedExportDriver",
    "check_key",
    "check_host",
    "check_port",
    "advertised_host",
    "checked_source",
    "source_file",
    "source_size",
    "file_size",
    "LISTEN_RE",
]

log = logging.getLogger(__name__)

LISTEN_RE = re.compile(r"^[0-9a-fA-F.:]{2,45}$|^[a-z0-9][a-z0-9.-]{0,252}$")
_WILDCARDS = {"0.0.0.0", "::", ""}


# -- what every call checks before anything reaches a daemon --------------------------------------
# (``check_key`` and ``check_host`` live in supervised_daemon.py: ``DesiredExports._desired_for`` uses them)


def check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise InvalidParameter(f"port out of range: {port}")
    return port


def advertised_host(listen_host: str, advertise_host: str | None) -> str:
    """The address clients are told to use: a daemon bound to a wildcard needs one named."""
    if advertise_host is not None and not LISTEN_RE.fullmatch(advertise_host):
        raise InvalidParameter(f"invalid advertise_host: {advertise_host[:80]!r}")
    advertised = advertise_host or listen_host
    if advertised in _WILDCARDS:
        raise InvalidParameter("listen_host is a wildcard: set advertise_host to the address clients use")
    return advertised


def _missing(key: str, path: Path) -> NotFound:
    kind = "InvalidSnapshot" if key.startswith("snap-") else "InvalidVolume"
    return NotFound(f"source file {path} of {key} does not exist", code=f"{kind}.NotFound")


def source_file(key: str, source: ExportSource, *, formats: tuple[str, ...] = ("raw",)) -> Path:
    """The file behind ``source``: an absolute path that exists, in one of ``formats``."""
    if not isinstance(source, FileSource):
        raise InvalidParameter(f"this export driver serves files, not {type(source).__name__}")
    if source.format not in formats:
        raise InvalidParameter(f"this export driver serves {' and '.join(formats)} files, not {source.format} "
                               f"({key}): serve that pool through NBD")
    path = Path(source.path)
    if not path.is_absolute():
        raise InvalidParameter(f"source path must be absolute: {path}")
    if not path.exists():
        raise _missing(key, path)
    return path


def file_size(key: str, path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise _missing(key, path) from None


def checked_source(key: str, source: ExportSource, *, formats: tuple[str, ...] = ("raw",)) -> ExportSource:
    """``source`` if it can be served: a file that exists (in one of ``formats``), or an image whose
    cluster configuration is a file (the image itself is the daemon's to open)."""
    if isinstance(source, RbdSource):
        if not source.conf.is_file():
            raise InvalidParameter(f"the Ceph configuration {source.conf} of {key} is not a file")
        return source
    return FileSource(source_file(key, source, formats=formats), source.format, source.size_bytes)


def source_size(key: str, source: ExportSource) -> int:
    """The bytes ``source`` has now: a file's own size, an image's as its backend read it."""
    if isinstance(source, RbdSource):
        if source.size_bytes is None:
            raise InvalidParameter(f"the RBD source of {key} must say its size")
        return source.size_bytes
    if source.format != "raw" and source.size_bytes is not None:
        return source.size_bytes
    return file_size(key, source_file(key, source, formats=(source.format,)))


# -- the driver skeleton --------------------------------------------------------------------------


class SupervisedExportDriver(SupervisedDaemon[ItemT, ViewT]):
    """An export driver whose exports live in one daemon it supervises (``SupervisedDaemon``: the
    lock, the desired items and the daemon's life).
    """

    # The file formats its daemon opens (tgt serves raw files only; QEMU's NBD server also qcow2).
    formats: tuple[str, ...] = ("raw",)

    def __init__(self, state_dir: Path, state: DesiredState[ItemT], *, listen_host: str, port: int,
                 advertise_host: str | None) -> None:
        """Called by a protocol's constructor once its own settings are made (``_daemon_spec``
        reads them)."""
        self.listen_host = listen_host
        self.port = check_port(port)
        self.advertise_host = advertised_host(listen_host, advertise_host)
        super().__init__(state_dir, state)

    # -- what a protocol module supplies: its exports (called under the lock, state loaded) ----------

    @abstractmethod
    def _hosts(self, item: ItemT) -> set[str]:
        """The hosts that have an export of ``item``."""

    @abstractmethod
    def _live_keys(self) -> set[str]:
        """The keys the running daemon exports to at least one host."""

    @abstractmethod
    def _list(self) -> list[ExportInfo]:
        """``list_exports`` of the running daemon."""

    def _check_source(self, source: ExportSource) -> None:
        """Refuse a source this protocol cannot serve (``InvalidParameter``), before any daemon runs."""

    @abstractmethod
    def _ensure(self, item: ItemT | None, key: str, source: ExportSource, host: HostIdentity, read_only: bool
                ) -> Connection:
        """``ensure_export`` with the daemon up; ``item`` (if any) serves ``source``."""

    @abstractmethod
    def _remove(self, item: ItemT | None, key: str, host_name: str) -> None:
        """``remove_export``; the daemon may be down (then only the desired state changes)."""

    @abstractmethod
    def _refresh(self, item: ItemT, host_name: str, size: int) -> Connection:
        """``refresh_export`` with the daemon up, for a host ``item`` has, ``size`` the source's now."""

    @abstractmethod
    def _retire(self, item: ItemT, host_name: str) -> None:
        """``retire_exports`` for a host ``item`` has; the daemon may be down."""

    # -- the contract (see vbs.pools.exports) -------------------------------------------------

    def ensure_export(self, key: str, source: ExportSource, host: HostIdentity, *, read_only: bool = False
                      ) -> Connection:
        """Serve ``source`` under ``key`` to ``host`` only; idempotent (same names and secrets)."""
        check_key(key)
        source = checked_source(key, source, formats=self.formats)
        self._check_source(source)
        with self._lock:
            self._up()
            return self._ensure(self._serving(key, source), key, source, host, read_only)

    def remove_export(self, key: str, host_name: str) -> None:
        """Withdraw ``host_name``'s export of ``key``; idempotent (absent is success)."""
        with self._desired_for(key, host_name) as item:
            self._remove(item, key, host_name)
            if item is not None:  # not said again for each repeated call (a workflow's polling step)
                log.info("removed the %s export of %s for %s", self.protocol, key, host_name)

    def refresh_export(self, key: str, source: ExportSource, host_name: str) -> Connection:
        """A connection that reports the source's grown size; ``NotFound`` if there is no export."""
        check_key(key)
        check_host(host_name)
        source = checked_source(key, source, formats=self.formats)
        self._check_source(source)
        with self._lock:
            self._load()
            item = self._desired.get(key)
            if item is None or host_name not in self._hosts(item):
                raise NotFound(f"{key} is not exported to {host_name}", code="InvalidAttachment.NotFound")
            self._serving(key, source)
            size = source_size(key, source)
            self._up()
            return self._refresh(item, host_name, size)

    def retire_exports(self, key: str, host_name: str) -> None:
        """Remove what a refresh replaced; idempotent."""
        with self._desired_for(key, host_name) as item:
            if item is not None and host_name in self._hosts(item):
                self._retire(item, host_name)

    def is_exported(self, key: str) -> bool:
        """Whether any host has an export of ``key``, desired or live."""
        check_key(key)
        with self._lock:
            self._load()
            item = self._desired.get(key)
            if item is not None and self._hosts(item):
                return True
            return self._running() and key in self._live_keys()

    def list_exports(self) -> list[ExportInfo]:
        """What the running daemon really has: one entry per (key, host)."""
        with self._lock:
            self._load()
            return self._list() if self._running() else []

    def _serving(self, key: str, source: ExportSource) -> ItemT | None:
        """The desired item of ``key``, which must serve ``source`` (a key is one source)."""
        item = self._desired.get(key)
        if item is not None and not item.serves(source):
            raise IdempotentParameterMismatch(f"{key} is served from {item.describe()}, not {source}")
        return item
