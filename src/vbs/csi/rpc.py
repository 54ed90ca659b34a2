"""What every CSI service shares: one decorator that turns an RPC's errors into gRPC statuses (CsiError as
itself, a VbsError by ``errors.code_of``, anything else INTERNAL, logged) and runs the call in its service's
``call_scope`` (the Controller's: the VBS key the request's secrets carry); and ``KeyedLocks``, one call at a
time per volume or name."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from vbs.csi.errors import CsiError, from_vbs
from vbs.errors import VbsError

__all__ = ["rpc", "unimplemented", "KeyedLocks"]

log = logging.getLogger("vbs.csi")

F = TypeVar("F", bound=Callable[..., Any])


def rpc(method: F) -> F:
    """Wrap a servicer's method ``(self, request, context)``: an error aborts the call with its status. A
    servicer with ``call_scope(request)`` runs each call inside the context it gives."""
    import grpc

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            scope: Callable[[Any], AbstractContextManager[None]] | None = getattr(self, "call_scope", None)
            with scope(request) if scope is not None else nullcontext():
                return method(self, request, context)
        except CsiError as exc:
            failure = exc
        except VbsError as exc:
            failure = from_vbs(exc)
        except Exception as exc:  # noqa: BLE001 - the sidecar gets INTERNAL, the log the trace
            log.exception("%s failed", method.__name__)
            failure = CsiError("INTERNAL", f"{type(exc).__name__}: {exc}")
        log.info("%s: %s %s", method.__name__, failure.code, failure.message)
        context.abort(getattr(grpc.StatusCode, failure.code), failure.message)
        raise AssertionError("context.abort returns only by raising")

    return wrapper  # type: ignore[return-value]


def unimplemented(name: str) -> Callable[[Any, Any, Any], Any]:
    """A method of the spec this driver does not offer (its capability is not advertised)."""

    @rpc
    def method(self: Any, request: Any, context: Any) -> Any:
        raise CsiError("UNIMPLEMENTED", f"{name} is not implemented by the VBS driver")

    method.__name__ = name
    return method


class KeyedLocks:
    """One call at a time per key (a volume or snapshot id, a name): ``with locks(key):`` holds ``key``'s lock
    for the call, and another call on the same key meanwhile answers ABORTED (CSI: "an operation is already
    pending for the volume"; the caller retries, while the first call goes on)."""

    def __init__(self) -> None:
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    @contextmanager
    def __call__(self, key: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        if not lock.acquire(blocking=False):
            raise CsiError("ABORTED", f"an operation on {key} is already in flight: try again")
        try:
            yield
        finally:
            lock.release()
