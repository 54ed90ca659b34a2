"""The Recycle Bin's routes on the controller's endpoint, as botocore's ``rbin`` model (2021-06-15) has them:
rest-json, SigV4 scoped to ``rbin`` (a bearer key works too), AWS's error shape (vbs.controller.aws_json).
The rules themselves: vbs.controller.requests.recycle_bin_rules (docs/recycle-bin.md)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.auth.keys import Principal
from vbs.controller.aws_json import Service, parse_body, refusal
from vbs.controller.rbin.errors import RbinError, RuleInvalid, rbin_error_of
from vbs.controller.requests import recycle_bin_rules as rules
from vbs.controller.rest.schemas.recycle_bin import (
    MAX_EXCLUDE_TAGS,
    MAX_RESOURCE_TAGS,
    MAX_RETENTION_DAYS,
    MAX_RULE_TAGS,
    MAX_UNLOCK_DELAY_DAYS,
    MIN_UNLOCK_DELAY_DAYS,
    RuleOut,
)
from vbs.controller.runtime import Controller
from vbs.errors import VbsError

__all__ = ["install", "is_rbin_path", "rbin_refusal"]

MAX_BODY = 256 * 1024


def is_rbin_path(path: str) -> bool:
    return path in ("/rules", "/list-rules") or path.startswith(("/rules/", "/tags/"))


def rbin_refusal(exc: VbsError) -> Response:
    return refusal(rbin_error_of(exc))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Retention(_Strict):
    RetentionPeriodValue: int = Field(ge=1, le=MAX_RETENTION_DAYS, strict=True)
    RetentionPeriodUnit: Literal["DAYS"]


class _UnlockDelay(_Strict):
    UnlockDelayValue: int = Field(ge=MIN_UNLOCK_DELAY_DAYS, le=MAX_UNLOCK_DELAY_DAYS, strict=True)
    UnlockDelayUnit: Literal["DAYS"]


class _LockConfiguration(_Strict):
    UnlockDelay: _UnlockDelay


class _ResourceTag(_Strict):
    ResourceTagKey: str = Field(min_length=1, max_length=128)
    ResourceTagValue: str | None = Field(None, max_length=256)


class _Tag(_Strict):
    Key: str = Field(min_length=1, max_length=128)
    Value: str = Field(max_length=256)


class _Create(_Strict):
    RetentionPeriod: _Retention
    ResourceType: str = Field(max_length=32)
    Description: str = Field("", max_length=255)
    Tags: list[_Tag] = Field(default_factory=list, max_length=MAX_RULE_TAGS)
    ResourceTags: list[_ResourceTag] = Field(default_factory=list, max_length=MAX_RESOURCE_TAGS)
    ExcludeResourceTags: list[_ResourceTag] = Field(default_factory=list, max_length=MAX_EXCLUDE_TAGS)
    LockConfiguration: _LockConfiguration | None = None


class _Update(_Strict):
    RetentionPeriod: _Retention | None = None
    ResourceType: str | None = Field(None, max_length=32)
    Description: str | None = Field(None, max_length=255)
    ResourceTags: list[_ResourceTag] | None = Field(None, max_length=MAX_RESOURCE_TAGS)
    ExcludeResourceTags: list[_ResourceTag] | None = Field(None, max_length=MAX_EXCLUDE_TAGS)


class _List(_Strict):
    ResourceType: str = Field(max_length=32)
    MaxResults: int | None = Field(None, ge=1, le=1000, strict=True)
    NextToken: str | None = Field(None, max_length=2048)
    ResourceTags: list[_ResourceTag] = Field(default_factory=list, max_length=MAX_RESOURCE_TAGS)
    ExcludeResourceTags: list[_ResourceTag] = Field(default_factory=list, max_length=MAX_EXCLUDE_TAGS)
    LockState: str | None = Field(None, max_length=32)


class _Lock(_Strict):
    LockConfiguration: _LockConfiguration


class _TagResource(_Strict):
    Tags: list[_Tag] = Field(max_length=MAX_RULE_TAGS)


def _tags(found: list[_ResourceTag] | None) -> rules.Tags | None:
    return None if found is None else [(t.ResourceTagKey, t.ResourceTagValue) for t in found]


def _resource_tags(found: list[Any]) -> list[dict[str, str]]:
    return [{"ResourceTagKey": t.key, **({"ResourceTagValue": t.value} if t.value is not None else {})}
            for t in found]


def rule_answer(rule: RuleOut, *, summary: bool = False) -> dict[str, Any]:
    """A rule as the ``rbin`` service answers it (ListRules: its summary)."""
    out: dict[str, Any] = {
        "Identifier": rule.rule_id, "Description": rule.description, "LockState": rule.lock_state,
        "RetentionPeriod": {"RetentionPeriodValue": rule.retention_days, "RetentionPeriodUnit": "DAYS"},
        "RuleArn": rule.rule_arn}
    if summary:
        return out
    out |= {"ResourceType": rule.resource_type, "ResourceTags": _resource_tags(rule.resource_tags),
            "ExcludeResourceTags": _resource_tags(rule.exclude_resource_tags), "Status": rule.status}
    if rule.unlock_delay_days is not None:
        out["LockConfiguration"] = {"UnlockDelay": {"UnlockDelayValue": rule.unlock_delay_days,
                                                    "UnlockDelayUnit": "DAYS"}}
    if rule.lock_end_time is not None:
        out["LockEndTime"] = rule.lock_end_time.timestamp()
    return out


def _rule_id(request: Request, svc: Controller, who: Principal) -> str:
    return rules.rule_of_arn(svc, who.tenant, str(request.path_params["resourceArn"]))


def install(app: FastAPI, auth: Authenticator) -> None:
    route = Service(app, auth, "rbin", body_max=MAX_BODY, refuse=lambda exc: refusal(rbin_error_of(exc)),
                    too_large=lambda: RuleInvalid(f"The request body is larger than {MAX_BODY} bytes."),
                    internal=lambda: RbinError("An internal error has occurred.")).route

    @route("/rules", "POST", 201)
    def create(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        req = parse_body(_Create, body, RuleInvalid)
        lock = req.LockConfiguration
        rule = rules.create_rule(svc, who.tenant, rules.RuleSpec(
            resource_type=req.ResourceType, retention_days=req.RetentionPeriod.RetentionPeriodValue,
            description=req.Description, resource_tags=_tags(req.ResourceTags),
            exclude_tags=_tags(req.ExcludeResourceTags),
            unlock_delay_days=lock.UnlockDelay.UnlockDelayValue if lock is not None else None,
            tags={t.Key: t.Value for t in req.Tags}))
        return rule_answer(rule) | {"Tags": [{"Key": k, "Value": v} for k, v in sorted(rule.tags.items())]}

    @route("/rules/{identifier}", "GET", 200)
    def get(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        return rule_answer(rules.get_rule(svc, who.tenant, request.path_params["identifier"]))

    @route("/list-rules", "POST", 200)
    def list_rules(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        req = parse_body(_List, body, RuleInvalid)
        found, token = rules.list_rules(svc, who.tenant, req.ResourceType, resource_tags=_tags(req.ResourceTags),
                                        exclude_tags=_tags(req.ExcludeResourceTags), in_lock_state=req.LockState,
                                        max_results=req.MaxResults, next_token=req.NextToken)
        out: dict[str, Any] = {"Rules": [rule_answer(r, summary=True) for r in found]}
        if token is not None:
            out["NextToken"] = token
        return out

    @route("/rules/{identifier}", "PATCH", 200)
    def update(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        req = parse_body(_Update, body, RuleInvalid)
        return rule_answer(rules.update_rule(svc, who.tenant, request.path_params["identifier"], rules.RuleChange(
            resource_type=req.ResourceType, description=req.Description,
            retention_days=req.RetentionPeriod.RetentionPeriodValue if req.RetentionPeriod else None,
            resource_tags=_tags(req.ResourceTags), exclude_tags=_tags(req.ExcludeResourceTags))))

    @route("/rules/{identifier}", "DELETE", 204)
    def delete(request: Request, svc: Controller, who: Principal, body: bytes) -> Response:
        rules.delete_rule(svc, who.tenant, request.path_params["identifier"])
        return Response(status_code=204)

    @route("/rules/{identifier}/lock", "PATCH", 200)
    def lock(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        req = parse_body(_Lock, body, RuleInvalid)
        return rule_answer(rules.lock_rule(svc, who.tenant, request.path_params["identifier"],
                                           req.LockConfiguration.UnlockDelay.UnlockDelayValue))

    @route("/rules/{identifier}/unlock", "PATCH", 200)
    def unlock(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        return rule_answer(rules.unlock_rule(svc, who.tenant, request.path_params["identifier"]))

    @route("/tags/{resourceArn:path}", "POST", 201)
    def tag(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        req = parse_body(_TagResource, body, RuleInvalid)
        rules.tag_rule(svc, who.tenant, _rule_id(request, svc, who), {t.Key: t.Value for t in req.Tags})
        return {}

    @route("/tags/{resourceArn:path}", "DELETE", 204)
    def untag(request: Request, svc: Controller, who: Principal, body: bytes) -> Response:
        keys = request.query_params.getlist("tagKeys")
        if len(keys) > MAX_RULE_TAGS or not all(1 <= len(k) <= 128 for k in keys):
            raise RuleInvalid(f"At most {MAX_RULE_TAGS} tag keys, each 1-128 characters.")
        rules.untag_rule(svc, who.tenant, _rule_id(request, svc, who), keys)
        return Response(status_code=204)

    @route("/tags/{resourceArn:path}", "GET", 200)
    def list_tags(request: Request, svc: Controller, who: Principal, body: bytes) -> dict[str, Any]:
        found = rules.rule_tags(svc, who.tenant, _rule_id(request, svc, who))
        return {"Tags": [{"Key": k, "Value": v} for k, v in sorted(found.items())]}
