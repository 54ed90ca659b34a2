"""Probe tickets: how a storage agent knows that a host's probe was allowed by the controller.

A storage agent trusts one secret, its own node token, which only it and the controller hold. The
controller gives each host, for each storage node, a ticket ``<host>:<expiry>:<mac>`` whose MAC is
an HMAC-SHA256 under that storage node's token: the agent checks it with its own token, and a
ticket opens nothing but the bounded probe endpoint, for a few minutes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

from vbs.errors import AuthFailure

TICKET_TTL_S = 600
_TICKET = re.compile(r"([a-z0-9][a-z0-9.-]{0,62}):([0-9]{1,12}):([A-Za-z0-9_-]{43})")


def _mac(storage_token: str, storage_node: str, host: str, expires: int) -> str:
    msg = f"vbs-probe\0{storage_node}\0{host}\0{expires}".encode()
    digest = hmac.new(storage_token.encode(), msg, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def mint(storage_token: str, storage_node: str, host: str, *, ttl_s: int = TICKET_TTL_S,
         now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + ttl_s)
    return f"{host}:{expires}:{_mac(storage_token, storage_node, host, expires)}"


def verify(ticket: str, storage_token: str, storage_node: str, *, now: float | None = None) -> str:
    """The host the ticket was made for; AuthFailure if it is malformed, forged or expired."""
    m = _TICKET.fullmatch(ticket)
    if m is None:
        raise AuthFailure("missing or wrong probe ticket")
    host, expires_s, mac = m.groups()
    expires = int(expires_s)
    good = hmac.compare_digest(mac.encode(), _mac(storage_token, storage_node, host, expires).encode())
    if not good or expires < (time.time() if now is None else now):
        raise AuthFailure("missing or wrong probe ticket")
    return host
