"""EC2 actions on volumes: create, delete, describe (and their status and attributes), attach, detach,
modify, and describe the modifications; each answers the 2016-11-15 shapes of a volume."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from vbs import ids
from vbs.controller.auth.keys import Principal
from vbs.controller.db.states import VolumeState
from vbs.controller.ec2.params import (
    MAX_TOKEN,
    act_unless_dry_run,
    describe_page,
    dry_run,
    matches,
    snapshot_id_of,
    tag_set,
    tags_for,
    validated,
    volume_id_of,
)
from vbs.controller.ec2.query import QueryParams
from vbs.controller.requests import attach_volume as attach_volume_req
from vbs.controller.requests import create_volume as create_volume_req
from vbs.controller.requests import delete_volume as delete_volume_req
from vbs.controller.requests import describe_volumes as describe_volumes_req
from vbs.controller.requests import detach_volume as detach_volume_req
from vbs.controller.requests import modify_volume as modify_volume_req
from vbs.controller.resolvers import is_cloud_ref
from vbs.controller.rest.schemas.volumes import (
    AttachmentOut,
    AttachVolumeRequest,
    CreateVolumeRequest,
    DetachVolumeRequest,
    ModificationOut,
    ModifyVolumeRequest,
    VolumeOut,
)
from vbs.controller.runtime import Controller
from vbs.errors import InvalidParameter, MissingParameter
from vbs.wire.storage import ZONE_NAME_RE

# Largest pages, as EC2 documents them; a describe without MaxResults answers one such page and a NextToken.
VOLUMES_PAGE = 500
MODIFICATIONS_PAGE = 500
VOLUME_STATUS_PAGE = 1000


def _attachment(a: AttachmentOut) -> dict[str, Any]:
    return {"volumeId": a.volume_id, "instanceId": a.instance_id, "device": a.device, "status": a.state,
            "attachTime": a.attach_time, "deleteOnTermination": False}


def _volume(v: VolumeOut) -> dict[str, Any]:
    return {
        "volumeId": v.volume_id, "size": v.size_gib, "snapshotId": v.snapshot_id or "",
        "availabilityZone": v.availability_zone, "status": v.status, "createTime": v.created_at,
        "attachmentSet": [_attachment(a) for a in v.attachments], "tagSet": tag_set(v.tags) if v.tags else None,
        "volumeType": v.volume_type, "iops": v.iops, "throughput": v.throughput, "encrypted": v.encrypted,
        "kmsKeyId": v.kms_key_id,
        "multiAttachEnabled": v.multi_attach, "fastRestored": False,
    }


def create_volume(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    zone = p.str("AvailabilityZone", max_len=64)
    if zone is not None and not re.fullmatch(ZONE_NAME_RE, zone):
        raise InvalidParameter(f"Invalid availability zone: [{zone[:64]}]", code="InvalidParameterValue")
    snap = p.str("SnapshotId", max_len=64)
    data: dict[str, Any] = {
        "size_gib": p.int("Size"), "snapshot_id": snapshot_id_of(snap) if snap else None,
        "volume_type": p.str("VolumeType", max_len=16) or "gp2", "iops": p.int("Iops"),
        "throughput": p.int("Throughput"), "multi_attach": p.bool("MultiAttachEnabled"),
        "encrypted": p.bool("Encrypted"), "kms_key_id": p.str("KmsKeyId", max_len=2048),
        "tags": tags_for(p, "volume"), "client_token": p.str("ClientToken", max_len=64),
        "availability_zone": zone,
        # VBS's own (semi-shared storage; no EC2 counterpart): a volume in a host's local pool.
        "placement": p.str("Placement", max_len=16), "host": p.str("Host", max_len=64),
        "persistent": p.bool("Persistent"),
    }
    if data["size_gib"] is None and snap is None:
        raise MissingParameter("The request must contain the parameter Size or SnapshotId.")
    req = validated(CreateVolumeRequest, {k: v for k, v in data.items() if v is not None})
    dry_run(p)
    return _volume(create_volume_req.create_volume(svc, req, who.tenant))


def delete_volume(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = volume_id_of(p.str("VolumeId", max_len=64))
    return act_unless_dry_run(p, lambda: delete_volume_req.delete_volume(svc, vol_id, who.tenant))


VOLUME_FILTER_NAMES = {"status", "volume-id", "snapshot-id", "size", "volume-type", "multi-attach-enabled",
                       "attachment.instance-id", "attachment.status", "attachment.device", "encrypted",
                       "attachment.delete-on-termination"}


def _volume_page(p: QueryParams, largest: int,
                 known: Callable[[str], bool]) -> tuple[list[str], dict[str, list[str]], int | None, str | None]:
    """A describe's volume ids, its filters (each one ``known``), its page size and NextToken; after DryRun."""
    vol_ids = [volume_id_of(v) for v in p.list("VolumeId")]
    filters, max_results, token = describe_page(p, vol_ids, "VolumeIds", largest)
    for name in filters:
        if not known(name):
            raise InvalidParameter(f"The filter '{name[:64]}' is invalid.", code="InvalidParameterValue")
    return vol_ids, filters, max_results, token


