"""Request and answer bodies of the Recycle Bin (``/v1/recycle-bin/…``, docs/recycle-bin.md): its retention
rules, and the snapshots and volumes in it."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from vbs.controller.rest.schemas.common import _Request

MAX_RETENTION_DAYS = 3650  # botocore's rbin model: RetentionPeriodValue 1-3650
MIN_UNLOCK_DELAY_DAYS, MAX_UNLOCK_DELAY_DAYS = 7, 30
MAX_RESOURCE_TAGS, MAX_EXCLUDE_TAGS, MAX_RULE_TAGS = 50, 5, 200

ResourceType = Literal["EBS_SNAPSHOT", "EBS_VOLUME", "EC2_IMAGE"]  # EC2_IMAGE is refused with a reason


class ResourceTag(BaseModel):
    """A tag a rule matches: ``value`` None matches the key with any value."""

    key: str = Field(min_length=1, max_length=128)
    value: str | None = Field(None, max_length=256)


class RuleRequest(_Request):
    resource_type: ResourceType
    retention_days: int = Field(ge=1, le=MAX_RETENTION_DAYS)
    description: str = Field("", max_length=255)
    resource_tags: list[ResourceTag] = Field(default_factory=list, max_length=MAX_RESOURCE_TAGS)
    exclude_resource_tags: list[ResourceTag] = Field(default_factory=list, max_length=MAX_EXCLUDE_TAGS)
    unlock_delay_days: int | None = Field(None, ge=MIN_UNLOCK_DELAY_DAYS, le=MAX_UNLOCK_DELAY_DAYS)
    tags: dict[str, str] = Field(default_factory=dict, max_length=MAX_RULE_TAGS)


class RuleUpdate(_Request):
    """What changes (None: as it is)."""

    resource_type: ResourceType | None = None
    retention_days: int | None = Field(None, ge=1, le=MAX_RETENTION_DAYS)
    description: str | None = Field(None, max_length=255)
    resource_tags: list[ResourceTag] | None = Field(None, max_length=MAX_RESOURCE_TAGS)
    exclude_resource_tags: list[ResourceTag] | None = Field(None, max_length=MAX_EXCLUDE_TAGS)


class RuleLock(_Request):
    unlock_delay_days: int = Field(ge=MIN_UNLOCK_DELAY_DAYS, le=MAX_UNLOCK_DELAY_DAYS)


class RuleTags(_Request):
    """A rule's own tags (given: to add or overwrite)."""

    tags: dict[str, str] = Field(max_length=MAX_RULE_TAGS)


class RuleOut(BaseModel):
    rule_id: str
    rule_arn: str
    resource_type: str
    retention_days: int
    description: str
    resource_tags: list[ResourceTag]
    exclude_resource_tags: list[ResourceTag]
    status: str  # available (a rule applies as soon as it is made)
    lock_state: str  # unlocked, locked, pending_unlock
    unlock_delay_days: int | None
    lock_end_time: datetime | None  # pending_unlock: when it is unlocked
    tags: dict[str, str]


class RuleList(BaseModel):
    rules: list[RuleOut]
    next_token: str | None = None


class BinSnapshotOut(BaseModel):
    snapshot_id: str
    volume_id: str
    description: str
    entered_at: datetime
    exits_at: datetime


class BinVolumeOut(BaseModel):
    volume_id: str
    volume_type: str
    size_gib: int
    iops: int | None
    throughput: int | None
    availability_zone: str
    snapshot_id: str | None
    created_at: datetime
    entered_at: datetime
    exits_at: datetime


class BinSnapshotList(BaseModel):
    snapshots: list[BinSnapshotOut]
    next_token: str | None = None


class BinVolumeList(BaseModel):
    volumes: list[BinVolumeOut]
    next_token: str | None = None


class Restored(BaseModel):
    resource_id: str
    status: str
