"""A lifecycle policy's document as AWS's ``dlm`` API takes it (botocore's model, 2018-01-12: PolicyDetails,
Schedule, CreateRule, RetainRule, ArchiveRule), checked in full before anything is stored: every field is
bounded, unknown fields are refused, and what VBS does not do (fast snapshot restore, cross-region copies,
sharing, AMI and event-based policies, default policies, scripts) is refused naming it, with
InvalidRequestException (docs/lifecycle-policies.md).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vbs.controller.lifecycle.errors import InvalidRequest
from vbs.controller.lifecycle.schedule import HOUR_INTERVALS, MINUTE_INTERVALS, CronError, cadence_of
from vbs.controller.rest.schemas.common import check_tags

__all__ = ["PolicyDetails", "check_details", "parse", "VARIABLES", "ROLE_ARN_RE", "DESCRIPTION_RE", "TAG_KEY_RE"]

ROLE_ARN_RE = r"arn:aws(-[a-z]{1,3}){0,2}:iam::\d{1,20}:role/[\x21-\x7e]{0,1800}"
DESCRIPTION_RE = r"[0-9A-Za-z _-]{0,500}"
NAME_RE = r"[0-9A-Za-z _-]{1,120}"
TAG_KEY_RE = r"[a-zA-Z0-9+\-=._:/@ ]{1,128}"
TIME_RE = r"(0[0-9]|1[0-9]|2[0-3]):[0-5][0-9]"
VARIABLES = ("$(instance-id)", "$(timestamp)")
RETAIN_UNITS = ("DAYS", "WEEKS", "MONTHS", "YEARS")
MAX_RETAIN_INTERVAL = 1000  # of any unit (AWS bounds the retention to 100 years)


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TagShape(_Shape):
    Key: str = Field(pattern=f"^{TAG_KEY_RE}$")
    Value: str = Field(max_length=256)


class CreateRuleShape(_Shape):
    Location: str = "CLOUD"
    Interval: int | None = Field(None, ge=1, le=60)
    IntervalUnit: str | None = None
    Times: list[str] | None = Field(None, max_length=1)
    CronExpression: str | None = Field(None, min_length=17, max_length=106)
    Scripts: list[Any] | None = None


class RetainRuleShape(_Shape):
    Count: int | None = Field(None, ge=1, le=1000)
    Interval: int | None = Field(None, ge=1, le=MAX_RETAIN_INTERVAL)
    IntervalUnit: str | None = None


class ArchiveRetainRuleShape(_Shape):
    RetentionArchiveTier: RetainRuleShape


class ArchiveRuleShape(_Shape):
    RetainRule: ArchiveRetainRuleShape


class ScheduleShape(_Shape):
    Name: str = Field(pattern=f"^{NAME_RE}$")
    CopyTags: bool = False
    TagsToAdd: list[TagShape] = Field(default_factory=list, max_length=45)
    VariableTags: list[TagShape] = Field(default_factory=list, max_length=45)
    CreateRule: CreateRuleShape
    RetainRule: RetainRuleShape
    FastRestoreRule: dict[str, Any] | None = None
    CrossRegionCopyRules: list[Any] | None = None
    ShareRules: list[Any] | None = None
    DeprecateRule: dict[str, Any] | None = None
    ArchiveRule: ArchiveRuleShape | None = None


class ParametersShape(_Shape):
    ExcludeBootVolume: bool | None = None
    NoReboot: bool | None = None
    ExcludeDataVolumeTags: list[TagShape] = Field(default_factory=list, max_length=50)


class PolicyDetails(_Shape):
    PolicyType: str = "EBS_SNAPSHOT_MANAGEMENT"
    ResourceTypes: list[str] | None = Field(None, max_length=1)
    ResourceLocations: list[str] = Field(default_factory=lambda: ["CLOUD"], max_length=1)
    TargetTags: list[TagShape] | None = Field(None, max_length=50)
    Schedules: list[ScheduleShape] | None = Field(None, max_length=4)
    Parameters: ParametersShape | None = None
    # What VBS refuses (each named in the refusal): event-based policies, default policies.
    EventSource: dict[str, Any] | None = None
    Actions: list[Any] | None = None
    PolicyLanguage: str | None = None
    ResourceType: str | None = None
    CreateInterval: int | None = None
    RetainInterval: int | None = None
    CopyTags: bool | None = None
    CrossRegionCopyTargets: list[Any] | None = None
    ExtendDeletion: bool | None = None
    Exclusions: dict[str, Any] | None = None


def parse(document: Any) -> PolicyDetails:
    """The PolicyDetails of a request, checked (InvalidRequestException naming what is wrong)."""
    if document is None:
        raise InvalidRequest("PolicyDetails is required.")
    try:
        details = PolicyDetails.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequest(f"Invalid value for PolicyDetails.{where}: {first.get('msg', 'invalid')}.") from None
    check_details(details)
    return details


def _refuse_unsupported(d: PolicyDetails) -> None:
    if d.PolicyType == "IMAGE_MANAGEMENT":
        raise InvalidRequest("PolicyType IMAGE_MANAGEMENT is not supported: VBS has no AMIs; use "
                             "EBS_SNAPSHOT_MANAGEMENT.")
    if d.PolicyType == "EVENT_BASED_POLICY" or d.EventSource is not None or d.Actions is not None:
        raise InvalidRequest("Event-based policies (EVENT_BASED_POLICY, EventSource, Actions) are not supported: "
                             "VBS has one region and no cross-account sharing events.")
    if d.PolicyType != "EBS_SNAPSHOT_MANAGEMENT":
        raise InvalidRequest(f"PolicyType {d.PolicyType[:40]!r} is invalid; expected EBS_SNAPSHOT_MANAGEMENT.")
    default_policy = (d.PolicyLanguage, d.ResourceType, d.CreateInterval, d.RetainInterval, d.CopyTags,
                      d.ExtendDeletion, d.Exclusions)
    if any(x is not None for x in default_policy) and d.PolicyLanguage != "STANDARD":
        raise InvalidRequest("Default policies (the SIMPLIFIED policy language: ResourceType, CreateInterval, "
                             "RetainInterval, CopyTags, ExtendDeletion, Exclusions) are not supported: give "
                             "a STANDARD policy with Schedules.")
    if d.CrossRegionCopyTargets is not None:
        raise InvalidRequest("CrossRegionCopyTargets is not supported: VBS has one region.")


def _check_schedule(s: ScheduleShape, resource: str) -> None:
    where = f"Schedule {s.Name!r}"
    if s.FastRestoreRule is not None:
        raise InvalidRequest(f"{where}: FastRestoreRule is not supported: VBS has no fast snapshot restore "
                             "(a volume made from a snapshot is usable at once where its pool has reflink).")
    if s.CrossRegionCopyRules is not None:
        raise InvalidRequest(f"{where}: CrossRegionCopyRules is not supported: VBS has one region.")
    if s.ShareRules is not None:
        raise InvalidRequest(f"{where}: ShareRules is not supported by policies: share a snapshot with "
                             "ModifySnapshotAttribute (vbs share-snapshot).")
    if s.DeprecateRule is not None:
        raise InvalidRequest(f"{where}: DeprecateRule applies to AMI policies, which VBS does not have.")
    rule = s.CreateRule
    if rule.Location != "CLOUD":
        raise InvalidRequest(f"{where}: CreateRule.Location {rule.Location[:20]!r} is not supported; only CLOUD.")
    if rule.Scripts is not None:
        raise InvalidRequest(f"{where}: CreateRule.Scripts (pre and post scripts) is not supported.")
    if rule.CronExpression is not None:
        if rule.Interval is not None or rule.IntervalUnit is not None or rule.Times is not None:
            raise InvalidRequest(f"{where}: give CronExpression, or Interval and IntervalUnit, not both.")
        try:
            cadence_of(rule.model_dump())
        except CronError as exc:
            raise InvalidRequest(f"{where}: CronExpression {rule.CronExpression[:106]!r} is invalid: {exc}.") from None
    elif rule.IntervalUnit == "HOURS":
        if rule.Interval not in HOUR_INTERVALS:
            raise InvalidRequest(f"{where}: an Interval of HOURS is one of {', '.join(map(str, HOUR_INTERVALS))}.")
        for t in rule.Times or []:
            if not re.fullmatch(TIME_RE, t):
                raise InvalidRequest(f"{where}: Times are hh:mm (UTC), not {t[:8]!r}.")
    elif rule.IntervalUnit == "MINUTES":  # VBS's extension (docs/lifecycle-policies.md)
        if rule.Interval not in MINUTE_INTERVALS or rule.Times is not None:
            raise InvalidRequest(f"{where}: an Interval of MINUTES (a VBS extension) is one of "
                                 f"{', '.join(map(str, MINUTE_INTERVALS))}, without Times.")
    else:
        raise InvalidRequest(f"{where}: CreateRule needs CronExpression, or Interval with IntervalUnit HOURS "
                             "(or MINUTES, a VBS extension).")
    _check_retain(s.RetainRule, f"{where}: RetainRule")
    if s.ArchiveRule is not None:
        if s.RetainRule.Count is None:
            raise InvalidRequest(f"{where}: an ArchiveRule needs a count-based RetainRule (snapshots beyond "
                                 "the count are archived).")
        _check_retain(s.ArchiveRule.RetainRule.RetentionArchiveTier, f"{where}: RetentionArchiveTier")
    if s.VariableTags and resource != "INSTANCE":
        raise InvalidRequest(f"{where}: VariableTags are supported only by policies that target instances.")
    for tag in s.VariableTags:
        if tag.Value not in VARIABLES:
            raise InvalidRequest(f"{where}: a VariableTags value is one of {', '.join(VARIABLES)}, "
                                 f"not {tag.Value[:40]!r}.")
    try:
        check_tags({t.Key: t.Value for t in [*s.TagsToAdd, *s.VariableTags]})
    except ValueError as exc:
        raise InvalidRequest(f"{where}: invalid tags: {exc}.") from None


def _check_retain(rule: RetainRuleShape, where: str) -> None:
    by_count = rule.Count is not None
    by_age = rule.Interval is not None or rule.IntervalUnit is not None
    if by_count == by_age:
        raise InvalidRequest(f"{where} needs Count, or Interval with IntervalUnit: one of the two.")
    if by_age and (rule.Interval is None or rule.IntervalUnit not in RETAIN_UNITS):
        raise InvalidRequest(f"{where}: Interval needs an IntervalUnit of {', '.join(RETAIN_UNITS)}.")


def check_details(d: PolicyDetails) -> None:
    _refuse_unsupported(d)
    if not d.ResourceTypes or d.ResourceTypes[0] not in ("VOLUME", "INSTANCE"):
        raise InvalidRequest("ResourceTypes is required: VOLUME or INSTANCE.")
    resource = d.ResourceTypes[0]
    if d.ResourceLocations != ["CLOUD"]:
        raise InvalidRequest("ResourceLocations other than CLOUD (OUTPOST, LOCAL_ZONE) are not supported.")
    if not d.TargetTags:
        raise InvalidRequest("TargetTags is required: the tags of the volumes or instances the policy targets.")
    excluded = d.Parameters.ExcludeDataVolumeTags if d.Parameters is not None else []
    for what, tags in (("TargetTags", d.TargetTags), ("ExcludeDataVolumeTags", excluded)):
        try:
            check_tags({t.Key: t.Value for t in tags})
        except ValueError as exc:
            raise InvalidRequest(f"Invalid {what}: {exc}.") from None
    if not d.Schedules:
        raise InvalidRequest("Schedules is required: one to four schedules.")
    names = [s.Name for s in d.Schedules]
    if len(set(names)) != len(names):
        raise InvalidRequest("Schedule names must be unique within a policy.")
    for s in d.Schedules:
        _check_schedule(s, resource)
    if d.Parameters is not None:
        if d.Parameters.NoReboot is not None:
            raise InvalidRequest("Parameters.NoReboot applies to AMI policies, which VBS does not have.")
        if d.Parameters.ExcludeDataVolumeTags and resource != "INSTANCE":
            raise InvalidRequest("Parameters.ExcludeDataVolumeTags applies to policies that target instances.")
        if d.Parameters.ExcludeBootVolume and resource != "INSTANCE":
            raise InvalidRequest("Parameters.ExcludeBootVolume applies to policies that target instances.")


def stored(d: PolicyDetails) -> dict[str, Any]:
    """The document as stored and answered: the fields given, and the defaults of those left out (fields
    given as null are left out)."""
    return d.model_dump(exclude_none=True)
