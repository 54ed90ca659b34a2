"""The libvirt connection of a host agent: opened (and reopened after a libvirtd restart) by itself, its
domain events delivered by libvirt's event loop in a thread of its own, and the list of domains kept from them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import libvirt

from vbs.errors import DriverError
from vbs.host.hypervisors.libvirt_metadata import cloud_ids
from vbs.wire.host import VM_ID_RE, VmInfo

__all__ = ["LibvirtSession", "no_domain", "message", "RECONNECT_INTERVAL_S"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# How often the watcher thread tries to reconnect to a libvirtd that went.
RECONNECT_INTERVAL_S = 1.0

_event_loop_lock = threading.Lock()
_event_loop_started = False


def _start_event_loop() -> None:
    """libvirt's default event loop, once per process, in a daemon thread: it delivers domain events
    and keepalives of every connection opened after it."""
    global _event_loop_started
    with _event_loop_lock:
        if _event_loop_started:
            return
        libvirt.virEventRegisterDefaultImpl()
        # Errors arrive as exceptions; libvirt's default handler would also print them to stderr.
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)

        def run() -> None:
            while True:
                if libvirt.virEventRunDefaultImpl() < 0:
                    log.error("libvirt's event loop failed")

        threading.Thread(target=run, name="vbs-libvirt-events", daemon=True).start()
        _event_loop_started = True


def no_domain(exc: libvirt.libvirtError) -> bool:
    return bool(exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN)


def message(exc: libvirt.libvirtError) -> str:
    return str(exc.get_error_message() or exc)


class LibvirtSession:
    """The connection to libvirt at ``uri``, replaced when it dies, and what its events tell: the domains,
    and the removals of devices a detach waits for. A watcher thread re-reads domains and reconnects."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._connecting = threading.Lock()
        self._guard = threading.Lock()  # guards the fields below
        self._conn: libvirt.virConnect | None = None
        self._callbacks: list[int] = []
        self._vms: dict[str, VmInfo] = {}
        self._removed: dict[tuple[str, str], threading.Event] = {}  # (domain UUID, alias) -> waiter
        self._refresh: queue.Queue[str | None] = queue.Queue()
        self._closed: queue.Queue[libvirt.virConnect] = queue.Queue()  # connections libvirt reported closed
        self._closing = threading.Event()
        self._reported_down = False
        _start_event_loop()
        self._watcher = threading.Thread(target=self._watch, name="vbs-libvirt-watch", daemon=True)
        self._watcher.start()

    def list_vms(self) -> list[VmInfo]:
        self.connection()  # a libvirtd that is not there: the VMs are unknown, not none
        with self._guard:
            return sorted(self._vms.values(), key=lambda vm: vm.vm_id)

    def vm_ids(self) -> list[str]:
        with self._guard:
            return sorted(self._vms)

    def expect_removal(self, key: tuple[str, str]) -> threading.Event:
        """A waiter for libvirt's ``DEVICE_REMOVED`` of (domain UUID, alias): registered before the request,
        as its event may come at once; ``forget_removal`` drops it."""
        removed = threading.Event()
        with self._guard:
            self._removed[key] = removed
        return removed

    def forget_removal(self, key: tuple[str, str]) -> None:
        with self._guard:
            self._removed.pop(key, None)

    def close(self) -> None:
        self._closing.set()
        self._refresh.put(None)
        self._watcher.join(10)
        with self._guard:
            conn, self._conn = self._conn, None
            callbacks, self._callbacks = self._callbacks, []
        if conn is not None:
            self._release(conn, callbacks)

    def with_conn(self, call: Callable[[libvirt.virConnect], T]) -> T:
        """Run ``call`` on the connection; one that turns out dead (libvirtd restarted) is replaced
        and the call made once more (every call is idempotent)."""
        for attempt in (1, 2):
            conn = self.connection()
            try:
                return call(conn)
            except libvirt.libvirtError as exc:
                if attempt == 1 and not alive(conn):
                    self._lost(conn)
                    continue
                raise DriverError(f"libvirt: {message(exc)}") from exc
        raise AssertionError("unreachable")

    def connection(self) -> libvirt.virConnect:
        with self._guard:
            conn = self._conn
        if conn is not None:
            return conn
        return self._connect()

    def _connect(self) -> libvirt.virConnect:
        with self._connecting:  # one open at a time; the guard is not held across libvirt calls
            with self._guard:
                if self._conn is not None:
                    return self._conn
            try:
                conn = libvirt.open(self.uri)
            except libvirt.libvirtError as exc:
                if not self._reported_down:
                    log.warning("libvirt at %s is not reachable: %s", self.uri, message(exc))
                    self._reported_down = True
                raise DriverError(f"libvirt at {self.uri} is not reachable: {message(exc)}") from exc
            try:
                # A remote connection (libvirtd) only: in-process drivers have neither.
                unless_unsupported(lambda: conn.setKeepAlive(5, 3))
                unless_unsupported(lambda: conn.registerCloseCallback(self._on_close, None))
                callbacks = [
                    conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._on_lifecycle, None),
                    conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED,
                                                self._on_device_removed, None),
                    # A cloud writing its ids into a domain's <metadata> (Nova does at define time).
                    conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_METADATA_CHANGE,
                                                self._on_metadata_change, None),
                ]
                # Events from here on are queued for the watcher: none is lost between the two.
                vms = {vm.vm_id: vm for vm in (vm_info(d) for d in conn.listAllDomains(0)) if vm is not None}
            except libvirt.libvirtError as exc:
                conn.close()
                raise DriverError(f"libvirt at {self.uri}: {message(exc)}") from exc
            with self._guard:
                self._conn, self._callbacks, self._vms = conn, callbacks, vms
            self._reported_down = False
        log.info("connected to libvirt at %s: %d domains", self.uri, len(vms))
        return conn

    def _lost(self, conn: libvirt.virConnect) -> None:
        """Forget a connection that closed; the watcher (or the next call) makes a new one."""
        with self._guard:
            if self._conn is not conn:
                return
            self._conn = None
            callbacks, self._callbacks = self._callbacks, []
        log.warning("the connection to libvirt at %s closed; reconnecting", self.uri)
        self._release(conn, callbacks)

    @staticmethod
    def _release(conn: libvirt.virConnect, callbacks: list[int]) -> None:
        for cb in callbacks:
            try:
                conn.domainEventDeregisterAny(cb)
            except libvirt.libvirtError:
                pass  # a dead connection has none left
        try:
            conn.unregisterCloseCallback()
        except libvirt.libvirtError:
            pass
        try:
            conn.close()
        except libvirt.libvirtError:
            pass

    def _watch(self) -> None:
        """Re-read the domains events name, and reconnect to a libvirtd that went."""
        while not self._closing.is_set():
            try:
                name = self._refresh.get(timeout=RECONNECT_INTERVAL_S)
            except queue.Empty:
                name = None
            if self._closing.is_set():
                return
            while not self._closed.empty():
                self._lost(self._closed.get())
            try:
                conn = self.connection()
                if name is not None:
                    self._refresh_vm(conn, name)
            except DriverError:
                pass  # reported once by _connect; tried again in a second
            except libvirt.libvirtError as exc:
                log.warning("libvirt: reading domain %s: %s", name, message(exc))

    def _refresh_vm(self, conn: libvirt.virConnect, name: str) -> None:
        try:
            vm = vm_info(conn.lookupByName(name))
        except libvirt.libvirtError as exc:
            if not no_domain(exc):
                raise
            vm = None
        with self._guard:
            if vm is None:
                self._vms.pop(name, None)
            else:
                self._vms[name] = vm

    def _on_lifecycle(self, _conn: libvirt.virConnect, dom: libvirt.virDomain, event: int, _detail: int,
                      _opaque: object) -> None:
        # On libvirt's event thread: no calls here, the watcher reads the domain.
        self._refresh.put(dom.name())

    def _on_metadata_change(self, _conn: libvirt.virConnect, dom: libvirt.virDomain, _kind: int, _nsuri: str | None,
                            _opaque: object) -> None:
        self._refresh.put(dom.name())

    def _on_device_removed(self, _conn: libvirt.virConnect, dom: libvirt.virDomain, alias: str,
                           _opaque: object) -> None:
        with self._guard:
            waiter = self._removed.get((dom.UUIDString(), alias))
        if waiter is not None:
            waiter.set()

    def _on_close(self, conn: libvirt.virConnect, reason: int, _opaque: object) -> None:
        # On libvirt's event thread: the watcher releases the connection and makes a new one.
        log.warning("libvirt at %s closed the connection (reason %d)", self.uri, reason)
        self._closed.put(conn)
        self._refresh.put(None)  # wake the watcher


def unless_unsupported(call: Callable[[], object]) -> None:
    try:
        call()
    except libvirt.libvirtError as exc:
        if exc.get_error_code() != libvirt.VIR_ERR_NO_SUPPORT:
            raise


def alive(conn: libvirt.virConnect) -> bool:
    try:
        return bool(conn.isAlive())
    except libvirt.libvirtError:
        return False


def vm_info(dom: libvirt.virDomain) -> VmInfo | None:
    name = dom.name()
    if not VM_ID_RE.fullmatch(name):
        log.debug("libvirt domain %r: its name is not a VBS VM id; ignored", name)
        return None
    state = dom.state()[0]
    title = ""
    try:
        title = dom.metadata(libvirt.VIR_DOMAIN_METADATA_TITLE, None) or ""
    except libvirt.libvirtError:
        pass  # no title
    return VmInfo(vm_id=name, name=title[:255] or name, running=state == libvirt.VIR_DOMAIN_RUNNING,
                  uuid=dom.UUIDString(), cloud_ids=cloud_ids(dom))
