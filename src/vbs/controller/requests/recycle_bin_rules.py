"""The Recycle Bin's retention rules as the API offers them (AWS's rules, docs/recycle-bin.md): CreateRule,
GetRule, ListRules, UpdateRule, DeleteRule, LockRule, UnlockRule and the rules' own tags.

- A rule keeps a tenant's deleted snapshots (``EBS_SNAPSHOT``) or volumes (``EBS_VOLUME``) for
  ``retention_days``: those with any of its resource tags, or, without resource tags (a region-level
  rule), every one but those with one of its exclusion tags. A delete matched by several rules keeps the
  resource for the longest of their retentions (``retention_for``).
- A locked rule (region-level rules only) is deleted by nobody, and its retention, resource type and tags
  do not change; UnlockRule starts its unlock delay (``pending_unlock``), after which it is unlocked.
- A "day" lasts ``recycle_bin_day_s`` (a day, shorter for tests and demos only).
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from vbs.controller.db import RecycleBinRule
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.tables import utcnow
from vbs.controller.rbin.errors import RuleConflict, RuleInvalid, RuleNotFound, RuleQuotaExceeded
from vbs.controller.requests.snapshot_permissions import owner_id
from vbs.controller.rest.schemas.recycle_bin import ResourceTag, RuleOut
from vbs.controller.runtime import Controller

__all__ = ["RuleSpec", "RuleChange", "RESOURCE_TYPES", "create_rule", "get_rule", "list_rules", "update_rule",
           "delete_rule", "lock_rule", "unlock_rule", "tag_rule", "untag_rule", "rule_tags", "rule_of_arn",
           "retention_for",
           "check_resource_type", "MAX_RULES"]

RESOURCE_TYPES = ("EBS_SNAPSHOT", "EBS_VOLUME")
MAX_RULES = 250  # a tenant's rules, as AWS's quota of retention rules per region
UNLOCKED, LOCKED, PENDING_UNLOCK = "unlocked", "locked", "pending_unlock"
_ID_CHARS = string.ascii_letters + string.digits
_ID_RE = re.compile(r"[0-9a-zA-Z]{11}")
_ARN_RE = re.compile(r"arn:aws:rbin:([a-z0-9-]{1,63}):([A-Za-z0-9_.-]{1,64}):rule/([0-9a-zA-Z]{11})")
_DESCRIPTION_RE = re.compile(r"[\S ]{0,255}")
_TAG_SYMBOLS = set("_.:/=+-@ ")

Tags = list[tuple[str, str | None]]


@dataclass(frozen=True)
class RuleSpec:
    resource_type: str
    retention_days: int
    description: str = ""
    resource_tags: Tags | None = None
    exclude_tags: Tags | None = None
    unlock_delay_days: int | None = None
    tags: dict[str, str] | None = None


@dataclass(frozen=True)
class RuleChange:
    """An UpdateRule: None leaves a field as it is."""

    resource_type: str | None = None
    retention_days: int | None = None
    description: str | None = None
    resource_tags: Tags | None = None
    exclude_tags: Tags | None = None


def check_resource_type(value: str) -> str:
    if value == "EC2_IMAGE":
        raise RuleInvalid("VBS has no machine images (AMIs): its Recycle Bin keeps EBS_SNAPSHOT and EBS_VOLUME "
                          "resources only.")
    if value not in RESOURCE_TYPES:
        raise RuleInvalid(f"ResourceType must be EBS_SNAPSHOT or EBS_VOLUME, not {value[:32]!r}.")
    return value


def _check_description(value: str) -> str:
    if not _DESCRIPTION_RE.fullmatch(value):
        raise RuleInvalid("Description is at most 255 characters, with no line breaks or tabs.")
    return value


def _check_rule_tags(tags: dict[str, str]) -> dict[str, str]:
    """The rule's own tags as the model's TagKey/TagValue patterns allow (letters, digits, spaces, _.:/=+-@)."""
    for key, value in tags.items():
        if not 1 <= len(key) <= 128 or len(value) > 256:
            raise RuleInvalid("A tag key is 1-128 characters and its value at most 256.")
        if key.startswith("aws:"):
            raise RuleInvalid("Tag keys starting with 'aws:' are reserved.")
        if not all(c.isalnum() or c in _TAG_SYMBOLS for c in key + value):
            raise RuleInvalid(f"The tag {key[:128]!r} holds a character tags may not: letters, digits, spaces "
                              "and _.:/=+-@ only.")
    return tags


def _check_tags(resource_tags: Tags, exclude_tags: Tags) -> None:
    if resource_tags and exclude_tags:
        raise RuleInvalid("ExcludeResourceTags belong to region-level rules only (rules without ResourceTags).")


def _day_s(svc: Controller) -> int:
    return svc.cfg.recycle_bin_day_s


def lock_state(rule: RecycleBinRule, now: datetime) -> str:
    """A rule whose unlock delay has passed is unlocked, before anything records it."""
    if rule.lock_state == PENDING_UNLOCK and rule.lock_end_at is not None and rule.lock_end_at <= now:
        return UNLOCKED
    return rule.lock_state


def _out(svc: Controller, rule: RecycleBinRule, now: datetime) -> RuleOut:
    state = lock_state(rule, now)
    return RuleOut(rule_id=rule.id, rule_arn=f"arn:aws:rbin:{svc.cfg.region}:{owner_id(rule.tenant)}:rule/{rule.id}",
                   resource_type=rule.resource_type, retention_days=rule.retention_days,
                   description=rule.description,
                   resource_tags=[ResourceTag(key=k, value=v) for k, v in rule.resource_tags],
                   exclude_resource_tags=[ResourceTag(key=k, value=v) for k, v in rule.exclude_tags],
                   status="available", lock_state=state,
                   unlock_delay_days=rule.unlock_delay_days if state != UNLOCKED else None,
                   lock_end_time=rule.lock_end_at if state == PENDING_UNLOCK else None, tags=dict(rule.tags))


def _rule(s: Session, rule_id: str, tenant: str, *, lock: bool = True) -> RecycleBinRule:
    """The tenant's rule; ``lock``: its row is locked first (two changes of it take turns)."""
    if not _ID_RE.fullmatch(rule_id):
        raise RuleInvalid(f"The rule identifier {rule_id[:32]!r} is malformed: 11 letters and digits.")
    if lock:
        lock_rows(s, RecycleBinRule, rule_id)
    rule = s.get(RecycleBinRule, rule_id)
    if rule is None or rule.tenant != tenant:
        raise RuleNotFound(f"The rule '{rule_id}' does not exist.")
    return rule


