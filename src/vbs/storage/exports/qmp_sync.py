"""A small synchronous client for QMP (QEMU, qemu-storage-daemon) on top of the asyncio ``qemu.qmp``.

The asyncio client runs on a private event-loop thread; every call has a timeout and every failure is
a ``DriverError`` subclass. Events are buffered from the moment of connection, so none is missed.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from qemu.qmp import EventListener, ExecuteError, Message, QMPClient, Runstate

from vbs.errors import DriverError

__all__ = ["QmpSync", "QmpError", "QmpCommandError", "QmpConnectionError"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0
_EVENT_BUFFER = 1024  # events kept for wait_event(); older ones are dropped


class QmpError(DriverError):
    """A QMP exchange failed."""


class QmpConnectionError(QmpError):
    """The monitor could not be reached, hung up, or did not answer in time."""


class QmpCommandError(QmpError):
    """The server answered a command with an error."""

    def __init__(self, command: str, error_class: str, desc: str) -> None:
        super().__init__(f"QMP {command} failed: {error_class}: {desc}")
        self.command = command
        self.error_class = error_class
        self.desc = desc


class _Ring(EventListener):
    """Keeps the last events with a sequence number; wakes waiters (runs on the loop thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = 0
        self.buf: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=_EVENT_BUFFER)
        self.cond = asyncio.Condition()

    async def put(self, event: Message) -> None:
        # Overridden so that nothing accumulates in the base class's unbounded queue and history.
        self.seq += 1
        self.buf.append((self.seq, dict(event)))
        async with self.cond:
            self.cond.notify_all()


class QmpSync:
    """One QMP monitor connection (a UNIX socket), usable from ordinary threads.

    ``execute`` is thread-safe. After a lost connection the next call reconnects once.
    """

    def __init__(self, socket_path: Path | str, *, name: str = "vbs", connect_timeout: float = 5.0) -> None:
        self.socket_path = str(socket_path)
        self.name = name
        self.connect_timeout = connect_timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"qmp-{name}", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._client: QMPClient | None = None
        self._ring: _Ring | None = None
        self._closed = False
        # Disconnect cleanly at interpreter exit (otherwise asyncio complains about pending tasks);
        # through a weak reference so that an unused client can still be collected.
        self._atexit = functools.partial(_close_weak, weakref.ref(self))
        atexit.register(self._atexit)

    # -- plumbing -----------------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        async def bounded() -> T:
            # The timeout runs inside the loop, so the coroutine is really cancelled, not abandoned.
            return await asyncio.wait_for(coro, timeout)

        fut = asyncio.run_coroutine_threadsafe(bounded(), self._loop)
        try:
            return fut.result(timeout + 5.0)
        except TimeoutError as exc:  # asyncio's and concurrent.futures' are this one since 3.11
            fut.cancel()
            raise QmpConnectionError(
                f"QMP {what}: no answer within {timeout:g}s ({self.socket_path})"
            ) from exc

    def _connected(self) -> QMPClient:
        with self._lock:
            if self._closed:
                raise QmpConnectionError(f"QMP client for {self.socket_path} is closed")
            client = self._client
            if client is not None and client.runstate == Runstate.RUNNING:
                return client
            if client is not None:
                self._drop_locked()
            return self._connect_locked()

    def _connect_locked(self) -> QMPClient:
        client = QMPClient(self.name)
        ring = _Ring()  # asyncio primitives bind to a loop on first use (3.10+), not here
        client.register_listener(ring)
        # The default listener queues and records every event forever and we never read it: a filter
        # no event passes keeps a long-lived connection from growing.
        client.events.names = {"\x00none"}
        try:
            self._call(client.connect(self.socket_path), self.connect_timeout, "connect")
        except Exception as exc:  # ConnectError, OSError, timeout: the daemon is not there
            try:
                self._call(client.disconnect(), self.connect_timeout, "disconnect")
            except Exception as exc2:  # already failing: keep the first error
                log.debug("QMP disconnect after failed connect: %s", exc2)
            if isinstance(exc, QmpError):
                raise
            raise QmpConnectionError(f"QMP connect to {self.socket_path} failed: {exc}") from exc
        self._client, self._ring = client, ring
        return client

    def _drop_locked(self) -> None:
        client, self._client, self._ring = self._client, None, None
        if client is None:
            return
        try:
            self._call(client.disconnect(), self.connect_timeout, "disconnect")
        except Exception as exc:  # a dead peer makes disconnect() re-raise its EOF
            log.debug("QMP disconnect from %s: %s", self.socket_path, exc)

    # -- public API ---------------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect now (otherwise the first call connects); raises ``QmpConnectionError``."""
        self._connected()

    def execute(self, command: str, arguments: Mapping[str, Any] | None = None, *,
                timeout: float = DEFAULT_TIMEOUT) -> Any:
        """Run one QMP command and return its ``return`` value."""
        client = self._connected()
        try:
            return self._call(client.execute(command, arguments), timeout, command)
        except ExecuteError as exc:
            raise QmpCommandError(command, exc.error_class, str(exc)) from exc
        except QmpError:
            raise
        except Exception as exc:  # ExecInterruptedError, StateError, EOF: the connection is gone
            with self._lock:
                self._drop_locked()
            raise QmpConnectionError(f"QMP {command}: connection to {self.socket_path} lost: {exc}") from exc

    def event_mark(self) -> int:
        """A position in the event stream: pass it to ``wait_event`` to see only later events."""
        self._connected()
        ring = self._ring
        return ring.seq if ring is not None else 0

    def wait_event(self, name: str, match: Callable[[dict[str, Any]], bool] | None = None, *,
                   since: int = 0, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        """Wait for event ``name`` (numbered after ``since``) for which ``match(event)`` holds."""
        self._connected()
        ring = self._ring
        if ring is None:
            raise QmpConnectionError(f"QMP connection to {self.socket_path} lost")

        def hit() -> dict[str, Any] | None:
            for seq, ev in ring.buf:
                if seq > since and ev.get("event") == name and (match is None or match(ev)):
                    return ev
            return None

        async def wait() -> dict[str, Any]:
            async with ring.cond:
                while (ev := hit()) is None:
                    await ring.cond.wait()
                return ev

        try:
            return self._call(wait(), timeout, f"wait for {name}")
        except QmpConnectionError as exc:
            raise QmpConnectionError(f"QMP event {name} did not come within {timeout:g}s") from exc

    def close(self) -> None:
        """Disconnect and stop the loop thread; the object cannot be used again."""
        with self._lock:
            if self._closed:
                return
            self._drop_locked()
            self._closed = True
        atexit.unregister(self._atexit)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> QmpSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_weak(ref: weakref.ref[QmpSync]) -> None:
    client = ref()
    if client is not None:
        client.close()


def wait_for_socket(path: Path, deadline: float, alive: Callable[[], bool] | None = None) -> bool:
    """Poll until ``path`` exists (the monitor socket is bound), ``alive()`` goes false, or the deadline."""
    while True:
        if path.exists():
            return True
        if alive is not None and not alive():
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
