"""Verify AWS Signature Version 4 on requests to the EC2 Query API edge.

Header (``Authorization: AWS4-HMAC-SHA256 …``) and query-string (presigned) authentication, canonicalised the way
botocore and the AWS SDKs sign; every failure is an ``AuthFailure`` (HTTP 401) saying what was wrong, except that
nothing says whether an access key id exists (unknown key, wrong secret and bad signature answer alike).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from urllib.parse import quote, unquote_to_bytes

from vbs.errors import AuthFailure

__all__ = ["ALGORITHM", "BAD_SIGNATURE", "Credential", "SecretLookup", "verify"]

ALGORITHM = "AWS4-HMAC-SHA256"
TERMINATOR = "aws4_request"

# Bounds far above anything an SDK sends, low enough that refusing a hostile request costs next to nothing.
MAX_AUTHORIZATION = 4096
MAX_CREDENTIAL = 512
MAX_HEADERS = 256
MAX_SIGNED_HEADERS = 64
MAX_HEADER_VALUE = 16384
MAX_PATH = 8192
MAX_QUERY_STRING = 1 << 17
MAX_QUERY_PARAMS = 2000
MAX_EXPIRES = 7 * 24 * 3600  # the longest X-Amz-Expires AWS accepts (one week): the hard maximum
DEFAULT_MAX_EXPIRES = 3600  # what a controller accepts unless its config says more (presigned_url_max_s)

_TIMESTAMP = "%Y%m%dT%H%M%SZ"
# ASCII classes on purpose: ``\d`` would also admit other scripts' digits.
_TIMESTAMP_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z")
_SIGNATURE_RE = re.compile(r"[0-9a-fA-F]{64}")
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")  # an RFC 9110 token, lowercased
_EXPIRES_RE = re.compile(r"[0-9]{1,7}")
_QUERY_AUTH_KEYS = ("X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "X-Amz-SignedHeaders",
                    "X-Amz-Signature")
_UNSIGNED_PAYLOADS = {"UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"}

_UNKNOWN_KEY_SECRET = "\0" * 40
BAD_SIGNATURE = ("The request signature we calculated does not match the signature you provided. "
                  "Check your AWS Secret Access Key and signing method.")


SecretLookup = Callable[[str], str | None]


@dataclass(frozen=True)
class Credential:
    """One access key pair the controller accepts; the secret stays out of ``repr`` so it never lands in logs."""

    access_key_id: str
    secret_access_key: str = field(repr=False)


@dataclass(frozen=True)
class _Scope:
    access_key_id: str
    date: str
    region: str
    service: str


def _fail(message: str) -> AuthFailure:
    # Every refusal uses the generic code: the EC2 contract is that unsigned or wrongly signed requests get AuthFailure.
    return AuthFailure(message, code="AuthFailure", status=401)


def _show(value: str, limit: int = 80) -> str:
    """Echo client input into a message safely: bounded and quoted."""
    return repr(value[:limit] + ("…" if len(value) > limit else ""))


def _utf8(text: str) -> bytes:
    # surrogatepass: a str from a hostile caller may hold lone surrogates; they must fail the comparison, not raise.
    return text.encode("utf-8", "surrogatepass")


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, _utf8(msg), hashlib.sha256).digest()


def _normalise_headers(headers: Mapping[str, str]) -> dict[str, list[str]]:
    """Lowercase names, keep every value of a repeated header (a Starlette ``Headers.items()`` yields them all)."""
    out: dict[str, list[str]] = {}
    for count, (name, value) in enumerate(headers.items(), 1):
        if count > MAX_HEADERS:
            raise _fail(f"The request has more than {MAX_HEADERS} headers.")
        if not isinstance(name, str) or not isinstance(value, str):
            continue
        out.setdefault(name.lower(), []).append(value)
    return out


def _single(headers: dict[str, list[str]], name: str, limit: int = MAX_HEADER_VALUE) -> str | None:
    values = headers.get(name)
    if values is None:
        return None
    if len(values) != 1:
        raise _fail(f"The {name} header must appear exactly once.")
    if len(values[0]) > limit:
        raise _fail(f"The {name} header is longer than {limit} characters.")
    return values[0]


def _unquote(text: str) -> str:
    # Form semantics ('+' is a space), as the Go SDK and AWS itself read query strings.
    try:
        return unquote_to_bytes(_utf8(text).replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(f"The query string parameter {_show(text)} is not percent-encoded UTF-8.") from None


def _parse_query(query_string: str) -> list[tuple[str, str]]:
    if len(query_string) > MAX_QUERY_STRING:
        raise _fail(f"The query string is longer than {MAX_QUERY_STRING} characters.")
    pairs: list[tuple[str, str]] = []
    for part in query_string.split("&"):
        if not part:
            continue
        if len(pairs) >= MAX_QUERY_PARAMS:
            raise _fail(f"The query string has more than {MAX_QUERY_PARAMS} parameters.")
        key, _, value = part.partition("=")
        pairs.append((_unquote(key), _unquote(value)))
    return pairs


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4 plus AWS's removal of empty segments, exactly as botocore normalises before signing."""
    out: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if out:
                out.pop()
        elif segment and segment != ".":
            out.append(segment)
    lead = "/" if path.startswith("/") else ""
    trail = "/" if path.endswith("/") and out else ""
    return lead + "/".join(out) + trail


