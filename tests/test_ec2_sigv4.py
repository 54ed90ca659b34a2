"""SigV4 verification against requests signed by botocore itself (header and presigned), plus a real boto3 client.

Every refusal must be ``AuthFailure`` with code ``AuthFailure`` and HTTP 401; fuzzing proves nothing else escapes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock
from urllib.parse import urlencode, urlsplit

import boto3
import botocore.auth
import pytest
from botocore.auth import SigV4Auth, SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.datastructures import Headers

from vbs.controller.ec2 import sigv4
from vbs.controller.ec2.query import QueryParams, parse_form
from vbs.controller.ec2.sigv4 import Credential, verify
from vbs.errors import AuthFailure

pytestmark = pytest.mark.unit

AK, SK = "AKIAVBSTESTKEY000001", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AK2, SK2 = "AKIAVBSTESTKEY000002", "second+secret/with=odd~chars"
KEYS = {AK: SK, AK2: SK2}
REGION = "us-east-1"
URL = "http://127.0.0.1:8770/"
FORM = "application/x-www-form-urlencoded; charset=utf-8"
BODY = urlencode({"Action": "DescribeVolumes", "Version": "2016-11-15", "Filter.1.Name": "tag:Name",
                  "Filter.1.Value.1": "a b/c+d~é"}).encode()
T0 = datetime(2025, 3, 14, 15, 9, 26, tzinfo=UTC)


@dataclass(frozen=True)
class Wire:
    """A request as the server would see it: raw path and query, headers (with Host), body bytes."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def verify(self, credentials: dict[str, str] | None = None, **kwargs: object) -> str:
        kwargs.setdefault("region", REGION)
        kwargs.setdefault("now", T0)
        return verify(self.method, self.path, self.query, self.headers, self.body,
                      KEYS if credentials is None else credentials, **kwargs)  # type: ignore[arg-type]


def _wire(request: AWSRequest) -> Wire:
    prepared = request.prepare()
    parts = urlsplit(prepared.url)
    headers = dict(prepared.headers)
    headers.setdefault("Host", parts.netloc)  # urllib3 adds it on the wire; botocore signs the same value
    body = prepared.body or b""
    return Wire(prepared.method, parts.path or "/", parts.query, headers,
                body.encode() if isinstance(body, str) else body)


def sign(body: bytes = BODY, *, ak: str = AK, sk: str = SK, region: str = REGION, service: str = "ec2",
         when: datetime = T0, url: str = URL, headers: dict[str, str] | None = None) -> Wire:
    request = AWSRequest(method="POST", url=url, data=body, headers={"Content-Type": FORM, **(headers or {})})
    with mock.patch.object(botocore.auth, "get_current_datetime", return_value=when.replace(tzinfo=None)):
        SigV4Auth(Credentials(ak, sk), service, region).add_auth(request)
    return _wire(request)


def presign(params: dict[str, str] | None = None, *, ak: str = AK, sk: str = SK, region: str = REGION,
            when: datetime = T0, expires: int = 300, method: str = "GET") -> Wire:
    params = params or {"Action": "DescribeVolumes", "Version": "2016-11-15", "VolumeId.1": "vol-0123 /+x"}
    request = AWSRequest(method=method, url=URL, params=params)
    with mock.patch.object(botocore.auth, "get_current_datetime", return_value=when.replace(tzinfo=None)):
        SigV4QueryAuth(Credentials(ak, sk), "ec2", region, expires=expires).add_auth(request)
    return _wire(request)


def refused(wire: Wire, match: str | None = None, **kwargs: object) -> AuthFailure:
    with pytest.raises(AuthFailure, match=match) as info:
        wire.verify(**kwargs)  # type: ignore[arg-type]
    assert info.value.code == "AuthFailure"
    assert info.value.status == 401
    return info.value


def with_header(wire: Wire, name: str, value: str | None) -> Wire:
    headers = {k: v for k, v in wire.headers.items() if k.lower() != name.lower()}
    if value is not None:
        headers[name] = value
    return replace(wire, headers=headers)


# --- accepted -----------------------------------------------------------------------------------------------


def test_header_auth_from_botocore_verifies_and_names_the_key() -> None:
    wire = sign()
    assert wire.headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=" + AK)
    assert wire.verify() == AK


