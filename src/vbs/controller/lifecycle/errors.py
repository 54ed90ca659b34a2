"""The ``dlm`` service's errors, as botocore's model names them: an exception shape (the
``x-amzn-ErrorType`` header), its HTTP status, and the body ``{"Message", "Code", ...}``."""

from __future__ import annotations

from typing import Any

from vbs.controller.aws_json import DENIED_CODES
from vbs.errors import VbsError

__all__ = ["DlmError", "InvalidRequest", "PolicyNotFound", "PolicyLimitExceeded", "dlm_error_of"]


class DlmError(VbsError):
    """An error answered in the ``dlm`` service's shape: ``code`` is the exception shape's name."""

    code = "InternalServerException"
    status = 500

    def extra(self) -> dict[str, Any]:
        """The shape's other members (RequiredParameters, ResourceIds, ...)."""
        return {}


class InvalidRequest(DlmError):
    code = "InvalidRequestException"
    status = 400


class PolicyNotFound(DlmError):
    code = "ResourceNotFoundException"
    status = 404

    def __init__(self, policy_id: str) -> None:
        super().__init__(f"The lifecycle policy '{policy_id[:64]}' does not exist.")
        self.policy_id = policy_id[:64]

    def extra(self) -> dict[str, Any]:
        return {"ResourceType": "LifecyclePolicy", "ResourceIds": [self.policy_id]}


class PolicyLimitExceeded(DlmError):
    code = "LimitExceededException"
    status = 429

    def extra(self) -> dict[str, Any]:
        return {"ResourceType": "LifecyclePolicy"}


def dlm_error_of(exc: VbsError) -> DlmError:
    """What a VBS error (authentication, a bad parameter) is as the ``dlm`` service answers it."""
    if isinstance(exc, DlmError):
        return exc
    if exc.status == 404:
        return DlmError(exc.message, code="ResourceNotFoundException", status=404)
    if 400 <= exc.status < 500:
        # AWS answers a refused signature with its own codes and 403; the others are the request's fault.
        if exc.code in DENIED_CODES:
            return DlmError(exc.message, code="AccessDeniedException", status=403)
        return InvalidRequest(exc.message)
    return DlmError(exc.message)
