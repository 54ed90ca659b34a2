"""The base of every wire model, and the id types requests carry."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from vbs import ids

__all__ = ["Wire", "Ack", "VolumeId", "SnapshotId", "left_out_while_empty"]


class Wire(BaseModel):
    """Every wire model: unknown fields are refused, values are immutable once made."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def left_out_while_empty(*fields: str) -> Any:
    """A serializer for a model's body (``_older_peers = left_out_while_empty("a", "b")``): these newer
    fields are left out while they are empty, so a peer older than them (which refuses unknown fields)
    still understands everything else."""

    @model_serializer(mode="wrap")
    def serialize(self: Wire, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in fields:
            if not data.get(key):
                data.pop(key, None)
        return data

    return serialize


class Ack(Wire):
    """The answer of a call that only needs to have been received (a heartbeat)."""

    status: Literal["ok"] = "ok"


VolumeId = Annotated[str, Field(max_length=32), AfterValidator(ids.must_be("volume"))]
SnapshotId = Annotated[str, Field(max_length=32), AfterValidator(ids.must_be("snapshot"))]