def create_rule(svc: Controller, tenant: str, spec: RuleSpec) -> RuleOut:
    check_resource_type(spec.resource_type)
    resource_tags, exclude_tags = spec.resource_tags or [], spec.exclude_tags or []
    _check_tags(resource_tags, exclude_tags)
    if spec.unlock_delay_days is not None and resource_tags:
        raise RuleInvalid("Only region-level rules (without ResourceTags) can be locked.")
    now = utcnow()
    with svc.db.session() as s:
        count = s.scalar(select(func.count()).select_from(RecycleBinRule).where(RecycleBinRule.tenant == tenant))
        if (count or 0) >= MAX_RULES:
            raise RuleQuotaExceeded(f"A tenant has at most {MAX_RULES} retention rules.")
        rule = RecycleBinRule(
            id="".join(secrets.choice(_ID_CHARS) for _ in range(11)), tenant=tenant,
            resource_type=spec.resource_type, description=_check_description(spec.description),
            retention_days=spec.retention_days, resource_tags=[list(t) for t in resource_tags],
            exclude_tags=[list(t) for t in exclude_tags], tags=_check_rule_tags(dict(spec.tags or {})),
            lock_state=LOCKED if spec.unlock_delay_days is not None else UNLOCKED,
            unlock_delay_days=spec.unlock_delay_days, lock_end_at=None, created_at=now, updated_at=now)
        s.add(rule)
        s.flush()
        return _out(svc, rule, now)


