"""Who may call the public APIs: access keys, as a bearer token or a SigV4 signature, and what each may do.

``Authorization: Bearer <access key id>:<secret>`` is the simple form for the REST API and the vbs
CLI; SigV4 (header or presigned query) is what AWS SDKs send, for REST and for the EC2 Query API.
Every refusal that could tell whether a key id exists answers the same ``AuthFailure``.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from vbs.controller.auth.keys import KeyStore, Principal
from vbs.controller.ec2 import sigv4
from vbs.errors import AuthFailure, UnauthorizedOperation

SIGV4_SERVICES = ("ec2", "vbs")
_UNKNOWN = "\0" * 40


def require_admin(who: Principal) -> Principal:
    """``who``, if its role may see the infrastructure (hosts, storage nodes, operations, repairs, keys)."""
    if not who.is_admin:
        raise UnauthorizedOperation("You are not authorized to perform this operation: it needs an admin key.")
    return who


class Authenticator:
    def __init__(self, keys: KeyStore, region: str, *, presign_max_s: int = sigv4.DEFAULT_MAX_EXPIRES) -> None:
        self.keys = keys
        self.region = region
        # The longest X-Amz-Expires a presigned request may carry (config presigned_url_max_s).
        self.presign_max_s = presign_max_s

    def check_bearer(self, value: str) -> Principal:
        key_id, _, secret = value.partition(":")
        found = self.keys.lookup(key_id)
        # Compare against something even for an unknown key id, so timing says nothing.
        expected = found[0] if found else _UNKNOWN
        if not hmac.compare_digest(secret.encode(), expected.encode()) or found is None:
            raise AuthFailure("AWS was not able to validate the provided access credentials")
        return found[1]

    def check(self, request: Request, body: bytes) -> Principal:
        """Who sent ``request``, or AuthFailure; a ``metrics`` key is refused (UnauthorizedOperation): it
        reads ``/metrics`` (``check_metrics_reader``) and nothing else."""
        who = self.identify(request, body)
        if who.reads_metrics_only:
            raise UnauthorizedOperation("You are not authorized to perform this operation: a metrics key reads "
                                        "/metrics only.")
        return who

    def check_metrics_reader(self, request: Request, body: bytes) -> Principal:
        """Who sent ``request``, if its role may read ``/metrics`` (admin or metrics)."""
        who = self.identify(request, body)
        if not (who.is_admin or who.reads_metrics_only):
            raise UnauthorizedOperation("You are not authorized to perform this operation: /metrics needs an admin "
                                        "or a metrics key.")
        return who

    def check_service(self, request: Request, body: bytes, service: str, *,
                      unsigned_payload_vouched_by: str | None = None) -> Principal:
        """Who sent ``request`` to another AWS service's API on this endpoint (``ebs``): a bearer key, or
        SigV4 scoped to ``service``; AuthFailure otherwise. A metrics key is refused."""
        checked: Principal | None = getattr(request.state, "caller", None)
        header = request.headers.get("authorization", "")
        if checked is None and header.startswith("Bearer "):
            checked = self.check_bearer(header[len("Bearer "):].strip())
        if checked is None:
            path = request.scope.get("raw_path", b"/").decode("latin-1") or "/"
            query = request.scope.get("query_string", b"").decode("latin-1")
            key_id = sigv4.verify(request.method, path, query, request.headers, body, self.keys.secret_of,
                                  region=self.region, service=service, max_expires=self.presign_max_s,
                                  unsigned_payload_vouched_by=unsigned_payload_vouched_by)
            found = self.keys.lookup(key_id)
            if found is None:  # deleted between the two look-ups
                raise AuthFailure(sigv4.BAD_SIGNATURE)
            checked = found[1]
        if checked.reads_metrics_only:
            raise UnauthorizedOperation("You are not authorized to perform this operation: a metrics key reads "
                                        "/metrics only.")
        return checked

    def identify(self, request: Request, body: bytes) -> Principal:
        """Who sent ``request``, whatever its role, or AuthFailure. A bearer key the edge already checked
        on the request's head (vbs.controller.rest.edge) is not looked up twice."""
        checked: Principal | None = getattr(request.state, "caller", None)
        if checked is not None:
            return checked
        header = request.headers.get("authorization", "")
        if header.startswith("Bearer "):
            return self.check_bearer(header[len("Bearer "):].strip())
        path = request.scope.get("raw_path", b"/").decode("latin-1") or "/"
        query = request.scope.get("query_string", b"").decode("latin-1")
        last: AuthFailure | None = None
        for service in SIGV4_SERVICES:
            try:
                key_id = sigv4.verify(request.method, path, query, request.headers, body, self.keys.secret_of,
                                      region=self.region, service=service, max_expires=self.presign_max_s)
            except AuthFailure as exc:
                last = exc
                if "service" not in exc.message.lower():
                    break
                continue
            found = self.keys.lookup(key_id)
            if found is None:  # deleted between the two look-ups
                break
            return found[1]
        raise last or AuthFailure(sigv4.BAD_SIGNATURE)
