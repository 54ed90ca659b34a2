"""CreateLifecyclePolicy, GetLifecyclePolicies, GetLifecyclePolicy, UpdateLifecyclePolicy,
DeleteLifecyclePolicy and a policy's tags, as the ``dlm`` API, the REST routes and the CLI offer them
(docs/lifecycle-policies.md). A policy is its tenant's alone: another tenant's is ResourceNotFoundException,
as one that does not exist. Its runs are the scheduler's (vbs.controller.lifecycle.runs).
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import LifecyclePolicy, PolicyRun
from vbs.controller.db.tables import utcnow
from vbs.controller.lifecycle import document
from vbs.controller.lifecycle.errors import InvalidRequest, PolicyLimitExceeded, PolicyNotFound
from vbs.controller.requests.snapshot_permissions import owner_id
from vbs.controller.rest.schemas.common import check_tags
from vbs.controller.rest.schemas.policies import DEFAULT_ROLE, PolicyOut, PolicyRequest, RunOut
from vbs.controller.runtime import Controller

__all__ = ["create_policy", "get_policy", "list_policies", "update_policy", "delete_policy", "policy_runs",
           "tag_policy", "untag_policy", "policy_of_arn", "run_out"]

_ARN_RE = re.compile(r"arn:aws(-[a-z]{1,3}){0,2}:dlm:[A-Za-z0-9_/.-]{0,63}:[A-Za-z0-9_.-]{1,64}:policy/"
                     r"(policy-[0-9a-f]{17})")
RUNS_SHOWN_MAX = 100
STATUS_MESSAGE_MAX = 500  # AWS's StatusMessage


def _tags(tags: dict[str, str]) -> dict[str, str]:
    try:
        return check_tags(tags)
    except ValueError as exc:
        raise InvalidRequest(f"Invalid tags: {exc}.") from None


def _owned(s: Session, policy_id: str, tenant: str, *, lock: bool = False) -> LifecyclePolicy:
    if not ids.is_valid("lifecycle-policy", policy_id):
        raise PolicyNotFound(policy_id)
    row = s.get(LifecyclePolicy, policy_id, with_for_update=lock)
    if row is None or row.tenant != tenant:
        raise PolicyNotFound(policy_id)
    return row


def run_out(run: PolicyRun) -> RunOut:
    return RunOut(run_id=run.id, policy_id=run.policy_id, schedule_name=run.schedule_name, due_at=run.due_at,
                  status=run.status, controller=run.controller, started_at=run.started_at,
                  finished_at=run.finished_at, snapshots={k: list(v) for k, v in (run.targets or {}).items()},
                  retired=list(run.deleted or []), error=run.error)


def _status_message(state: str, last: PolicyRun | None) -> str:
    if last is None:
        return f"{state}: no run yet."
    what = f"last run {last.schedule_name!r} due {last.due_at:%Y-%m-%dT%H:%M:%SZ}: {last.status}"
    return (f"{state}: {what}" + (f": {last.error}" if last.error else "."))[:STATUS_MESSAGE_MAX]


def _last_runs(s: Session, policy_ids: list[str]) -> dict[str, PolicyRun]:
    """Each policy's newest run that started (or was skipped)."""
    if not policy_ids:
        return {}
    newest = (select(PolicyRun.policy_id, func.max(PolicyRun.due_at).label("due"))
              .where(PolicyRun.policy_id.in_(policy_ids)).group_by(PolicyRun.policy_id).subquery())
    rows = s.scalars(select(PolicyRun).join(newest, (PolicyRun.policy_id == newest.c.policy_id)
                                            & (PolicyRun.due_at == newest.c.due)))
    return {r.policy_id: r for r in rows}


def _out(svc: Controller, row: LifecyclePolicy, last: PolicyRun | None) -> PolicyOut:
    arn = f"arn:aws:dlm:{svc.cfg.region}:{owner_id(row.tenant)}:policy/{row.id}"
    return PolicyOut(policy_id=row.id, policy_arn=arn,
                     description=row.description, state=row.state, status_message=_status_message(row.state, last),
                     execution_role_arn=row.execution_role_arn, policy_details=row.details, tags=dict(row.tags or {}),
                     created_at=row.created_at, modified_at=row.modified_at,
                     last_run=run_out(last) if last is not None else None)


def create_policy(svc: Controller, req: PolicyRequest, tenant: str) -> PolicyOut:
    if req.description is None:
        raise InvalidRequest("Description is required.")
    if req.state is None:
        raise InvalidRequest("State is required: ENABLED or DISABLED.")
    details = document.stored(document.parse(req.policy_details))
    tags = _tags(req.tags or {})
    now = utcnow()
    with svc.db.session() as s:
        held = s.scalar(select(func.count()).select_from(LifecyclePolicy).where(LifecyclePolicy.tenant == tenant))
        if int(held or 0) >= svc.cfg.lifecycle_policies_max:
            raise PolicyLimitExceeded(f"You have {held} lifecycle policies, the most allowed "
                                      f"({svc.cfg.lifecycle_policies_max}); delete one first.")
        row = LifecyclePolicy(id=ids.new_id("lifecycle-policy"), tenant=tenant, description=req.description,
                              state=req.state, execution_role_arn=req.execution_role_arn or DEFAULT_ROLE,
                              details=details, tags=tags, created_at=now, modified_at=now, schedules_from=now)
        s.add(row)
        s.flush()
        return _out(svc, row, None)


