"""Request and answer bodies of snapshot tiers (``/v1/snapshots/{id}/tier``, ``/v1/snapshot-tiers``)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from vbs.controller.rest.schemas.common import _Request

MAX_RESTORE_DAYS = 180


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
    owner: str  # the tenant that owns the snapshot
    storage_tier: str
    last_status: str | None
    last_started_at: datetime | None
    last_progress: int | None
    last_detail: str | None
    archived_at: datetime | None
    restore_expires_at: datetime | None


class TierList(BaseModel):
    tiers: list[TierOut]
