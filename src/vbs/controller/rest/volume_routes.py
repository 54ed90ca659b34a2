"""The ``/v1`` routes of volumes (tag ``volumes``): create, describe, delete, attach and detach, the
placement advice, and modifications of a volume's size or type."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from vbs.controller.placement import advice
from vbs.controller.requests import attach_volume as attach_volume_req
from vbs.controller.requests import create_volume as create_volume_req
from vbs.controller.requests import delete_volume as delete_volume_req
from vbs.controller.requests import describe_volumes as describe_volumes_req
from vbs.controller.requests import detach_volume as detach_volume_req
from vbs.controller.requests import modify_volume as modify_volume_req
from vbs.controller.requests.filters import parse_filters
from vbs.controller.rest import queries
from vbs.controller.rest.completion import VOLUME_BUSY
from vbs.controller.rest.queries import Caller, Services
from vbs.controller.rest.schemas.advice import AdviceOut
from vbs.controller.rest.schemas.volumes import (
    AttachmentOut,
    AttachVolumeRequest,
    CreateVolumeRequest,
    DetachVolumeRequest,
    ModificationList,
    ModificationOut,
    ModifyVolumeRequest,
    VolumeList,
    VolumeOut,
)


def volume_routes(r: APIRouter) -> None:
    @r.post("/volumes", response_model=VolumeOut, tags=["volumes"])
    def create_volume(body: CreateVolumeRequest, svc: Services, who: Caller) -> Response:
        return Response(create_volume_req.create_volume_json(svc, body, who.tenant), media_type="application/json")

    @r.get("/volumes", response_model=VolumeList, tags=["volumes"])
    def describe_volumes(svc: Services, who: Caller, volume_id: list[str] = queries.ids_query(),
                         filter: list[str] = queries.filters_query(),
                         max_results: int | None = queries.max_results_query(),
                         next_token: str | None = queries.next_token_query()) -> Response:
        # Encoded from plain dicts (describe_volumes_req.VolumePage): no model per volume, no second validation.
        page = describe_volumes_req.volume_page(svc, who.tenant, volume_id, parse_filters(filter), max_results,
                                                next_token, deleted_by_id=True)
        return Response(page.json(), media_type="application/json")

    @r.get("/volumes/{volume_id}", response_model=VolumeOut, tags=["volumes"])
    async def get_volume(volume_id: str, svc: Services, who: Caller, wait: int = queries.wait_query()) -> VolumeOut:
        """With ``wait``: answers once the volume is no longer creating or deleting (the CLI's --wait)."""
        return await queries.settled_read(svc, volume_id,
                                          lambda: describe_volumes_req.get_volume(svc, volume_id, who.tenant),
                                          VOLUME_BUSY, wait)

    @r.delete("/volumes/{volume_id}", response_model=VolumeOut, tags=["volumes"])
    def delete_volume(volume_id: str, svc: Services, who: Caller) -> VolumeOut:
        return delete_volume_req.delete_volume(svc, volume_id, who.tenant)

    @r.post("/volumes/{volume_id}/attach", response_model=AttachmentOut, tags=["volumes"])
    def attach_volume(volume_id: str, body: AttachVolumeRequest, svc: Services, who: Caller) -> AttachmentOut:
        return attach_volume_req.attach_volume(svc, volume_id, body, who.tenant)

    @r.post("/volumes/{volume_id}/detach", response_model=AttachmentOut, tags=["volumes"])
    def detach_volume(volume_id: str, body: DetachVolumeRequest, svc: Services, who: Caller) -> AttachmentOut:
        return detach_volume_req.detach_volume(svc, volume_id, body, who.tenant)

    @r.get("/volumes/{volume_id}/advice", response_model=AdviceOut, tags=["volumes"])
    def volume_advice(volume_id: str, svc: Services, who: Caller, instance: str = Query(max_length=64),
                      io_gib: float | None = Query(None, gt=0, le=1 << 20),
                      random_ios: int = Query(0, ge=0, le=1 << 40),
                      memory_mib: int = Query(1024, ge=1, le=1 << 24)) -> AdviceOut:
        """Remote access vs moving the VM or the volume, costed from the hosts' RTT probes."""
        return advice.advise(svc, volume_id, instance, who.tenant,
                             advice.Workload(io_gib=io_gib, random_ios=random_ios, memory_mib=memory_mib))

    @r.post("/volumes/{volume_id}/modify", response_model=ModificationOut, tags=["volumes"])
    def modify_volume(volume_id: str, body: ModifyVolumeRequest, svc: Services, who: Caller) -> ModificationOut:
        return modify_volume_req.modify_volume(svc, volume_id, body, who.tenant)

    @r.get("/volume-modifications", response_model=ModificationList, tags=["volumes"])
    def describe_modifications(svc: Services, who: Caller, volume_id: list[str] = queries.ids_query(),
                               filter: list[str] = queries.filters_query(),
                               max_results: int | None = queries.max_results_query(),
                               next_token: str | None = queries.next_token_query()) -> ModificationList:
        return modify_volume_req.describe_modifications(svc, who.tenant, volume_id, parse_filters(filter), max_results,
                                                    next_token)
