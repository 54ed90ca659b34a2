"""HTTP plumbing shared by the three services: error mapping, bearer-token auth, bounded servers.

The API edge maps ``VbsError`` to ``{"error": {"code", "message", "type", "fields"}}`` here and
nowhere else, and turns request-validation failures into ``InvalidParameterValue`` /
``MissingParameter``; ``ApiClient`` (``vbs.net.api_client``, importable from here too) turns such a
body back into the same exception class.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from vbs.errors import (
    AuthFailure,
    InvalidParameter,
    MissingParameter,
    NotFound,
    VbsError,
)
from vbs.net.api_client import SERVER_KEEP_ALIVE_S
from vbs.net.api_client import ApiClient as ApiClient
from vbs.net.asgi import HttpMiddleware
from vbs.net.heads import Scope as Scope
from vbs.net.heads import header as header
from vbs.net.heads import peer_check as peer_check
from vbs.net.heads import refusal as refusal
from vbs.trust import fencing
from vbs.trust.node_credentials import TokenSource
from vbs.trust.pki import PeerCertificate, peer_certificate
from vbs.trust.tls import TlsFiles

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
BODY_IDLE_TIMEOUT_S = 10.0
BODY_TOTAL_TIMEOUT_S = 30.0
# A body must arrive at this many bytes a second at least, after a grace period (then 408). The
# grace is as long as the idle bound: a client starved of CPU may send its body seconds after its
# head (seen at 2 s under load, with 50 client threads on 2 cores).
BODY_MIN_RATE = 1024
BODY_GRACE_S = BODY_IDLE_TIMEOUT_S
# Requests in progress at once (then 503): per client address, per access key, per tenant, per
# node (an agent's calls, which share no budget with users), and for the whole server.
MAX_REQUESTS_PER_CLIENT = 128
MAX_REQUESTS_PER_KEY = 64
MAX_REQUESTS_PER_TENANT = 96
MAX_REQUESTS_PER_NODE = 16
MAX_CONCURRENCY = 1024


@dataclass(frozen=True)
class RequestBounds:
    """How much one request body, and one client, may hold of a server (docs/security.md)."""

    body_min_rate: float = BODY_MIN_RATE
    body_grace_s: float = BODY_GRACE_S
    per_address: int = MAX_REQUESTS_PER_CLIENT
    per_key: int = MAX_REQUESTS_PER_KEY
    per_tenant: int = MAX_REQUESTS_PER_TENANT
    per_node: int = MAX_REQUESTS_PER_NODE


DEFAULT_BOUNDS = RequestBounds()


def _describe_validation(exc: RequestValidationError) -> VbsError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
    kind = first.get("type", "")
    if kind == "missing":
        return MissingParameter(f"The request must contain the parameter {loc or 'body'}.")
    if kind == "extra_forbidden":
        return InvalidParameter(f"Unknown parameter {loc}.")
    if kind == "json_invalid":
        return InvalidParameter("The request body is not valid JSON.")
    msg = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return InvalidParameter(f"Invalid value for {loc or 'request'}: {msg}{more}.")


def install_error_handlers(app: FastAPI, bounds: RequestBounds = DEFAULT_BOUNDS) -> None:
    @app.exception_handler(VbsError)
    async def _vbs_error(_request: Request, exc: VbsError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("%s: %s", exc.code, exc.message)
        return JSONResponse(exc.to_body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _describe_validation(exc)
        return JSONResponse(err.to_body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err: VbsError
        if exc.status_code == 404:
            err = NotFound(str(exc.detail))
        else:
            code = {405: "MethodNotAllowed", 413: "RequestTooLarge"}.get(exc.status_code, "BadRequest")
            err = VbsError(str(exc.detail), code=code, status=exc.status_code)
        return JSONResponse(err.to_body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse({"error": {"code": "InternalError", "message": "internal error"}}, status_code=500)

    app.add_middleware(BodyLimit, bounds=bounds)


# BaseException, not Exception: FastAPI turns any Exception raised while it reads a body into a
# generic 400, and these must reach BodyLimit to become 413 / 408.
class _BodyTooLarge(BaseException):
    pass


class _BodyTooSlow(BaseException):
    pass


class BodyLimit(HttpMiddleware):
    """Bound every request body in size and time, however it is sent (Content-Length or chunked).

    A body over ``MAX_BODY_BYTES`` is refused with 413 as soon as that much has arrived; a client
    that stops sending its body for ``BODY_IDLE_TIMEOUT_S``, or has not sent all of it after
    ``BODY_TOTAL_TIMEOUT_S``, or sends it slower than ``bounds.body_min_rate`` bytes a second once
    ``bounds.body_grace_s`` have passed (a byte at a time), gets 408. Nothing reads more than that.
    The rate is over the time the server spent waiting for the body, not since the request came in:
    a loaded server that reads a body late never blames the client for its own delay.
    """

    def __init__(self, app: Any, bounds: RequestBounds = DEFAULT_BOUNDS) -> None:
        super().__init__(app)
        self.bounds = bounds

    async def http(self, scope: Any, receive: Any, send: Any) -> None:
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            await _send_refusal(scope, send, _too_large())
            return
        received = 0
        started = False
        complete = False
        waited = 0.0  # time spent waiting on the client: a server busy elsewhere does not count against it
        deadline = time.monotonic() + BODY_TOTAL_TIMEOUT_S
        rate, grace = self.bounds.body_min_rate, self.bounds.body_grace_s

        async def limited_receive() -> Any:
            nonlocal received, complete, waited
            now = time.monotonic()
            left = min(BODY_IDLE_TIMEOUT_S, deadline - now)
            if rate > 0 and not complete:  # the floor: what has arrived must keep pace with the waiting
                left = min(left, grace + received / rate - waited)
            try:
                if left <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                raise _BodyTooSlow() from None
            finally:
                waited += time.monotonic() - now
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = complete or not message.get("more_body", False)
                if received > MAX_BODY_BYTES:
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_refusal(scope, send, _too_large())
        except _BodyTooSlow:
            if not started:
                await _send_refusal(scope, send, VbsError(
                    f"the request body stopped arriving, or arrived slower than {rate:g} bytes a second",
                    code="RequestTimeout", status=408))


def _too_large() -> VbsError:
    return VbsError(f"request body larger than {MAX_BODY_BYTES} bytes", code="RequestTooLarge", status=413)


async def _send_refusal(scope: Scope, send: Any, exc: VbsError) -> None:
    """Answer with ``refusal(exc)`` from inside an ASGI middleware (it reads nothing more)."""

    async def nothing() -> Any:
        return {"type": "http.disconnect"}

    await refusal(exc)(scope, nothing, send)


def agent_auth(source: TokenSource, *, insecure: bool, fences: fencing.FenceBook | None = None,
               me: str = "this agent") -> Callable[[Scope], Response | None]:
    """The pre-body check of an agent's ``/v1``: ``Authorization: Bearer <this node's token>``, then
    the caller's wire version (``peer_check``; ``me`` names this agent in a refusal), then the call's
    fencing token, if it carries one (``vbs.trust.fencing``).

    Without a token the agent accepts every caller only when it runs ``--insecure``."""

    def admit(scope: Scope) -> Response | None:  # the caller is authenticated: its versions, then its fence
        refused = peer_check(scope, me)
        if refused is not None:
            return refused
        value = header(scope, fencing.FENCE_HEADER.encode())
        if not value or fences is None:
            return None
        try:
            fences.admit(value)
        except VbsError as exc:
            log.warning("refused a call to %s: %s", scope["path"][:200], exc.message)
            return refusal(exc)
        return None

    def check(scope: Scope) -> Response | None:
        if scope["path"] == "/health":
            return None
        if not source.configured and insecure:
            return admit(scope)
        given = header(scope, b"authorization")
        if given.startswith("Bearer ") and source.accepts(given[len("Bearer "):].strip()):
            return admit(scope)
        return refusal(AuthFailure("missing or wrong bearer token"))

    return check


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def sigv4_key_id(scope: Scope) -> str | None:
    """The access key id a SigV4 request claims (header or presigned query), not yet verified."""
    authz = header(scope, b"authorization")
    if authz.startswith("AWS4-HMAC-SHA256 "):
        _, sep, rest = authz.partition("Credential=")
        return rest.split("/", 1)[0].strip()[:128] if sep else None
    query = scope.get("query_string", b"")
    if b"X-Amz-Credential=" in query:
        values = urllib.parse.parse_qs(bytes(query).decode("latin-1")).get("X-Amz-Credential") or [""]
        return values[0].split("/", 1)[0][:128] or None
    return None


def budgets(scope: Scope) -> list[tuple[str, str]]:
    """The budgets a request in progress counts against, from what the head check left in its state.

    A node's calls (heartbeats) count against that node's own budget only, never a client
    address's: users cannot crowd them out. ``/health`` has a budget of its own per address. A
    user's request counts against its address, its key and (once known) its tenant; a SigV4
    request, verified only once its body is in, against the key id it claims.
    """
    state = scope.get("state") or {}
    client = (scope.get("client") or ("?", 0))[0]
    node = state.get("node")
    if node is not None:
        return [("node", f"{getattr(node, 'kind', '')}.{getattr(node, 'name', node)}")]
    if scope.get("path") == "/health":
        return [("health", client)]
    if str(scope.get("path", "")).startswith("/internal/"):
        return [("internal", client)]  # an insecure controller's heartbeat without a token
    out = [("address", client)]
    caller = state.get("caller")
    if caller is not None:
        out += [("key", caller.access_key_id), ("tenant", caller.tenant)]
    elif (key_id := sigv4_key_id(scope)) is not None:
        out.append(("key", key_id))
    return out


def _nosniff(send: Any) -> Any:
    """``send`` that adds ``X-Content-Type-Options: nosniff`` to every answer (JSON, XML, errors)."""

    async def with_nosniff(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if not any(bytes(k).lower() == b"x-content-type-options" for k, _ in headers):
                headers.append((b"x-content-type-options", b"nosniff"))
            message = {**message, "headers": headers}
        await send(message)

    return with_nosniff


class PreAuth(HttpMiddleware):
    """Refuse a request on its head alone, before any of its body is read (an unauthenticated client
    cannot make a server wait for a body), and bound requests in progress per budget (``budgets``:
    client address, access key, tenant, node).

    ``check(scope)`` answers None to let the request through, or the answer that refuses it.
    """

    def __init__(self, app: Any, check: Callable[[Scope], Response | None],
                 bounds: RequestBounds = DEFAULT_BOUNDS) -> None:
        super().__init__(app)
        self.check = check
        self.limits = {"address": bounds.per_address, "health": bounds.per_address, "key": bounds.per_key,
                       "tenant": bounds.per_tenant, "node": bounds.per_node, "internal": bounds.per_node}
        self._in_flight: dict[tuple[str, str], int] = {}

    async def http(self, scope: Any, receive: Any, send: Any) -> None:
        send = _nosniff(send)
        refused = self.check(scope)
        if refused is not None:
            await refused(scope, receive, send)
            return
        held = budgets(scope)
        for budget in held:
            limit = self.limits[budget[0]]
            if self._in_flight.get(budget, 0) >= limit:
                what = "client address" if budget[0] in ("address", "health", "internal") else budget[0]
                await _send_refusal(scope, send, VbsError(
                    f"more than {limit} requests in progress for one {what}",
                    code="RequestLimitExceeded", status=503))
                return
        for budget in held:
            self._in_flight[budget] = self._in_flight.get(budget, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            for budget in held:
                left = self._in_flight[budget] - 1
                if left:
                    self._in_flight[budget] = left
                else:
                    del self._in_flight[budget]


IDLE_CONNECTION_TIMEOUT_S = 10.0
PEER_KEY = "vbs.peer_certificate"


def peer_of(scope: Scope) -> PeerCertificate | None:
    """The verified client certificate of the request's connection, if it presented one."""
    peer = scope.get(PEER_KEY)
    return peer if isinstance(peer, PeerCertificate) else None


class PeerCertProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus the connection's verified client certificate in every request's
    scope (``peer_of``): uvicorn passes no TLS details to the app. The TLS handshake (and so the
    certificate's verification against the CA) is over before ``connection_made``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if not der:
            return
        peer, app = peer_certificate(der), self.app

        async def with_peer(scope: Scope, receive: Any, send: Any) -> None:
            scope[PEER_KEY] = peer
            await app(scope, receive, send)

        self.app = with_peer


class BoundedServer(uvicorn.Server):
    """uvicorn, plus a deadline for connections that are not in the middle of a request.

    uvicorn closes an idle keep-alive connection only after a response, and never times out a
    client that connects and then sends nothing, or stops halfway through its headers: each would
    hold a socket for ever. Every second this closes connections that have waited for a request for
    ``IDLE_CONNECTION_TIMEOUT_S``. (A stalled *body* is BodyLimit's business.)
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._waiting: dict[Any, tuple[int, float]] = {}

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0:
            self._close_stalled(time.monotonic())
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn closes an idle connection and waits until it is gone; a TLS one is gone only once the
        # client answers the close with its own close_notify, which an idle client never sends (nobody
        # reads its socket): the stop would hang until killed. Idle connections are cut at once instead;
        # one in the middle of a request still ends it first.
        for proto in list(self.server_state.connections):
            transport = getattr(proto, "transport", None)
            if _idle(proto) and transport is not None:
                transport.abort()
        await super().shutdown(sockets)

    def _close_stalled(self, now: float) -> None:
        connections = list(self.server_state.connections)
        for proto in connections:
            cycle = getattr(proto, "cycle", None)
            if not _idle(proto):
                self._waiting.pop(proto, None)
                continue
            marker, since = self._waiting.get(proto, (id(cycle), now))
            if marker != id(cycle):  # a request came and went since the last look
                since = now
            self._waiting[proto] = (id(cycle), since)
            if now - since > IDLE_CONNECTION_TIMEOUT_S:
                transport = getattr(proto, "transport", None)
                if transport is not None:
                    transport.close()
        for proto in list(self._waiting):
            if proto not in connections:
                del self._waiting[proto]


def _idle(proto: Any) -> bool:
    """Whether a connection waits for a request (none yet, or the last one answered)."""
    cycle = getattr(proto, "cycle", None)
    return cycle is None or bool(getattr(cycle, "response_complete", False))


def bounded_server(app: Any, host: str, port: int, tls: TlsFiles | None = None, *,
                   require_client_cert: bool = False, trusted_proxies: Sequence[str] = ()) -> BoundedServer:
    """uvicorn with the bounds above. ``X-Forwarded-For``/``-Proto`` are read only from the proxies
    in ``trusted_proxies`` (addresses or networks); with none (the default) they are ignored from
    everyone, loopback included (uvicorn's own default trusts 127.0.0.1, and FORWARDED_ALLOW_IPS)."""
    ssl_kwargs = tls.server_kwargs(require_client_cert=require_client_cert) if tls is not None else {}
    # Longer than the clients keep an idle connection for reuse (vbs.net.api_client.KEEPALIVE_EXPIRY_S).
    return BoundedServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
                                        proxy_headers=bool(trusted_proxies),
                                        forwarded_allow_ips=list(trusted_proxies) or None,
                                        limit_concurrency=MAX_CONCURRENCY, http=PeerCertProtocol, **ssl_kwargs))


def serve(app: Any, host: str, port: int, tls: TlsFiles | None = None, *, trusted_proxies: Sequence[str] = ()) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, with the request bounds above (HTTPS with ``tls``)."""
    bounded_server(app, host, port, tls, trusted_proxies=trusted_proxies).run()


def serve_agent(app: FastAPI, host: str, port: int, *, heartbeat: Callable[[BoundedServer], Any],
                shutdown: Callable[[], None], tls: TlsFiles | None = None) -> None:
    """Serve an agent's ``app`` until SIGINT/SIGTERM: its heartbeat starts once the API listens,
    ``shutdown`` runs once at the end (uvicorn re-raises the signal after its own shutdown, so the
    clean-up runs in the lifespan's exit, and again, harmlessly, in ``finally``)."""
    # Only the controller calls an agent: with a CA configured it must present a certificate from it.
    server = bounded_server(app, host, port, tls, require_client_cert=True)
    beat = heartbeat(server)
    done = threading.Event()

    def stop() -> None:
        if done.is_set():
            return
        done.set()
        beat.stop()
        shutdown()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        stop()

    app.router.lifespan_context = lifespan
    beat.start()
    try:
        server.run()
    finally:
        stop()
