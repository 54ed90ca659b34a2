"""What every export driver with a daemon shares: one lock, the desired state, the daemon's life.

``SupervisedExportDriver`` implements the ``ExportDriver`` contract around hooks: it checks every
request, starts or adopts the daemon, checks and restarts it and brings it back to the desired
state; a protocol module (nbd, iscsi) supplies only how to run and talk to its daemon and how to
serve one key to one host.
"""

from __future__ import annotations

import logging
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from vbs import ids
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, NotFound
from vbs.pools.exports import ExportSource, FileSource, RbdSource
from vbs.system.daemons import Daemon, DaemonSpec
from vbs.system.desired_state import DesiredState
from vbs.wire.connection import HOST_NAME_RE, Connection, HostIdentity
from vbs.wire.storage import ExportInfo

__all__ = [
    "ServedKey",
    "ServedImage",
    "SupervisedExportDriver",
    "check_key",
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


def check_key(key: str) -> str:
    """A volume id, or the id of a snapshot a hypervisor copies into; ``InvalidParameter`` otherwise."""
    if ids.is_valid("volume", key) or ids.is_valid("snapshot", key):
        return key
    raise InvalidParameter(f"invalid export key {str(key)[:80]!r} (expecting a volume or snapshot id)")


def _check_host(host_name: str) -> str:
    if not HOST_NAME_RE.match(host_name):
        raise InvalidParameter(f"invalid host name: {host_name[:80]!r}")
    return host_name


def _check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise InvalidParameter(f"port out of range: {port}")
    return port


def _advertised_host(listen_host: str, advertise_host: str | None) -> str:
    """The address clients are told to use: a daemon bound to a wildcard needs one named."""
    if advertise_host is not None and not LISTEN_RE.match(advertise_host):
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


class ServedImage(BaseModel):
    """The RBD image a key is served from (no key material: librbd reads the keyring ``conf`` names)."""

    pool: str
    image: str
    conf: str
    user: str

    def source(self) -> RbdSource:
        return RbdSource(pool=self.pool, image=self.image, conf=Path(self.conf), user=self.user)


class ServedKey(BaseModel):
    """One desired item of an export driver: everything it serves under one key, from one source:
    the file ``path``, or the RBD image ``rbd``."""

    key: str
    path: str = ""
    format: str = "raw"  # of the file at path
    rbd: ServedImage | None = None

    @staticmethod
    def fields_of(source: ExportSource) -> dict[str, Any]:
        """The fields that name ``source`` (a new item is ``Item(key=…, **ServedKey.fields_of(s))``)."""
        if isinstance(source, RbdSource):
            return {"path": "", "format": "raw", "rbd": ServedImage(pool=source.pool, image=source.image,
                                                                    conf=str(source.conf), user=source.user)}
        return {"path": str(source.path), "format": source.format, "rbd": None}

    def serves(self, source: ExportSource) -> bool:
        fields = self.fields_of(source)
        return bool(self.path == fields["path"] and self.format == fields["format"] and self.rbd == fields["rbd"])

    def describe(self) -> str:
        if self.rbd is not None:
            return f"rbd:{self.rbd.pool}/{self.rbd.image}"
        return self.path


ItemT = TypeVar("ItemT", bound=ServedKey)
ViewT = TypeVar("ViewT")


class SupervisedExportDriver(ABC, Generic[ItemT, ViewT]):
    """An export driver whose exports live in one daemon it supervises.

    Every public method runs under one lock. The desired items (one per key, ``ItemT``) are loaded
    on first use and saved *before* the daemon is changed, so that whatever a crash interrupts is
    re-created by ``check()`` or the next ``start()``, and the daemon never holds what the agent
    does not know. ``ViewT`` is what the daemon has now, read once per reconciliation.
    """

    protocol: str
    # The file formats its daemon opens (tgt serves raw files only; QEMU's NBD server also qcow2).
    formats: tuple[str, ...] = ("raw",)

    def __init__(self, state_dir: Path, state: DesiredState[ItemT], *, listen_host: str, port: int,
                 advertise_host: str | None) -> None:
        """Called by a protocol's constructor once its own settings are made (``_daemon_spec``
        reads them)."""
        self.state_dir = state_dir
        self.state_path = state.path
        self.listen_host = listen_host
        self.port = _check_port(port)
        self.advertise_host = _advertised_host(listen_host, advertise_host)
        self._lock = threading.RLock()
        self._state = state
        self._desired: dict[str, ItemT] = {}
        self._loaded = False
        self._daemon = Daemon(self._daemon_spec())
        self.pid_path = self._daemon.spec.pid_path
        self.log_path = self._daemon.spec.log_path

    # -- what a protocol module supplies: its daemon ------------------------------------------------

    @abstractmethod
    def _daemon_spec(self) -> DaemonSpec:
        """How to run the daemon."""

    @abstractmethod
    def _ready(self, deadline: float) -> None:
        """Called in a loop while a spawned daemon starts: raise ``DriverError`` until it serves."""

    def _spawned(self) -> None:
        """Checks on a daemon that just started (it is stopped and an error raised if one fails)."""

    @abstractmethod
    def _take_over(self) -> bool:
        """Talk to an adopted daemon; False if it must be replaced (it was stopped)."""

    def _daemon_up(self) -> None:
        """Settings made on every daemon this driver runs, spawned or adopted."""

    @abstractmethod
    def _probe(self) -> None:
        """Raise ``DriverError`` if the running daemon does not answer (it hangs)."""

    @abstractmethod
    def _ask_exit(self) -> bool:
        """Ask the daemon to exit cleanly; True if it was asked (raise ``DriverError`` if not)."""

    def _let_go(self) -> None:
        """Forget what this object holds of the daemon it runs (a connection, pending work)."""

    def _loaded_state(self) -> None:
        """Called once the desired items are loaded (to tidy files that derive from them)."""

    @abstractmethod
    def _view(self) -> ViewT:
        """What the daemon serves now."""

    @abstractmethod
    def _restore(self, item: ItemT, view: ViewT) -> None:
        """Make the daemon serve ``item`` as desired (after a restart or an adoption); ``view`` is
        kept up to date with what this changes."""

    def _reconciled(self, view: ViewT) -> None:
        """Work left for after every item was restored."""

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
        check_key(key)
        _check_host(host_name)
        with self._lock:
            self._load()
            self._remove(self._desired.get(key), key, host_name)
            log.info("removed the %s export of %s for %s", self.protocol, key, host_name)

    def refresh_export(self, key: str, source: ExportSource, host_name: str) -> Connection:
        """A connection that reports the source's grown size; ``NotFound`` if there is no export."""
        check_key(key)
        _check_host(host_name)
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
        check_key(key)
        _check_host(host_name)
        with self._lock:
            self._load()
            item = self._desired.get(key)
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

    # -- the daemon's life -------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """PID of the daemon this driver runs or adopted (None when it has none)."""
        return self._daemon.pid

    def start(self) -> None:
        """Start the daemon, or adopt the one an earlier agent left, and create every desired export."""
        with self._lock:
            self._load()
            if self._daemon.running():
                return
            self._ensure_daemon()
            self._reconcile()

    def check(self) -> None:
        """Restart a dead or hung daemon and re-create every export that should exist (same names
        and secrets: clients that reconnect resume). Also finishes work a restart left over."""
        with self._lock:
            self._load()
            if not self._healthy():
                if self._daemon.pid is not None:
                    self._terminate()
                self._ensure_daemon()  # adopts a daemon left by an earlier agent, else starts one
            self._reconcile()

    def stop(self) -> None:
        """Stop the daemon: a clean exit first, then signals by PID. The desired exports are kept:
        ``start()`` brings them back."""
        with self._lock:
            name = self._daemon.spec.name
            self._daemon.stop(self._ask_exit, grace=10.0)
            self._let_go()
            log.info("stopped %s", name)

    def close(self) -> None:
        """Let go of the daemon without stopping it: exports keep serving and the next agent adopts it."""
        with self._lock:
            self._let_go()
            self._daemon.forget()

    def _healthy(self) -> bool:
        name, pid = self._daemon.spec.name, self._daemon.pid
        if not self._daemon.running():
            if pid is not None:
                log.warning("%s pid %s is gone: restarting it, %d keys to restore", name, pid, len(self._desired))
            return False
        try:
            self._probe()
        except DriverError as exc:
            log.warning("%s pid %s does not answer (%s): restarting it, %d keys to restore",
                        name, pid, exc.message, len(self._desired))
            return False
        return True

    def _ensure_daemon(self) -> None:
        self._let_go()  # whatever this object held of a daemon that is gone
        if not (self._daemon.adopt() and self._take_over()):
            self._daemon.spawn(self._ready)
            try:
                self._spawned()
            except DriverError:
                self._terminate()
                raise
        self._daemon_up()

    def _terminate(self) -> None:
        self._let_go()
        self._daemon.terminate(grace=0.0)

    def _running(self) -> bool:
        return self._daemon.running()

    def _up(self) -> None:
        """The desired state loaded and the daemon serving it: started or adopted, and brought
        back to the desired state, if it was not running."""
        self._load()
        if self._daemon.running():
            return
        self._ensure_daemon()
        try:
            self._reconcile()
        except DriverError:
            pass  # logged per key; other keys' trouble is not this caller's

    def _reconcile(self) -> None:
        """Create in the daemon whatever desired state it lacks."""
        view = self._view()
        failed: list[str] = []
        for item in list(self._desired.values()):
            try:
                self._restore(item, view)
            except DriverError as exc:
                # One missing source file must not keep every other host from its disk.
                log.error("re-creating the %s exports of %s failed: %s", self.protocol, item.key, exc.message)
                failed.append(item.key)
        self._reconciled(view)
        if failed:
            raise DriverError(f"could not re-create the {self.protocol} exports of {', '.join(failed)}")

    # -- desired state -----------------------------------------------------------------------------

    def _load(self) -> None:
        if self._loaded:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._desired = {item.key: item for item in self._state.load()}
        self._loaded = True
        self._loaded_state()

    def _save(self) -> None:
        self._state.save(self._desired.values())

    def _save_best_effort(self) -> None:
        try:
            self._save()
        except OSError as exc:
            log.error("could not roll back the %s export state: %s", self.protocol, exc)

    @contextmanager
    def _desired_first(self, undo: Callable[[], None]) -> Iterator[None]:
        """Save the changed desired state, then let the caller change the daemon. If that fails,
        ``undo`` puts the desired items back as they were, and they are saved again."""
        try:
            self._save()
            yield
        except BaseException:
            undo()
            self._save_best_effort()
            raise
