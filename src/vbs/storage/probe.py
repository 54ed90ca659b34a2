"""The storage agent's probe endpoint: hosts measure their round trip and throughput to this node.

``GET /probe?bytes=N`` answers N bytes (at most ``MAX_PROBE_BYTES``) from one buffer made at start:
it costs a memory copy, no disk. It is outside the node-token API: a host presents a probe ticket
(``vbs.trust.probe_tickets``) the controller signed with this node's token, and the ticket opens nothing
else. Without a token the agent, run ``--insecure``, lets every probe through, as it does every call.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Query
from starlette.responses import Response

from vbs.errors import AuthFailure
from vbs.net.web import Scope, header, peer_check, refusal
from vbs.trust import probe_tickets
from vbs.trust.node_credentials import TokenSource
from vbs.wire.probes import MAX_PROBE_BYTES, PROBE_PATH, PROBE_TICKET_HEADER

_PAYLOAD = bytes(MAX_PROBE_BYTES)


def probe_auth(node_auth: Callable[[Scope], Response | None], token: TokenSource, *, insecure: bool,
               node_name: str) -> Callable[[Scope], Response | None]:
    """``node_auth`` for every path but the probe's, which needs a ticket for this node instead."""

    def check(scope: Scope) -> Response | None:
        if scope["path"] != PROBE_PATH:
            return node_auth(scope)
        if scope.get("method") != "GET":
            return refusal(AuthFailure("the probe endpoint answers GET only"))
        if not token.configured and insecure:
            return peer_check(scope, f"storage agent {node_name}")
        current = token.current()
        try:
            if current is None:
                raise AuthFailure("missing or wrong probe ticket")
            probe_tickets.verify(header(scope, PROBE_TICKET_HEADER.encode()), current, node_name)
        except AuthFailure as exc:
            return refusal(exc)
        return peer_check(scope, f"storage agent {node_name}")

    return check


def install_probe(app: FastAPI) -> None:
    @app.get(PROBE_PATH)
    def probe(size: int = Query(0, alias="bytes", ge=0, le=MAX_PROBE_BYTES)) -> Response:
        return Response(_PAYLOAD[:size], media_type="application/octet-stream",
                        headers={"cache-control": "no-store"})
