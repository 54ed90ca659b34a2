"""The ``dlm`` API's routes on the controller's endpoint, as botocore's model (2018-01-12) has them: rest-json,
SigV4 scoped to ``dlm`` (a bearer key works too), AWS's error shape (the ``x-amzn-ErrorType`` header and
``{"Message", "Code", ...}``). The same requests as ``/v1/lifecycle-policies`` (vbs.controller.lifecycle.policies);
docs/lifecycle-policies.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.auth.keys import Principal
from vbs.controller.aws_json import Service, parse_body
from vbs.controller.lifecycle import policies
from vbs.controller.lifecycle.document import DESCRIPTION_RE, ROLE_ARN_RE
from vbs.controller.lifecycle.errors import DlmError, InvalidRequest, dlm_error_of
from vbs.controller.rest.schemas.policies import PolicyOut, PolicyRequest
from vbs.controller.runtime import Controller
from vbs.errors import VbsError

__all__ = ["install", "is_dlm_path", "dlm_refusal"]

BODY_MAX = 64 * 1024
_QUERY_MAX = 100  # values of one query parameter


def is_dlm_path(path: str) -> bool:
    return path == "/policies" or path.startswith(("/policies/", "/tags/arn:aws:dlm:"))


def dlm_refusal(exc: VbsError) -> Response:
    """An error as the ``dlm`` service answers it."""
    err = dlm_error_of(exc)
    body: dict[str, Any] = {"Message": err.message, "Code": err.code, **err.extra()}
    return JSONResponse(body, status_code=err.status, headers={"x-amzn-ErrorType": err.code})


class _Policy(BaseModel):
    """CreateLifecyclePolicy's and UpdateLifecyclePolicy's bodies (PolicyId travels in the path)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ExecutionRoleArn: str | None = Field(None, max_length=2048, pattern=f"^{ROLE_ARN_RE}$")
    Description: str | None = Field(None, pattern=f"^{DESCRIPTION_RE}$")
    State: Literal["ENABLED", "DISABLED"] | None = None
    PolicyDetails: dict[str, Any] | None = None
    Tags: dict[str, str] | None = Field(None, max_length=200)
    # Default policies (AWS's simplified form): refused by name below.
    DefaultPolicy: str | None = None
    CreateInterval: int | None = None
    RetainInterval: int | None = None
    CopyTags: bool | None = None
    ExtendDeletion: bool | None = None
    CrossRegionCopyTargets: list[Any] | None = None
    Exclusions: dict[str, Any] | None = None


class _Tags(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    Tags: dict[str, str] = Field(max_length=200)


def _request(body: bytes, *, creating: bool) -> PolicyRequest:
    p = parse_body(_Policy, body, InvalidRequest)
    if p.DefaultPolicy is not None:
        raise InvalidRequest("Default policies (DefaultPolicy) are not supported: give a custom policy with "
                             "PolicyDetails.")
    simplified = [n for n in ("CreateInterval", "RetainInterval", "CopyTags", "ExtendDeletion", "Exclusions")
                  if getattr(p, n) is not None]
    if simplified:
        raise InvalidRequest(f"{', '.join(simplified)} belong to default policies, which are not supported.")
    if p.CrossRegionCopyTargets is not None:
        raise InvalidRequest("CrossRegionCopyTargets is not supported: VBS has one region.")
    if creating:
        missing = [n for n in ("ExecutionRoleArn", "Description", "State") if getattr(p, n) is None]
        if missing:
            raise InvalidRequest(f"Missing required parameters: {', '.join(missing)}.")
    return PolicyRequest(description=p.Description, state=p.State, execution_role_arn=p.ExecutionRoleArn,
                         policy_details=p.PolicyDetails, tags=p.Tags if creating else None)


def _time(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def policy_shape(p: PolicyOut) -> dict[str, Any]:
    """A policy as GetLifecyclePolicy answers it (LifecyclePolicy)."""
    out: dict[str, Any] = {
        "PolicyId": p.policy_id, "Description": p.description, "State": p.state, "StatusMessage": p.status_message,
        "ExecutionRoleArn": p.execution_role_arn, "DateCreated": _time(p.created_at),
        "DateModified": _time(p.modified_at), "PolicyDetails": p.policy_details, "PolicyArn": p.policy_arn,
        "DefaultPolicy": False}
    if p.tags:
        out["Tags"] = p.tags
    return out


def _summary(p: PolicyOut) -> dict[str, Any]:
    out: dict[str, Any] = {"PolicyId": p.policy_id, "Description": p.description, "State": p.state,
                           "PolicyType": p.policy_details.get("PolicyType", "EBS_SNAPSHOT_MANAGEMENT"),
                           "DefaultPolicy": False}
    if p.tags:
        out["Tags"] = p.tags
    return out


def _list(request: Request, name: str) -> list[str]:
    values = request.query_params.getlist(name)
    if len(values) > _QUERY_MAX or any(len(v) > 512 for v in values):
        raise InvalidRequest(f"{name}: at most {_QUERY_MAX} values of at most 512 characters.")
    return values


def install(app: FastAPI, auth: Authenticator) -> None:
    route = Service(app, auth, "dlm", body_max=BODY_MAX, refuse=dlm_refusal,
                    too_large=lambda: InvalidRequest(f"The request body is larger than {BODY_MAX} bytes."),
                    internal=lambda: DlmError("An internal error has occurred.")).route

    @route("/policies", "POST")
    def create(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        return {"PolicyId": policies.create_policy(svc, _request(body, creating=True), who.tenant).policy_id}

    @route("/policies", "GET")
    def list_(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        if request.query_params.get("defaultPolicyType"):
            return {"Policies": []}  # VBS has no default policies
        found = policies.list_policies(svc, who.tenant, policy_ids=_list(request, "policyIds"),
                                       state=request.query_params.get("state"),
                                       resource_types=_list(request, "resourceTypes"),
                                       target_tags=_list(request, "targetTags"),
                                       tags_to_add=_list(request, "tagsToAdd"))
        return {"Policies": [_summary(p) for p in found]}

    @route("/policies/{policyId}", "GET")
    def get(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        return {"Policy": policy_shape(policies.get_policy(svc, request.path_params["policyId"], who.tenant))}

    @route("/policies/{policyId}", "PATCH")
    def update(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        policies.update_policy(svc, request.path_params["policyId"], _request(body, creating=False), who.tenant)
        return {}

    @route("/policies/{policyId}", "DELETE")
    def delete(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        policies.delete_policy(svc, request.path_params["policyId"], who.tenant)
        return {}

    @route("/tags/{resourceArn:path}", "GET")
    def list_tags(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        policy_id = policies.policy_of_arn(request.path_params["resourceArn"])
        return {"Tags": policies.get_policy(svc, policy_id, who.tenant).tags}

    @route("/tags/{resourceArn:path}", "POST")
    def tag(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        policy_id = policies.policy_of_arn(request.path_params["resourceArn"])
        policies.tag_policy(svc, policy_id, parse_body(_Tags, body, InvalidRequest).Tags, who.tenant)
        return {}

    @route("/tags/{resourceArn:path}", "DELETE")
    def untag(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        policy_id = policies.policy_of_arn(request.path_params["resourceArn"])
        policies.untag_policy(svc, policy_id, _list(request, "tagKeys"), who.tenant)
        return {}