def get_rule(svc: Controller, tenant: str, rule_id: str) -> RuleOut:
    with svc.db.read() as s:
        return _out(svc, _rule(s, rule_id, tenant, lock=False), utcnow())


def _has_all(rule_tags: list[Any], wanted: Tags) -> bool:
    have = {(k, v) for k, v in rule_tags}
    return all((k, v) in have for k, v in wanted)


def list_rules(svc: Controller, tenant: str, resource_type: str, *, resource_tags: Tags | None = None,
               exclude_tags: Tags | None = None, in_lock_state: str | None = None, max_results: int | None = None,
               next_token: str | None = None) -> tuple[list[RuleOut], str | None]:
    """The tenant's rules of ``resource_type`` (with all of ``resource_tags`` and ``exclude_tags``, in
    ``in_lock_state``), by identifier, a page at a time."""
    check_resource_type(resource_type)
    if next_token is not None and not _ID_RE.fullmatch(next_token):
        raise RuleInvalid("The NextToken is not one this service gave.", "INVALID_PAGE_TOKEN")
    if in_lock_state is not None and in_lock_state not in (UNLOCKED, LOCKED, PENDING_UNLOCK):
        raise RuleInvalid("LockState must be locked, pending_unlock or unlocked.")
    now = utcnow()
    q = select(RecycleBinRule).where(RecycleBinRule.tenant == tenant, RecycleBinRule.resource_type == resource_type)
    if next_token is not None:
        q = q.where(RecycleBinRule.id > next_token)
    with svc.db.read() as s:
        found = [_out(svc, r, now) for r in s.scalars(q.order_by(RecycleBinRule.id))
                 if _has_all(r.resource_tags, resource_tags or []) and _has_all(r.exclude_tags, exclude_tags or [])
                 and (in_lock_state is None or lock_state(r, now) == in_lock_state)]
    limit = max_results or MAX_RULES
    page = found[:limit]
    return page, page[-1].rule_id if len(found) > limit else None


def _refuse_if_locked(rule: RecycleBinRule, now: datetime, what: str) -> None:
    if lock_state(rule, now) != UNLOCKED:
        raise RuleConflict(f"The rule '{rule.id}' is {lock_state(rule, now)}: {what}")


def _change_rule(svc: Controller, tenant: str, rule_id: str,
                 change: Callable[[RecycleBinRule, datetime], None]) -> RuleOut:
    """Apply ``change(rule, now)`` to the tenant's rule (locked for the update), stamp it updated, and
    answer the rule as it is now."""
    now = utcnow()
    with svc.db.session() as s:
        rule = _rule(s, rule_id, tenant)
        change(rule, now)
        rule.updated_at = now
        s.flush()
        return _out(svc, rule, now)


def update_rule(svc: Controller, tenant: str, rule_id: str, change: RuleChange) -> RuleOut:
    def update(rule: RecycleBinRule, now: datetime) -> None:
        if change.resource_type is not None and check_resource_type(change.resource_type) != rule.resource_type:
            raise RuleInvalid("A rule's ResourceType cannot change after it is made.")
        resource_tags = change.resource_tags if change.resource_tags is not None else rule.resource_tags
        exclude_tags = change.exclude_tags if change.exclude_tags is not None else rule.exclude_tags
        _check_tags(resource_tags, exclude_tags)
        retention = change.retention_days if change.retention_days is not None else rule.retention_days
        if (retention != rule.retention_days or [list(t) for t in resource_tags] != rule.resource_tags
                or [list(t) for t in exclude_tags] != rule.exclude_tags):
            _refuse_if_locked(rule, now, "its retention period and tags cannot change until it is unlocked.")
        rule.retention_days = retention
        rule.resource_tags = [list(t) for t in resource_tags]
        rule.exclude_tags = [list(t) for t in exclude_tags]
        if change.description is not None:
            rule.description = _check_description(change.description)
    return _change_rule(svc, tenant, rule_id, update)


