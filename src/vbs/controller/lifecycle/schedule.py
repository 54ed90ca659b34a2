"""When a schedule's runs are due (docs/lifecycle-policies.md, "Schedules"): every ``Interval`` hours from
``Times`` (UTC; midnight if none), every ``Interval`` minutes (VBS's extension ``IntervalUnit: MINUTES``), or
at the times of AWS's six-field ``cron(Minutes Hours Day-of-month Month Day-of-week Year)``.

Due times are pure functions of the rule: every controller computes the same ones, so the unique
(policy, schedule, due time) row of a run is one claim for all of them (vbs.controller.lifecycle.runs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

__all__ = ["Cadence", "CronError", "cadence_of", "HOUR_INTERVALS", "MINUTE_INTERVALS"]

HOUR_INTERVALS = (1, 2, 3, 4, 6, 8, 12, 24)  # AWS's
MINUTE_INTERVALS = (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30)  # VBS's: each divides an hour
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# How far a cron schedule is searched for its next or last time: a year field may leave years out.
_CRON_SEARCH_DAYS = 5 * 366
_MONTHS = {m: i for i, m in enumerate(("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT",
                                       "NOV", "DEC"), start=1)}
_DAYS = {d: i for i, d in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"), start=1)}
_CRON_RE = re.compile(r"cron\(([^\n]{11,100})\)")
_FIELD_RE = re.compile(r"[0-9A-Za-z*?,/-]{1,64}")


class CronError(ValueError):
    """A cron expression VBS does not take, with why."""


def _values(field: str, lo: int, hi: int, names: dict[str, int], what: str) -> frozenset[int]:
    if not _FIELD_RE.fullmatch(field):
        raise CronError(f"the {what} field {field[:20]!r} has characters a cron field does not have "
                        "(L, W and # are not supported)")
    out: set[int] = set()
    for part in field.split(","):
        base, _, step_text = part.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or not 1 <= int(step_text) <= hi:
                raise CronError(f"the {what} field's step {step_text[:8]!r} is not 1-{hi}")
            step = int(step_text)
        if base in ("*", "?"):
            first, last = lo, hi
        else:
            a, dash, b = base.partition("-")
            first = _number(a, lo, hi, names, what)
            last = _number(b, lo, hi, names, what) if dash else (hi if step_text else first)
            if last < first:
                raise CronError(f"the {what} field's range {base[:16]!r} runs backwards")
        out.update(range(first, last + 1, step))
    return frozenset(out)


def _number(text: str, lo: int, hi: int, names: dict[str, int], what: str) -> int:
    if text.upper() in names:
        return names[text.upper()]
    if not text.isdigit() or not lo <= int(text) <= hi:
        raise CronError(f"the {what} field's value {text[:8]!r} is not {lo}-{hi}")
    return int(text)


@dataclass(frozen=True)
class _Cron:
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int] | None  # day of month; None: '?'
    months: frozenset[int]
    weekdays: frozenset[int] | None  # 1 = Sunday, as AWS counts; None: '?'
    years: frozenset[int]

    @classmethod
    def parse(cls, expression: str) -> _Cron:
        m = _CRON_RE.fullmatch(expression)
        if m is None:
            raise CronError("a cron expression is cron(Minutes Hours Day-of-month Month Day-of-week Year)")
        fields = m.group(1).split()
        if len(fields) != 6:
            raise CronError(f"a cron expression has six fields, not {len(fields)}")
        minute, hour, dom, month, dow, year = fields
        if (dom == "?") == (dow == "?"):
            raise CronError("one of Day-of-month and Day-of-week must be '?', and only one")
        return cls(minutes=_values(minute, 0, 59, {}, "Minutes"), hours=_values(hour, 0, 23, {}, "Hours"),
                   days=None if dom == "?" else _values(dom, 1, 31, {}, "Day-of-month"),
                   months=_values(month, 1, 12, _MONTHS, "Month"),
                   weekdays=None if dow == "?" else _values(dow, 1, 7, _DAYS, "Day-of-week"),
                   years=_values(year, 1970, 2199, {}, "Year"))

    def day_matches(self, day: datetime) -> bool:
        if day.year not in self.years or day.month not in self.months:
            return False
        if self.days is not None:
            return day.day in self.days
        assert self.weekdays is not None
        return (day.isoweekday() % 7) + 1 in self.weekdays  # isoweekday: Monday 1 .. Sunday 7

    def times_of(self, day: datetime) -> list[datetime]:
        return [day.replace(hour=h, minute=m) for h in sorted(self.hours) for m in sorted(self.minutes)]


@dataclass(frozen=True)
class Cadence:
    """A schedule's due times: a fixed ``period`` from ``anchor``, or a cron expression's."""

    period: timedelta | None = None
    anchor: datetime = _EPOCH
    cron: _Cron | None = None

    def last_due(self, now: datetime) -> datetime | None:
        """The latest due time at or before ``now`` (None: none within the cron search)."""
        if self.period is not None:
            steps = (now - self.anchor) // self.period
            return self.anchor + steps * self.period
        assert self.cron is not None
        day = now.replace(hour=0, minute=0, second=0, microsecond=0)
        for _ in range(_CRON_SEARCH_DAYS):
            if self.cron.day_matches(day):
                times = [t for t in self.cron.times_of(day) if t <= now]
                if times:
                    return times[-1]
            day -= timedelta(days=1)
        return None

    def due_between(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        """Due times in (``after``, ``until``], oldest first, at most ``limit`` of them."""
        out: list[datetime] = []
        if self.period is not None:
            steps = (after - self.anchor) // self.period + 1
            t = self.anchor + steps * self.period
            while t <= until and len(out) < limit:
                out.append(t)
                t += self.period
            return out
        assert self.cron is not None
        day = after.replace(hour=0, minute=0, second=0, microsecond=0)
        for _ in range(_CRON_SEARCH_DAYS):
            if day > until or len(out) >= limit:
                break
            if self.cron.day_matches(day):
                out += [t for t in self.cron.times_of(day) if after < t <= until][:limit - len(out)]
            day += timedelta(days=1)
        return out


def cadence_of(create_rule: dict[str, Any]) -> Cadence:
    """The cadence of a checked CreateRule (vbs.controller.lifecycle.document); CronError for a cron
    expression VBS does not take."""
    cron = create_rule.get("CronExpression")
    if cron is not None:
        return Cadence(cron=_Cron.parse(str(cron)))
    interval = int(create_rule["Interval"])
    if create_rule.get("IntervalUnit") == "MINUTES":
        return Cadence(period=timedelta(minutes=interval))
    times = create_rule.get("Times") or ["00:00"]
    hh, mm = (int(x) for x in str(times[0]).split(":"))
    return Cadence(period=timedelta(hours=interval), anchor=_EPOCH + timedelta(hours=hh, minutes=mm))
