"""The JSON client of VBS APIs (agents, controller, CLI), apart from the server plumbing of ``vbs.net.web``:
a client command imports httpx and this, not FastAPI, uvicorn or pydantic (``vbs --help`` and
``vbs describe-volumes`` pay for every module they import, on every run).
"""

from __future__ import annotations

import logging
import ssl
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

# httpx's package imports its own command line (``httpx._main``: click, rich.syntax, pygments) whenever
# those are installed, as they are with the CLI's rich. Nothing in VBS runs it; it would be a third of
# every client command's imports. A None entry makes that import fail, and httpx then does without it.
if "httpx" not in sys.modules:
    sys.modules["httpx._main"] = None  # type: ignore[assignment]

import httpx  # noqa: E402

from vbs.errors import AgentUnavailable, AgentUnreachable, InvalidParameter, VbsError, from_body
from vbs.net.endpoints import is_idempotent
from vbs.trust import fencing
from vbs.versions import sent_headers

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["ApiClient"]

M = TypeVar("M", bound="BaseModel")

log = logging.getLogger(__name__)

# VBS's servers close a keep-alive connection after SERVER_KEEP_ALIVE_S idle (vbs.net.web). A client that
# reused one idle for as long (httpx's default expiry is also 5 s) could send a request just as the
# server closed it, and get no answer at all ("Server disconnected without sending a response"): a
# POST is not sent again. A connection idle for KEEPALIVE_EXPIRY_S is not reused: a new one is made.
SERVER_KEEP_ALIVE_S = 5
KEEPALIVE_EXPIRY_S = 2.0
CONNECTION_LIMITS = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)


