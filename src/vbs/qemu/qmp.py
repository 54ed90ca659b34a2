"""The one QMP client of VBS (qemu-storage-daemon and QEMU VMs), synchronous, on top of ``qemu.qmp``.

One ``QmpClient`` holds one persistent connection to one monitor socket and can be used from any
thread. The asyncio work runs on a single background event loop shared by every client of the
process. Every call has a timeout, every failure is a ``QmpError`` (a ``DriverError``):

- ``QmpCommandError``: the server answered with an error (``error_class``, ``desc``);
- ``QmpGone``: nobody listens on the socket (it does not exist, or the connection is refused):
  the daemon or VM is gone;
- ``QmpConnectionError``: anything else on the way (a hang-up, a timeout, a busy monitor).

Events are buffered from the moment a connection is made, so one that arrives between a command
and the wait for it is not missed: take ``event_mark()`` before the command, ``wait_event(...,
since=mark)`` after it. A lost connection is made again by the next call.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from qemu.qmp import ConnectError, EventListener, ExecuteError, Message, QMPClient, Runstate

from vbs.errors import DriverError

__all__ = ["QmpClient", "QmpError", "QmpCommandError", "QmpConnectionError", "QmpGone", "connect_until"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0
_EVENT_BUFFER = 1024  # events kept for wait_event(); older ones are dropped


class QmpError(DriverError):
    """A QMP exchange failed."""


class QmpConnectionError(QmpError):
    """The monitor could not be reached, hung up, or did not answer in time."""


class QmpGone(QmpConnectionError):
    """Nothing listens on the monitor socket: the daemon or VM behind it is gone."""


class QmpCommandError(QmpError):
    """The server answered a command with an error (``error_class`` is QMP's: ``GenericError``…)."""

    def __init__(self, command: str, error_class: str, desc: str) -> None:
        super().__init__(f"QMP {command} failed: {error_class}: {desc}")
        self.command = command
        self.error_class = error_class
        self.desc = desc


class _Loop:
    """The process's one event loop for QMP, on a daemon thread, started on first use."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="qmp-loop", daemon=True).start()
                cls._loop = loop
            return cls._loop


def _run(coro: Coroutine[Any, Any, T], timeout: float, what: str, where: str) -> T:
    """Run ``coro`` on the shared loop, cancelled inside the loop if it takes longer than ``timeout``."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    fut = asyncio.run_coroutine_threadsafe(bounded(), _Loop.get())
    try:
        return fut.result(timeout + 5.0)
    except TimeoutError as exc:  # asyncio's and concurrent.futures' are this one since 3.11
        fut.cancel()
        raise QmpConnectionError(f"QMP {what}: no answer within {timeout:g}s ({where})") from exc


class _Ring(EventListener):
    """Keeps the last events with a sequence number and wakes waiters (runs on the loop thread)."""

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


class QmpClient:
    """One persistent connection to one QMP monitor (a unix socket), usable from any thread.

    ``name`` shows in the server's view of its clients and in log lines. Calls are serialised per
    client: QEMU answers one command at a time on a monitor anyway.
    """

    def __init__(self, socket_path: Path | str, *, name: str = "vbs", connect_timeout: float = 5.0,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.socket_path = str(socket_path)
        self.name = name
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self._lock = threading.RLock()
        self._client: QMPClient | None = None
        self._ring: _Ring | None = None
        self._closed = False
        _open_clients.add(self)

    # -- connection --------------------------------------------------------------------------------

    def _connected(self, connect_timeout: float | None = None) -> tuple[QMPClient, _Ring]:
        with self._lock:
            if self._closed:
                raise QmpConnectionError(f"QMP client for {self.socket_path} is closed")
            if self._client is not None and self._ring is not None and self._client.runstate == Runstate.RUNNING:
                return self._client, self._ring
            self._drop()
            client = QMPClient(self.name)
            # The library logs every failed connect at ERROR; callers raise (and log) instead, so a
            # VM socket probed at every heartbeat does not flood the log.
            client.logger.setLevel(logging.CRITICAL)
            ring = _Ring()
            client.register_listener(ring)
            # The default listener keeps every event forever and nobody reads it.
            client.events.names = {"\x00none"}
            try:
                limit = self.connect_timeout if connect_timeout is None else connect_timeout
                _run(client.connect(self.socket_path), limit, "connect", self.socket_path)
            except Exception as exc:
                self._discard(client)
                if isinstance(exc, ConnectError) and isinstance(exc.exc, FileNotFoundError | ConnectionRefusedError):
                    raise QmpGone(f"nothing listens on {self.socket_path}") from exc
                if isinstance(exc, QmpError):
                    raise QmpConnectionError(f"{exc.message} (busy with another client?)") from exc
                raise QmpConnectionError(f"QMP connect to {self.socket_path} failed: {exc}") from exc
            self._client, self._ring = client, ring
            return client, ring

    def _discard(self, client: QMPClient) -> None:
        try:
            _run(client.disconnect(), self.connect_timeout, "disconnect", self.socket_path)
        except Exception as exc:  # a dead peer makes disconnect() re-raise its EOF
            log.debug("QMP disconnect from %s: %s", self.socket_path, exc)

    def _drop(self) -> None:
        client, self._client, self._ring = self._client, None, None
        if client is not None:
            self._discard(client)

    @property
    def connected(self) -> bool:
        client = self._client
        return client is not None and client.runstate == Runstate.RUNNING

    def connect(self, timeout: float | None = None) -> None:
        """Connect now unless connected (otherwise the first call connects); ``timeout`` bounds this
        connect instead of ``connect_timeout`` (a quick probe of a monitor that may be busy)."""
        self._connected(timeout)

    # -- commands and events -------------------------------------------------------------------------

    def execute(self, command: str, arguments: Mapping[str, Any] | None = None, *,
                timeout: float | None = None) -> Any:
        """Run one QMP command and return its ``return`` value."""
        with self._lock:
            client, _ = self._connected()
            limit = self.timeout if timeout is None else timeout
            try:
                return _run(client.execute(command, arguments), limit, command, self.socket_path)
            except ExecuteError as exc:
                raise QmpCommandError(command, exc.error_class, str(exc)) from exc
            except QmpError:
                self._drop()  # a timed-out command leaves the stream in an unknown state
                raise
            except Exception as exc:  # ExecInterruptedError, StateError, EOF: the connection is gone
                self._drop()
                raise QmpConnectionError(f"QMP {command}: connection to {self.socket_path} lost: {exc}") from exc

    def event_mark(self) -> int:
        """A position in the event stream: pass it to ``wait_event`` to see only later events."""
        _, ring = self._connected()
        return ring.seq

    def wait_event(self, name: str, match: Callable[[dict[str, Any]], bool] | None = None, *,
                   since: int = 0, timeout: float | None = None) -> dict[str, Any]:
        """Wait for event ``name`` (numbered after ``since``) for which ``match(event)`` holds."""
        _, ring = self._connected()
        limit = self.timeout if timeout is None else timeout

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
            return _run(wait(), limit, f"wait for {name}", self.socket_path)
        except QmpConnectionError as exc:
            raise QmpConnectionError(f"QMP event {name} did not come within {limit:g}s") from exc

    def close(self) -> None:
        """Disconnect; the client cannot be used again."""
        with self._lock:
            if self._closed:
                return
            self._drop()
            self._closed = True
        _open_clients.discard(self)

    def __enter__(self) -> QmpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_until(socket_path: Path, deadline: float, *, alive: Callable[[], bool] | None = None,
                  name: str = "vbs", timeout: float = DEFAULT_TIMEOUT) -> QmpClient:
    """A client connected to a monitor that is still starting: retried until ``deadline``
    (``time.monotonic()``), or until ``alive()`` says the process died.

    The socket file appears when the daemon binds it, a moment before it listens: a connect in
    between is refused, which here means "not yet", not "gone".
    """
    client = QmpClient(socket_path, name=name, timeout=timeout)
    while True:
        try:
            # The greeting of a daemon that just started may take longer than a connect's usual bound
            # on a loaded machine (a storage agent's qemu-storage-daemon once took over 5 s while Ceph
            # and a guest started beside it): the deadline bounds it.
            left = max(0.5, deadline - time.monotonic())
            client.connect(timeout=left)
            client.execute("query-version", timeout=left)
            return client
        except QmpGone:
            pass
        except QmpError:
            client.close()
            raise
        if (alive is not None and not alive()) or time.monotonic() >= deadline:
            client.close()
            raise QmpConnectionError(f"no QMP monitor on {socket_path} in time")
        time.sleep(0.02)


_open_clients: weakref.WeakSet[QmpClient] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Disconnect cleanly at interpreter exit (otherwise asyncio complains about pending tasks).
    for client in list(_open_clients):
        try:
            client.close()
        except Exception as exc:  # exiting anyway
            log.debug("closing QMP client at exit: %s", exc)
