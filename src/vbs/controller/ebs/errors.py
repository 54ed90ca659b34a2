"""The EBS direct APIs' errors, as botocore's model names them: an exception shape (the
``x-amzn-ErrorType`` header), its HTTP status, and for most a ``Reason`` from the shape's enum."""

from __future__ import annotations

from vbs.controller.aws_json import (
    DENIED_CODES,
    AccessDeniedException,
    AwsJsonError,
    ConflictException,
    ResourceNotFoundException,
    ValidationException,
)
from vbs.errors import VbsError

__all__ = ["EbsError", "Validation", "NotFoundError", "AccessDenied", "Conflict", "ConcurrentLimit", "Internal",
           "ebs_error_of"]


class EbsError(AwsJsonError):
    """An error answered in the ``ebs`` service's shape: ``code`` is the exception shape's name."""


class Validation(EbsError, ValidationException):
    pass


class NotFoundError(EbsError, ResourceNotFoundException):
    reason = "SNAPSHOT_NOT_FOUND"


class AccessDenied(EbsError, AccessDeniedException):
    reason = "UNAUTHORIZED_ACCOUNT"


class Conflict(EbsError, ConflictException):
    pass


class ConcurrentLimit(EbsError):
    code = "ConcurrentLimitExceededException"
    status = 400


class Internal(EbsError):
    code = "InternalServerException"
    status = 500


def ebs_error_of(exc: VbsError) -> EbsError:
    """What a VBS error (of the store, an agent, authentication) is as the ``ebs`` service answers it."""
    if isinstance(exc, EbsError):
        return exc
    if exc.code in DENIED_CODES:
        return AccessDenied(exc.message)
    if exc.status == 404:
        return NotFoundError(exc.message)
    if exc.status in (400, 409, 412, 422):
        return Validation(exc.message)
    return Internal(exc.message)