def delete_rule(svc: Controller, tenant: str, rule_id: str) -> None:
    """What the rule kept in the bin stays there until its own retention ends (as on AWS)."""
    now = utcnow()
    with svc.db.session() as s:
        rule = _rule(s, rule_id, tenant)
        _refuse_if_locked(rule, now, "it cannot be deleted until it is unlocked.")
        s.delete(rule)


def lock_rule(svc: Controller, tenant: str, rule_id: str, unlock_delay_days: int) -> RuleOut:
    def lock(rule: RecycleBinRule, now: datetime) -> None:
        if rule.resource_tags:
            raise RuleInvalid("Only region-level rules (without ResourceTags) can be locked.")
        if lock_state(rule, now) == LOCKED:
            raise RuleConflict(f"The rule '{rule.id}' is locked already.")
        rule.lock_state, rule.unlock_delay_days, rule.lock_end_at = LOCKED, unlock_delay_days, None
    return _change_rule(svc, tenant, rule_id, lock)


def unlock_rule(svc: Controller, tenant: str, rule_id: str) -> RuleOut:
    """A locked rule stays locked for its unlock delay (``pending_unlock``), then it is unlocked."""
    def unlock(rule: RecycleBinRule, now: datetime) -> None:
        if lock_state(rule, now) != LOCKED:
            raise RuleConflict(f"The rule '{rule.id}' is {lock_state(rule, now)}, not locked.")
        rule.lock_state = PENDING_UNLOCK
        rule.lock_end_at = now + timedelta(seconds=(rule.unlock_delay_days or 0) * _day_s(svc))
    return _change_rule(svc, tenant, rule_id, unlock)


def rule_of_arn(svc: Controller, tenant: str, arn: str) -> str:
    """The identifier of the tenant's rule ``arn`` names (TagResource and its kin name rules by ARN)."""
    m = _ARN_RE.fullmatch(arn)
    if m is None:
        raise RuleInvalid(f"{arn[:128]!r} is not a retention rule's ARN (arn:aws:rbin:REGION:ACCOUNT:rule/ID).")
    region, account, rule_id = m.groups()
    if region != svc.cfg.region or account != owner_id(tenant):
        raise RuleNotFound(f"The rule '{arn[:128]}' does not exist.")
    return rule_id


def tag_rule(svc: Controller, tenant: str, rule_id: str, tags: dict[str, str]) -> dict[str, str]:
    """Add or overwrite the rule's own tags; its tags now."""
    with svc.db.session() as s:
        rule = _rule(s, rule_id, tenant)
        merged = {**rule.tags, **_check_rule_tags(tags)}
        if len(merged) > 200:
            raise RuleQuotaExceeded("A rule has at most 200 tags.")
        rule.tags, rule.updated_at = merged, utcnow()
        return dict(merged)


def untag_rule(svc: Controller, tenant: str, rule_id: str, keys: list[str]) -> dict[str, str]:
    """Remove these keys from the rule's own tags; its tags now."""
    with svc.db.session() as s:
        rule = _rule(s, rule_id, tenant)
        rule.tags, rule.updated_at = {k: v for k, v in rule.tags.items() if k not in set(keys)}, utcnow()
        return dict(rule.tags)


def rule_tags(svc: Controller, tenant: str, rule_id: str) -> dict[str, str]:
    with svc.db.read() as s:
        return dict(_rule(s, rule_id, tenant, lock=False).tags)


def _matches(tags: list[Any], resource: dict[str, str]) -> bool:
    return any(k in resource and (v is None or resource[k] == v) for k, v in tags)


def retention_for(s: Session, tenant: str, resource_type: str, resource_tags: dict[str, str]) -> int | None:
    """The days a deleted resource of ``tenant`` with ``resource_tags`` is kept: the longest retention of the
    rules that match it, or None when none does."""
    days = [r.retention_days for r in s.scalars(select(RecycleBinRule).where(
        RecycleBinRule.tenant == tenant, RecycleBinRule.resource_type == resource_type))
        if (_matches(r.resource_tags, resource_tags) if r.resource_tags
            else not _matches(r.exclude_tags, resource_tags))]
    return max(days) if days else None
