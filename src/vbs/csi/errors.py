"""VBS errors as the gRPC codes CSI expects (docs/kubernetes.md "Errors"): the sidecars retry on some codes
and give up on others, so the mapping is part of the contract."""

from __future__ import annotations

from vbs.errors import VbsError

__all__ = ["CsiError", "code_of", "from_vbs"]

# gRPC status codes by name (grpc.StatusCode's members): the mapping is tested without a server.
_BY_CODE: dict[str, str] = {
    "InvalidParameterValue": "INVALID_ARGUMENT",
    "InvalidParameterCombination": "INVALID_ARGUMENT",
    "MissingParameter": "INVALID_ARGUMENT",
    "InvalidVolume.NotFound": "NOT_FOUND",
    "InvalidSnapshot.NotFound": "NOT_FOUND",
    "InvalidInstanceID.NotFound": "NOT_FOUND",
    "IdempotentParameterMismatch": "ALREADY_EXISTS",
    "VolumeLimitExceeded": "RESOURCE_EXHAUSTED",
    "SnapshotLimitExceeded": "RESOURCE_EXHAUSTED",
    "VolumeSnapshotLimitExceeded": "RESOURCE_EXHAUSTED",
    "LimitExceeded": "RESOURCE_EXHAUSTED",
    "InsufficientVolumeCapacity": "RESOURCE_EXHAUSTED",
    "VolumeInUse": "FAILED_PRECONDITION",
    "InvalidSnapshot.InUse": "FAILED_PRECONDITION",
    "IncorrectInstanceState": "FAILED_PRECONDITION",
    # Another operation holds the volume (delete, attach, detach and modify exclude each other): the
    # sidecar's retry is the remedy, as CSI's ABORTED asks.
    "IncorrectState": "ABORTED",
    "AuthFailure": "UNAUTHENTICATED",
    "UnauthorizedOperation": "PERMISSION_DENIED",
    "AgentUnavailable": "UNAVAILABLE",
    "RetryLater": "UNAVAILABLE",
}
_BY_STATUS: dict[int, str] = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                              404: "NOT_FOUND", 409: "FAILED_PRECONDITION", 503: "UNAVAILABLE"}


class CsiError(Exception):
    """An answer of a CSI call that is an error: a gRPC status code (by name) and a message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def code_of(exc: VbsError) -> str:
    """The gRPC code of a VBS error: by its EBS code, else by its HTTP status, else INTERNAL."""
    if exc.code in _BY_CODE:
        return _BY_CODE[exc.code]
    if exc.code.endswith(".NotFound"):
        return "NOT_FOUND"
    return _BY_STATUS.get(exc.status, "INTERNAL")


def from_vbs(exc: VbsError) -> CsiError:
    return CsiError(code_of(exc), f"{exc.code}: {exc}")
