"""Describe filters (``name=value``, EBS names) and keyset pagination shared by volumes and snapshots."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Select, and_, exists, or_, select, true

from vbs.controller.db import Tag
from vbs.errors import InvalidParameter

DEFAULT_PAGE = 100  # a REST describe without max_results answers this many and a next_token
MAX_RESULTS = 1000
MAX_FILTER_VALUES = 200
MAX_TOKEN_KEY = 100  # "v1:" and the last key of a page (a node name is up to 63 characters)
INT_MAX = (1 << 31) - 1  # SQL INTEGER
_INT_RE = re.compile(r"-?[0-9]{1,10}")  # ASCII digits only: int() also takes " 1_0 " and other scripts' digits
T = TypeVar("T")


def parse_filters(raw: Iterable[str]) -> dict[str, list[str]]:
    """``["status=available", "tag:team=db"]`` → ``{"status": ["available"], "tag:team": ["db"]}``."""
    out: dict[str, list[str]] = {}
    for item in raw:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InvalidParameter(f"Invalid filter {item[:80]!r}: expecting name=value.")
        out.setdefault(name, []).extend(v for v in value.split(",") if v != "")
        if len(out[name]) > MAX_FILTER_VALUES:
            raise InvalidParameter(f"Too many values for filter {name[:80]!r}.")
    return out


def where_clauses(
    filters: dict[str, list[str]],
    id_column: Any,
    columns: dict[str, Callable[[list[str]], ColumnElement[bool]]],
    elsewhere: Iterable[str] = (),
) -> list[ColumnElement[bool]]:
    """SQL conditions for EBS filters: values of one name are OR-ed, names are AND-ed. Names in ``elsewhere``
    are the caller's to apply (no clause here); an unknown name is refused with the whole list."""
    clauses: list[ColumnElement[bool]] = []
    for name, values in filters.items():
        if name in elsewhere:
            continue
        if name.startswith("tag:"):
            key = name[4:]
            clauses.append(exists().where(Tag.resource_id == id_column, Tag.key == key,
                                          Tag.value.in_(values) if values else true()))
        elif name == "tag-key":
            clauses.append(exists().where(Tag.resource_id == id_column, Tag.key.in_(values)))
        elif name == "tag-value":
            clauses.append(exists().where(Tag.resource_id == id_column, Tag.value.in_(values)))
        elif name in columns:
            clauses.append(columns[name](values))
        else:
            known = ", ".join(sorted([*columns, *elsewhere, "tag:KEY", "tag-key", "tag-value"]))
            raise InvalidParameter(f"The filter {name[:80]!r} is invalid; known filters: {known}.")
    return clauses


def in_values(column: Any, cast: Callable[[str], Any] = str) -> Callable[[list[str]], ColumnElement[bool]]:
    def clause(values: list[str]) -> ColumnElement[bool]:
        try:
            condition: ColumnElement[bool] = column.in_([cast(v) for v in values])
            return condition
        except ValueError as exc:
            raise InvalidParameter(f"Invalid filter value: {exc}") from exc

    return clause


# A time filter value: a UTC timestamp, cut anywhere after the year with a trailing "*" (EC2's wildcard).
_TIME_RE = re.compile(r"(\d{4})(?:-(\d{2})(?:-(\d{2})(?:T(\d{2})(?::(\d{2})(?::(\d{2})(?:\.(\d{1,6}))?)?)?)?)?)?")