def test_second_configured_key_verifies() -> None:
    assert sign(ak=AK2, sk=SK2).verify() == AK2


def test_header_names_are_case_insensitive_and_starlette_headers_work() -> None:
    wire = sign()
    shouted = {k.upper(): v for k, v in wire.headers.items()}
    assert replace(wire, headers=shouted).verify() == AK
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in wire.headers.items()]
    assert verify(wire.method, wire.path, wire.query, Headers(raw=raw), wire.body, KEYS, region=REGION,
                  now=T0) == AK


def test_unsigned_extra_headers_do_not_matter() -> None:
    wire = with_header(sign(), "User-Agent", "aws-cli/2.15 something else")
    assert with_header(wire, "X-Forwarded-For", "10.0.0.1").verify() == AK


def test_signed_header_values_are_trimmed_and_whitespace_collapsed() -> None:
    # botocore signs Trimall(value); a proxy re-spacing the value must not matter, and neither must we lowercase it.
    wire = sign(headers={"X-Amz-Meta-Note": "  Mixed   Case\tvalue  "})
    assert "x-amz-meta-note" in wire.headers["Authorization"]
    assert with_header(wire, "X-Amz-Meta-Note", "Mixed Case value").verify() == AK
    refused(with_header(wire, "X-Amz-Meta-Note", "mixed case value"), "does not match")


def test_within_skew_verifies() -> None:
    wire = sign()
    assert wire.verify(now=T0 + timedelta(minutes=14)) == AK
    assert wire.verify(now=T0 - timedelta(minutes=14)) == AK
    assert wire.verify(now=(T0 + timedelta(minutes=1)).replace(tzinfo=None)) == AK  # naive means UTC


def test_explicit_content_sha256_header_verifies() -> None:
    import hashlib

    wire = sign(headers={"X-Amz-Content-SHA256": hashlib.sha256(BODY).hexdigest()})
    assert wire.verify() == AK


def test_date_header_instead_of_x_amz_date_verifies() -> None:
    # botocore signs with the HTTP Date header when the request already has one.
    wire = sign(headers={"Date": "Thu, 01 Jan 1970 00:00:00 GMT"})
    assert "X-Amz-Date" not in wire.headers and "Date" in wire.headers
    assert wire.verify() == AK


def test_path_and_query_string_are_canonicalised_like_botocore() -> None:
    url = "http://127.0.0.1:8770/a%20b/./c/../d~e%2Ff/?z=1&a=x%2By&a=b&empty=&sp=a%20b"
    assert sign(url=url).verify() == AK


def test_presigned_request_verifies() -> None:
    wire = presign()
    assert "X-Amz-Signature=" in wire.query and "Authorization" not in wire.headers
    assert wire.verify() == AK
    assert wire.verify(now=T0 + timedelta(seconds=300)) == AK
    assert presign(ak=AK2, sk=SK2).verify() == AK2


def test_presigned_post_with_body_moved_to_query_verifies() -> None:
    data = {"Action": "DescribeVolumes", "Version": "2016-11-15", "Filter.1.Name": "tag:Name"}
    request = AWSRequest(method="POST", url=URL, data=data, headers={"Content-Type": FORM})
    with mock.patch.object(botocore.auth, "get_current_datetime", return_value=T0.replace(tzinfo=None)):
        SigV4QueryAuth(Credentials(AK, SK), "ec2", REGION, expires=60).add_auth(request)
    wire = _wire(request)
    assert "Action=DescribeVolumes" in wire.query and wire.body == b""
    assert wire.verify() == AK


def test_credential_repr_hides_the_secret() -> None:
    cred = Credential(AK, SK)
    assert AK in repr(cred) and SK not in repr(cred)
    assert verify(*_args(sign()), {cred.access_key_id: cred.secret_access_key}, region=REGION, now=T0) == AK


def _args(wire: Wire) -> tuple[str, str, str, dict[str, str], bytes]:
    return wire.method, wire.path, wire.query, wire.headers, wire.body


# --- refused ------------------------------------------------------------------------------------------------


def test_wrong_secret_is_refused() -> None:
    refused(sign(sk="not-the-secret"), "signature we calculated does not match")


