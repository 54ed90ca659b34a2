"""EC2 actions on top of the controller's domain: parameters in, the 2016-11-15 response shapes out.

Each handler reads its parameters through ``QueryParams``, builds the same request models the REST
API validates, calls the same domain functions, and returns the body of the XML answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select

from vbs import ids
from vbs.controller.auth.keys import Principal
from vbs.controller.db import Snapshot, Tag, Volume
from vbs.controller.db.states import SnapshotState, VolumeState
from vbs.controller.ec2.query import QueryParams
from vbs.controller.fleet import describe_nodes
from vbs.controller.requests import attach_volume as attach_volume_req
from vbs.controller.requests import copy_snapshot as copy_snapshot_req
from vbs.controller.requests import create_snapshot as create_snapshot_req
from vbs.controller.requests import create_snapshots as snapshot_sets
from vbs.controller.requests import create_volume as create_volume_req
from vbs.controller.requests import delete_snapshot as delete_snapshot_req
from vbs.controller.requests import delete_volume as delete_volume_req
from vbs.controller.requests import describe_instances as describe_instances_req
from vbs.controller.requests import describe_snapshots as describe_snapshots_req
from vbs.controller.requests import describe_volumes as describe_volumes_req
from vbs.controller.requests import detach_volume as detach_volume_req
from vbs.controller.requests import modify_volume as modifications
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.requests import tags
from vbs.controller.requests.filters import decode_token, encode_token
from vbs.controller.resolvers import is_cloud_ref
from vbs.controller.rest.schemas import (
    AttachmentOut,
    AttachVolumeRequest,
    CopySnapshotRequest,
    CreateSnapshotRequest,
    CreateSnapshotSetRequest,
    CreateVolumeRequest,
    DetachVolumeRequest,
    ModificationOut,
    ModifyVolumeRequest,
    SnapshotOut,
    VolumeOut,
)
from vbs.controller.runtime import Controller
from vbs.errors import InvalidParameter, MissingParameter, NotFound, VbsError
from vbs.wire.storage import ZONE_NAME_RE

Handler = Callable[[Controller, QueryParams, Principal], dict[str, Any]]
ACCOUNT_ID = sharing.DEFAULT_ACCOUNT_ID
# Largest pages, as EC2 documents them; a describe without MaxResults answers one such page and a NextToken.
VOLUMES_PAGE = 500
SNAPSHOTS_PAGE = 1000
MODIFICATIONS_PAGE = 500
VOLUME_STATUS_PAGE = 1000
TAGS_PAGE = 1000
MAX_TOKEN = 160


class DryRunOperation(VbsError):
    code = "DryRunOperation"
    status = 412

    def __init__(self) -> None:
        super().__init__("Request would have succeeded, but DryRun flag is set.")


# The request models' field names, as EC2 clients know the parameters.
EC2_NAMES = {"size_gib": "Size", "snapshot_id": "SnapshotId", "volume_type": "VolumeType", "iops": "Iops",
             "throughput": "Throughput", "client_token": "ClientToken", "tags": "TagSpecification",
             "comment": "Description", "device": "Device", "instance_id": "InstanceId", "volume_id": "VolumeId",
             "multi_attach": "MultiAttachEnabled", "resource_ids": "ResourceId", "force": "Force",
             "availability_zone": "AvailabilityZone"}


def _model(model: type[Any], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        field = ".".join([EC2_NAMES.get(loc[0], loc[0]), *loc[1:]]) if loc else "request"
        value = str(first.get("input", ""))[:64] if not isinstance(first.get("input"), dict) else ""
        raise InvalidParameter(f"Value ({value}) for parameter {field} is invalid. {first['msg']}.") from None


def _volume_id(value: str | None, name: str = "VolumeId") -> str:
    if not value:
        raise MissingParameter(f"The request must contain the parameter {name}.")
    if not value.startswith("vol-"):
        raise InvalidParameter(f'Invalid id: "{value[:64]}" (expecting "vol-...")')
    if not ids.is_valid("volume", value):
        raise NotFound(f"The volume '{value[:64]}' does not exist.", code="InvalidVolume.NotFound")
    return value


def _snapshot_id(value: str | None, name: str = "SnapshotId") -> str:
    if not value:
        raise MissingParameter(f"The request must contain the parameter {name}.")
    if not value.startswith("snap-"):
        raise InvalidParameter(f'Invalid id: "{value[:64]}" (expecting "snap-...")')
    if not ids.is_valid("snapshot", value):
        raise NotFound(f"The snapshot '{value[:64]}' does not exist.", code="InvalidSnapshot.NotFound")
    return value


def _page_size(p: QueryParams, resource_ids: list[str], ids_name: str, largest: int) -> int | None:
    """MaxResults (at least 5; above ``largest`` answers ``largest``, as EC2 does), else ``largest`` per page;
    None where resource ids were given (they bound the answer and cannot be combined with MaxResults)."""
    asked = p.int("MaxResults", min=5)
    if resource_ids:
        if asked is not None:
            raise InvalidParameter(f"The parameter {ids_name} cannot be used with the parameter maxResults.",
                                   code="InvalidParameterCombination")
        return None
    return min(asked or largest, largest)


def _dry_run(p: QueryParams) -> None:
    if p.bool("DryRun"):
        raise DryRunOperation()


def _tag_set(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": k, "value": v} for k, v in sorted(values.items())]


def _tags_for(p: QueryParams, resource_type: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for rtype, spec_tags in p.tag_specifications():
        if rtype not in (None, resource_type):
            raise InvalidParameter(f"The resource type '{rtype}' cannot be tagged by this action; "
                                   f"use '{resource_type}'.")
        out.update(spec_tags)
    return out


def _attachment(a: AttachmentOut) -> dict[str, Any]:
    return {"volumeId": a.volume_id, "instanceId": a.instance_id, "device": a.device, "status": a.state,
            "attachTime": a.attach_time, "deleteOnTermination": False}


def _volume(v: VolumeOut) -> dict[str, Any]:
    return {
        "volumeId": v.volume_id, "size": v.size_gib, "snapshotId": v.snapshot_id or "",
        "availabilityZone": v.availability_zone, "status": v.status, "createTime": v.created_at,
        "attachmentSet": [_attachment(a) for a in v.attachments], "tagSet": _tag_set(v.tags) if v.tags else None,
        "volumeType": v.volume_type, "iops": v.iops, "throughput": v.throughput, "encrypted": v.encrypted,
        "kmsKeyId": v.kms_key_id,
        "multiAttachEnabled": v.multi_attach, "fastRestored": False,
    }


def _snapshot(s: SnapshotOut) -> dict[str, Any]:
    return {
        "snapshotId": s.snapshot_id, "volumeId": s.volume_id, "status": s.status, "startTime": s.started_at,
        "progress": f"{s.progress}%", "ownerId": sharing.owner_id(s.owner), "volumeSize": s.volume_size_gib,
        "description": s.comment, "encrypted": s.encrypted, "kmsKeyId": s.kms_key_id, "storageTier": "standard",
        "stateMessage": s.status_reason, "tagSet": _tag_set(s.tags) if s.tags else None,
    }


# -- volumes ---------------------------------------------------------------------------------------


def create_volume(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    zone = p.str("AvailabilityZone", max_len=64)
    if zone is not None and not re.fullmatch(ZONE_NAME_RE, zone):
        raise InvalidParameter(f"Invalid availability zone: [{zone[:64]}]", code="InvalidParameterValue")
    snap = p.str("SnapshotId", max_len=64)
    data: dict[str, Any] = {
        "size_gib": p.int("Size"), "snapshot_id": _snapshot_id(snap) if snap else None,
        "volume_type": p.str("VolumeType", max_len=16) or "gp2", "iops": p.int("Iops"),
        "throughput": p.int("Throughput"), "multi_attach": p.bool("MultiAttachEnabled"),
        "encrypted": p.bool("Encrypted"), "kms_key_id": p.str("KmsKeyId", max_len=2048),
        "tags": _tags_for(p, "volume"), "client_token": p.str("ClientToken", max_len=64),
        "availability_zone": zone,
        # VBS's own (semi-shared storage; no EC2 counterpart): a volume in a host's local pool.
        "placement": p.str("Placement", max_len=16), "host": p.str("Host", max_len=64),
        "persistent": p.bool("Persistent"),
    }
    if data["size_gib"] is None and snap is None:
        raise MissingParameter("The request must contain the parameter Size or SnapshotId.")
    req = _model(CreateVolumeRequest, {k: v for k, v in data.items() if v is not None})
    _dry_run(p)
    return _volume(create_volume_req.create_volume(svc, req, who.tenant))


def delete_volume(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = _volume_id(p.str("VolumeId", max_len=64))
    _dry_run(p)
    delete_volume_req.delete_volume(svc, vol_id, who.tenant)
    return {"return": True}


VOLUME_FILTER_NAMES = {"status", "volume-id", "snapshot-id", "size", "volume-type", "multi-attach-enabled",
                       "attachment.instance-id", "attachment.status", "attachment.device", "encrypted",
                       "attachment.delete-on-termination"}


def describe_volumes(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_ids = [_volume_id(v) for v in p.list("VolumeId")]
    filters = p.filters()
    # EC2 documents 5-500 and returns at most 500 when asked for more (the AWS CLI asks for 1000).
    max_results = _page_size(p, vol_ids, "VolumeIds", VOLUMES_PAGE)
    token = p.str("NextToken", max_len=MAX_TOKEN)
    _dry_run(p)
    for name in filters:
        if name not in VOLUME_FILTER_NAMES | {"availability-zone", "tag-key", "tag-value"} \
                and not name.startswith("tag:"):
            raise InvalidParameter(f"The filter '{name[:64]}' is invalid.", code="InvalidParameterValue")
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
    vol_ids = [_volume_id(v) for v in p.list("VolumeId")]
    filters = p.filters()
    max_results = _page_size(p, vol_ids, "VolumeIds", VOLUME_STATUS_PAGE)
    token = p.str("NextToken", max_len=MAX_TOKEN)
    _dry_run(p)
    for name in filters:
        if name not in VOLUME_STATUS_FILTERS:
            raise InvalidParameter(f"The filter '{name[:64]}' is invalid.", code="InvalidParameterValue")
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
        if not _matches({k: vals for k, vals in filters.items() if k != "availability-zone"}, facts,
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
    vol_id = _volume_id(p.str("VolumeId", max_len=64))
    instance = p.str("InstanceId", required=True, max_len=200)
    if not ids.is_valid("instance", instance) and not is_cloud_ref(str(instance)):
        raise InvalidParameter(f"Invalid id: \"{str(instance)[:64]}\"", code="InvalidInstanceID.Malformed")
    device = p.str("Device", required=True, max_len=64)
    req = _model(AttachVolumeRequest, {"instance_id": instance, "device": device})
    _dry_run(p)
    return _attachment(attach_volume_req.attach_volume(svc, vol_id, req, who.tenant))


def detach_volume(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = _volume_id(p.str("VolumeId", max_len=64))
    data: dict[str, Any] = {"force": p.bool("Force")}
    instance = p.str("InstanceId", max_len=64)
    if instance is not None:
        data["instance_id"] = instance
    req = _model(DetachVolumeRequest, data)
    _dry_run(p)
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
    vol_id = _volume_id(p.str("VolumeId", max_len=64))
    data = {"size_gib": p.int("Size"), "volume_type": p.str("VolumeType", max_len=16), "iops": p.int("Iops"),
            "throughput": p.int("Throughput"),
            "multi_attach": p.bool("MultiAttachEnabled") if "MultiAttachEnabled" in p else None}
    req = _model(ModifyVolumeRequest, {k: v for k, v in data.items() if v is not None})
    _dry_run(p)
    return {"volumeModification": _modification(modifications.modify_volume(svc, vol_id, req, who.tenant))}


def describe_volumes_modifications(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_ids = [_volume_id(v) for v in p.list("VolumeId")]
    filters = p.filters()
    max_results = p.int("MaxResults", min=1, max=MODIFICATIONS_PAGE) or MODIFICATIONS_PAGE
    token = p.str("NextToken", max_len=MAX_TOKEN)
    _dry_run(p)
    # EC2 describes the most recent modification of each volume (Terraform relies on one answer).
    found = modifications.describe_modifications(svc, who.tenant, vol_ids, filters, max_results, token,
                                                 latest_only=True)
    return {"volumeModificationSet": [_modification(m) for m in found.modifications],
            "nextToken": found.next_token}


# -- snapshots -------------------------------------------------------------------------------------


def create_snapshot(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = _volume_id(p.str("VolumeId", max_len=64))
    req = _model(CreateSnapshotRequest, {"volume_id": vol_id, "comment": p.str("Description", max_len=255) or "",
                                         "tags": _tags_for(p, "snapshot")})
    _dry_run(p)
    return _snapshot(create_snapshot_req.create_snapshot(svc, req, who.tenant))


def delete_snapshot(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = _snapshot_id(p.str("SnapshotId", max_len=64))
    _dry_run(p)
    delete_snapshot_req.delete_snapshot(svc, snap_id, who.tenant)
    return {"return": True}


def describe_snapshots(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_ids = [_snapshot_id(v) for v in p.list("SnapshotId")]
    owners = p.list("Owner")
    filters = p.filters()
    filters.pop("owner-id", None)
    filters.pop("owner-alias", None)
    max_results = _page_size(p, snap_ids, "SnapshotIds", SNAPSHOTS_PAGE)
    token = p.str("NextToken", max_len=MAX_TOKEN)
    _dry_run(p)
    # Owner: self, account ids (tenants); none: every snapshot the caller may use (its own and shared ones).
    owner_tenants = {who.tenant if o == "self" else sharing.tenant_of(o) for o in owners
                     if o not in ("amazon", "aws-marketplace")} if owners else None
    # A snapshot being deleted is already gone as far as EC2 clients are concerned.
    found = describe_snapshots_req.describe_snapshots(svc, who.tenant, snap_ids, filters, max_results, token,
                                        hide_deleting=True, shared=True, owners=owner_tenants)
    return {"snapshotSet": [_snapshot(s) for s in found.snapshots], "nextToken": found.next_token}


def create_snapshots(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    """A crash-consistent set of the instance's volumes. VBS volumes are never an instance's boot disk, so
    ExcludeBootVolume changes nothing."""
    instance = str(p.str("InstanceSpecification.InstanceId", required=True, max_len=64))
    if not ids.is_valid("instance", instance):
        raise InvalidParameter(f"Invalid id: \"{instance[:64]}\"", code="InvalidInstanceID.Malformed")
    excluded = [_volume_id(v, "ExcludeDataVolumeId") for v in p.list("InstanceSpecification.ExcludeDataVolumeId")]
    p.bool("InstanceSpecification.ExcludeBootVolume")
    copy_tags = p.str("CopyTagsFromSource", max_len=16)
    if copy_tags not in (None, "volume"):
        raise InvalidParameter(f"Value ({copy_tags}) for parameter CopyTagsFromSource is invalid. Expected: volume.")
    req = _model(CreateSnapshotSetRequest, {
        "instance_id": instance, "comment": p.str("Description", max_len=255) or "",
        "tags": _tags_for(p, "snapshot"), "copy_tags_from_volume": bool(copy_tags), "exclude_volume_ids": excluded})
    _dry_run(p)
    made = snapshot_sets.create_snapshot_set(svc, req, who.tenant)
    # EC2's SnapshotInfo: a snapshot's fields, its status named state.
    return {"snapshotSet": [{("state" if k == "status" else k): v for k, v in _snapshot(x).items()} for x in made]}


def copy_snapshot(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    source = _snapshot_id(p.str("SourceSnapshotId", max_len=64), "SourceSnapshotId")
    p.str("SourceRegion", required=True, max_len=64)  # EC2 requires it; it must be this region
    for name in ("SourceRegion", "DestinationRegion"):
        value = p.str(name, max_len=64)
        if value is not None and value != svc.cfg.region:
            raise InvalidParameter(f"{name} {value[:64]!r}: this VBS copies snapshots within its region "
                                   f"{svc.cfg.region!r} only.")
    req = _model(CopySnapshotRequest, {"source_snapshot_id": source,
                                       "comment": p.str("Description", max_len=255) or "",
                                       "tags": _tags_for(p, "snapshot"), "encrypted": p.bool("Encrypted"),
                                       **({"kms_key_id": kms} if (kms := p.str("KmsKeyId", max_len=2048)) else {})})
    _dry_run(p)
    made = copy_snapshot_req.copy_snapshot(svc, req, who.tenant)
    return {"snapshotId": made.snapshot_id, "tagSet": _tag_set(made.tags) if made.tags else None}


def _permission_attribute(p: QueryParams) -> str:
    attribute = p.str("Attribute", required=True, max_len=64)
    if attribute not in ("createVolumePermission", "productCodes"):
        raise InvalidParameter(f"Value ({str(attribute)[:64]}) for parameter attribute is invalid. "
                               "Valid values: createVolumePermission, productCodes.")
    return str(attribute)


def _grantee_item(grantee: str) -> dict[str, str]:
    return {"group": "all"} if grantee == sharing.ALL else {"userId": sharing.owner_id(grantee)}


def describe_snapshot_attribute(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = _snapshot_id(p.str("SnapshotId", max_len=64))
    attribute = _permission_attribute(p)
    _dry_run(p)
    with svc.db.read() as s:
        sharing.owned_snapshot(s, snap_id, who.tenant)
        granted = sharing.grantees(s, snap_id)
    if attribute == "productCodes":
        return {"snapshotId": snap_id, "productCodes": []}
    return {"snapshotId": snap_id, "createVolumePermission": [_grantee_item(g) for g in granted]}


def _grantees(p: QueryParams, prefix: str) -> list[str]:
    """``prefix.N.UserId`` / ``prefix.N.Group`` → tenant names and ``all``."""
    return [_grantee(r.get("UserId"), r.get("Group")) for r in p.records(prefix, ("UserId", "Group"))]


def _grantee(user: str | None, group: str | None) -> str:
    if group is not None:
        if group != "all":
            raise InvalidParameter(f"Invalid group {group[:16]!r}: the only group is 'all'.")
        return sharing.ALL
    return sharing.tenant_of(str(user))


def modify_snapshot_attribute(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = _snapshot_id(p.str("SnapshotId", max_len=64))
    attribute = p.str("Attribute", max_len=64) or "createVolumePermission"
    if attribute != "createVolumePermission":
        raise InvalidParameter(f"The attribute {attribute[:64]!r} cannot be modified; only createVolumePermission.")
    add, remove = _grantees(p, "CreateVolumePermission.Add"), _grantees(p, "CreateVolumePermission.Remove")
    operation = p.str("OperationType", max_len=16)
    listed = [_grantee(u, None) for u in p.list("UserId")] + [_grantee(None, g) for g in p.list("UserGroup")]
    if listed:
        if operation not in ("add", "remove"):
            raise MissingParameter("The request must contain the parameter OperationType (add or remove) with "
                                   "UserId or UserGroup.")
        (add if operation == "add" else remove).extend(listed)
    if not add and not remove:
        raise MissingParameter("The request must contain the parameter CreateVolumePermission (Add or Remove), or "
                               "UserId / UserGroup with OperationType.")
    _dry_run(p)
    with svc.db.session() as s:
        sharing.modify(s, snap_id, who.tenant, add=add, remove=remove)
    return {"return": True}


def reset_snapshot_attribute(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = _snapshot_id(p.str("SnapshotId", max_len=64))
    if _permission_attribute(p) != "createVolumePermission":
        raise InvalidParameter("Only createVolumePermission can be reset.")
    _dry_run(p)
    with svc.db.session() as s:
        sharing.modify(s, snap_id, who.tenant, add=[], remove=sharing.grantees(s, snap_id))
    return {"return": True}


def describe_volume_attribute(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    """EC2's defaults: autoEnableIO false (VBS never disables a volume's I/O, so it changes nothing), no product
    codes."""
    vol_id = _volume_id(p.str("VolumeId", max_len=64))
    attribute = p.str("Attribute", required=True, max_len=32)
    if attribute not in ("autoEnableIO", "productCodes"):
        raise InvalidParameter(f"Value ({str(attribute)[:32]}) for parameter attribute is invalid. "
                               "Valid values: autoEnableIO, productCodes.")
    _dry_run(p)
    # NotFound unless the caller's and live
    describe_volumes_req.describe_volumes(svc, who.tenant, [vol_id], {}, None, None)
    if attribute == "productCodes":
        return {"volumeId": vol_id, "productCodes": []}
    return {"volumeId": vol_id, "autoEnableIO": {"value": False}}


# -- tags ------------------------------------------------------------------------------------------


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
    from vbs.controller.rest.schemas import CreateTagsRequest

    req = _model(CreateTagsRequest, {"resource_ids": rids, "tags": new_tags})
    _dry_run(p)
    with svc.db.session() as s:
        tags.create_tags(s, req.resource_ids, req.tags, who.tenant)
    return {"return": True}


def delete_tags(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    rids = _resource_ids(p)
    pairs = p.tag_keys()
    _dry_run(p)
    with svc.db.session() as s:
        tags.delete_tag_pairs(s, rids, pairs, who.tenant)
    return {"return": True}


def describe_tags(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    filters = p.filters()
    max_results = min(p.int("MaxResults", min=5) or TAGS_PAGE, TAGS_PAGE)
    token = p.str("NextToken", max_len=MAX_TOKEN)
    _dry_run(p)
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
            from sqlalchemy import or_

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
        live_vols = select(Volume.id).where(Volume.tenant == who.tenant, Volume.status != VolumeState.DELETED)
        live_snaps = select(Snapshot.id).where(Snapshot.tenant == who.tenant,
                                               Snapshot.status.not_in([SnapshotState.DELETED, SnapshotState.DELETING]))
        stmt = stmt.where(Tag.resource_id.in_(live_vols) | Tag.resource_id.in_(live_snaps))
        rows = list(s.scalars(stmt.limit(max_results + 1)))
    next_token = None
    if len(rows) > max_results:
        rows = rows[:max_results]
        next_token = encode_token(f"{rows[-1].resource_id}\x1f{rows[-1].key}")
    return {"tagSet": [{"resourceId": t.resource_id,
                        "resourceType": "volume" if t.resource_id.startswith("vol-") else "snapshot",
                        "key": t.key, "value": t.value} for t in rows], "nextToken": next_token}


# -- instances and zones ---------------------------------------------------------------------------


def describe_instances(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    wanted = set(p.list("InstanceId"))
    filters = p.filters()
    _dry_run(p)
    found = describe_instances_req.describe_instances(svc, who.tenant)
    known = {i.instance_id for i in found}
    missing = sorted(wanted - known)
    if missing:
        raise NotFound(f"The instance IDs '{', '.join(missing)}' do not exist", code="InvalidInstanceID.NotFound")
    reservations = []
    for inst in found:
        if wanted and inst.instance_id not in wanted:
            continue
        # "incoming": a live migration's destination VM, waiting for it.
        state = {"running": (16, "running"), "stopped": (80, "stopped"),
                 "incoming": (0, "pending")}.get(inst.state, (48, "terminated"))
        # An external cloud's ids show as tags vbs:cloud-id:SCHEME (attach with InstanceId SCHEME:ID).
        inst_tags = {"Name": inst.name, "vbs:host": inst.host, "vbs:vm-id": inst.vm_id,
                     **{f"vbs:cloud-id:{scheme}": cloud_id for scheme, cloud_id in sorted(inst.cloud_ids.items())}}
        facts = {"instance-id": [inst.instance_id], "instance-state-name": [state[1]],
                 "instance-state-code": [str(state[0])], "availability-zone": [svc.cfg.availability_zone],
                 "private-dns-name": [inst.host], "tag-key": list(inst_tags), "tag-value": list(inst_tags.values()),
                 "block-device-mapping.volume-id": [a.volume_id for a in inst.volumes],
                 "block-device-mapping.device-name": [a.device for a in inst.volumes],
                 **{f"tag:{k}": [v] for k, v in inst_tags.items()}}
        if not _matches(filters, facts, known={"instance-id", "instance-state-name", "instance-state-code",
                                                  "availability-zone", "private-dns-name", "tag-key", "tag-value",
                                                  "block-device-mapping.volume-id",
                                                  "block-device-mapping.device-name"}):
            continue
        reservations.append({
            "reservationId": "r-" + inst.instance_id[2:], "ownerId": ACCOUNT_ID, "groupSet": [],
            "instancesSet": [{
                "instanceId": inst.instance_id, "imageId": "ami-00000000000000000",
                "instanceState": {"code": state[0], "name": state[1]}, "privateDnsName": inst.host,
                "instanceType": "vbs.vm", "placement": {"availabilityZone": svc.cfg.availability_zone},
                "tagSet": _tag_set(inst_tags),
                "rootDeviceType": "ebs", "blockDeviceMapping": [
                    {"deviceName": a.device, "ebs": {"volumeId": a.volume_id, "status": a.state,
                                                     "attachTime": a.attach_time, "deleteOnTermination": False}}
                    for a in inst.volumes],
            }],
        })
    return {"reservationSet": reservations}


def _matches(filters: dict[str, list[str]], facts: dict[str, list[str]], known: set[str]) -> bool:
    """EC2 filter semantics over a resource's facts: values of a name OR-ed, names AND-ed."""
    for name, values in filters.items():
        if name not in known and not name.startswith("tag:"):
            raise InvalidParameter(f"The filter '{name[:64]}' is invalid.")
        if not set(values) & set(facts.get(name, [])):
            return False
    return True


