"""The tables of Data Lifecycle Manager (docs/lifecycle-policies.md): a tenant's snapshot policies and their
runs. A run row is the claim of one due time of one schedule: (policy, schedule, due time) is unique, so
whichever controller inserts it first takes that run, and no other does (docs/scale-out.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from vbs.controller.db.tables import Base


class LifecyclePolicy(Base):
    """A snapshot lifecycle policy: its validated document (AWS's PolicyDetails, stored as given once
    checked), its state (ENABLED, DISABLED) and its own tags."""

    __tablename__ = "lifecycle_policies"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    description: Mapped[str] = mapped_column(String(500))
    state: Mapped[str] = mapped_column(String(16))
    execution_role_arn: Mapped[str] = mapped_column(String(2048))
    details: Mapped[dict[str, Any]] = mapped_column(JSON)
    tags: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime]
    modified_at: Mapped[datetime]
    # Due times from this instant on are run (or recorded as skipped): set when the policy is made, enabled
    # again, or given a new document. A change of its description or tags leaves it.
    schedules_from: Mapped[datetime]


class PolicyRun(Base):
    """One due time of one schedule of a policy: taken (``running``) by the controller that inserted it, then
    ``succeeded``, ``failed`` (with its error) or ``skipped`` (a due time nobody ran in time, with why).
    ``targets`` maps each target (volume or instance id) to the snapshot ids made for it: a target is
    written in the transaction that begins its snapshots, so a run taken over does not snapshot it again."""

    __tablename__ = "policy_runs"
    __table_args__ = (Index("uq_policy_runs_due", "policy_id", "schedule_name", "due_at", unique=True),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    policy_id: Mapped[str] = mapped_column(String(32), ForeignKey("lifecycle_policies.id"), index=True)
    schedule_name: Mapped[str] = mapped_column(String(120))
    due_at: Mapped[datetime]
    status: Mapped[str] = mapped_column(String(16), index=True)
    controller: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    targets: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    deleted: Mapped[list[Any]] = mapped_column(JSON, default=list)
    error: Mapped[str | None] = mapped_column(Text)