def test_unknown_access_key_is_refused_like_a_wrong_secret() -> None:
    # One answer whether the key id exists or not (docs/security.md, uniform answers).
    wrong_secret = refused(sign(sk="not-the-secret"))
    for error in (refused(sign(ak="AKIAUNKNOWN", sk=SK)), refused(sign(), credentials={AK2: SK2})):
        assert (error.code, error.status, error.message) == (wrong_secret.code, wrong_secret.status,
                                                             wrong_secret.message)
        assert "AKIAUNKNOWN" not in error.message


def test_tampered_body_is_refused() -> None:
    wire = sign()
    refused(replace(wire, body=wire.body.replace(b"DescribeVolumes", b"DeleteVolume")), "does not match")
    refused(replace(wire, body=wire.body + b"&DryRun=false"), "does not match")


def test_tampered_signed_headers_are_refused() -> None:
    wire = sign()
    refused(with_header(wire, "Content-Type", "application/json"), "does not match")
    refused(with_header(wire, "Host", "evil.example:8770"), "does not match")
    refused(with_header(wire, "X-Amz-Date", "20250314T151000Z"), "does not match")


def test_tampered_method_path_or_query_is_refused() -> None:
    wire = sign()
    refused(replace(wire, method="PUT"), "does not match")
    refused(replace(wire, path="/other"), "does not match")
    refused(replace(wire, query="Action=DeleteVolume"), "does not match")


def test_missing_signed_header_is_refused() -> None:
    refused(with_header(sign(), "Content-Type", None), "missing from the request")


def test_wrong_region_is_refused_naming_ours() -> None:
    error = refused(sign(region="eu-west-1"), "region")
    assert "'us-east-1'" in error.message and "eu-west-1" in error.message
    refused(sign(), "region", region="eu-west-1")


def test_wrong_service_is_refused() -> None:
    refused(sign(service="sts"), "service")
    refused(sign(), "service", service="s3")


def test_expired_and_future_dates_are_refused() -> None:
    wire = sign()
    refused(wire, "Signature expired", now=T0 + timedelta(minutes=16))
    refused(wire, "Request timestamp too skewed", now=T0 - timedelta(minutes=16))
    refused(wire, "Signature expired", now=T0 + timedelta(seconds=61), max_skew=timedelta(minutes=1))


def test_expired_presigned_request_is_refused() -> None:
    wire = presign(expires=60)
    refused(wire, "Signature expired", now=T0 + timedelta(seconds=61))
    refused(wire, "too skewed", now=T0 - timedelta(minutes=16))


def test_tampered_presigned_query_is_refused() -> None:
    wire = presign()
    refused(replace(wire, query=wire.query.replace("DescribeVolumes", "DeleteVolume")), "does not match")
    refused(replace(wire, query=wire.query.replace("X-Amz-Expires=300", "X-Amz-Expires=3000")), "does not match")
    refused(replace(wire, query=wire.query + "&Extra=1"), "does not match")
    refused(replace(wire, body=b"Action=DeleteVolume"), "does not match")


def test_incomplete_or_doubled_presigned_parameters_are_refused() -> None:
    wire = presign()
    without_signature = "&".join(p for p in wire.query.split("&") if not p.startswith("X-Amz-Signature="))
    refused(replace(wire, query=without_signature), "X-Amz-Signature")
    refused(replace(wire, query=wire.query + "&X-Amz-Date=20250314T151000Z"), "more than once")
    refused(replace(wire, query=wire.query.replace("X-Amz-Expires=300", "X-Amz-Expires=0")), "X-Amz-Expires")
    refused(replace(wire, query=wire.query.replace("X-Amz-Expires=300", "X-Amz-Expires=604801")), "X-Amz-Expires")


def test_missing_authorization_is_refused() -> None:
    refused(with_header(sign(), "Authorization", None), "not signed")
    refused(Wire("POST", "/", "", {}, b""), "not signed")


def test_header_and_query_auth_together_are_refused() -> None:
    wire = sign()
    refused(replace(wire, query=presign().query), "Only one authentication mechanism")