ZONE_FILTERS = {"zone-name", "zone-id", "region-name", "state", "zone-type", "opt-in-status"}


def describe_availability_zones(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    """The zones of the storage nodes (``available`` while one of its nodes is up)."""
    names = p.list("ZoneName")
    zone_ids = p.list("ZoneId")
    filters = p.filters()
    _dry_run(p)
    with svc.db.read() as s:
        zones = describe_nodes.availability_zones(s, svc.cfg.heartbeat_timeout_s, svc.cfg.availability_zone,
                                                  svc.cfg.region)
    unknown = [n for n in names if n not in {z.zone_name for z in zones}] + [
        i for i in zone_ids if i not in {z.zone_id for z in zones}]
    if unknown:
        raise InvalidParameter(f"Invalid availability zone: [{unknown[0][:64]}]", code="InvalidParameterValue")
    info = []
    for z in zones:
        facts: dict[str, list[str]] = {
            "zone-name": [z.zone_name], "zone-id": [z.zone_id], "region-name": [z.region_name], "state": [z.state],
            "zone-type": ["availability-zone"], "opt-in-status": ["opt-in-not-required"]}
        if (names and z.zone_name not in names) or (zone_ids and z.zone_id not in zone_ids) \
                or not _matches(filters, facts, known=ZONE_FILTERS):
            continue
        info.append({"zoneName": z.zone_name, "zoneState": z.state, "regionName": z.region_name,
                     "zoneId": z.zone_id, "zoneType": "availability-zone", "optInStatus": "opt-in-not-required",
                     "messageSet": []})
    return {"availabilityZoneInfo": info}


HANDLERS: dict[str, Handler] = {
    "CreateVolume": create_volume,
    "DeleteVolume": delete_volume,
    "DescribeVolumes": describe_volumes,
    "DescribeVolumeStatus": describe_volume_status,
    "ModifyVolume": modify_volume,
    "DescribeVolumesModifications": describe_volumes_modifications,
    "AttachVolume": attach_volume,
    "DetachVolume": detach_volume,
    "CreateSnapshot": create_snapshot,
    "DeleteSnapshot": delete_snapshot,
    "DescribeSnapshots": describe_snapshots,
    "CopySnapshot": copy_snapshot,
    "CreateSnapshots": create_snapshots,
    "DescribeSnapshotAttribute": describe_snapshot_attribute,
    "ModifySnapshotAttribute": modify_snapshot_attribute,
    "ResetSnapshotAttribute": reset_snapshot_attribute,
    "DescribeVolumeAttribute": describe_volume_attribute,
    "CreateTags": create_tags,
    "DeleteTags": delete_tags,
    "DescribeTags": describe_tags,
    "DescribeInstances": describe_instances,
    "DescribeAvailabilityZones": describe_availability_zones,
}
