"""The ``s3`` snapshot store: objects in a bucket of any S3-compatible object store, under a prefix.

Made to work beyond AWS (Ceph RADOS Gateway, MinIO, moto): path-style addressing by default when an
endpoint URL is given, plain single-part PUTs (a chunk is at most a few MiB), no object lock, tags,
versioning or multipart, and boto3's newer default checksums (CRC trailers with aws-chunked bodies,
which several S3-compatible stores refuse) only when the operation requires one; what the store
keeps is verified by the snapshot format itself (every chunk hashes to its id).

Credentials come from a 0600 file in the AWS shared-credentials format (``credentials_file``, its
``credentials_profile``), or else from boto3's usual chain (``AWS_ACCESS_KEY_ID``/
``AWS_SECRET_ACCESS_KEY``, ``~/.aws``, an instance role). They are never in the options, an argv, a
log line or an error: ``describe`` and every message name the endpoint, bucket and prefix only.
"""

from __future__ import annotations

import configparser
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import boto3
import botocore.config
import botocore.exceptions
from pydantic import BaseModel, ConfigDict, Field

from vbs.errors import DriverError, SnapshotStoreUnavailable
from vbs.snapshot_store.contract import ObjectInfo, ObjectMissing, check_key, check_prefix, parse_options

__all__ = ["S3Store", "S3StoreOptions"]

# S3's rules for bucket names (RADOS Gateway's are the same or looser).
_BUCKET_RE = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
_PREFIX_RE = r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127}/?){0,8}$"
# Codes after which the same request may well succeed: the store is busy or briefly broken.
_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


