"""The Recycle Bin's errors, as botocore's ``rbin`` model (2021-06-15) names them: an exception shape (the
``x-amzn-ErrorType`` header), its HTTP status, and a ``Reason`` from the shape's enum. The REST API answers
them with the same code and status (docs/recycle-bin.md)."""

from __future__ import annotations

from vbs.controller import aws_json
from vbs.errors import VbsError

__all__ = ["RbinError", "RuleInvalid", "RuleNotFound", "RuleConflict", "RuleQuotaExceeded", "rbin_error_of"]


class RbinError(aws_json.AwsJsonError):
    """An error of the ``rbin`` service."""


class RuleInvalid(RbinError, aws_json.ValidationException):
    pass


class RuleNotFound(RbinError, aws_json.ResourceNotFoundException):
    reason = "RULE_NOT_FOUND"


class RuleConflict(RbinError, aws_json.ConflictException):
    reason = "INVALID_RULE_STATE"


class RuleQuotaExceeded(RbinError):
    code = "ServiceQuotaExceededException"
    status = 402
    reason = "SERVICE_QUOTA_EXCEEDED"


def rbin_error_of(exc: VbsError) -> aws_json.AwsJsonError:
    """A VBS error (authentication, a bad request body) as the ``rbin`` service answers it."""
    if isinstance(exc, aws_json.AwsJsonError):
        return exc
    if exc.code in aws_json.DENIED_CODES:
        # rbin's model has no AccessDeniedException: AWS's common one, as every service answers it.
        return aws_json.AccessDeniedException(exc.message)
    if exc.status == 404:
        return RuleNotFound(exc.message)
    if exc.status < 500:
        return RuleInvalid(exc.message)
    return RbinError(exc.message)
