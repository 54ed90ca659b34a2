"""The EBS direct APIs' errors, as botocore's model names them: an exception shape (the
``x-amzn-ErrorType`` header), its HTTP status, and for most a ``Reason`` from the shape's enum."""

from __future__ import annotations

from vbs.controller import aws_json
from vbs.errors import VbsError

__all__ = ["EbsError", "Validation", "NotFoundError", "AccessDenied", "Conflict", "ConcurrentLimit", "Internal",
           "ebs_error_of"]


class EbsError(aws_json.AwsJsonError):
    """An error answered in the ``ebs`` service's shape: ``code`` is the exception shape's name."""


class Validation(EbsError, aws_json.ValidationException):
    pass


class NotFoundError(EbsError, aws_json.ResourceNotFoundException):
    reason = "SNAPSHOT_NOT_FOUND"


class AccessDenied(EbsError, aws_json.AccessDeniedException):
    reason = "UNAUTHORIZED_ACCOUNT"


class Conflict(EbsError, aws_json.ConflictException):
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
    if exc.code in aws_json.DENIED_CODES:
        return AccessDenied(exc.message)
    if exc.status == 404:
        return NotFoundError(exc.message)
    if exc.status in (400, 409, 412, 422):
        return Validation(exc.message)
    return Internal(exc.message)
