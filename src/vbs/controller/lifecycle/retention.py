"""Which of a schedule's snapshots of one target go (docs/lifecycle-policies.md, "Retention"), as AWS's
RetainRule and ArchiveRule say: keep the newest ``Count`` (or those younger than ``Interval`` units); with an
ArchiveRule, the standard-tier snapshots beyond the count are archived instead of deleted, and the archived
ones beyond the archive tier's own count (or age) are deleted. A pure function of the snapshots and the rule.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

__all__ = ["Kept", "retire", "older_than"]


@dataclass(frozen=True)
class Kept:
    snapshot_id: str
    started_at: datetime
    completed: bool  # a pending snapshot counts, but is neither deleted nor archived until it completes
    archived: bool


def older_than(now: datetime, interval: int, unit: str) -> datetime:
    """``now`` less ``interval`` DAYS, WEEKS, MONTHS or YEARS (calendar months and years)."""
    if unit == "DAYS":
        return now - timedelta(days=interval)
    if unit == "WEEKS":
        return now - timedelta(weeks=interval)
    months = interval * (12 if unit == "YEARS" else 1)
    year, month = divmod(now.year * 12 + now.month - 1 - months, 12)
    day = min(now.day, calendar.monthrange(year, month + 1)[1])
    return now.replace(year=year, month=month + 1, day=day)


def _beyond(snaps: list[Kept], rule: dict[str, Any], now: datetime) -> list[Kept]:
    """The snapshots (newest first) the rule does not keep."""
    if rule.get("Count") is not None:
        return snaps[int(rule["Count"]):]
    cutoff = older_than(now, int(rule["Interval"]), str(rule["IntervalUnit"]))
    return [x for x in snaps if x.started_at < cutoff]


def retire(snaps: list[Kept], retain: dict[str, Any], archive: dict[str, Any] | None, now: datetime
           ) -> tuple[list[str], list[str]]:
    """(the snapshots to archive, the snapshots to delete) of one schedule's snapshots of one target."""
    snaps = sorted(snaps, key=lambda x: (x.started_at, x.snapshot_id), reverse=True)
    standard = [x for x in snaps if not x.archived]
    gone = [x for x in _beyond(standard, retain, now) if x.completed]
    if archive is None:
        return [], [x.snapshot_id for x in gone]
    archived = [x for x in snaps if x.archived]
    archive_rule = archive["RetainRule"]["RetentionArchiveTier"]
    # What is archived now joins the archive tier, newest first, before the ones archived earlier.
    in_archive = sorted([*gone, *archived], key=lambda x: (x.started_at, x.snapshot_id), reverse=True)
    dropped = {x.snapshot_id for x in _beyond(in_archive, archive_rule, now)}
    return ([x.snapshot_id for x in gone if x.snapshot_id not in dropped],
            [x.snapshot_id for x in in_archive if x.snapshot_id in dropped])