def time_span(value: str) -> tuple[datetime, datetime]:
    """The instants ``value`` names: ``2026-11-26T08:30:00.000Z`` (that millisecond), ``2026-11-26T08:30:00Z``
    (that second), or a prefix ending in ``*`` (``2026-11-*``: that month)."""
    wild = value.endswith("*")
    text = value.rstrip("*").rstrip("-T:.")
    text = text[:-1] if not wild and text.endswith("Z") else text
    match = _TIME_RE.fullmatch(text)
    if match is None or (not wild and match.group(6) is None):
        raise ValueError(f"{value[:40]!r} is not a time: give 2026-11-26T08:30:00Z, or a prefix ending in * "
                         "(2026-11-26T08:*)")
    year = int(match.group(1))
    month, day, hour, minute, second = (int(g) if g else None for g in match.groups()[1:6])
    fraction = match.group(7)
    try:
        start = datetime(year, month or 1, day or 1, hour or 0, minute or 0, second or 0,
                         int((fraction or "0").ljust(6, "0")), tzinfo=UTC)
    except ValueError as exc:
        raise ValueError(f"{value[:40]!r} is not a time: {exc}") from None
    if fraction is not None:
        return start, start + timedelta(microseconds=10 ** (6 - len(fraction)))
    for unit, step in ((second, timedelta(seconds=1)), (minute, timedelta(minutes=1)), (hour, timedelta(hours=1)),
                       (day, timedelta(days=1))):
        if unit is not None:
            return start, start + step
    if month is not None:
        return start, start.replace(year=year + month // 12, month=month % 12 + 1)
    return start, start.replace(year=year + 1)


def in_time_spans(column: Any) -> Callable[[list[str]], ColumnElement[bool]]:
    """A filter on a time column: any of the values' spans (``time_span``)."""

    def clause(values: list[str]) -> ColumnElement[bool]:
        try:
            spans = [time_span(v) for v in values]
        except ValueError as exc:
            raise InvalidParameter(f"Invalid filter value: {exc}") from exc
        return or_(*(and_(column >= start, column < end) for start, end in spans))

    return clause


def flag(condition: ColumnElement[bool]) -> Callable[[list[str]], ColumnElement[bool]]:
    """A true/false filter on ``condition`` (e.g. ``encrypted=true``)."""

    def clause(values: list[str]) -> ColumnElement[bool]:
        wanted = {v.lower() for v in values}
        if not wanted <= {"true", "false"}:
            raise InvalidParameter("Invalid filter value: expecting true or false.")
        if wanted == {"true", "false"}:
            return true()
        return condition if "true" in wanted else ~condition

    return clause


def encode_token(last_id: str) -> str:
    return base64.urlsafe_b64encode(f"v1:{last_id}".encode()).decode().rstrip("=")


def decode_token(token: str) -> str:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raw = ""
    if not raw.startswith("v1:") or len(raw) > MAX_TOKEN_KEY:
        raise InvalidParameter("The next token is invalid.")
    return raw[3:]


def page_limit(max_results: int | None, resource_ids: list[str], *, default: int = DEFAULT_PAGE,
               maximum: int = MAX_RESULTS) -> int | None:
    """How many rows one page holds: as asked (1..maximum), else ``default``; None where the ids asked for
    bound the answer already (at most 1,000 of them)."""
    if max_results is not None:
        if resource_ids:
            raise InvalidParameter("max-results cannot be combined with resource ids.")
        if not 1 <= max_results <= maximum:
            raise InvalidParameter(f"max-results must be between 1 and {maximum}.")
        return max_results
    return None if resource_ids else default


def paginate(stmt: Select[Any], id_column: Any, limit: int | None, next_token: str | None) -> Select[Any]:
    """``stmt`` in ``id_column`` order after the token's row, one row more than ``limit`` (to know if more follow)."""
    if limit is not None and not 1 <= limit <= MAX_RESULTS:
        raise InvalidParameter(f"max-results must be between 1 and {MAX_RESULTS}.")
    if next_token:
        stmt = stmt.where(id_column > decode_token(next_token))
    stmt = stmt.order_by(id_column)
    if limit is not None:
        stmt = stmt.limit(limit + 1)
    return stmt


def page(rows: list[Any], limit: int | None, id_of: Callable[[Any], str]) -> tuple[list[Any], str | None]:
    if limit is not None and len(rows) > limit:
        rows = rows[:limit]
        return rows, encode_token(id_of(rows[-1]))
    return rows, None


def page_of(items: list[T], key: Callable[[T], str], max_results: int | None,
            next_token: str | None) -> tuple[list[T], str | None]:
    """One page of a list already in memory (nodes, instances), in ``key`` order."""
    limit = page_limit(max_results, [])
    after = decode_token(next_token) if next_token else None
    rows = sorted((i for i in items if after is None or key(i) > after), key=key)
    return page(rows, limit, key)


def bounded_int(low: int = 0, high: int = INT_MAX) -> Callable[[str], int]:
    """A filter value's cast to a whole number within [low, high]; anything else is refused (400), never
    handed to the database (a 20-digit ``size=`` overflowed SQLite's INTEGER: a 500)."""

    def cast(value: str) -> int:
        if not _INT_RE.fullmatch(value) or not low <= int(value) <= high:
            raise ValueError(f"{value[:32]!r} is not a whole number from {low} to {high}")
        return int(value)

    return cast


def tags_of(session: Any, resource_ids: list[str], *, within: Select[Any] | None = None) -> dict[str, dict[str, str]]:
    """The tags of each of ``resource_ids``. ``within``: a query of ids that holds them all (a page's own
    query), looked up in the database instead of a list of ids that SQLAlchemy expands into one bound
    parameter each (about 1 ms a thousand); tags of ids it gives beyond ``resource_ids`` are left out."""
    out: dict[str, dict[str, str]] = {rid: {} for rid in resource_ids}
    if within is not None:
        queries = [select(Tag).where(Tag.resource_id.in_(within))] if resource_ids else []
    else:
        queries = [select(Tag).where(Tag.resource_id.in_(resource_ids[start:start + 500]))
                   for start in range(0, len(resource_ids), 500)]
    for query in queries:
        for t in session.scalars(query):
            if t.resource_id in out:
                out[t.resource_id][t.key] = t.value
    return out
