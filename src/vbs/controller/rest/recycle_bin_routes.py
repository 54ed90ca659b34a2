"""The ``/v1/recycle-bin`` routes (tag ``recycle-bin``): retention rules, and the snapshots and volumes in
the bin (vbs.controller.requests.recycle_bin_rules and .recycle_bin; docs/recycle-bin.md)."""

from __future__ import annotations

from fastapi import APIRouter, Query

from vbs.controller.requests import recycle_bin as bin_req
from vbs.controller.requests import recycle_bin_rules as rules
from vbs.controller.rest import queries
from vbs.controller.rest.queries import Caller, Services
from vbs.controller.rest.schemas.recycle_bin import (
    MAX_RULE_TAGS,
    BinSnapshotList,
    BinVolumeList,
    ResourceTag,
    Restored,
    RuleList,
    RuleLock,
    RuleOut,
    RuleRequest,
    RuleTags,
    RuleUpdate,
)
from vbs.errors import InvalidParameter


def _tags(found: list[ResourceTag] | None) -> rules.Tags | None:
    return None if found is None else [(t.key, t.value) for t in found]


def recycle_bin_routes(r: APIRouter) -> None:
    @r.post("/recycle-bin/rules", response_model=RuleOut, tags=["recycle-bin"])
    def create_rule(body: RuleRequest, svc: Services, who: Caller) -> RuleOut:
        """A retention rule: deleted snapshots or volumes it matches stay in the bin for its retention."""
        return rules.create_rule(svc, who.tenant, rules.RuleSpec(
            resource_type=body.resource_type, retention_days=body.retention_days, description=body.description,
            resource_tags=_tags(body.resource_tags), exclude_tags=_tags(body.exclude_resource_tags),
            unlock_delay_days=body.unlock_delay_days, tags=body.tags))

    @r.get("/recycle-bin/rules", response_model=RuleList, tags=["recycle-bin"])
    def list_rules(svc: Services, who: Caller, resource_type: str = Query(max_length=32),
                   lock_state: str | None = Query(None, max_length=32),
                   max_results: int | None = Query(None, ge=1, le=1000),
                   next_token: str | None = queries.next_token_query()) -> RuleList:
        found, token = rules.list_rules(svc, who.tenant, resource_type, in_lock_state=lock_state,
                                        max_results=max_results, next_token=next_token)
        return RuleList(rules=found, next_token=token)

    @r.get("/recycle-bin/rules/{rule_id}", response_model=RuleOut, tags=["recycle-bin"])
    def get_rule(rule_id: str, svc: Services, who: Caller) -> RuleOut:
        return rules.get_rule(svc, who.tenant, rule_id)

    @r.patch("/recycle-bin/rules/{rule_id}", response_model=RuleOut, tags=["recycle-bin"])
    def update_rule(rule_id: str, body: RuleUpdate, svc: Services, who: Caller) -> RuleOut:
        return rules.update_rule(svc, who.tenant, rule_id, rules.RuleChange(
            resource_type=body.resource_type, retention_days=body.retention_days, description=body.description,
            resource_tags=_tags(body.resource_tags), exclude_tags=_tags(body.exclude_resource_tags)))

    @r.delete("/recycle-bin/rules/{rule_id}", status_code=204, tags=["recycle-bin"])
    def delete_rule(rule_id: str, svc: Services, who: Caller) -> None:
        rules.delete_rule(svc, who.tenant, rule_id)

    @r.put("/recycle-bin/rules/{rule_id}/lock", response_model=RuleOut, tags=["recycle-bin"])
    def lock_rule(rule_id: str, body: RuleLock, svc: Services, who: Caller) -> RuleOut:
        """Lock a region-level rule: nobody deletes it or shortens its retention until it is unlocked."""
        return rules.lock_rule(svc, who.tenant, rule_id, body.unlock_delay_days)

    @r.delete("/recycle-bin/rules/{rule_id}/lock", response_model=RuleOut, tags=["recycle-bin"])
    def unlock_rule(rule_id: str, svc: Services, who: Caller) -> RuleOut:
        """Start the rule's unlock delay: it is unlocked when the delay ends."""
        return rules.unlock_rule(svc, who.tenant, rule_id)

    @r.post("/recycle-bin/rules/{rule_id}/tags", response_model=RuleTags, tags=["recycle-bin"])
    def tag_rule(rule_id: str, body: RuleTags, svc: Services, who: Caller) -> RuleTags:
        """Add or overwrite the rule's own tags (rbin's TagResource)."""
        return RuleTags(tags=rules.tag_rule(svc, who.tenant, rule_id, body.tags))

    @r.delete("/recycle-bin/rules/{rule_id}/tags", response_model=RuleTags, tags=["recycle-bin"])
    def untag_rule(rule_id: str, svc: Services, who: Caller,
                   key: list[str] = Query(default_factory=list, max_length=MAX_RULE_TAGS)) -> RuleTags:
        """Remove these keys from the rule's own tags (rbin's UntagResource)."""
        if not all(1 <= len(k) <= 128 for k in key):
            raise InvalidParameter("A tag key is 1-128 characters.")
        return RuleTags(tags=rules.untag_rule(svc, who.tenant, rule_id, key))

    @r.get("/recycle-bin/snapshots", response_model=BinSnapshotList, tags=["recycle-bin"])
    def list_snapshots(svc: Services, who: Caller, snapshot_id: list[str] = queries.ids_query(),
                       max_results: int | None = Query(None, ge=5, le=1000),
                       next_token: str | None = queries.next_token_query()) -> BinSnapshotList:
        found, token = bin_req.list_snapshots(svc, who.tenant, snapshot_id, max_results, next_token)
        return BinSnapshotList(snapshots=found, next_token=token)

    @r.post("/recycle-bin/snapshots/{snapshot_id}/restore", response_model=Restored, tags=["recycle-bin"])
    def restore_snapshot(snapshot_id: str, svc: Services, who: Caller) -> Restored:
        return Restored(resource_id=snapshot_id, status=bin_req.restore(svc, who.tenant, bin_req.SNAPSHOT,
                                                                         snapshot_id))

    @r.get("/recycle-bin/volumes", response_model=BinVolumeList, tags=["recycle-bin"])
    def list_volumes(svc: Services, who: Caller, volume_id: list[str] = queries.ids_query(),
                     max_results: int | None = Query(None, ge=5, le=1000),
                     next_token: str | None = queries.next_token_query()) -> BinVolumeList:
        found, token = bin_req.list_volumes(svc, who.tenant, volume_id, max_results, next_token)
        return BinVolumeList(volumes=found, next_token=token)

    @r.post("/recycle-bin/volumes/{volume_id}/restore", response_model=Restored, tags=["recycle-bin"])
    def restore_volume(volume_id: str, svc: Services, who: Caller) -> Restored:
        return Restored(resource_id=volume_id, status=bin_req.restore(svc, who.tenant, bin_req.VOLUME, volume_id))
