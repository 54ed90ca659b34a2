"""Request and answer bodies of snapshot tiers (``/v1/snapshots/{id}/tier``, ``/v1/snapshot-tiers``)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from vbs.controller.requests.snapshot_tiers import MAX_RESTORE_DAYS, TierInfo
from vbs.controller.rest.schemas.common import _Request


class TierRequest(_Request):
    tier: Literal["archive"]


class TierRestoreRequest(_Request):
    """Back to the standard tier for ``temporary_days``, or ``permanent`` (one of them)."""

    temporary_days: int | None = Field(None, ge=1, le=MAX_RESTORE_DAYS)
    permanent: bool = False


class TieringStarted(BaseModel):
    snapshot_id: str
    started_at: datetime
    restore_days: int | None = None


class TierOut(BaseModel):
    snapshot_id: str
    volume_id: str
    status: str
    storage_tier: str
    last_status: str | None
    last_started_at: datetime | None
    last_progress: int | None
    last_detail: str | None
    archived_at: datetime | None
    restore_expires_at: datetime | None

    @classmethod
    def of(cls, t: TierInfo) -> TierOut:
        return cls(snapshot_id=t.snapshot_id, volume_id=t.volume_id, status=t.status, storage_tier=t.tier,
                   last_status=t.last_status, last_started_at=t.last_started_at, last_progress=t.last_progress,
                   last_detail=t.last_detail, archived_at=t.archived_at, restore_expires_at=t.restore_expires_at)


class TierList(BaseModel):
    tiers: list[TierOut]