def _canonical_path(path: str) -> str:
    if len(path) > MAX_PATH:
        raise _fail(f"The request path is longer than {MAX_PATH} characters.")
    # The path arrives as sent (already percent-encoded); encoding it once more is the SigV4 rule for every service
    # but S3, and what botocore and the Go SDK do.
    return quote(_utf8(_remove_dot_segments(path) or "/"), safe="/~")


def _canonical_query(pairs: list[tuple[str, str]]) -> str:
    encoded = sorted((quote(_utf8(k), safe="-_.~"), quote(_utf8(v), safe="-_.~")) for k, v in pairs)
    return "&".join(f"{k}={v}" for k, v in encoded)


def _parse_signed_headers(value: str) -> list[str]:
    names = value.split(";")
    if len(names) > MAX_SIGNED_HEADERS:
        raise _fail(f"SignedHeaders lists more than {MAX_SIGNED_HEADERS} headers.")
    for name in names:
        if not _HEADER_NAME_RE.fullmatch(name):
            raise _fail(f"SignedHeaders is malformed: {_show(name)} is not a lowercase header name.")
    if len(set(names)) != len(names):
        raise _fail("SignedHeaders lists a header more than once.")
    if "host" not in names:
        raise _fail("The host header must be signed (listed in SignedHeaders).")
    return sorted(names)


def _canonical_headers(headers: dict[str, list[str]], signed: list[str]) -> str:
    lines: list[str] = []
    for name in signed:
        values = headers.get(name)
        if values is None:
            raise _fail(f"The header {_show(name)} is listed in SignedHeaders but missing from the request.")
        if sum(len(v) for v in values) > MAX_HEADER_VALUE:
            raise _fail(f"The signed header {_show(name)} is longer than {MAX_HEADER_VALUE} characters.")
        # Trimall: strip and collapse runs of whitespace; repeated headers join with commas, in arrival order.
        lines.append(name + ":" + ",".join(" ".join(v.split()) for v in values))
    return "".join(line + "\n" for line in lines)