class S3StoreOptions(BaseModel):
    """``[storage_agent.snapshot_store]`` of an ``s3`` store."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True, frozen=True)

    bucket: str = Field(pattern=_BUCKET_RE)
    prefix: str = Field("", pattern=_PREFIX_RE)
    # None: AWS itself, found by region.
    endpoint_url: str | None = Field(None, pattern=r"^https?://[^\s/@]+(/[^\s@]*)?$")
    region: str | None = Field(None, pattern=r"^[a-z0-9-]{1,32}$")
    # None: "path" with an endpoint_url (RADOS Gateway, MinIO), boto3's choice on AWS.
    addressing_style: Literal["path", "virtual", "auto"] | None = None
    credentials_file: Path | None = None
    credentials_profile: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # A CA bundle for a store whose certificate a private CA signed; verify_tls=false only for tests.
    ca_bundle: Path | None = None
    verify_tls: bool = True
    checksums: Literal["when_required", "when_supported"] = "when_required"
    max_connections: int = Field(32, ge=1, le=512)
    connect_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(60.0, gt=0)
    # botocore's "standard" retries (with backoff) before a call raises SnapshotStoreUnavailable.
    max_attempts: int = Field(5, ge=1, le=20)


class _S3Client(Protocol):
    """The calls this store makes of a boto3 S3 client (boto3 ships no types)."""

    def put_object(self, **kwargs: Any) -> dict[str, Any]: ...
    def get_object(self, **kwargs: Any) -> dict[str, Any]: ...
    def head_object(self, **kwargs: Any) -> dict[str, Any]: ...
    def delete_object(self, **kwargs: Any) -> dict[str, Any]: ...
    def get_paginator(self, name: str) -> Any: ...


def read_credentials(path: Path, profile: str) -> dict[str, str]:
    """The keys of ``profile`` in an AWS shared-credentials file that only its owner may read."""
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise DriverError(f"the S3 credentials file {path} may be read by others (mode {mode & 0o777:o}); "
                              "make it 0600")
        parser = configparser.ConfigParser(interpolation=None)
        parser.read_string(path.read_text())
    except OSError as exc:
        raise DriverError(f"cannot read the S3 credentials file {path}: {exc.strerror}") from None
    except configparser.Error:
        raise DriverError(f"the S3 credentials file {path} is not in the AWS credentials format") from None
    if not parser.has_section(profile):
        raise DriverError(f"the S3 credentials file {path} has no profile [{profile}]")
    section = parser[profile]
    names = {"aws_access_key_id": "aws_access_key_id", "aws_secret_access_key": "aws_secret_access_key",
             "aws_session_token": "aws_session_token"}
    found = {arg: section[name].strip() for name, arg in names.items() if section.get(name, "").strip()}
    if "aws_access_key_id" not in found or "aws_secret_access_key" not in found:
        raise DriverError(f"profile [{profile}] of the S3 credentials file {path} needs aws_access_key_id "
                          "and aws_secret_access_key")
    return found


class S3Store:
    """A snapshot store in an S3 bucket."""

    name = "s3"

    def __init__(self, options: S3StoreOptions) -> None:
        self.options = options
        self.bucket = options.bucket
        self.prefix = options.prefix.strip("/") + "/" if options.prefix.strip("/") else ""
        style = options.addressing_style or ("path" if options.endpoint_url else "auto")
        config = botocore.config.Config(
            region_name=options.region,
            s3={"addressing_style": style},
            retries={"max_attempts": options.max_attempts, "mode": "standard"},
            max_pool_connections=options.max_connections,
            connect_timeout=options.connect_timeout_s,
            read_timeout=options.read_timeout_s,
            request_checksum_calculation=options.checksums,
            response_checksum_validation=options.checksums,
        )
        keys = read_credentials(options.credentials_file, options.credentials_profile) \
            if options.credentials_file else {}
        verify: bool | str = str(options.ca_bundle) if options.ca_bundle else options.verify_tls
        try:
            session = boto3.session.Session(region_name=options.region, **keys)
            self._client = cast(_S3Client, session.client("s3", endpoint_url=options.endpoint_url, config=config,
                                                          verify=verify))
        except botocore.exceptions.BotoCoreError as exc:
            raise DriverError(f"cannot set up the S3 snapshot store {self.describe()}: {type(exc).__name__}") from None

    @classmethod
    def from_config(cls, options: Mapping[str, Any], *, default_dir: Path) -> S3Store:
        return cls(parse_options(S3StoreOptions, options, "s3"))

    def describe(self) -> str:
        where = self.options.endpoint_url or "AWS"
        return f"s3://{self.bucket}/{self.prefix} at {where}"

    def __repr__(self) -> str:
        return f"S3Store({self.describe()!r})"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _error(self, exc: Exception, what: str, key: str) -> Exception:
        where = f"{self.describe()} ({what} {key})"
        if isinstance(exc, botocore.exceptions.ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in _TRANSIENT_CODES or status >= 500 or status == 429:
                return SnapshotStoreUnavailable(f"the snapshot store {where} answered {code or status}",
                                                store=self.describe())
            # RADOS Gateway's error bodies carry a code and no message: name what there is.
            said = " ".join(filter(None, [code or str(status), str(error.get("Message") or "").strip()]))
            return DriverError(f"the snapshot store {where} refused: {said}")
        if isinstance(exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError):
            return DriverError(f"the snapshot store {where}: no S3 credentials (give credentials_file, a 0600 file "
                               "in the AWS credentials format, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
        if isinstance(exc, botocore.exceptions.SSLError):
            return DriverError(f"the snapshot store {where}: TLS failed: {exc}")
        if isinstance(exc, botocore.exceptions.ConnectionError | botocore.exceptions.HTTPClientError
                      | botocore.exceptions.IncompleteReadError):
            return SnapshotStoreUnavailable(f"the snapshot store {where} could not be reached: {type(exc).__name__}",
                                            store=self.describe())
        return DriverError(f"the snapshot store {where} failed: {type(exc).__name__}")

    def put(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(exc, "put", key) from None

    def get(self, key: str) -> bytes:
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return bytes(answer["Body"].read())
        except botocore.exceptions.ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING_CODES:
                raise ObjectMissing(key) from None
            raise self._error(exc, "get", key) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise self._error(exc, "get", key) from None

    def head(self, key: str) -> ObjectInfo | None:
        try:
            answer = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except botocore.exceptions.ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING_CODES:
                return None
            raise self._error(exc, "head", key) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise self._error(exc, "head", key) from None
        return ObjectInfo(key, int(answer["ContentLength"]), answer["LastModified"].timestamp())

    def has(self, key: str) -> bool:
        return self.head(key) is not None

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(exc, "delete", key) from None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        full = self.prefix + check_prefix(prefix)
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            for page in pages:
                for item in page.get("Contents", []):
                    key = str(item["Key"])[len(self.prefix):]
                    yield ObjectInfo(key, int(item["Size"]), item["LastModified"].timestamp())
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(exc, "list", prefix or "/") from None
