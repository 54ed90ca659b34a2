"""The one error hierarchy of VBS.

Every error carries the EBS/EC2 error code and the HTTP status the API edge answers with. Code below
the API raises these; the REST and agent edges map them to responses in exactly one place.
"""

from __future__ import annotations

__all__ = [
    "VbsError",
    "InvalidParameter",
    "MissingParameter",
    "NotFound",
    "IncorrectState",
    "VolumeInUse",
    "SnapshotInUse",
    "IdempotentParameterMismatch",
    "InsufficientCapacity",
    "DriverError",
    "AgentUnavailable",
    "AgentUnreachable",
    "AuthFailure",
]


class VbsError(Exception):
    """Root of every error VBS raises on purpose."""

    code = "InternalError"
    status = 500

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_body(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


class InvalidParameter(VbsError):
    code = "InvalidParameterValue"
    status = 400


class MissingParameter(VbsError):
    code = "MissingParameter"
    status = 400


class NotFound(VbsError):
    """An unknown resource; ``code`` names its kind (``InvalidVolume.NotFound``, …)."""

    code = "NotFound"
    status = 404


class IncorrectState(VbsError):
    code = "IncorrectState"
    status = 409


class VolumeInUse(VbsError):
    code = "VolumeInUse"
    status = 409


class SnapshotInUse(VbsError):
    code = "InvalidSnapshot.InUse"
    status = 409


class IdempotentParameterMismatch(VbsError):
    code = "IdempotentParameterMismatch"
    status = 409


class InsufficientCapacity(VbsError):
    code = "InsufficientVolumeCapacity"
    status = 503


class DriverError(VbsError):
    """A backend, export or hypervisor tool failed; the message says which and why."""

    code = "DriverError"
    status = 502


class AgentUnavailable(VbsError):
    """A storage or host agent could not be reached or did not answer in time."""

    code = "AgentUnavailable"
    status = 503


class AgentUnreachable(AgentUnavailable):
    """The request never reached the agent (connection refused): nothing can have happened there."""


class AuthFailure(VbsError):
    code = "AuthFailure"
    status = 401
