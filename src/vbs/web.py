"""HTTP plumbing shared by the three services: error mapping, bearer-token auth, agent clients.

The API edge maps ``VbsError`` to ``{"error": {"code", "message"}}`` here and nowhere else, and
turns request-validation failures into ``InvalidParameterValue`` / ``MissingParameter``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vbs.errors import AgentUnavailable, AgentUnreachable, AuthFailure, InvalidParameter, MissingParameter, VbsError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20


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


def install_error_handlers(app: FastAPI) -> None:
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
        code = {404: "NotFound", 405: "MethodNotAllowed", 413: "RequestTooLarge"}.get(exc.status_code, "BadRequest")
        return JSONResponse({"error": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse({"error": {"code": "InternalError", "message": "internal error"}}, status_code=500)

    @app.middleware("http")
    async def _limit_body(request: Request, call_next: Callable[[Request], Any]) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            err = InvalidParameter(f"request body larger than {MAX_BODY_BYTES} bytes")
            return JSONResponse(err.to_body(), status_code=413)
        return await call_next(request)


def token_checker(token: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency that requires ``Authorization: Bearer <token>`` (constant-time compare)."""

    def check(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise AuthFailure("missing or wrong bearer token")

    return check


class ApiClient:
    """A small JSON client for VBS APIs (agents, controller, CLI); errors come back as VbsError."""

    def __init__(self, base_url: str, token: str | None, *, timeout: float = 30.0) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def call(self, method: str, path: str, json: Any = None, *, timeout: float | None = None) -> Any:
        kwargs: dict[str, Any] = {"json": json}
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise AgentUnreachable(f"{self.base_url}: connection refused ({method} {path})") from exc
        except httpx.TimeoutException as exc:
            raise AgentUnavailable(f"{self.base_url}: no answer in time ({method} {path})") from exc
        except httpx.HTTPError as exc:
            raise AgentUnavailable(f"{self.base_url}: unreachable ({type(exc).__name__})") from exc
        if resp.status_code >= 400:
            try:
                err = resp.json()["error"]
                raise VbsError(str(err["message"]), code=str(err["code"]), status=resp.status_code)
            except (ValueError, KeyError, TypeError):
                raise VbsError(f"{self.base_url}: HTTP {resp.status_code}", status=502) from None
        return resp.json() if resp.content else None

    def close(self) -> None:
        self._http.close()
