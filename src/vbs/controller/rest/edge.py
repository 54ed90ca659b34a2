"""The controller's checks on a request's head, made before any of its body is read.

- ``/health`` is open, and so are ``GET``/``HEAD`` of the web console's static files (``/console``:
  a sign-in page must load before its user signs in; it holds no data, vbs.controller.console). A
  browser's ``GET /`` (no credentials, no ``Action``, an ``Accept`` that prefers HTML) is sent there
  with a 303; every other request to ``/`` is the EC2 Query API's.
- ``/internal/v1`` (agents' heartbeats) needs a node token (vbs.trust.node_credentials), unless the
  controller runs ``--insecure`` and the caller sends none; the node it names is left in the
  request's state (``request.state.node``) for the handler. A controller that serves HTTPS with a
  CA also needs the node's client certificate (CN = the token's node name: mutual TLS, two factors
  a thief must both hold); the certificate goes in ``request.state.node_cert``, whose names bound
  the address the node may report. Then the agent's wire version (vbs.versions): one this controller
  cannot serve is refused, naming both sides' versions; the one it can is ``request.state.versions``.
- The public APIs need credentials: a bearer key is checked in full here (and accepted over plain
  HTTP from loopback only: it is the secret itself); a SigV4 signature covers the body's hash, so it
  is verified once the (bounded) body has arrived, but a request without any is refused at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from starlette.responses import RedirectResponse, Response

from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.console import PREFIX as CONSOLE_PREFIX
from vbs.controller.console import is_console_path
from vbs.controller.ebs.api import ebs_refusal, is_ebs_path
from vbs.controller.ec2 import xml
from vbs.controller.lifecycle.api import dlm_refusal, is_dlm_path
from vbs.controller.rbin.api import is_rbin_path, rbin_refusal
from vbs.errors import AuthFailure, VbsError
from vbs.net.web import Scope, header, is_loopback, peer_check, peer_of, refusal
from vbs.trust.node_credentials import REFUSED, NodeKeyring

XML_TYPE = "text/xml;charset=UTF-8"
ME = "the controller"  # as a refusal of an agent's wire version names it
NO_CREDENTIALS = "The request carries no credentials (a bearer key or an AWS Signature Version 4)."
BEARER_OFF_LOOPBACK = ("bearer credentials are accepted over plain HTTP from loopback only: use HTTPS, "
                       "or sign the request (SigV4)")


def _refuse(scope: Scope, exc: VbsError) -> Response:
    if scope["path"] == "/":  # the EC2 Query API answers in its own envelope
        return Response(xml.error(exc.code, exc.message, str(uuid.uuid4())), status_code=exc.status,
                        media_type=XML_TYPE, headers={"connection": "close"})
    if is_ebs_path(scope["path"]):  # and the EBS direct APIs in theirs
        return ebs_refusal(exc)
    if is_dlm_path(scope["path"]):  # and Data Lifecycle Manager's (its tags: a dlm ARN)
        return dlm_refusal(exc)
    if is_rbin_path(scope["path"]):  # and the Recycle Bin in its own
        return rbin_refusal(exc)
    return refusal(exc)


def prefers_html(accept: str) -> bool:
    """Whether an ``Accept`` header ranks ``text/html`` first (by q, ties to it): a browser's does,
    an EC2 client's (none, ``*/*``, XML) does not."""
    ranks: dict[str, float] = {}
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if media:
            ranks[media.lower()] = max(q, ranks.get(media.lower(), 0.0))
    html = ranks.get("text/html", 0.0)
    return html > 0 and all(q <= html for media, q in ranks.items() if media != "text/html")


def _browser_at_root(scope: Scope) -> bool:
    query = scope.get("query_string", b"")
    return (scope["path"] == "/" and scope.get("method") in ("GET", "HEAD") and not header(scope, b"authorization")
            and b"Action=" not in query and b"X-Amz-" not in query and prefers_html(header(scope, b"accept")))


def pre_auth(auth: Authenticator, keyring: NodeKeyring, *, insecure: bool,
             node_certs: bool) -> Callable[[Scope], Response | None]:
    def check(scope: Scope) -> Response | None:
        path = scope["path"]
        if path == "/health" or (is_console_path(path) and scope.get("method") in ("GET", "HEAD")):
            return None
        if _browser_at_root(scope):  # a browser pointed at the endpoint: the console, not EC2's XML
            return RedirectResponse(CONSOLE_PREFIX + "/", status_code=303)
        authz = header(scope, b"authorization")
        try:
            if path.startswith("/internal/"):
                if not authz and insecure:
                    return peer_check(scope, ME)
                token = authz[len("Bearer "):].strip() if authz.startswith("Bearer ") else ""
                node = keyring.verify(token)
                peer = peer_of(scope)
                if node_certs and (peer is None or peer.common_name != node.name):
                    raise AuthFailure(REFUSED)
                scope.setdefault("state", {}).update(node=node, node_cert=peer)
                return peer_check(scope, ME)
            if authz.startswith("Bearer "):
                client = (scope.get("client") or (None, 0))[0]
                if scope.get("scheme") != "https" and not is_loopback(client):
                    raise AuthFailure(BEARER_OFF_LOOPBACK)
                # The handler's own check finds the caller here instead of looking the key up again.
                scope.setdefault("state", {})["caller"] = auth.check_bearer(authz[len("Bearer "):].strip())
                return None
            if authz.startswith("AWS4-HMAC-SHA256 ") or b"X-Amz-Signature=" in scope.get("query_string", b""):
                return None
            raise AuthFailure(NO_CREDENTIALS)
        except AuthFailure as exc:
            return _refuse(scope, exc)

    return check
