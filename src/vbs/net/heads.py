"""What every check on a request's head reads and answers with: the ASGI scope, its headers, a refusal,
and the caller's versions (vbs.versions), shared by the agents' and the controller's pre-body checks
(``vbs.net.web``, ``vbs.controller.rest.edge``)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse, Response

from vbs import versions
from vbs.errors import VbsError

log = logging.getLogger(__name__)

Scope = dict[str, Any]


def header(scope: Scope, name: bytes) -> str:
    for k, v in scope.get("headers", []):
        if k == name:
            return bytes(v).decode("latin-1")
    return ""


def refusal(exc: VbsError) -> Response:
    """A JSON error answer without a request (for checks made on a request's head)."""
    return JSONResponse(exc.to_body(), status_code=exc.status, headers={"connection": "close"})


def peer_check(scope: Scope, me: str) -> Response | None:
    """The caller's versions (``vbs.versions``): None when ``me`` serves its wire version (the caller
    is then in the request's state, ``request.state.versions``), else the refusal naming both sides'."""
    try:
        peer = versions.peer_of_headers(header(scope, versions.RELEASE_HEADER.encode()),
                                        header(scope, versions.WIRE_HEADER.encode()), me=me)
    except versions.UnsupportedWireVersion as exc:
        log.warning("refused a call to %s: %s", str(scope.get("path", ""))[:200], exc.message)
        return refusal(exc)
    scope.setdefault("state", {})["versions"] = peer
    return None
