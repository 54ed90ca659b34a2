"""Parameters of the EC2 Query protocol: a form-encoded body with indexed names (``Filter.1.Value.2``).

``parse_form`` decodes a body as botocore's ``ec2`` serializer writes it; ``QueryParams`` reads it through typed
getters whose every complaint is an ``InvalidParameter`` or ``MissingParameter`` (HTTP 400) with an EC2-like message.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterator, Mapping
from urllib.parse import unquote_to_bytes

from vbs.errors import InvalidParameter, MissingParameter

__all__ = ["MAX_BODY", "MAX_INDEX", "MAX_PARAMS", "QueryParams", "parse_form"]

MAX_BODY = 1 << 20
MAX_PARAMS = 2000
MAX_NAME_LEN = 256  # the longest real name (TagSpecification.N.Tag.M.Value) is ~40 characters
MAX_VALUE_LEN = 1 << 15  # CopySnapshot's PresignedUrl is the longest real value, a few KiB
MAX_INDEX = 999  # list indexes run 1..MAX_INDEX; botocore numbers from 1 without gaps
MAX_STR_LEN = 1024  # QueryParams.str's default bound; callers pass their own where EC2 documents one

# Every name botocore's ec2 serializer emits is made of these; anything else is garbage worth a clear refusal.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_INDEX_RE = re.compile(r"[1-9][0-9]*")  # no leading zeros: "VolumeId.01" must not alias "VolumeId.1"
_INT_RE = re.compile(r"-?[0-9]{1,18}")  # ASCII digits only (int() would take " 1_0 " and other scripts' digits)
_ACTION_RE = re.compile(r"[A-Za-z][A-Za-z0-9]{0,127}")
_FIELD_RE = re.compile(rb"[^&]+")


def _echo(value: str, limit: int = 64) -> str:
    """Client input quoted back in a message: bounded, control characters escaped."""
    return repr(value[:limit])[1:-1] + ("…" if len(value) > limit else "")


def _invalid(message: str) -> InvalidParameter:
    return InvalidParameter(message, code="InvalidParameterValue", status=400)


def _missing(name: str) -> MissingParameter:
    return MissingParameter(f"The request must contain the parameter {name}.", status=400)


def _decode(raw: bytes, what: str, limit: int) -> str:
    # Percent-decoding only shrinks, so a raw field three times the limit cannot decode to something within it.
    if len(raw) > 3 * limit:
        raise _invalid(f"A {what} is longer than {limit} characters.")
    try:
        text = unquote_to_bytes(raw.replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid(f"A {what} is not valid UTF-8 once percent-decoded.") from None
    if len(text) > limit:
        raise _invalid(f"A {what} is longer than {limit} characters.")
    return text


def parse_form(raw: bytes) -> dict[str, str]:
    """Decode an ``application/x-www-form-urlencoded`` body (or a query string) into name → value.

    Refuses, as ``InvalidParameterValue``: bodies over ``MAX_BODY``, more than ``MAX_PARAMS`` parameters, repeated
    or malformed names, over-long names or values, non-UTF-8 text and NUL characters.
    """
    if len(raw) > MAX_BODY:
        raise _invalid(f"The request body is larger than {MAX_BODY} bytes.")
    params: dict[str, str] = {}
    # finditer rather than split: a body of a million '&' must not become a million empty bytes objects.
    for match in _FIELD_RE.finditer(bytes(raw)):
        if len(params) >= MAX_PARAMS:
            raise _invalid(f"The request has more than {MAX_PARAMS} parameters.")
        raw_name, _, raw_value = match.group().partition(b"=")
        name = _decode(raw_name, "parameter name", MAX_NAME_LEN)
        if not _NAME_RE.fullmatch(name):
            raise _invalid(f"Invalid parameter name ({_echo(name)}).")
        value = _decode(raw_value, f"value of parameter {name}", MAX_VALUE_LEN)
        if "\x00" in value:
            raise _invalid(f"The value of parameter {name} contains a NUL character.")
        if name in params:
            raise _invalid(f"The parameter {name} is given more than once.")
        params[name] = value
    return params


def _parse_index(text: str, key: str) -> int:
    if not _INDEX_RE.fullmatch(text) or len(text) > 3 or builtins.int(text) > MAX_INDEX:
        raise _invalid(f"Invalid parameter name ({_echo(key)}): the index ({_echo(text)}) must be a whole number "
                       f"from 1 to {MAX_INDEX} without leading zeros.")
    return builtins.int(text)


def _grouped(params: Mapping[str, str], prefix: str) -> list[tuple[int, dict[str, str]]]:
    """``prefix.N[.rest]`` entries grouped by N (ascending) as {rest: value}; rest is "" for ``prefix.N`` itself."""
    lead = prefix + "."
    groups: dict[int, dict[str, str]] = {}
    for key, value in params.items():
        if key.startswith(lead):
            index_text, _, rest = key[len(lead):].partition(".")
            groups.setdefault(_parse_index(index_text, key), {})[rest] = value
    return sorted(groups.items())


def _scalar_list(params: Mapping[str, str], prefix: str, where: str) -> list[str]:
    """``prefix.1``, ``prefix.2``… in index order; ``where`` is the full name of ``prefix`` for messages."""
    # A bare, empty ``prefix`` is how the plain query protocol writes an empty list; tolerate it, refuse anything else.
    bare = params.get(prefix)
    if bare:
        raise _invalid(f"The parameter {where} is a list: give it as {where}.1, {where}.2, ….")
    out: list[str] = []
    for index, sub in _grouped(params, prefix):
        extra = [k for k in sub if k]
        if extra:
            raise _invalid(f"Unexpected parameter {where}.{index}.{_echo(extra[0])}.")
        out.append(sub[""])
    return out


def _check_fields(sub: Mapping[str, str], where: str, allowed: tuple[str, ...], lists: tuple[str, ...] = ()) -> None:
    for key in sub:
        head = key.partition(".")[0]
        if key not in allowed and not (head in lists and (key == head or key.startswith(head + "."))):
            raise _invalid(f"Unexpected parameter {where}.{_echo(key)}." if key else f"Unexpected parameter {where}.")


def _tag_pairs(params: Mapping[str, str], prefix: str, where: str) -> Iterator[tuple[str, str, str | None]]:
    """(full name of the entry, Key, Value or None) for each ``prefix.N.Key`` / ``prefix.N.Value``."""
    if params.get(prefix):
        raise _invalid(f"The parameter {where} is a list: give it as {where}.1.Key, {where}.1.Value, ….")
    for index, sub in _grouped(params, prefix):
        entry = f"{where}.{index}"
        _check_fields(sub, entry, ("Key", "Value"))
        if "Key" not in sub:
            raise _missing(f"{entry}.Key")
        yield entry, sub["Key"], sub.get("Value")


def _tag_dict(params: Mapping[str, str], prefix: str, where: str) -> dict[str, str]:
    tags: dict[str, str] = {}
    for entry, key, value in _tag_pairs(params, prefix, where):
        if key in tags:
            raise _invalid(f"Duplicate tag key ({_echo(key)}) in {entry}.Key.")
        tags[key] = "" if value is None else value
    return tags


class QueryParams:
    """A read-only view of one request's parameters with typed getters; errors are all 400s."""

    def __init__(self, params: Mapping[str, str]) -> None:
        self._params = dict(params)

    def __contains__(self, name: object) -> bool:
        return name in self._params

    def __len__(self) -> builtins.int:
        return len(self._params)

    @property
    def action(self) -> builtins.str:
        value = self._params.get("Action")
        if not value:
            raise _missing("Action")
        if not _ACTION_RE.fullmatch(value):
            raise InvalidParameter(f"The action {_echo(value)} is not valid for this web service.",
                                   code="InvalidAction", status=400)
        return value

    @property
    def version(self) -> builtins.str | None:
        return self._params.get("Version")

    def str(self, name: builtins.str, *, required: builtins.bool = False,
            max_len: builtins.int = MAX_STR_LEN) -> builtins.str | None:
        """The value of ``name``; ``required`` also refuses an empty value."""
        value = self._params.get(name)
        if value is None or (required and value == ""):
            if required:
                raise _missing(name)
            return None
        if len(value) > max_len:
            raise _invalid(f"Value ({_echo(value)}) for parameter {name} is invalid. "
                           f"It is longer than {max_len} characters.")
        return value

    def int(self, name: builtins.str, *, required: builtins.bool = False, min: builtins.int | None = None,
            max: builtins.int | None = None) -> builtins.int | None:
        value = self._params.get(name)
        if value is None:
            if required:
                raise _missing(name)
            return None
        if not _INT_RE.fullmatch(value):
            raise _invalid(f"Value ({_echo(value)}) for parameter {name} is invalid. Expected an integer.")
        number = builtins.int(value)
        if (min is not None and number < min) or (max is not None and number > max):
            bounds = (f"between {min} and {max}" if min is not None and max is not None
                      else f"at least {min}" if min is not None else f"at most {max}")
            raise _invalid(f"Value ({number}) for parameter {name} is invalid. It must be {bounds}.")
        return number

    def bool(self, name: builtins.str, default: builtins.bool = False) -> builtins.bool:
        value = self._params.get(name)
        if value is None:
            return default
        lowered = value.lower()
        if lowered not in ("true", "false"):
            raise _invalid(f"Value ({_echo(value)}) for parameter {name} is invalid. Expected 'true' or 'false'.")
        return lowered == "true"

    def list(self, prefix: builtins.str) -> builtins.list[builtins.str]:
        """``prefix.1``, ``prefix.2``… in numeric order (gaps tolerated, as EC2 does)."""
        return _scalar_list(self._params, prefix, prefix)

    def filters(self) -> dict[builtins.str, builtins.list[builtins.str]]:
        """``Filter.N.Name`` + ``Filter.N.Value.M`` → {name: [values]}; a name given twice is refused."""
        if self._params.get("Filter"):
            raise _invalid("The parameter Filter is a list: give it as Filter.1.Name, Filter.1.Value.1, ….")
        out: dict[builtins.str, builtins.list[builtins.str]] = {}
        for index, sub in _grouped(self._params, "Filter"):
            where = f"Filter.{index}"
            _check_fields(sub, where, ("Name",), lists=("Value",))
            name = sub.get("Name")
            if not name:
                raise _missing(f"{where}.Name")
            # EC2 ANDs filters; a dict cannot say "status=a AND status=b", so a repeated name is refused, not merged.
            if name in out:
                raise _invalid(f"The filter ({_echo(name)}) is given more than once ({where}.Name); "
                               "give all its values in one filter.")
            out[name] = _scalar_list(sub, "Value", f"{where}.Value")
        return out

    def tag_specifications(self) -> builtins.list[tuple[builtins.str | None, dict[builtins.str, builtins.str]]]:
        """``TagSpecification.N.ResourceType`` + ``TagSpecification.N.Tag.M.Key/Value`` → [(type, {key: value})]."""
        if self._params.get("TagSpecification"):
            raise _invalid("The parameter TagSpecification is a list: give it as TagSpecification.1.ResourceType, "
                           "TagSpecification.1.Tag.1.Key, ….")
        out: builtins.list[tuple[builtins.str | None, dict[builtins.str, builtins.str]]] = []
        for index, sub in _grouped(self._params, "TagSpecification"):
            where = f"TagSpecification.{index}"
            _check_fields(sub, where, ("ResourceType",), lists=("Tag",))
            spec_tags = _tag_dict(sub, "Tag", f"{where}.Tag")
            if not spec_tags:
                raise _invalid(f"Tag specification must have at least one tag ({where} has none).")
            out.append((sub.get("ResourceType"), spec_tags))
        return out

    def records(self, prefix: builtins.str, fields: tuple[builtins.str, ...]) -> builtins.list[dict[builtins.str,
                                                                                                     builtins.str]]:
        """``prefix.N.FIELD`` entries, one {FIELD: value} per N in index order; any other field is refused."""
        if self._params.get(prefix):
            raise _invalid(f"The parameter {prefix} is a list: give it as {prefix}.1.{fields[0]}, ….")
        out = []
        for index, sub in _grouped(self._params, prefix):
            _check_fields(sub, f"{prefix}.{index}", fields)
            out.append(dict(sub))
        return out

    def tags(self, prefix: builtins.str = "Tag") -> dict[builtins.str, builtins.str]:
        """``Tag.N.Key`` / ``Tag.N.Value`` → {key: value}; an absent Value is ""; a repeated key is refused."""
        return _tag_dict(self._params, prefix, prefix)

    def tag_keys(self, prefix: builtins.str = "Tag") -> builtins.list[tuple[builtins.str, builtins.str | None]]:
        """DeleteTags' ``Tag.N.Key`` with optional ``Tag.N.Value``: None (any value) differs from "" (empty value)."""
        return [(key, value) for _, key, value in _tag_pairs(self._params, prefix, prefix)]

    def unknown(self, known: set[builtins.str]) -> builtins.list[builtins.str]:
        """Top-level names (before the first '.') outside ``known``, sorted; Action and Version are always known."""
        allowed = known | {"Action", "Version"}
        return sorted({key.partition(".")[0] for key in self._params} - allowed)
