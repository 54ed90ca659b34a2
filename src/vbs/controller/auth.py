"""Who may call the public APIs: the configured access keys, as a bearer token or a SigV4 signature.

``Authorization: Bearer <access key id>:<secret>`` is the simple form for the REST API and the vbs
CLI; SigV4 (header or presigned query) is what AWS SDKs send, for REST and for the EC2 Query API.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from fastapi import Request

from vbs.controller.ec2 import sigv4
from vbs.errors import AuthFailure

SIGV4_SERVICES = ("ec2", "vbs")


class Authenticator:
    def __init__(self, keys: Mapping[str, str], region: str) -> None:
        self.keys = dict(keys)
        self.region = region

    def check_bearer(self, value: str) -> str:
        key_id, _, secret = value.partition(":")
        expected = self.keys.get(key_id)
        # Compare against something even for an unknown key id, so timing says nothing.
        if not hmac.compare_digest(secret.encode(), (expected or "\0" * 40).encode()) or expected is None:
            raise AuthFailure("AWS was not able to validate the provided access credentials")
        return key_id

    def check(self, request: Request, body: bytes) -> str:
        """The access key id that authenticated ``request``, or AuthFailure."""
        header = request.headers.get("authorization", "")
        if header.startswith("Bearer "):
            return self.check_bearer(header[len("Bearer "):].strip())
        path = request.scope.get("raw_path", b"/").decode("latin-1") or "/"
        query = request.scope.get("query_string", b"").decode("latin-1")
        last: AuthFailure | None = None
        for service in SIGV4_SERVICES:
            try:
                return sigv4.verify(request.method, path, query, request.headers, body, self.keys,
                                    region=self.region, service=service)
            except AuthFailure as exc:
                last = exc
                if "service" not in exc.message.lower():
                    break
        assert last is not None
        raise last