def get_policy(svc: Controller, policy_id: str, tenant: str) -> PolicyOut:
    with svc.db.read() as s:
        row = _owned(s, policy_id, tenant)
        return _out(svc, row, _last_runs(s, [row.id]).get(row.id))


def list_policies(svc: Controller, tenant: str, *, policy_ids: list[str] | None = None, state: str | None = None,
                  resource_types: list[str] | None = None, target_tags: list[str] | None = None,
                  tags_to_add: list[str] | None = None) -> list[PolicyOut]:
    """The tenant's policies, filtered as GetLifecyclePolicies filters them (tags as ``key=value``)."""
    if state is not None and state not in ("ENABLED", "DISABLED", "ERROR"):
        raise InvalidRequest(f"state {state[:20]!r} is invalid; expected ENABLED, DISABLED or ERROR.")
    with svc.db.read() as s:
        q = select(LifecyclePolicy).where(LifecyclePolicy.tenant == tenant)
        if policy_ids:
            q = q.where(LifecyclePolicy.id.in_(policy_ids))
        if state is not None:
            q = q.where(LifecyclePolicy.state == state)
        rows = [r for r in s.scalars(q.order_by(LifecyclePolicy.id)) if _matches(r.details, resource_types,
                                                                                 target_tags, tags_to_add)]
        last = _last_runs(s, [r.id for r in rows])
        return [_out(svc, r, last.get(r.id)) for r in rows]


def _pairs(tags: list[dict[str, Any]]) -> set[str]:
    return {f"{t['Key']}={t['Value']}" for t in tags}


def _matches(details: dict[str, Any], resource_types: list[str] | None, target_tags: list[str] | None,
             tags_to_add: list[str] | None) -> bool:
    if resource_types and not set(resource_types) & set(details.get("ResourceTypes", [])):
        return False
    if target_tags and not set(target_tags) & _pairs(details.get("TargetTags", [])):
        return False
    added = set().union(*(_pairs(s.get("TagsToAdd", [])) for s in details.get("Schedules", [])))
    return not tags_to_add or bool(set(tags_to_add) & added)


def update_policy(svc: Controller, policy_id: str, req: PolicyRequest, tenant: str) -> PolicyOut:
    """Change what is given. A new document, or enabling a disabled policy, starts the schedules afresh from
    now: due times before it are neither run nor counted as skipped; the runs already made and their
    snapshots stay. A new description or role changes no schedule."""
    details = document.stored(document.parse(req.policy_details)) if req.policy_details is not None else None
    if req.tags is not None:
        raise InvalidRequest("Tags are changed with TagResource and UntagResource.")
    with svc.db.session() as s:
        row = _owned(s, policy_id, tenant, lock=True)
        if req.description is not None:
            row.description = req.description
        if req.execution_role_arn is not None:
            row.execution_role_arn = req.execution_role_arn
        now = utcnow()
        if req.state is not None:
            if req.state == "ENABLED" and row.state != "ENABLED":
                row.schedules_from = now
            row.state = req.state
        if details is not None:
            row.details, row.schedules_from = details, now
        row.modified_at = now
        s.flush()
        return _out(svc, row, _last_runs(s, [row.id]).get(row.id))


def delete_policy(svc: Controller, policy_id: str, tenant: str) -> str:
    """Forget the policy and its runs; the snapshots it made stay (AWS keeps them too)."""
    with svc.db.session() as s:
        row = _owned(s, policy_id, tenant, lock=True)
        s.execute(delete(PolicyRun).where(PolicyRun.policy_id == row.id))
        s.delete(row)
    return policy_id


def policy_runs(svc: Controller, policy_id: str, tenant: str, limit: int = RUNS_SHOWN_MAX) -> list[RunOut]:
    """The policy's newest runs, newest first."""
    with svc.db.read() as s:
        row = _owned(s, policy_id, tenant)
        runs = s.scalars(select(PolicyRun).where(PolicyRun.policy_id == row.id)
                         .order_by(PolicyRun.due_at.desc(), PolicyRun.schedule_name).limit(limit))
        return [run_out(r) for r in runs]


def policy_of_arn(arn: str) -> str:
    m = _ARN_RE.fullmatch(arn)
    if m is None:
        raise InvalidRequest(f"{arn[:100]!r} is not the ARN of a lifecycle policy.")
    return m.group(2)


def tag_policy(svc: Controller, policy_id: str, tags: dict[str, str], tenant: str) -> None:
    if not tags:
        raise InvalidRequest("Tags must name at least one tag.")
    with svc.db.session() as s:
        row = _owned(s, policy_id, tenant, lock=True)
        row.tags = _tags({**(row.tags or {}), **_tags(tags)})


def untag_policy(svc: Controller, policy_id: str, keys: list[str], tenant: str) -> None:
    if not keys:
        raise InvalidRequest("TagKeys must name at least one key.")
    with svc.db.session() as s:
        row = _owned(s, policy_id, tenant, lock=True)
        row.tags = {k: v for k, v in (row.tags or {}).items() if k not in set(keys)}
