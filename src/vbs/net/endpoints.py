"""Lists of service URLs: the controllers an agent reports to, the endpoints a client calls.

One value may name several URLs (``"http://a:8770,http://b:8770"``, or a list in TOML, or a
repeated flag); ``parse`` validates each one and the whole list, and ``is_idempotent`` says which
requests ``vbs.net.api_client.ApiClient`` may repeat at another URL once they were sent.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Any

from vbs.errors import InvalidParameter

__all__ = ["MAX_URLS", "parse", "is_idempotent", "DEFAULT_CONTROLLER_PORT"]

# Here, not in vbs.config (pydantic): the CLI names it in its help and default endpoint.
DEFAULT_CONTROLLER_PORT = 8770
MAX_URLS = 16
MAX_URL_LENGTH = 512
_URL_RE = re.compile(
    r"(?P<scheme>https?)://"
    r"(?P<host>\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)"
    r"(?::(?P<port>[0-9]{1,5}))?"
    r"(?P<path>(?:/[A-Za-z0-9._~%-]*)*)")
_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Methods a server must treat the same when they come twice (RFC 9110 §9.2.2).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


def parse(value: str | Iterable[str], *, what: str = "URL") -> tuple[str, ...]:
    """The URLs of ``value`` (one string with commas, or several strings, each of which may hold
    commas), without trailing slashes, in order. Refuses an empty list, an empty item, a URL that is
    not ``http(s)://host[:port][/path]``, one that carries credentials, a duplicate, and more than
    ``MAX_URLS``; the message names ``what``."""
    items = [value] if isinstance(value, str) else list(value)
    urls = [part.strip() for item in items for part in item.split(",")]
    if not urls or urls == [""]:
        raise InvalidParameter(f"{what}: give at least one http(s):// URL")
    if len(urls) > MAX_URLS:
        raise InvalidParameter(f"{what}: at most {MAX_URLS} URLs, not {len(urls)}")
    out: list[str] = []
    for url in urls:
        checked = _check(url, what)
        if checked in out:
            raise InvalidParameter(f"{what}: {checked} is listed twice")
        out.append(checked)
    return tuple(out)


def _check(url: str, what: str) -> str:
    if not url:
        raise InvalidParameter(f"{what}: an empty item in the list (two commas, or one at an end)")
    if len(url) > MAX_URL_LENGTH:
        raise InvalidParameter(f"{what}: a URL longer than {MAX_URL_LENGTH} characters")
    if "@" in url:
        # Not echoed: it may hold a password.
        raise InvalidParameter(f"{what}: a URL with user:password@ in it; give credentials another way")
    m = _URL_RE.fullmatch(url)
    if m is None:
        raise InvalidParameter(f"{what}: {url[:100]!r} is not an http(s)://host[:port][/path] URL "
                               "(no query, no fragment)")
    host, port = m["host"], m["port"]
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise InvalidParameter(f"{what}: {host} is not an IPv6 address") from None
    elif not all(_LABEL_RE.fullmatch(label) for label in host.split(".")):
        raise InvalidParameter(f"{what}: {host[:100]!r} is not a host name or address")
    if port is not None and not 1 <= int(port) <= 65535:
        raise InvalidParameter(f"{what}: port {port} is not in 1-65535")
    return url.rstrip("/")


def is_idempotent(method: str, body: Any = None) -> bool:
    """Whether the same request may be sent again (to another URL) after it may have been carried
    out: a method that is idempotent by definition, or a POST whose body carries a client token (the
    server answers a repeat with the first result)."""
    if method.upper() in IDEMPOTENT_METHODS:
        return True
    return method.upper() == "POST" and isinstance(body, dict) and bool(body.get("client_token"))
