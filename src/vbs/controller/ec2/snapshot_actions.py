"""EC2 actions on snapshots: create one or the set of an instance's volumes, delete, describe, copy, and
their createVolumePermission attribute (describe, modify, reset); each answers EC2's snapshot shapes."""

from __future__ import annotations

from typing import Any

from vbs.controller.auth.keys import Principal
from vbs.controller.ec2.params import (
    act_unless_dry_run,
    describe_page,
    dry_run,
    instance_id_of,
    snapshot_id_of,
    tag_set,
    tags_for,
    validated,
    volume_id_of,
)
from vbs.controller.ec2.query import QueryParams
from vbs.controller.requests import copy_snapshot as copy_snapshot_req
from vbs.controller.requests import create_snapshot as create_snapshot_req
from vbs.controller.requests import create_snapshots as create_snapshots_req
from vbs.controller.requests import delete_snapshot as delete_snapshot_req
from vbs.controller.requests import describe_snapshots as describe_snapshots_req
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.rest.schemas.snapshots import (
    CopySnapshotRequest,
    CreateSnapshotRequest,
    CreateSnapshotSetRequest,
    SnapshotOut,
)
from vbs.controller.runtime import Controller
from vbs.errors import InvalidParameter, MissingParameter

# The largest page, as EC2 documents it; a describe without MaxResults answers one such page and a NextToken.
SNAPSHOTS_PAGE = 1000


def snapshot_item(s: SnapshotOut) -> dict[str, Any]:
    return {
        "snapshotId": s.snapshot_id, "volumeId": s.volume_id, "status": s.status, "startTime": s.started_at,
        "progress": f"{s.progress}%", "ownerId": sharing.owner_id(s.owner), "volumeSize": s.volume_size_gib,
        "description": s.comment, "encrypted": s.encrypted, "kmsKeyId": s.kms_key_id, "storageTier": s.storage_tier,
        "restoreExpiryTime": s.restore_expires_at,
        "stateMessage": s.status_reason, "tagSet": tag_set(s.tags) if s.tags else None,
    }


def create_snapshot(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = volume_id_of(p.str("VolumeId", max_len=64))
    req = validated(CreateSnapshotRequest, {"volume_id": vol_id,
                                            "comment": p.str("Description", max_len=255) or "",
                                            "tags": tags_for(p, "snapshot")})
    dry_run(p)
    return snapshot_item(create_snapshot_req.create_snapshot(svc, req, who.tenant))


def delete_snapshot(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
    return act_unless_dry_run(p, lambda: delete_snapshot_req.delete_snapshot(svc, snap_id, who.tenant))


def describe_snapshots(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_ids = [snapshot_id_of(v) for v in p.list("SnapshotId")]
    owners = p.list("Owner")
    filters, max_results, token = describe_page(p, snap_ids, "SnapshotIds", SNAPSHOTS_PAGE)
    filters.pop("owner-id", None)
    filters.pop("owner-alias", None)
    # Owner: self, account ids (tenants); none: every snapshot the caller may use (its own and shared ones).
    owner_tenants = {who.tenant if o == "self" else sharing.tenant_of(o) for o in owners
                     if o not in ("amazon", "aws-marketplace")} if owners else None
    # A snapshot being deleted is already gone as far as EC2 clients are concerned.
    found = describe_snapshots_req.describe_snapshots(svc, who.tenant, snap_ids, filters, max_results, token,
                                        hide_deleting=True, shared=True, owners=owner_tenants)
    return {"snapshotSet": [snapshot_item(s) for s in found.snapshots], "nextToken": found.next_token}


def create_snapshots(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    """A crash-consistent set of the instance's volumes. VBS volumes are never an instance's boot disk, so
    ExcludeBootVolume changes nothing."""
    instance = instance_id_of(p.str("InstanceSpecification.InstanceId", max_len=64), "InstanceSpecification.InstanceId")
    excluded = [volume_id_of(v, "ExcludeDataVolumeId") for v in p.list("InstanceSpecification.ExcludeDataVolumeId")]
    p.bool("InstanceSpecification.ExcludeBootVolume")
    copy_tags = p.str("CopyTagsFromSource", max_len=16)
    if copy_tags not in (None, "volume"):
        raise InvalidParameter(f"Value ({copy_tags}) for parameter CopyTagsFromSource is invalid. Expected: volume.")
    req = validated(CreateSnapshotSetRequest, {
        "instance_id": instance, "comment": p.str("Description", max_len=255) or "",
        "tags": tags_for(p, "snapshot"), "copy_tags_from_volume": bool(copy_tags), "exclude_volume_ids": excluded})
    dry_run(p)
    made = create_snapshots_req.create_snapshot_set(svc, req, who.tenant)
    # EC2's SnapshotInfo: a snapshot's fields, its status named state.
    return {"snapshotSet": [{("state" if k == "status" else k): v for k, v in snapshot_item(x).items()} for x in made]}


def copy_snapshot(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    source = snapshot_id_of(p.str("SourceSnapshotId", max_len=64), "SourceSnapshotId")
    p.str("SourceRegion", required=True, max_len=64)  # EC2 requires it; it must be this region
    for name in ("SourceRegion", "DestinationRegion"):
        value = p.str(name, max_len=64)
        if value is not None and value != svc.cfg.region:
            raise InvalidParameter(f"{name} {value[:64]!r}: this VBS copies snapshots within its region "
                                   f"{svc.cfg.region!r} only.")
    req = validated(CopySnapshotRequest, {"source_snapshot_id": source,
                                          "comment": p.str("Description", max_len=255) or "",
                                          "tags": tags_for(p, "snapshot"), "encrypted": p.bool("Encrypted"),
                                          **({"kms_key_id": kms} if (kms := p.str("KmsKeyId", max_len=2048)) else {})})
    dry_run(p)
    made = copy_snapshot_req.copy_snapshot(svc, req, who.tenant)
    return {"snapshotId": made.snapshot_id, "tagSet": tag_set(made.tags) if made.tags else None}


def _permission_attribute(p: QueryParams) -> str:
    attribute = p.str("Attribute", required=True, max_len=64)
    if attribute not in ("createVolumePermission", "productCodes"):
        raise InvalidParameter(f"Value ({str(attribute)[:64]}) for parameter attribute is invalid. "
                               "Valid values: createVolumePermission, productCodes.")
    return str(attribute)


def _grantee_item(grantee: str) -> dict[str, str]:
    return {"group": "all"} if grantee == sharing.ALL else {"userId": sharing.owner_id(grantee)}


def describe_snapshot_attribute(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
    attribute = _permission_attribute(p)
    dry_run(p)
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
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
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
    dry_run(p)
    with svc.db.session() as s:
        sharing.modify(s, snap_id, who.tenant, add=add, remove=remove)
    return {"return": True}


def reset_snapshot_attribute(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
    if _permission_attribute(p) != "createVolumePermission":
        raise InvalidParameter("Only createVolumePermission can be reset.")
    dry_run(p)
    with svc.db.session() as s:
        sharing.modify(s, snap_id, who.tenant, add=[], remove=sharing.grantees(s, snap_id))
    return {"return": True}