def _volume_filter(name: str) -> bool:
    return name in VOLUME_FILTER_NAMES | {"availability-zone", "tag-key", "tag-value"} or name.startswith("tag:")


def describe_volumes(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    # EC2 documents 5-500 and returns at most 500 when asked for more (the AWS CLI asks for 1000).
    vol_ids, filters, max_results, token = _volume_page(p, VOLUMES_PAGE, _volume_filter)
    found = describe_volumes_req.describe_volumes(svc, who.tenant, vol_ids, filters, max_results, token)
    return {"volumeSet": [_volume(v) for v in found.volumes], "nextToken": found.next_token}


# What DescribeVolumeStatus answers of each check; VBS has no scheduled events or actions.
_IO_ENABLED = {"ok": "passed", "impaired": "failed", "insufficient-data": "insufficient-data"}
VOLUME_STATUS_FILTERS = {"availability-zone", "volume-status.status", "volume-status.details-name",
                         "volume-status.details-status", "action.code", "action.description", "action.event-id",
                         "event.description", "event.event-id", "event.event-type", "event.not-after",
                         "event.not-before"}


def describe_volume_status(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    """Whether I/O reaches each volume: ``impaired`` once its storage node stopped heartbeating.

    The status filters apply to a page after it is read: a page may hold fewer than MaxResults and
    still have a NextToken, as EC2 allows."""
    vol_ids, filters, max_results, token = _volume_page(p, VOLUME_STATUS_PAGE, VOLUME_STATUS_FILTERS.__contains__)
    by_zone = {"availability-zone": filters["availability-zone"]} if "availability-zone" in filters else {}
    found = describe_volumes_req.describe_volumes(svc, who.tenant, vol_ids, by_zone, max_results, token)
    statuses = []
    for v in found.volumes:
        if v.status == VolumeState.DELETED:
            continue
        io = _IO_ENABLED[v.volume_status]
        facts: dict[str, list[str]] = {
            "availability-zone": [v.availability_zone], "volume-status.status": [v.volume_status],
            "volume-status.details-name": ["io-enabled", "io-performance"],
            "volume-status.details-status": [io, "not-applicable"]}
        if not matches({k: vals for k, vals in filters.items() if k != "availability-zone"}, facts,
                       known=VOLUME_STATUS_FILTERS):
            continue
        statuses.append({
            "volumeId": v.volume_id, "availabilityZone": v.availability_zone, "actionsSet": [], "eventsSet": [],
            "volumeStatus": {"status": v.volume_status, "details": [
                {"name": "io-enabled", "status": io}, {"name": "io-performance", "status": "not-applicable"}]},
            "attachmentStatuses": [{"instanceId": a.instance_id, "ioPerformance": "not-applicable"}
                                   for a in v.attachments if a.instance_id],
        })
    return {"volumeStatusSet": statuses, "nextToken": found.next_token}


def attach_volume(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = volume_id_of(p.str("VolumeId", max_len=64))
    instance = p.str("InstanceId", required=True, max_len=200)
    if not ids.is_valid("instance", instance) and not is_cloud_ref(str(instance)):
        raise InvalidParameter(f"Invalid id: \"{str(instance)[:64]}\"", code="InvalidInstanceID.Malformed")
    device = p.str("Device", required=True, max_len=64)
    req = validated(AttachVolumeRequest, {"instance_id": instance, "device": device})
    dry_run(p)
    return _attachment(attach_volume_req.attach_volume(svc, vol_id, req, who.tenant))


def detach_volume(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = volume_id_of(p.str("VolumeId", max_len=64))
    data: dict[str, Any] = {"force": p.bool("Force")}
    instance = p.str("InstanceId", max_len=64)
    if instance is not None:
        data["instance_id"] = instance
    req = validated(DetachVolumeRequest, data)
    dry_run(p)
    return _attachment(detach_volume_req.detach_volume(svc, vol_id, req, who.tenant))


def _modification(m: ModificationOut) -> dict[str, Any]:
    return {
        "volumeId": m.volume_id, "modificationState": m.state, "statusMessage": m.status_message,
        "targetSize": m.target_size_gib, "targetIops": m.target_iops, "targetVolumeType": m.target_volume_type,
        "targetThroughput": m.target_throughput, "originalSize": m.original_size_gib,
        "originalIops": m.original_iops, "originalVolumeType": m.original_volume_type,
        "originalThroughput": m.original_throughput, "progress": m.progress, "startTime": m.start_time,
        "endTime": m.end_time,
    }


def modify_volume(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = volume_id_of(p.str("VolumeId", max_len=64))
    data = {"size_gib": p.int("Size"), "volume_type": p.str("VolumeType", max_len=16), "iops": p.int("Iops"),
            "throughput": p.int("Throughput"),
            "multi_attach": p.bool("MultiAttachEnabled") if "MultiAttachEnabled" in p else None}
    req = validated(ModifyVolumeRequest, {k: v for k, v in data.items() if v is not None})
    dry_run(p)
    return {"volumeModification": _modification(modify_volume_req.modify_volume(svc, vol_id, req, who.tenant))}


def describe_volumes_modifications(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_ids = [volume_id_of(v) for v in p.list("VolumeId")]
    filters = p.filters()
    max_results = p.int("MaxResults", min=1, max=MODIFICATIONS_PAGE) or MODIFICATIONS_PAGE
    token = p.str("NextToken", max_len=MAX_TOKEN)
    dry_run(p)
    # EC2 describes the most recent modification of each volume (Terraform relies on one answer).
    found = modify_volume_req.describe_modifications(svc, who.tenant, vol_ids, filters, max_results, token,
                                                 latest_only=True)
    return {"volumeModificationSet": [_modification(m) for m in found.modifications],
            "nextToken": found.next_token}


def describe_volume_attribute(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    """EC2's defaults: autoEnableIO false (VBS never disables a volume's I/O, so it changes nothing), no product
    codes."""
    vol_id = volume_id_of(p.str("VolumeId", max_len=64))
    attribute = p.str("Attribute", required=True, max_len=32)
    if attribute not in ("autoEnableIO", "productCodes"):
        raise InvalidParameter(f"Value ({str(attribute)[:32]}) for parameter attribute is invalid. "
                               "Valid values: autoEnableIO, productCodes.")
    dry_run(p)
    # NotFound unless the caller's and live
    describe_volumes_req.describe_volumes(svc, who.tenant, [vol_id], {}, None, None)
    if attribute == "productCodes":
        return {"volumeId": vol_id, "productCodes": []}
    return {"volumeId": vol_id, "autoEnableIO": {"value": False}}
