"""The Recycle Bin's errors, as botocore's ``rbin`` model (2021-06-15) names them: an exception shape (the
``x-amzn-ErrorType`` header), its HTTP status, and a ``Reason`` from the shape's enum. The REST API answers
them with the same code and status (docs/recycle-bin.md)."""

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

__all__ = ["RbinError", "RuleInvalid", "RuleNotFound", "RuleConflict", "RuleQuotaExceeded", "rbin_error_of"]


class RbinError(AwsJsonError):
    """An error of the ``rbin`` service."""


class RuleInvalid(RbinError, ValidationException):
    pass


class RuleNotFound(RbinError, ResourceNotFoundException):
    reason = "RULE_NOT_FOUND"


class RuleConflict(RbinError, ConflictException):
    reason = "INVALID_RULE_STATE"


class RuleQuotaExceeded(RbinError):
    code = "ServiceQuotaExceededException"
    status = 402
    reason = "SERVICE_QUOTA_EXCEEDED"


def rbin_error_of(exc: VbsError) -> AwsJsonError:
    """A VBS error (authentication, a bad request body) as the ``rbin`` service answers it."""
    if isinstance(exc, AwsJsonError):
        return exc
    if exc.code in DENIED_CODES:
        # rbin's model has no AccessDeniedException: AWS's common one, as every service answers it.
        return AccessDeniedException(exc.message)
    if exc.status == 404:
        return RuleNotFound(exc.message)
    if exc.status < 500:
        return RuleInvalid(exc.message)
    return RbinError(exc.message)
