"""Request and answer bodies of snapshot locks (``/v1/snapshots/{id}/lock``, ``/v1/snapshot-locks``)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from vbs.controller.rest.schemas.common import _Request

MAX_DURATION_DAYS = 36500
MAX_COOL_OFF_HOURS = 72


class LockRequest(_Request):
    """Lock a snapshot against deletion for ``duration_days`` or until ``expires_at`` (one of them)."""

    mode: Literal["governance", "compliance"]
    duration_days: int | None = Field(None, ge=1, le=MAX_DURATION_DAYS)
    expires_at: datetime | None = None
    cool_off_hours: int | None = Field(None, ge=1, le=MAX_COOL_OFF_HOURS)

    model_config = {**_Request.model_config, "strict": False}  # an ISO date string is the JSON of a datetime


class LockOut(BaseModel):
    snapshot_id: str
    owner: str  # the tenant that owns the snapshot
    lock_state: str  # compliance-cooloff, governance, compliance or expired
    mode: str
    created_at: datetime
    duration_start: datetime
    expires_at: datetime
    duration_days: int | None
    cool_off_hours: int | None
    cool_off_expires_at: datetime | None


class LockList(BaseModel):
    locks: list[LockOut]


class Unlocked(BaseModel):
    snapshot_id: str
