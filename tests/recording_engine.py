"""A workflow engine for tests of the API functions alone: it records each operation it is asked to
begin and runs none (placement, quotas and parameters are what those tests look at)."""

from __future__ import annotations

from typing import Any

from vbs import ids


class RecordingEngine:
    """``begun``: (kind, resource id, params) of every operation, in order."""

    def __init__(self) -> None:
        self.begun: list[tuple[str, str, Any]] = []

    def stamp(self, session: Any) -> None:  # the real engine reads the database's time and a fence here
        return None

    def begin(self, session: Any, workflow: Any, resource_id: str, params: Any, *, new_resource: bool = False,
              stamp: Any = None) -> str:
        self.begun.append((workflow.kind, resource_id, params))
        return ids.new_id("operation")

    def submit(self, op_id: str, *, resuming: bool = False) -> None:
        pass
