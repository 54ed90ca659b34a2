"""The EC2 Query endpoint: ``POST /`` (and ``GET /``) with ``Action=…&Version=2016-11-15``.

Authenticates with SigV4 (or a bearer key), parses the form, runs the action, answers EC2's XML.
Every error is EC2's error envelope: 400 for a bad request, 401 for authentication, 412 for DryRun.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.ec2 import xml
from vbs.controller.ec2.actions import HANDLERS
from vbs.controller.ec2.query import MAX_BODY, QueryParams, parse_form
from vbs.controller.runtime import Controller
from vbs.errors import InvalidParameter, VbsError
from vbs.net.metrics import ROUTE_KEY

log = logging.getLogger(__name__)

XML_TYPE = "text/xml;charset=UTF-8"


def _status(exc: VbsError) -> int:
    if exc.code in ("AuthFailure", "DryRunOperation", "UnauthorizedOperation") or exc.status >= 500:
        return exc.status
    return 400


def _error(exc: VbsError, request_id: str) -> Response:
    return Response(xml.error(exc.code, exc.message, request_id), status_code=_status(exc), media_type=XML_TYPE)


async def _params(request: Request, body: bytes) -> QueryParams:
    params = parse_form(request.scope.get("query_string", b""))
    # A presigned request carries its signature in the query string: not an EC2 parameter.
    params = {k: v for k, v in params.items() if not k.startswith("X-Amz-")}
    if request.method == "POST" and body:
        for key, value in parse_form(body).items():
            if key in params:
                raise InvalidParameter(f"The parameter {key} is given twice.")
            params[key] = value
    return QueryParams(params)


def install(app: FastAPI, auth: Authenticator) -> None:
    async def endpoint(request: Request) -> Response:
        request_id = str(uuid.uuid4())
        try:
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
                raise InvalidParameter(f"The request body is larger than {MAX_BODY} bytes.")
            body = await request.body()
            if len(body) > MAX_BODY:
                raise InvalidParameter(f"The request body is larger than {MAX_BODY} bytes.")
            who = auth.check(request, body)
            params = await _params(request, body)
            action = params.action
            handler = HANDLERS.get(action)
            if handler is None:
                raise InvalidParameter(f"The action {action} is not valid for this web service.",
                                       code="InvalidAction")
            request.scope[ROUTE_KEY] = f"/?Action={action}"  # one of HANDLERS: a bounded label
            svc: Controller = request.app.state.services
            answer = await run_in_threadpool(handler, svc, params, who)
        except VbsError as exc:
            return _error(exc, request_id)
        except Exception:
            log.exception("EC2 request %s", request_id)
            return _error(VbsError("An internal error has occurred."), request_id)
        return Response(xml.response(action, request_id, answer), media_type=XML_TYPE)

    app.add_api_route("/", endpoint, methods=["GET", "POST"], include_in_schema=False)