@pytest.mark.parametrize(
    ("authorization", "match"),
    [
        ("", "Unsupported Authorization algorithm"),
        ("Basic dXNlcjpwYXNz", "Unsupported Authorization algorithm"),
        ("AWS AKID:c2lnbmF0dXJl", "Unsupported Authorization algorithm"),
        ("AWS4-HMAC-SHA256", "unexpected component"),
        ("AWS4-HMAC-SHA256 Credential=x", "requires a 'SignedHeaders'"),
        ("AWS4-HMAC-SHA256 Credential=x, SignedHeaders=host", "requires a 'Signature'"),
        ("AWS4-HMAC-SHA256 Credential=, SignedHeaders=host, Signature=" + "0" * 64, "requires a 'Credential'"),
        ("AWS4-HMAC-SHA256 Credential=a, Credential=b, SignedHeaders=host, Signature=" + "0" * 64, "more than once"),
        ("AWS4-HMAC-SHA256 Credential=a, SignedHeaders=host, Signature=" + "0" * 64 + ", Extra=1", "unexpected"),
        ("AWS4-HMAC-SHA256 Credential=a, SignedHeaders=host, Signature=xyz", "Signature 'xyz' is malformed"),
        ("AWS4-HMAC-SHA256 Credential=a/b, SignedHeaders=host, Signature=" + "0" * 64, "Credential 'a/b' is malformed"),
        (f"AWS4-HMAC-SHA256 Credential={AK}/2025-03-14/us-east-1/ec2/aws4_request, SignedHeaders=host, "
         "Signature=" + "0" * 64, "date '2025-03-14' is malformed"),
        (f"AWS4-HMAC-SHA256 Credential={AK}/20250314/us-east-1/ec2/aws4, SignedHeaders=host, Signature=" + "0" * 64,
         "terminator"),
        (f"AWS4-HMAC-SHA256 Credential={AK}/20250313/us-east-1/ec2/aws4_request, SignedHeaders=host, "
         "Signature=" + "0" * 64, "Date in Credential scope does not match"),
        (f"AWS4-HMAC-SHA256 Credential={AK}/20250314/us-east-1/ec2/aws4_request, SignedHeaders=x-amz-date, "
         "Signature=" + "0" * 64, "host header must be signed"),
        (f"AWS4-HMAC-SHA256 Credential={AK}/20250314/us-east-1/ec2/aws4_request, SignedHeaders=Host;x-amz-date, "
         "Signature=" + "0" * 64, "SignedHeaders is malformed"),
        (f"AWS4-HMAC-SHA256 Credential={AK}/20250314/us-east-1/ec2/aws4_request, SignedHeaders=host;host, "
         "Signature=" + "0" * 64, "more than once"),
        ("AWS4-HMAC-SHA256 " + "x" * 5000, "longer than"),
    ],
)
def test_malformed_authorization_is_refused(authorization: str, match: str) -> None:
    refused(with_header(sign(), "Authorization", authorization), match)


def test_malformed_or_missing_date_is_refused() -> None:
    wire = sign()
    refused(with_header(wire, "X-Amz-Date", "2025-03-14T15:09:26Z"), "malformed")
    refused(with_header(wire, "X-Amz-Date", "20251314T150926Z"), "not a valid date")
    refused(with_header(wire, "X-Amz-Date", None), "X-Amz-Date")


def test_payload_hash_header_must_match_the_body() -> None:
    wire = sign()
    refused(with_header(wire, "X-Amz-Content-Sha256", "0" * 64), "does not match what was computed")
    refused(with_header(wire, "X-Amz-Content-Sha256", "UNSIGNED-PAYLOAD"), "must be signed")


def test_repeated_authorization_header_is_refused() -> None:
    wire = sign()
    raw = [(k.lower().encode(), v.encode()) for k, v in wire.headers.items()]
    raw.append((b"authorization", wire.headers["Authorization"].encode()))
    with pytest.raises(AuthFailure, match="exactly once"):
        verify(wire.method, wire.path, wire.query, Headers(raw=raw), wire.body, KEYS, region=REGION, now=T0)


