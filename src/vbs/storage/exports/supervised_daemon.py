"""The daemon an export driver supervises, and the desired items it brings that daemon back to.

``SupervisedDaemon`` keeps one lock and the desired items (one per key, kept in a state file and
saved *before* the daemon changes), and the daemon's life: started or adopted, checked, restarted
and reconciled with the desired items. ``SupervisedExportDriver`` (supervised.py) builds the
``ExportDriver`` contract on it.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from vbs import ids
from vbs.errors import DriverError, InvalidParameter
from vbs.pools.exports import ExportSource, RbdSource
from vbs.system.daemons import Daemon, DaemonSpec
from vbs.system.desired_state import DesiredState
from vbs.wire.connection import HOST_NAME_RE

__all__ = ["DesiredExports", "ServedKey", "ServedImage", "SupervisedDaemon", "check_key", "check_host"]

log = logging.getLogger("vbs.storage.exports.supervised")  # the records keep the drivers' shared name


def check_key(key: str) -> str:
    """A volume id, or the id of a snapshot a hypervisor copies into; ``InvalidParameter`` otherwise."""
    if ids.is_valid("volume", key) or ids.is_valid("snapshot", key):
        return key
    raise InvalidParameter(f"invalid export key {str(key)[:80]!r} (expecting a volume or snapshot id)")


def check_host(host_name: str) -> str:
    if not HOST_NAME_RE.fullmatch(host_name):
        raise InvalidParameter(f"invalid host name: {host_name[:80]!r}")
    return host_name


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


class DesiredExports(Generic[ItemT]):
    """An export driver's desired items by key: read from ``_state`` on first use (``_load``, under
    the driver's lock ``_lock``) and written back whole (``_save``)."""

    state_dir: Path
    _lock: threading.RLock
    _state: DesiredState[ItemT]
    _desired: dict[str, ItemT]
    _loaded: bool

    @contextmanager
    def _desired_for(self, key: str, host_name: str) -> Iterator[ItemT | None]:
        """Check ``key`` and ``host_name`` (``InvalidParameter``), then, under the lock with the desired
        state loaded, give the desired item of ``key`` (None: it has none)."""
        check_key(key)
        check_host(host_name)
        with self._lock:
            self._load()
            yield self._desired.get(key)

    def _load(self) -> None:
        if self._loaded:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._desired = {item.key: item for item in self._state.load()}
        self._loaded = True
        self._loaded_state()

    def _loaded_state(self) -> None:
        """Called once the desired items are loaded (to tidy files that derive from them)."""

    def _save(self) -> None:
        self._state.save(self._desired.values())


class SupervisedDaemon(DesiredExports[ItemT], ABC, Generic[ItemT, ViewT]):
    """The one daemon of an export driver, and what it should serve.

    Every public method runs under one lock. The desired items (one per key, ``ItemT``) are loaded
    on first use and saved *before* the daemon is changed, so that whatever a crash interrupts is
    re-created by ``check()`` or the next ``start()``, and the daemon never holds what the agent
    does not know. ``ViewT`` is what the daemon has now, read once per reconciliation.
    """

    protocol: str

    def __init__(self, state_dir: Path, state: DesiredState[ItemT]) -> None:
        """Called once the driver's own settings are made (``_daemon_spec`` reads them)."""
        self.state_dir = state_dir
        self.state_path = state.path
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

    @abstractmethod
    def _view(self) -> ViewT:
        """What the daemon serves now."""

    @abstractmethod
    def _restore(self, item: ItemT, view: ViewT) -> None:
        """Make the daemon serve ``item`` as desired (after a restart or an adoption); ``view`` is
        kept up to date with what this changes."""

    def _reconciled(self, view: ViewT) -> None:
        """Work left for after every item was restored."""


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
