"""What the REST models of every resource share: the bounds and checks of free text and tags, the
constrained strings (comments, client tokens, zones, node and pool names, KMS key ids) and ``_Request``,
the base of a request: strict, unknown fields refused."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from vbs.wire.connection import HOST_NAME_RE
from vbs.wire.storage import POOL_NAME_RE, ZONE_NAME_RE

MAX_SIZE_GIB = 16384
COMMENT_MAX = 255
TAG_KEY_MAX = 128
TAG_VALUE_MAX = 256
TAGS_MAX = 50

# Printable text: no control characters (they break logs, terminals and XML answers).
_TEXT_RE = re.compile(r"^[^\x00-\x1f\x7f]*$")
_TAG_KEY_RE = re.compile(r"^[^\x00-\x1f\x7f]{1,128}$")


def _text(value: str) -> str:
    if not _TEXT_RE.fullmatch(value):
        raise ValueError("must not contain control characters")
    return value


def _tags(value: dict[str, str]) -> dict[str, str]:
    if len(value) > TAGS_MAX:
        raise ValueError(f"at most {TAGS_MAX} tags per resource")
    for key, val in value.items():
        if not _TAG_KEY_RE.fullmatch(key):
            raise ValueError(f"tag key {key[:40]!r} must be 1-{TAG_KEY_MAX} printable characters")
        if key.lower().startswith("aws:"):
            raise ValueError("tag keys starting with 'aws:' are reserved")
        if len(val) > TAG_VALUE_MAX or not _TEXT_RE.fullmatch(val):
            raise ValueError(f"tag value for {key[:40]!r} must be at most {TAG_VALUE_MAX} printable characters")
    return value


def check_tags(value: dict[str, str]) -> dict[str, str]:
    """``value`` if its tags are within the limits and rules of every API's tags, else ``ValueError``."""
    return _tags(value)


Comment = Annotated[str, Field(max_length=COMMENT_MAX), AfterValidator(_text)]
Tags = Annotated[dict[str, str], AfterValidator(_tags)]
ClientToken = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[\x21-\x7e]+$")]
VolumeType = Literal["standard", "gp2", "gp3", "io1", "io2", "st1", "sc1"]
StorageZone = Annotated[str, Field(pattern=ZONE_NAME_RE)]
NodeName = Annotated[str, Field(pattern=HOST_NAME_RE.pattern)]
PoolName = Annotated[str, Field(pattern=POOL_NAME_RE)]


KmsKeyId = Annotated[str, Field(min_length=1, max_length=2048, pattern=r"^[A-Za-z0-9:/_.+=@-]+$")]


# What no metadata database can store: a lone UTF-16 surrogate (JSON's "\ud800" decodes to one; it
# has no UTF-8 form, SQLite raises) and NUL (PostgreSQL's text refuses it).
_UNSTORABLE_RE = re.compile("[\x00\ud800-\udfff]")
UNSTORABLE = "must not contain NUL characters or lone UTF-16 surrogates (text that cannot be stored)"


def refuse_unstorable(value: Any, where: str = "body") -> None:
    """Raise ValueError for any string in ``value`` (a JSON document: keys too) that cannot be stored."""
    if isinstance(value, str):
        if not value.isascii() or "\x00" in value:
            if _UNSTORABLE_RE.search(value):
                raise ValueError(f"{where} {UNSTORABLE}")
    elif isinstance(value, dict):
        for key, item in value.items():
            refuse_unstorable(key, f"{where} (a key)")
            refuse_unstorable(item, f"{where}.{key}" if isinstance(key, str) and key.isprintable() else where)
    elif isinstance(value, list | tuple):
        for item in value:
            refuse_unstorable(item, where)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        # Once for every string of every request body, whatever its field: a 400, never a 500.
        refuse_unstorable(data)
        return data