def test_absurd_sizes_are_refused_quickly() -> None:
    wire = sign()
    # Refused by the size checks, before any signing work (no HMAC computed).
    with mock.patch.object(sigv4, "_hmac", side_effect=AssertionError("HMAC computed")):
        refused(replace(wire, query="a=b&" * 300_000), "longer than")
        refused(replace(wire, query="a&" * 2001), "more than 2000 parameters")
        refused(replace(wire, path="/" + "a" * 10_000), "path is longer")
        refused(with_header(wire, "Content-Type", "x" * 20_000), "longer than")
        refused(replace(wire, headers={**wire.headers, **{f"x-h{i}": "v" for i in range(300)}}),
                "more than 256 headers")


# --- fuzzing: nothing but AuthFailure escapes ----------------------------------------------------------------

_FRAGMENTS = st.sampled_from([
    "AWS4-HMAC-SHA256", " ", ",", ", ", "=", "/", ";", "Credential=", "SignedHeaders=", "Signature=", AK, "20250314",
    "us-east-1", "ec2", "aws4_request", "host", "x-amz-date", "content-type", "0" * 64, "%", "%zz", "%ff", "+",
    "\x00", "é", "\ud800", "X-Amz-Algorithm=", "X-Amz-Credential=", "X-Amz-Date=", "X-Amz-Expires=",
    "X-Amz-SignedHeaders=", "X-Amz-Signature=", "20250314T150926Z", "&", "300", "99999999999", "-1",
])
_GARBAGE = st.one_of(st.text(max_size=300), st.lists(_FRAGMENTS, max_size=40).map("".join))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(authorization=_GARBAGE, query=_GARBAGE, amz_date=st.one_of(st.none(), _GARBAGE),
       sha=st.one_of(st.none(), _GARBAGE), path=st.one_of(st.just("/"), _GARBAGE), method=_GARBAGE)
def test_garbage_never_raises_anything_but_auth_failure(authorization: str, query: str, amz_date: str | None,
                                                        sha: str | None, path: str, method: str) -> None:
    wire = with_header(sign(), "Authorization", authorization)
    wire = with_header(with_header(wire, "X-Amz-Date", amz_date), "X-Amz-Content-Sha256", sha)
    for candidate in (wire, replace(wire, query=query, path=path, method=method),
                      replace(with_header(wire, "Authorization", None), query=query)):
        try:
            candidate.verify()
        except AuthFailure as exc:
            assert exc.code == "AuthFailure" and exc.status == 401
        else:  # pragma: no cover - a forged signature would have to be valid by chance
            pytest.fail("garbage verified")


def _maybe(valid: str) -> st.SearchStrategy[str]:
    # Mostly valid: each field is garbage a quarter of the time, so many examples get past the early checks.
    return st.one_of(st.just(valid), st.just(valid), st.just(valid), _GARBAGE)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_well_shaped_garbage_reaches_deep_and_still_only_fails_with_auth_failure(data: st.DataObject) -> None:
    # Valid-looking structure with one or more fields swapped for garbage, so fuzzing gets past the first parse.
    wire = sign()
    date = data.draw(_maybe("20250314"))
    credential = "/".join([data.draw(_maybe(AK)), date, data.draw(_maybe(REGION)), data.draw(_maybe("ec2")),
                           data.draw(_maybe("aws4_request"))])
    signed = data.draw(_maybe("content-type;host;x-amz-date"))
    signature = data.draw(_maybe("0" * 64))
    header = f"AWS4-HMAC-SHA256 Credential={credential}, SignedHeaders={signed}, Signature={signature}"
    stamp = data.draw(_maybe("20250314T150926Z"))
    query = urlencode({"X-Amz-Algorithm": data.draw(_maybe("AWS4-HMAC-SHA256")), "X-Amz-Credential": credential,
                       "X-Amz-Date": stamp, "X-Amz-Expires": data.draw(_maybe("300")),
                       "X-Amz-SignedHeaders": signed, "X-Amz-Signature": signature},
                      encoding="utf-8", errors="surrogatepass")
    for candidate in (with_header(with_header(wire, "Authorization", header), "X-Amz-Date", stamp),
                      replace(with_header(wire, "Authorization", None), query=query)):
        with pytest.raises(AuthFailure) as info:
            candidate.verify()
        assert info.value.code == "AuthFailure" and info.value.status == 401


