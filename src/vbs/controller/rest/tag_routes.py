"""The ``/v1`` routes of tags (tag ``tags``): add tags to volumes and snapshots, or remove them."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from sqlalchemy.orm import Session

from vbs.controller.requests import tags
from vbs.controller.rest.queries import Caller, Services
from vbs.controller.rest.schemas.tags import CreateTagsRequest, DeleteTagsRequest
from vbs.controller.runtime import Controller


def tag_routes(r: APIRouter) -> None:
    @r.post("/tags", tags=["tags"])
    def create_tags(body: CreateTagsRequest, svc: Services, who: Caller) -> dict[str, bool]:
        return _in_session(svc, lambda s: tags.create_tags(s, body.resource_ids, body.tags, who.tenant))

    @r.post("/tags/delete", tags=["tags"])
    def delete_tags(body: DeleteTagsRequest, svc: Services, who: Caller) -> dict[str, bool]:
        return _in_session(svc, lambda s: tags.delete_tags(s, body.resource_ids, body.keys, who.tenant))


def _in_session(svc: Controller, change: Callable[[Session], None]) -> dict[str, bool]:
    """``change`` the tags in one transaction; the answer of a request with nothing to describe."""
    with svc.db.session() as s:
        change(s)
    return {"return": True}
