"""The Recycle Bin's tables (docs/recycle-bin.md): its retention rules, and the volumes and snapshots a
delete put in it. Portable SQL, as ``tables.py``; a volume's or snapshot's own state says that it is in
the bin (``recoverable``, db/states.py), its entry here until when it stays there."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from vbs.controller.db.tables import Base


class RecycleBinRule(Base):
    """A retention rule of a tenant: which deleted resources of a type (``EBS_SNAPSHOT``, ``EBS_VOLUME``)
    it keeps, for how many days, and its lock (``unlocked``, ``locked``, ``pending_unlock`` until
    ``lock_end_at``)."""

    __tablename__ = "recycle_bin_rules"
    __table_args__ = (Index("ix_recycle_bin_rules_tenant_type", "tenant", "resource_type"),)

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    resource_type: Mapped[str] = mapped_column(String(16))
    description: Mapped[str] = mapped_column(Text, default="")
    retention_days: Mapped[int] = mapped_column(Integer)
    # [[key, value or None], …]: resources with any of these tags (none: every resource, a region-level rule)
    resource_tags: Mapped[list[Any]]
    # [[key, value or None], …]: a region-level rule's exceptions
    exclude_tags: Mapped[list[Any]]
    # The rule's own tags (TagResource): {key: value}
    tags: Mapped[dict[str, Any]]
    lock_state: Mapped[str] = mapped_column(String(16))
    unlock_delay_days: Mapped[int | None] = mapped_column(Integer)
    lock_end_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class RecycleBinEntry(Base):
    """A volume or snapshot in the Recycle Bin: since when, until when, and the state a restore gives it
    back."""

    __tablename__ = "recycle_bin_entries"
    __table_args__ = (Index("ix_recycle_bin_entries_tenant_type", "tenant", "resource_type", "resource_id"),)

    resource_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    resource_type: Mapped[str] = mapped_column(String(16))
    tenant: Mapped[str] = mapped_column(String(64))
    former_status: Mapped[str] = mapped_column(String(16))
    entered_at: Mapped[datetime]
    exits_at: Mapped[datetime] = mapped_column(index=True)
