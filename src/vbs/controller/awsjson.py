"""The plumbing every rest-json AWS service on the controller's endpoint shares (the EBS direct APIs,
docs/ebs-direct.md; the Recycle Bin, docs/recycle-bin.md): routes that check the caller (SigV4 scoped to
the service's signing name, or a bearer key), run their handler in a thread, and answer errors in AWS's
shape: the ``x-amzn-ErrorType`` header and ``{"Message", "Reason"}``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.auth.keys import Principal
from vbs.controller.runtime import Controller
from vbs.errors import VbsError

__all__ = ["AwsJsonError", "refusal", "json_routes", "Handler", "parse_body"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class AwsJsonError(VbsError):
    """An error answered in a rest-json service's shape: ``code`` is the exception shape's name."""

    code = "InternalServerException"
    status = 500
    reason: str | None = None

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


def refusal(err: AwsJsonError) -> Response:
    body: dict[str, Any] = {"Message": err.message}
    if err.reason is not None:
        body["Reason"] = err.reason
    return JSONResponse(body, status_code=err.status, headers={"x-amzn-ErrorType": err.code})


Handler = Callable[[Request, Controller, Principal, bytes], Any]
Route = Callable[[Handler], Callable[[Request], Awaitable[Response]]]


def json_routes(app: FastAPI, auth: Authenticator, service: str, error_of: Callable[[VbsError], AwsJsonError],
                max_body: int) -> Callable[..., Route]:
    """``route(path, method, status, unsigned_ok=False)``: a decorator that adds a handler of ``service``
    to ``app``. The handler answers a JSON-able value (sent with ``status``) or a Response of its own."""

    def route(path: str, method: str, status: int, *, unsigned_ok: bool = False) -> Route:
        def wrap(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
            async def endpoint(request: Request) -> Response:
                try:
                    body = await request.body()
                    if len(body) > max_body:
                        raise error_of(VbsError(f"The request body is larger than {max_body} bytes.", status=400))
                    who = auth.check_service(request, body, service,
                                             unsigned_payload_vouched_by="x-amz-checksum" if unsigned_ok else None)
                    svc: Controller = request.app.state.services
                    answer = await run_in_threadpool(handler, request, svc, who, body)
                except VbsError as exc:
                    return refusal(error_of(exc))
                except Exception:
                    log.exception("%s %s %s", service, method, path)
                    return refusal(AwsJsonError("An internal error has occurred."))
                if isinstance(answer, Response):
                    return answer
                return JSONResponse(answer, status_code=status)

            app.add_api_route(path, endpoint, methods=[method], include_in_schema=False)
            return endpoint
        return wrap
    return route


def parse_body(model: type[M], body: bytes, invalid: Callable[[str], AwsJsonError]) -> M:
    """``body`` (JSON; empty: ``{}``) as ``model``, or ``invalid(message)`` naming the first bad field."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise invalid(f"Invalid value for {where or 'the request'}: {first.get('msg', 'invalid')}.") from None
