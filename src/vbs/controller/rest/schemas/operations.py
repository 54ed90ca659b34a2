"""The REST models of operations: an operation of a volume or snapshot, its steps, and a list of them."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class StepOut(BaseModel):
    name: str
    state: str
    error: str | None


class OperationOut(BaseModel):
    operation_id: str
    kind: str
    resource_id: str
    status: str
    error: str | None
    attempts: int
    created_at: datetime
    updated_at: datetime
    steps: list[StepOut]


class OperationList(BaseModel):
    operations: list[OperationOut]
