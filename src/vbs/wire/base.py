"""The base of every wire model, and the id types requests carry."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from vbs import ids

__all__ = ["Wire", "Ack", "VolumeId", "SnapshotId"]


class Wire(BaseModel):
    """Every wire model: unknown fields are refused, values are immutable once made."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Ack(Wire):
    """The answer of a call that only needs to have been received (a heartbeat)."""

    status: Literal["ok"] = "ok"


VolumeId = Annotated[str, Field(max_length=32), AfterValidator(ids.must_be("volume"))]
SnapshotId = Annotated[str, Field(max_length=32), AfterValidator(ids.must_be("snapshot"))]