def _parse_credential(value: str, *, region: str, service: str) -> _Scope:
    if len(value) > MAX_CREDENTIAL:
        raise _fail(f"The Credential is longer than {MAX_CREDENTIAL} characters.")
    parts = value.split("/")
    if len(parts) != 5 or not all(parts):
        raise _fail(f"The Credential {_show(value)} is malformed: expecting "
                    "'ACCESS_KEY_ID/YYYYMMDD/REGION/SERVICE/aws4_request'.")
    access_key_id, date, scope_region, scope_service, terminator = parts
    if not re.fullmatch(r"[0-9]{8}", date):
        raise _fail(f"The Credential date {_show(date)} is malformed: expecting YYYYMMDD.")
    # An aws-cli or SDK configured for another region signs for it; saying which region we answer for is the fix.
    if scope_region != region:
        raise _fail(f"Credential should be scoped to a valid region, not {_show(scope_region)}; "
                    f"this endpoint answers for region {region!r}.")
    if scope_service != service:
        raise _fail(f"Credential should be scoped to correct service: {service!r}, not {_show(scope_service)}.")
    if terminator != TERMINATOR:
        raise _fail(f"Credential should be scoped with a valid terminator: {TERMINATOR!r}, not {_show(terminator)}.")
    return _Scope(access_key_id, date, scope_region, scope_service)


def _parse_authorization(value: str) -> tuple[str, str, str]:
    """``AWS4-HMAC-SHA256 Credential=…, SignedHeaders=…, Signature=…`` → (credential, signed headers, signature)."""
    if len(value) > MAX_AUTHORIZATION:
        raise _fail(f"The Authorization header is longer than {MAX_AUTHORIZATION} characters.")
    algorithm, _, rest = value.strip().partition(" ")
    if algorithm != ALGORITHM:
        raise _fail(f"Unsupported Authorization algorithm {_show(algorithm)}: only {ALGORITHM} (SigV4) is accepted.")
    fields: dict[str, str] = {}
    for component in rest.split(","):
        name, sep, field_value = component.strip().partition("=")
        if not sep or name not in ("Credential", "SignedHeaders", "Signature"):
            raise _fail(f"The Authorization header is malformed: unexpected component {_show(component.strip())}.")
        if name in fields:
            raise _fail(f"The Authorization header is malformed: {name} appears more than once.")
        fields[name] = field_value
    for name in ("Credential", "SignedHeaders", "Signature"):
        if not fields.get(name):
            raise _fail(f"The Authorization header is malformed: it requires a {name!r} parameter.")
    return fields["Credential"], fields["SignedHeaders"], fields["Signature"]


def _parse_timestamp(value: str, source: str) -> datetime:
    if not _TIMESTAMP_RE.fullmatch(value):
        raise _fail(f"The {source} {_show(value)} is malformed: expecting the ISO 8601 basic format YYYYMMDDTHHMMSSZ.")
    try:
        return datetime.strptime(value, _TIMESTAMP).replace(tzinfo=UTC)
    except ValueError:
        raise _fail(f"The {source} {_show(value)} is not a valid date and time.") from None


def _header_timestamp(headers: dict[str, list[str]]) -> tuple[str, datetime]:
    """X-Amz-Date, or the HTTP Date header when X-Amz-Date is absent (SigV4 allows either)."""
    amz_date = _single(headers, "x-amz-date", limit=64)
    if amz_date is not None:
        return amz_date, _parse_timestamp(amz_date, "X-Amz-Date header")
    http_date = _single(headers, "date", limit=64)
    if http_date is None:
        raise _fail("The request must carry an X-Amz-Date (or Date) header with the signing time.")
    try:
        when = parsedate_to_datetime(http_date)
    except (TypeError, ValueError, IndexError, OverflowError):
        raise _fail(f"The Date header {_show(http_date)} is malformed.") from None
    when = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    return when.strftime(_TIMESTAMP), when


def _payload_hash(headers: dict[str, list[str]], body: bytes, signed: list[str], vouching: str | None) -> str:
    claimed = _single(headers, "x-amz-content-sha256", limit=128)
    if claimed == "UNSIGNED-PAYLOAD" and vouching is not None:
        # A body left unsigned (EBS PutSnapshotBlock's 512 KiB) is accepted only with a signed header that
        # vouches for it (its checksum), which the caller then checks against the body.
        if vouching not in signed:
            raise _fail(f"An unsigned payload needs the {vouching} header signed.")
        return claimed
    computed = _sha256_hex(body)
    if claimed is None:
        return computed
    if claimed in _UNSIGNED_PAYLOADS:
        # The action and its parameters live in the body: an unsigned body would be an unauthenticated request.
        raise _fail(f"X-Amz-Content-Sha256 {_show(claimed)} is not accepted: the request body must be signed.")
    if claimed.lower() != computed:
        raise _fail("The provided X-Amz-Content-Sha256 header does not match what was computed from the body.")
    return claimed  # the client signed the header's spelling of the hash


