"""EC2 actions on tags: create and delete the tags of volumes and snapshots, and describe them (the live
resources of the caller's tenant only), a page at a time."""

from __future__ import annotations

from typing import Any

from sqlalchemy import or_, select

from vbs import ids
from vbs.controller.auth.keys import Principal
from vbs.controller.db import Snapshot, Tag, Volume
from vbs.controller.db.states import GONE_SNAPSHOT, GONE_VOLUME
from vbs.controller.ec2.params import MAX_TOKEN, dry_run, validated
from vbs.controller.ec2.query import QueryParams
from vbs.controller.requests import tags
from vbs.controller.requests.filters import decode_token, encode_token
from vbs.controller.rest.schemas.tags import CreateTagsRequest
from vbs.controller.runtime import Controller
from vbs.errors import InvalidParameter, MissingParameter

# The largest page, as EC2 documents it; a describe without MaxResults answers one such page and a NextToken.
TAGS_PAGE = 1000


def _resource_ids(p: QueryParams) -> list[str]:
    rids = p.list("ResourceId")
    if not rids:
        raise MissingParameter("The request must contain the parameter ResourceId.")
    for rid in rids:
        if not (ids.is_valid("volume", rid) or ids.is_valid("snapshot", rid)):
            raise InvalidParameter(f"Invalid id: '{rid[:64]}'", code="InvalidID")
    return rids


def create_tags(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    rids = _resource_ids(p)
    new_tags = p.tags()
    if not new_tags:
        raise MissingParameter("The request must contain the parameter Tag.")
    req = validated(CreateTagsRequest, {"resource_ids": rids, "tags": new_tags})
    dry_run(p)
    with svc.db.session() as s:
        tags.create_tags(s, req.resource_ids, req.tags, who.tenant)
    return {"return": True}


def delete_tags(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    rids = _resource_ids(p)
    pairs = p.tag_keys()
    dry_run(p)
    with svc.db.session() as s:
        tags.delete_tag_pairs(s, rids, pairs, who.tenant)
    return {"return": True}


def describe_tags(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    filters = p.filters()
    max_results = min(p.int("MaxResults", min=5) or TAGS_PAGE, TAGS_PAGE)
    token = p.str("NextToken", max_len=MAX_TOKEN)
    dry_run(p)
    stmt = select(Tag)
    for name, values in filters.items():
        if name == "resource-id":
            stmt = stmt.where(Tag.resource_id.in_(values))
        elif name == "key":
            stmt = stmt.where(Tag.key.in_(values))
        elif name == "value":
            stmt = stmt.where(Tag.value.in_(values))
        elif name == "resource-type":
            prefixes = [{"volume": "vol-", "snapshot": "snap-"}.get(v, "\0") for v in values]
            stmt = stmt.where(or_(*(Tag.resource_id.startswith(x) for x in prefixes)))
        else:
            raise InvalidParameter(f"The filter '{name[:64]}' is invalid.")
    if token:
        last = decode_token(token)
        rid, _, key = last.partition("\x1f")
        stmt = stmt.where((Tag.resource_id > rid) | ((Tag.resource_id == rid) & (Tag.key > key)))
    stmt = stmt.order_by(Tag.resource_id, Tag.key)
    with svc.db.session() as s:
        # Tags of deleted resources are not shown.
        live_vols = select(Volume.id).where(Volume.tenant == who.tenant, Volume.status.not_in(GONE_VOLUME))
        live_snaps = select(Snapshot.id).where(Snapshot.tenant == who.tenant,
                                               Snapshot.status.not_in(GONE_SNAPSHOT))
        stmt = stmt.where(Tag.resource_id.in_(live_vols) | Tag.resource_id.in_(live_snaps))
        rows = list(s.scalars(stmt.limit(max_results + 1)))
    next_token = None
    if len(rows) > max_results:
        rows = rows[:max_results]
        next_token = encode_token(f"{rows[-1].resource_id}\x1f{rows[-1].key}")
    return {"tagSet": [{"resourceId": t.resource_id,
                        "resourceType": "volume" if t.resource_id.startswith("vol-") else "snapshot",
                        "key": t.key, "value": t.value} for t in rows], "nextToken": next_token}
