"""The plumbing of AWS's rest-json services on the controller's endpoint (the EBS direct APIs, the Recycle
Bin, Data Lifecycle Manager: docs/ebs-direct.md, docs/recycle-bin.md, docs/lifecycle-policies.md): each
route reads its bounded body, checks SigV4 scoped to its service (or a bearer key), runs its handler in a
worker thread, and answers errors in the service's own shape. The services whose errors carry a ``Reason``
(``ebs``, ``rbin``: the ``x-amzn-ErrorType`` header and ``{"Message", "Reason"}``) share ``AwsJsonError``
and ``refusal``."""

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

__all__ = ["AwsJsonError", "AccessDeniedException", "ConflictException", "ResourceNotFoundException",
           "ValidationException", "DENIED_CODES", "Handler", "Service", "parse_body", "refusal"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

Handler = Callable[[Request, Controller, Principal, bytes], Any]
Endpoint = Callable[[Request], Awaitable[Response]]


class Service:
    """The routes of one rest-json service: ``name`` is its SigV4 service name; ``refuse`` answers an error in
    its shape; ``too_large`` and ``internal`` are its errors for an oversized body and an unexpected fault."""

    def __init__(self, app: FastAPI, auth: Authenticator, name: str, *, body_max: int,
                 refuse: Callable[[VbsError], Response], too_large: Callable[[], VbsError],
                 internal: Callable[[], VbsError]) -> None:
        self.app, self.auth, self.name, self.body_max = app, auth, name, body_max
        self.refuse, self.too_large, self.internal = refuse, too_large, internal

    def route(self, path: str, method: str, status: int = 200, *,
              unsigned_payload_vouched_by: str | None = None) -> Callable[[Handler], Endpoint]:
        """Install ``handler`` on ``method path``: it answers a dict (JSON with ``status``) or a Response."""
        def wrap(handler: Handler) -> Endpoint:
            async def endpoint(request: Request) -> Response:
                try:
                    body = await request.body()
                    if len(body) > self.body_max:
                        raise self.too_large()
                    who = self.auth.check_service(request, body, self.name,
                                                  unsigned_payload_vouched_by=unsigned_payload_vouched_by)
                    svc: Controller = request.app.state.services
                    answer = await run_in_threadpool(handler, request, svc, who, body)
                except VbsError as exc:
                    return self.refuse(exc)
                except Exception:
                    log.exception("%s API %s %s", self.name, method, path)
                    return self.refuse(self.internal())
                if isinstance(answer, Response):
                    return answer
                return JSONResponse(answer, status_code=status)

            self._install(path, method, endpoint)
            return endpoint
        return wrap

    def _install(self, path: str, method: str, endpoint: Endpoint) -> None:
        """Add the route; a path another service has too (``/tags/{resourceArn}``: the Recycle Bin's and Data
        Lifecycle Manager's) goes to the service its ARN names (``arn:aws:<service>:…``), else to the first."""
        routes: dict[tuple[str, str], list[tuple[str, Endpoint]]] = getattr(self.app.state, "aws_json_routes", {})
        self.app.state.aws_json_routes = routes
        owners = routes.get((path, method))
        if owners is not None:
            owners.append((self.name, endpoint))
            return
        owners = routes[(path, method)] = [(self.name, endpoint)]

        async def dispatch(request: Request) -> Response:
            arn = str(request.path_params.get("resourceArn", ""))
            for name, owner in owners:
                if arn.startswith(f"arn:aws:{name}:"):
                    return await owner(request)
            return await owners[0][1](request)

        self.app.add_api_route(path, dispatch, methods=[method], include_in_schema=False)


class AwsJsonError(VbsError):
    """An error answered in the shape of a service whose errors carry a ``Reason``: ``code`` is the exception
    shape's name."""

    code = "InternalServerException"
    status = 500
    reason: str | None = None

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


# The exception shapes AWS's rest-json services have in common: a service's error class takes its
# ``Reason`` and the service's base (``class NotFoundError(EbsError, ResourceNotFoundException)``).
class ValidationException(AwsJsonError):
    code = "ValidationException"
    status = 400
    reason: str | None = "INVALID_PARAMETER_VALUE"


class ResourceNotFoundException(AwsJsonError):
    code = "ResourceNotFoundException"
    status = 404


class AccessDeniedException(AwsJsonError):
    code = "AccessDeniedException"
    status = 403


class ConflictException(AwsJsonError):
    code = "ConflictException"
    status = 409


# VBS's codes for a refused key or signature, which AWS's services answer with their own and 403.
DENIED_CODES = ("AuthFailure", "UnauthorizedOperation", "SignatureDoesNotMatch")


def refusal(err: AwsJsonError) -> Response:
    body: dict[str, Any] = {"Message": err.message}
    if err.reason is not None:
        body["Reason"] = err.reason
    return JSONResponse(body, status_code=err.status, headers={"x-amzn-ErrorType": err.code})


def parse_body(model: type[M], body: bytes, invalid: Callable[[str], VbsError]) -> M:
    """``body`` (JSON; empty: ``{}``) as ``model``, or ``invalid(message)`` naming the first bad field."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise invalid(f"Invalid value for {where or 'the request'}: {first.get('msg', 'invalid')}.") from None