def _check_skew(signed_at: datetime, now: datetime, max_skew: timedelta, stamp: str) -> None:
    minutes = f"{max_skew.total_seconds() / 60:g} min."
    if signed_at < now - max_skew:
        raise _fail(f"Signature expired: {stamp} is now earlier than {(now - max_skew).strftime(_TIMESTAMP)} "
                    f"({now.strftime(_TIMESTAMP)} - {minutes})")
    if signed_at > now + max_skew:
        raise _fail(f"Request timestamp too skewed: {stamp} is later than {(now + max_skew).strftime(_TIMESTAMP)} "
                    f"({now.strftime(_TIMESTAMP)} + {minutes})")


def _signature(secret: str, scope: _Scope, stamp: str, canonical_request: str) -> str:
    string_to_sign = "\n".join([
        ALGORITHM,
        stamp,
        f"{scope.date}/{scope.region}/{scope.service}/{TERMINATOR}",
        _sha256_hex(_utf8(canonical_request)),
    ])
    key = _hmac(_utf8("AWS4" + secret), scope.date)
    for part in (scope.region, scope.service, TERMINATOR):
        key = _hmac(key, part)
    return hmac.new(key, _utf8(string_to_sign), hashlib.sha256).hexdigest()


def verify(
    method: str,
    path: str,
    query_string: str,
    headers: Mapping[str, str],
    body: bytes,
    credentials: Mapping[str, str] | SecretLookup,
    *,
    region: str,
    service: str = "ec2",
    now: datetime | None = None,
    max_skew: timedelta = timedelta(minutes=15),
    max_expires: int = DEFAULT_MAX_EXPIRES,
    unsigned_payload_vouched_by: str | None = None,
) -> str:
    """Check the request's SigV4 signature and return the access key id that signed it.

    ``path`` and ``query_string`` are as sent on the wire (still percent-encoded: ASGI ``raw_path`` and
    ``query_string``); ``headers`` may be a plain dict or a Starlette ``Headers``; ``body`` is the raw body;
    ``credentials`` maps access key id to secret (a mapping, or a function answering None for an unknown
    key id). Every failure that depends on the key (unknown id, wrong secret, bad signature) has one
    message. Raises ``AuthFailure`` (HTTP 401) on any problem. ``unsigned_payload_vouched_by``: a header
    (lower case) that, signed, lets the body go unsigned (``UNSIGNED-PAYLOAD``); the caller checks the body
    against it.
    """
    now = datetime.now(UTC) if now is None else (now.replace(tzinfo=UTC) if now.tzinfo is None else now)
    hdrs = _normalise_headers(headers)
    pairs = _parse_query(query_string)
    authorization = _single(hdrs, "authorization", limit=MAX_AUTHORIZATION)
    query_auth = [k for k, _ in pairs if k in _QUERY_AUTH_KEYS]
    if authorization is not None and query_auth:
        raise _fail("Only one authentication mechanism is allowed: an Authorization header or X-Amz-* query "
                    "parameters, not both.")
    if authorization is None and not query_auth:
        raise _fail("The request is not signed: it needs an Authorization header (AWS Signature Version 4) or "
                    "X-Amz-* query-string authentication parameters.")

    if authorization is not None:
        credential, signed_headers, signature = _parse_authorization(authorization)
        stamp, signed_at = _header_timestamp(hdrs)
        expires: int | None = None
        canonical_pairs = pairs
    else:
        auth: dict[str, str] = {}
        for key, value in pairs:
            if key in _QUERY_AUTH_KEYS:
                if key in auth:
                    raise _fail(f"The query parameter {key} appears more than once.")
                auth[key] = value
        missing = [k for k in _QUERY_AUTH_KEYS if not auth.get(k)]
        if missing:
            raise _fail("AWS query-string parameters must include " + ", ".join(repr(k) for k in _QUERY_AUTH_KEYS)
                        + f"; missing {', '.join(missing)}.")
        if auth["X-Amz-Algorithm"] != ALGORITHM:
            raise _fail(f"Unsupported X-Amz-Algorithm {_show(auth['X-Amz-Algorithm'])}: only {ALGORITHM} is accepted.")
        credential, signed_headers, signature = (auth["X-Amz-Credential"], auth["X-Amz-SignedHeaders"],
                                                 auth["X-Amz-Signature"])
        stamp = auth["X-Amz-Date"]
        signed_at = _parse_timestamp(stamp, "X-Amz-Date parameter")
        longest = min(max_expires, MAX_EXPIRES)
        if not _EXPIRES_RE.fullmatch(auth["X-Amz-Expires"]) or not 1 <= int(auth["X-Amz-Expires"]) <= longest:
            raise _fail(f"X-Amz-Expires {_show(auth['X-Amz-Expires'])} must be a number of seconds "
                        f"from 1 to {longest}.")
        expires = int(auth["X-Amz-Expires"])
        # The signature cannot sign itself: every other parameter, auth ones included, is in the canonical query.
        canonical_pairs = [(k, v) for k, v in pairs if k != "X-Amz-Signature"]

    if len(signed_headers) > MAX_AUTHORIZATION:
        raise _fail(f"SignedHeaders is longer than {MAX_AUTHORIZATION} characters.")
    if not _SIGNATURE_RE.fullmatch(signature):
        raise _fail(f"The Signature {_show(signature)} is malformed: expecting 64 hexadecimal digits.")
    scope = _parse_credential(credential, region=region, service=service)
    if scope.date != stamp[:8]:
        raise _fail(f"Date in Credential scope does not match YYYYMMDD from the signing time: "
                    f"{_show(scope.date)} != {_show(stamp[:8])}, from {_show(stamp)}.")
    lookup = credentials.get if isinstance(credentials, Mapping) else credentials
    secret = lookup(scope.access_key_id)
    # An unknown key id takes the same path as a known one (every check below, the same HMAC work) and
    # fails with the same answer as a wrong secret: no reply may tell whether a key id exists.
    known = secret is not None
    secret = secret if secret is not None else _UNKNOWN_KEY_SECRET
    if expires is None:
        _check_skew(signed_at, now, max_skew, stamp)
    else:
        if now > signed_at + timedelta(seconds=expires):
            raise _fail(f"Signature expired: the presigned request signed at {stamp} expired after {expires} s, "
                        f"at {(signed_at + timedelta(seconds=expires)).strftime(_TIMESTAMP)} "
                        f"(now {now.strftime(_TIMESTAMP)}).")
        if signed_at > now + max_skew:
            raise _fail(f"Request timestamp too skewed: {stamp} is later than "
                        f"{(now + max_skew).strftime(_TIMESTAMP)} ({now.strftime(_TIMESTAMP)} + "
                        f"{max_skew.total_seconds() / 60:g} min.)")

    names = _parse_signed_headers(signed_headers)
    canonical_request = "\n".join([
        method.upper(),
        _canonical_path(path),
        _canonical_query(canonical_pairs),
        _canonical_headers(hdrs, names),
        ";".join(names),
        _payload_hash(hdrs, body, names, unsigned_payload_vouched_by),
    ])
    expected = _signature(secret, scope, stamp, canonical_request)
    if not hmac.compare_digest(expected.encode("ascii"), signature.lower().encode("ascii")) or not known:
        raise _fail(BAD_SIGNATURE)
    return scope.access_key_id
