"""The ``/v1`` routes of tags (tag ``tags``): add tags to volumes and snapshots, or remove them."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from vbs.controller.auth.keys import Principal
from vbs.controller.requests import tags
from vbs.controller.rest.queries import caller, services
from vbs.controller.rest.schemas import CreateTagsRequest, DeleteTagsRequest
from vbs.controller.runtime import Controller


def tag_routes(r: APIRouter) -> None:
    @r.post("/tags", tags=["tags"])
    def create_tags(body: CreateTagsRequest, svc: Controller = Depends(services),
                    who: Principal = Depends(caller)) -> dict[str, bool]:
        with svc.db.session() as s:
            tags.create_tags(s, body.resource_ids, body.tags, who.tenant)
        return {"return": True}

    @r.post("/tags/delete", tags=["tags"])
    def delete_tags(body: DeleteTagsRequest, svc: Controller = Depends(services),
                    who: Principal = Depends(caller)) -> dict[str, bool]:
        with svc.db.session() as s:
            tags.delete_tags(s, body.resource_ids, body.keys, who.tenant)
        return {"return": True}
