"""Request and answer bodies of lifecycle policies (``/v1/lifecycle-policies``; the ``dlm`` API answers the
same in AWS's shapes, vbs.controller.lifecycle.api)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from vbs.controller.lifecycle.document import DESCRIPTION_RE, ROLE_ARN_RE
from vbs.controller.rest.schemas.common import _Request

DEFAULT_ROLE = "arn:aws:iam::000000000000:role/AWSDataLifecycleManagerDefaultRole"


class PolicyRequest(_Request):
    """A new policy (every field), or a change of one (only the fields given)."""

    description: str | None = Field(None, pattern=f"^{DESCRIPTION_RE}$")
    state: Literal["ENABLED", "DISABLED"] | None = None
    execution_role_arn: str | None = Field(None, max_length=2048, pattern=f"^{ROLE_ARN_RE}$")
    # AWS's PolicyDetails document, checked by vbs.controller.lifecycle.document.
    policy_details: dict[str, Any] | None = None
    tags: dict[str, str] | None = Field(None, max_length=200)


class RunOut(BaseModel):
    run_id: str
    policy_id: str
    schedule_name: str
    due_at: datetime
    status: str  # running, succeeded, failed, skipped
    controller: str | None
    started_at: datetime | None
    finished_at: datetime | None
    snapshots: dict[str, list[str]]  # target (volume or instance id) -> the snapshots made for it
    retired: list[str]  # snapshots its retention deleted or archived
    error: str | None


class PolicyOut(BaseModel):
    policy_id: str
    policy_arn: str
    description: str
    state: str
    status_message: str
    execution_role_arn: str
    policy_details: dict[str, Any]
    tags: dict[str, str]
    created_at: datetime
    modified_at: datetime
    last_run: RunOut | None


class PolicyList(BaseModel):
    policies: list[PolicyOut]


class RunList(BaseModel):
    runs: list[RunOut]


class PolicyDeleted(BaseModel):
    policy_id: str