@settings(max_examples=200, deadline=None)
@given(position=st.integers(min_value=0), byte=st.integers(min_value=0, max_value=255))
def test_any_single_byte_change_to_the_body_is_refused(position: int, byte: int) -> None:
    wire = sign()
    body = bytearray(wire.body)
    index = position % len(body)
    if body[index] == byte:
        return
    body[index] = byte
    with pytest.raises(AuthFailure):
        replace(wire, body=bytes(body)).verify()


# --- a real boto3 client on the wire ---------------------------------------------------------------------------

_EMPTY_VOLUMES = (b'<?xml version="1.0" encoding="UTF-8"?>\n<DescribeVolumesResponse '
                  b'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>r-1</requestId><volumeSet/>'
                  b'</DescribeVolumesResponse>')


class _Ec2Stub(BaseHTTPRequestHandler):
    """Verifies what boto3 really sends: raw path, headers as received, body bytes."""

    seen: list[tuple[str, dict[str, str]]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        parts = urlsplit(self.path)
        try:
            key = verify("POST", parts.path, parts.query, dict(self.headers.items()), body, KEYS, region=REGION)
            params = QueryParams(parse_form(body))
            self.seen.append((key, {"Action": params.action, "VolumeIds": ",".join(params.list("VolumeId")),
                                    "Filters": repr(params.filters())}))
            status, payload = 200, _EMPTY_VOLUMES
        except AuthFailure as exc:
            status = exc.status
            payload = (f"<Response><Errors><Error><Code>{exc.code}</Code><Message>{exc.message}</Message></Error>"
                       "</Errors><RequestID>r-2</RequestID></Response>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/xml;charset=UTF-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def ec2_stub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ec2Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Ec2Stub.seen = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _client(endpoint: str, ak: str, sk: str, region: str = REGION):  # type: ignore[no-untyped-def]
    return boto3.session.Session().client(
        "ec2", endpoint_url=endpoint, region_name=region, aws_access_key_id=ak, aws_secret_access_key=sk,
        config=Config(retries={"max_attempts": 1, "mode": "standard"}))


def test_real_boto3_client_is_accepted(ec2_stub: str) -> None:
    client = _client(ec2_stub, AK2, SK2)
    client.describe_volumes(VolumeIds=["vol-1", "vol-2"], Filters=[{"Name": "tag:team", "Values": ["a b", "c/d"]}])
    assert _Ec2Stub.seen == [(AK2, {"Action": "DescribeVolumes", "VolumeIds": "vol-1,vol-2",
                                    "Filters": repr({"tag:team": ["a b", "c/d"]})})]


def test_real_boto3_client_with_a_wrong_secret_or_region_gets_auth_failure(ec2_stub: str) -> None:
    for client in (_client(ec2_stub, AK, "wrong"), _client(ec2_stub, "AKIANOBODY", SK),
                   _client(ec2_stub, AK, SK, region="eu-west-1")):
        with pytest.raises(ClientError) as info:
            client.describe_volumes()
        assert info.value.response["Error"]["Code"] == "AuthFailure"
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 401
    assert _Ec2Stub.seen == []



def test_a_presigned_url_may_live_an_hour_unless_the_config_says_more_and_never_past_a_week() -> None:
    # The attack: a URL presigned for a week (what AWS allows at most), for a mutating action.
    week = presign({"Action": "DeleteVolume", "Version": "2016-11-15", "VolumeId": "vol-0123456789abcdef0"},
                   expires=7 * 24 * 3600)
    error = refused(week, "X-Amz-Expires", now=T0 + timedelta(seconds=1))
    assert "from 1 to 3600" in error.message
    assert week.verify(now=T0 + timedelta(seconds=1), max_expires=7 * 24 * 3600) == AK  # an operator's choice
    refused(presign(expires=7 * 24 * 3600 + 1), "X-Amz-Expires", max_expires=10 * 24 * 3600)  # never past a week
    hour = presign(expires=3600)
    assert hour.verify(now=T0 + timedelta(seconds=3599)) == AK
    refused(hour, "Signature expired", now=T0 + timedelta(seconds=3601))
    refused(presign(expires=3601), "X-Amz-Expires", now=T0)
    # Nor can a presigned URL be turned into another action by a body the signer never saw.
    refused(replace(hour, method="POST", body=b"Action=DeleteVolume&VolumeId=vol-0123456789abcdef0"), None,
            now=T0 + timedelta(seconds=1))
