"""The ``/v1`` routes of lifecycle policies (tag ``lifecycle-policies``): create, list, show, change, delete, and
a policy's runs (vbs.controller.lifecycle.policies; docs/lifecycle-policies.md)."""

from __future__ import annotations

from fastapi import APIRouter, Query

from vbs.controller.lifecycle import policies
from vbs.controller.rest.queries import Caller, Services
from vbs.controller.rest.schemas.policies import (
    PolicyDeleted,
    PolicyList,
    PolicyOut,
    PolicyRequest,
    RunList,
)

TAG = "lifecycle-policies"


def policy_routes(r: APIRouter) -> None:
    @r.post("/lifecycle-policies", response_model=PolicyOut, tags=[TAG])
    def create_lifecycle_policy(body: PolicyRequest, svc: Services, who: Caller) -> PolicyOut:
        """A snapshot policy: its document is AWS's PolicyDetails (docs/lifecycle-policies.md)."""
        return policies.create_policy(svc, body, who.tenant)

    @r.get("/lifecycle-policies", response_model=PolicyList, tags=[TAG])
    def get_lifecycle_policies(svc: Services, who: Caller,
                               policy_id: list[str] = Query(default_factory=list, max_length=100),
                               state: str | None = Query(None, max_length=16)) -> PolicyList:
        return PolicyList(policies=policies.list_policies(svc, who.tenant, policy_ids=policy_id, state=state))

    @r.get("/lifecycle-policies/{policy_id}", response_model=PolicyOut, tags=[TAG])
    def get_lifecycle_policy(policy_id: str, svc: Services, who: Caller) -> PolicyOut:
        return policies.get_policy(svc, policy_id, who.tenant)

    @r.patch("/lifecycle-policies/{policy_id}", response_model=PolicyOut, tags=[TAG])
    def update_lifecycle_policy(policy_id: str, body: PolicyRequest, svc: Services, who: Caller) -> PolicyOut:
        return policies.update_policy(svc, policy_id, body, who.tenant)

    @r.delete("/lifecycle-policies/{policy_id}", response_model=PolicyDeleted, tags=[TAG])
    def delete_lifecycle_policy(policy_id: str, svc: Services, who: Caller) -> PolicyDeleted:
        return PolicyDeleted(policy_id=policies.delete_policy(svc, policy_id, who.tenant))

    @r.get("/lifecycle-policies/{policy_id}/runs", response_model=RunList, tags=[TAG])
    def describe_policy_runs(policy_id: str, svc: Services, who: Caller,
                             max_results: int = Query(policies.RUNS_SHOWN_MAX, ge=1,
                                                      le=policies.RUNS_SHOWN_MAX)) -> RunList:
        """The policy's newest runs, newest first: each one's controller, snapshots, retired snapshots, error."""
        return RunList(runs=policies.policy_runs(svc, policy_id, who.tenant, max_results))