class ApiClient:
    """A JSON client for VBS APIs (agents, controller, CLI); errors come back as their VbsError class.

    Given several base URLs (an install's controllers), it calls the current one and moves on to the
    next, round-robin, when that one fails and moving on is safe: after a connection error (nothing
    was sent) for any request; after the request was sent (no answer in time, the connection
    lost) or answered with a 5xx only for a request that may be repeated (``vbs.net.endpoints.
    is_idempotent``, or ``idempotent=True``). The next call starts at the URL that answered last.
    """

    def __init__(self, base_url: str | Sequence[str], token: str | Callable[[], str | None] | None, *,
                 timeout: float = 30.0, verify: ssl.SSLContext | bool = True, label: str = "",
                 transport: httpx.BaseTransport | None = None) -> None:
        """``token`` is a bearer token, or a function that gives the current one (it may rotate);
        ``label`` says whose calls these are in the log line of a switch."""
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise InvalidParameter("an API client needs at least one URL")
        self.base_urls = tuple(u.rstrip("/") for u in urls)
        self._token = token
        self._label = f"{label}: " if label else ""
        self._current = 0
        self._failing = False
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=timeout, verify=verify, transport=transport, limits=CONNECTION_LIMITS)

    @property
    def base_url(self) -> str:
        """The URL the next call goes to first."""
        return self.base_urls[self._current]

    def _auth(self) -> dict[str, str]:
        """The headers of every call: the caller's versions (vbs.versions), its token, its fence."""
        token = self._token() if callable(self._token) else self._token
        headers = sent_headers()
        if token:
            headers["authorization"] = f"Bearer {token}"
        fence = fencing.current()
        if fence is not None:
            headers[fencing.FENCE_HEADER] = fence
        return headers

    def call(self, method: str, path: str, json: Any = None, *, timeout: float | None = None,
             params: dict[str, str] | list[tuple[str, str]] | None = None, idempotent: bool | None = None) -> Any:
        """One call with a JSON body; the decoded JSON answer (the CLI's view of the public API).
        ``idempotent`` overrides what method and body say about repeating it elsewhere."""
        kwargs: dict[str, Any] = {"json": json, "params": params, "headers": self._auth()}
        if timeout is not None:
            kwargs["timeout"] = timeout
        repeatable = is_idempotent(method, json) if idempotent is None else idempotent
        first = self._current
        count = len(self.base_urls)
        failures: list[str] = []
        for attempt in range(count):
            url = self.base_urls[(first + attempt) % count]
            last = attempt == count - 1
            try:
                resp = self._http.request(method, url + path, **kwargs)
            except httpx.HTTPError as exc:
                error_class, reason, sent = _transport_failure(exc)
                failure = f"{url}: {reason} ({method} {path})"
                if sent and not repeatable and count > 1:
                    raise error_class(f"{failure}; not repeated at another URL, as it may have been carried out "
                                      "(a client token makes a create safe to repeat)") from exc
                failures.append(failure)
                if last:
                    raise error_class(failure if count == 1 else
                                      f"none of {count} URLs answered: {'; '.join(failures)}") from exc
                self._move_on(url, reason)
                continue
            if resp.status_code >= 500 and repeatable and not last:
                failures.append(f"{url}: HTTP {resp.status_code} ({method} {path})")
                self._move_on(url, f"HTTP {resp.status_code}")
                continue
            self._answered(url)
            return _answer(url, resp)
        raise AssertionError("unreachable")  # the loop returns or raises on its last attempt

    def _move_on(self, failed: str, reason: str) -> None:
        """Make the URL after ``failed`` the current one; say so once until a call succeeds again."""
        with self._lock:
            index = self.base_urls.index(failed)
            if index != self._current:
                return  # another thread moved on already
            self._current = (index + 1) % len(self.base_urls)
            if not self._failing:
                log.warning("%s%s failed (%s): switching to %s", self._label, failed, reason,
                            self.base_urls[self._current])
            self._failing = True

    def _answered(self, url: str) -> None:
        with self._lock:
            if self._failing and len(self.base_urls) > 1:
                log.info("%s%s answers", self._label, url)
            self._failing = False

    def request(self, method: str, path: str, answer: type[M], body: BaseModel | None = None, *,
                timeout: float | None = None, params: dict[str, str] | None = None,
                idempotent: bool | None = None) -> M:
        """One typed call: ``body`` is sent as JSON (secrets revealed for the wire), the answer is
        validated as ``answer``. An answer that is not one is the agent's fault: a DriverError."""
        from pydantic import ValidationError  # the agents' typed calls only: the CLI never loads pydantic

        payload = body.model_dump(mode="json") if body is not None else None
        raw = self.call(method, path, payload, timeout=timeout, params=params, idempotent=idempotent)
        try:
            return answer.model_validate(raw)
        except ValidationError as exc:
            raise VbsError(f"{self.base_url}: {method} {path} answered an invalid {answer.__name__}: "
                           f"{exc.error_count()} problems", status=502) from exc

    def close(self) -> None:
        self._http.close()


def _transport_failure(exc: httpx.HTTPError) -> tuple[type[AgentUnavailable], str, bool]:
    """What a call that got no answer raises, why, and whether its request may have reached the server."""
    if isinstance(exc, httpx.ConnectError):
        if isinstance(exc.__context__, ssl.SSLError) or "SSL" in str(exc) or "certificate" in str(exc):
            return AgentUnavailable, f"TLS handshake failed: {exc}", False
        return AgentUnreachable, "connection refused", False
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return AgentUnavailable, "no connection in time", False
    if isinstance(exc, httpx.TimeoutException):
        return AgentUnavailable, "no answer in time", True
    return AgentUnavailable, f"unreachable ({type(exc).__name__})", True


def _answer(url: str, resp: httpx.Response) -> Any:
    if resp.status_code >= 400 and "x-amzn-errortype" in resp.headers:
        # An AWS rest-json API on the same endpoint (the EBS direct APIs): its error shape.
        try:
            message = str(resp.json().get("Message", ""))[:2000]
        except (ValueError, AttributeError):
            message = ""
        raise VbsError(message or f"{url}: HTTP {resp.status_code}", code=resp.headers["x-amzn-errortype"][:64],
                       status=resp.status_code)
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
            if not isinstance(err, dict):
                raise TypeError("error is not an object")
        except (ValueError, KeyError, TypeError):
            raise VbsError(f"{url}: HTTP {resp.status_code}", status=502) from None
        raise from_body(err, resp.status_code)
    return resp.json() if resp.content else None
