"""Request and answer bodies of snapshot locks (``/v1/snapshots/{id}/lock``, ``/v1/snapshot-locks``)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from vbs.controller.requests.snapshot_locks import MAX_COOL_OFF_HOURS, MAX_DURATION_DAYS, LockInfo
from vbs.controller.rest.schemas.common import _Request


class LockRequest(_Request):
    """Lock a snapshot against deletion for ``duration_days`` or until ``expires_at`` (one of them)."""

    mode: Literal["governance", "compliance"]
    duration_days: int | None = Field(None, ge=1, le=MAX_DURATION_DAYS)
    expires_at: datetime | None = None
    cool_off_hours: int | None = Field(None, ge=1, le=MAX_COOL_OFF_HOURS)

    model_config = {**_Request.model_config, "strict": False}  # an ISO date string is the JSON of a datetime


class LockOut(BaseModel):
    snapshot_id: str
    lock_state: str
    mode: str
    created_at: datetime
    duration_start: datetime
    expires_at: datetime
    duration_days: int | None
    cool_off_hours: int | None
    cool_off_expires_at: datetime | None

    @classmethod
    def of(cls, info: LockInfo) -> LockOut:
        return cls(snapshot_id=info.snapshot_id, lock_state=info.state, mode=info.mode, created_at=info.created_at,
                   duration_start=info.duration_start, expires_at=info.expires_at, duration_days=info.duration_days,
                   cool_off_hours=info.cool_off_hours, cool_off_expires_at=info.cool_off_expires_at)


class LockList(BaseModel):
    locks: list[LockOut]


class Unlocked(BaseModel):
    snapshot_id: str
