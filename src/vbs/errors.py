"""The one error hierarchy of VBS.

Every error carries the EBS/EC2 error code and the HTTP status the API edge answers with. Code below
the API raises these; the REST and agent edges map them to responses in exactly one place
(``vbs.net.web``). Errors keep their class across the wire: the body names the class and its fields,
and ``from_body`` on the caller's side makes the same exception again (``DeviceBusy`` raised in a
host agent arrives as ``DeviceBusy`` in the controller).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

__all__ = [
    "VbsError",
    "InvalidParameter",
    "MissingParameter",
    "NotFound",
    "IncorrectState",
    "VolumeInUse",
    "SnapshotInUse",
    "DeviceBusy",
    "PointInTimeUnavailable",
    "MirrorLost",
    "IdempotentParameterMismatch",
    "InsufficientCapacity",
    "DriverError",
    "RetryLater",
    "AgentUnavailable",
    "AgentUnreachable",
    "StaleFence",
    "LeaseLost",
    "AuthFailure",
    "UnauthorizedOperation",
    "LimitExceeded",
    "VolumeSnapshotLimitExceeded",
    "SnapshotStoreUnavailable",
    "SnapshotDataError",
    "ChunkMissing",
    "ChunkCorrupt",
    "from_body",
    "matching",
]

FieldValue = str | int | bool | None


class VbsError(Exception):
    """Root of every error VBS raises on purpose.

    ``fields`` are machine-readable details (the VM, the serial…) that travel with the error.
    """

    code = "InternalError"
    status = 500
    _by_name: ClassVar[dict[str, type[VbsError]]] = {}

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 **fields: FieldValue) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.fields: dict[str, FieldValue] = fields

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A driver's own error class registers itself the same way, so it survives the wire too.
        VbsError._by_name.setdefault(cls.__name__, cls)

    def to_body(self) -> dict[str, dict[str, Any]]:
        body: dict[str, Any] = {"code": self.code, "message": self.message, "type": type(self).__name__}
        if self.fields:
            body["fields"] = self.fields
        return {"error": body}


VbsError._by_name["VbsError"] = VbsError


def from_body(error: dict[str, Any], status: int) -> VbsError:
    """The exception an agent raised, made again from its answer's ``error`` object.

    An unknown type (a newer agent) becomes a ``VbsError`` that still has the code and status.
    """
    cls = VbsError._by_name.get(str(error.get("type", "")), VbsError)
    fields = error.get("fields") or {}
    exc = cls.__new__(cls)  # subclasses may take other constructor arguments: bypass them
    VbsError.__init__(exc, str(error.get("message", "")), code=str(error.get("code", cls.code)), status=status,
                      **{str(k): v for k, v in fields.items() if isinstance(v, str | int | bool) or v is None})
    return exc


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


class DeviceBusy(IncorrectState):
    """The guest did not release an unplugged disk in time (attachment state ``busy``)."""

    code = "DeviceBusy"


class PointInTimeUnavailable(IncorrectState):
    """The storage node cannot take a point-in-time copy of this volume now (a writer it does not
    control has it open); the hypervisor that writes to it may."""

    code = "PointInTimeUnavailable"


class MirrorLost(IncorrectState):
    """A disk was to be switched onto its mirror, but it has none and is not on the target: it never
    switched (the mirror was cancelled, the VM restarted), so its old storage is still its data."""

    code = "MirrorLost"


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


class SnapshotSourceLost(DriverError):
    """What a snapshot's upload reads is gone for good (the export daemon that held its point-in-time view
    died with it): the upload can never finish, and retrying it would only wait for nothing."""

    code = "DriverError.SnapshotSourceLost"


class RetryLater(VbsError):
    """Not now, and not a failure: something this depends on is still in progress."""

    code = "RetryLater"
    status = 503


class AgentUnavailable(VbsError):
    """A storage or host agent could not be reached or did not answer in time."""

    code = "AgentUnavailable"
    status = 503


class AgentUnreachable(AgentUnavailable):
    """The request never reached the agent (connection refused): nothing can have happened there."""


class StaleFence(IncorrectState):
    """An agent refused a call whose fencing token is lower than one it already saw for that resource:
    the caller's operation was taken over by another controller (docs/architecture.md §6)."""

    code = "StaleFence"


class LeaseLost(IncorrectState):
    """This controller no longer owns the operation (its lease expired and another controller adopted
    it): it must stop at once and write nothing more for it."""

    code = "LeaseLost"


class AuthFailure(VbsError):
    code = "AuthFailure"
    status = 401


class UnauthorizedOperation(VbsError):
    """The key is valid but its role may not do this (a ``user`` key on an admin route)."""

    code = "UnauthorizedOperation"
    status = 403


class LimitExceeded(VbsError):
    """A tenant's quota would be exceeded; ``code`` names it (``VolumeLimitExceeded``, ``SnapshotLimitExceeded``)."""

    code = "LimitExceeded"
    status = 400


class VolumeSnapshotLimitExceeded(LimitExceeded):
    """One volume has as many snapshots as its pool allows (RBD: 450 an image); none was made."""

    code = "VolumeSnapshotLimitExceeded"


class SnapshotStoreUnavailable(RetryLater):
    """The snapshot store (a directory, an S3 bucket) could not be reached or did not answer in time;
    nothing is known to be wrong with what it holds, and the same call may succeed later."""

    code = "SnapshotStoreUnavailable"


class SnapshotDataError(VbsError):
    """What the snapshot store holds for a snapshot is not what its manifest promises; the message and
    the fields name the snapshot and the chunk. Never retried: the data itself is wrong."""

    code = "SnapshotDataError"
    status = 500


class ChunkMissing(SnapshotDataError):
    """A chunk a manifest lists is not in the store."""

    code = "SnapshotDataError.ChunkMissing"


class ChunkCorrupt(SnapshotDataError):
    """A chunk is in the store but its bytes do not decode, or do not hash to its id."""

    code = "SnapshotDataError.ChunkCorrupt"


def matching(pattern: re.Pattern[str], value: str, what: str, *, shown: int = 64, hint: str = "") -> str:
    """``value`` if ``pattern`` matches all of it, else ``InvalidParameter`` naming ``what`` with at most
    ``shown`` characters of the value (and ``hint``, what was expected)."""
    if not pattern.fullmatch(value):
        raise InvalidParameter(f"invalid {what} {value[:shown]!r}" + (f": {hint}" if hint else ""))
    return value
