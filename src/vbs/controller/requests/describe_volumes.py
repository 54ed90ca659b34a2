"""DescribeVolumes as the API offers it: filters, keyset pages and the fields of each volume (its
attachments, tags, status checks and a migration under way), read in a few queries per page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic_core import to_json
from sqlalchemy import ColumnElement, Select, and_, exists, false, or_, select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.auth import encryption
from vbs.controller.db import Attachment, Node, Volume
from vbs.controller.db.states import GONE_VOLUME, AttachmentState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.describe_nodes import NodeHealth, node_health, volume_status
from vbs.controller.fleet.nodes import zone_of
from vbs.controller.placement import volume_types
from vbs.controller.requests import filters as flt
from vbs.controller.rest.schemas.volumes import AttachmentOut, MigrationProgressOut, VolumeList, VolumeOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.migrate_volume import migration_progress
from vbs.errors import (
    NotFound,
)


def volume_not_found(volume_id: str) -> NotFound:
    return NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound")


def live_volume(s: Session, volume_id: str, tenant: str) -> Volume:
    """The tenant's volume row, unless it is unknown, another tenant's, deleted or in the Recycle Bin
    (``InvalidVolume.NotFound``, as EC2 answers: another tenant's volume does not exist for this caller)."""
    vol = s.get(Volume, ids.check("volume", volume_id))
    if vol is None or vol.status in GONE_VOLUME or vol.tenant != tenant:
        raise volume_not_found(volume_id)
    return vol


# Fields newer than some stored digests: left out when not given, so that a request retried with its
# client token across an upgrade still matches the digest an older controller stored.


VOLUME_FILTERS = {
    "status": flt.in_values(Volume.status),
    "volume-id": flt.in_values(Volume.id),
    "snapshot-id": flt.in_values(Volume.snapshot_id),
    "size": flt.in_values(Volume.size_gib, flt.bounded_int()),
    "volume-type": flt.in_values(Volume.volume_type),
    "multi-attach-enabled": flt.in_values(Volume.multi_attach, lambda v: {"true": True, "false": False}[v]),
    "storage-node": flt.in_values(Volume.storage_node),
    "encrypted": flt.flag(Volume.key_id.is_not(None)),
    "attachment.delete-on-termination": lambda vals: exists().where(
        Attachment.volume_id == Volume.id, Attachment.status != AttachmentState.DETACHED) if "false" in vals
    else false(),
    "attachment.instance-id": lambda vals: exists().where(
        Attachment.volume_id == Volume.id, Attachment.instance_id.in_(vals),
        Attachment.status != AttachmentState.DETACHED),
    "attachment.status": lambda vals: exists().where(Attachment.volume_id == Volume.id, Attachment.status.in_(vals)),
    "attachment.device": lambda vals: exists().where(
        Attachment.volume_id == Volume.id, Attachment.device.in_(vals),
        Attachment.status != AttachmentState.DETACHED),
}


@dataclass(frozen=True)
class VolumePage:
    """A page of volumes as plain dicts, VolumeOut's fields in its order: the REST API encodes them as
    they are (``json()``), without making and validating a model per volume (a fifth of a page of
    1,000); the EC2 API and single reads take models (``models()``)."""

    volumes: list[dict[str, Any]]
    next_token: str | None

    def models(self) -> VolumeList:
        return VolumeList(volumes=[VolumeOut.model_validate(v) for v in self.volumes], next_token=self.next_token)

    def json(self) -> bytes:
        """What ``models().model_dump_json()`` would give (a test holds them equal), at a fraction of its cost."""
        return to_json({"volumes": self.volumes, "next_token": self.next_token})


def describe_volumes(svc: Controller, tenant: str, volume_ids: list[str], filters: dict[str, list[str]],
                     max_results: int | None, next_token: str | None, *,
                     deleted_by_id: bool = False) -> VolumeList:
    """A page of the tenant's volumes (``volume_page``) as models."""
    return volume_page(svc, tenant, volume_ids, filters, max_results, next_token,
                       deleted_by_id=deleted_by_id).models()


def volume_page(svc: Controller, tenant: str, volume_ids: list[str], filters: dict[str, list[str]],
                max_results: int | None, next_token: str | None, *, deleted_by_id: bool = False) -> VolumePage:
    """A page of the tenant's volumes. A deleted volume is gone, as on EC2 (``deleting`` shows, then nothing),
    except to a caller who asks for history with the filter ``status=deleted`` (kept for
    ``deleted_retention_s``) and, with ``deleted_by_id``, to one who names it (the REST API: a client
    waiting for a delete to finish sees ``deleted``)."""
    for vid in volume_ids:
        ids.check("volume", vid)
    limit = flt.page_limit(max_results, volume_ids)
    retention = utcnow() - timedelta(seconds=svc.cfg.deleted_retention_s)
    history = VolumeState.DELETED in filters.get("status", ()) or (deleted_by_id and bool(volume_ids))
    # A volume in the Recycle Bin is hidden as a deleted one is, history or not (docs/recycle-bin.md).
    shown = and_(Volume.status != VolumeState.RECOVERABLE,
                 or_(Volume.status != VolumeState.DELETED, Volume.deleted_at >= retention)) if history \
        else Volume.status.not_in(GONE_VOLUME)
    # Plain rows, not ORM objects: a page is read once and described, and 1,000 tracked objects cost
    # more to load and to read than the rows themselves.
    stmt = select(*Volume.__table__.columns).where(Volume.tenant == tenant, shown,
                                                   *flt.where_clauses(filters, Volume.id, VOLUME_FILTERS,
                                                                      elsewhere=("availability-zone",)))
    if volume_ids:
        stmt = stmt.where(Volume.id.in_(volume_ids))
    stmt = flt.paginate(stmt, Volume.id, limit, next_token)
    with svc.db.read() as s:
        if "availability-zone" in filters:
            stmt = stmt.where(_in_zones(s, set(filters["availability-zone"]), svc.cfg.availability_zone))
        rows: list[VolumeFields] = [row._mapping for row in s.execute(stmt)]
        if volume_ids:
            missing = sorted(set(volume_ids) - {v["id"] for v in rows})
            if missing and not filters:
                raise NotFound(f"The volume(s) '{', '.join(missing)}' do not exist.", code="InvalidVolume.NotFound")
        rows, token = flt.page(rows, limit, lambda v: str(v["id"]))
        # The page's tags, attachments and migrations are looked up by the page's own query of ids.
        return VolumePage(describe_many(svc, s, rows, within=stmt.with_only_columns(Volume.id)), token)


def _in_zones(s: Session, zones: set[str], default_zone: str) -> ColumnElement[bool]:
    """Volumes whose storage node is in one of ``zones`` (a zone lives in the node's heartbeat, not a column)."""
    storage = s.scalars(select(Node).where(Node.kind == "storage")).all()
    clause: ColumnElement[bool] = Volume.storage_node.in_([n.name for n in storage
                                                           if zone_of(n, default_zone) in zones])
    if default_zone in zones:  # a node with no row (yet) is in the controller's zone
        clause = or_(clause, Volume.storage_node.not_in([n.name for n in storage]))
    return clause


def get_volume(svc: Controller, volume_id: str, tenant: str) -> VolumeOut:
    return describe_volumes(svc, tenant, [volume_id], {}, None, None, deleted_by_id=True).volumes[0]


_COLUMNS = tuple(c.key for c in Volume.__table__.columns)


def describe_one(svc: Controller, s: Session, vol: Volume) -> VolumeOut:
    return VolumeOut.model_validate(describe_fields(svc, s, vol))


def describe_fields(svc: Controller, s: Session, vol: Volume, *, new_tags: dict[str, str] | None = None,
                     health: dict[str, NodeHealth] | None = None) -> dict[str, Any]:
    """VolumeOut's fields of ``vol``; ``new_tags``: this transaction just inserted it with these tags, so it
    has no attachment or migration yet and only its node is read (the answer of every create), unless
    ``health`` holds that node's."""
    fields = {key: getattr(vol, key) for key in _COLUMNS}
    return describe_many(svc, s, [fields], new_tags=None if new_tags is None else {vol.id: dict(new_tags)},
                          health=health)[0]


# A volume as described: its table's columns by name. Read through a mapping: a Row's attributes cost
# about 0.4 µs each (SQLAlchemy 2.1), ten times a mapping's, and a page of 1,000 reads 25,000.
VolumeFields = Mapping[Any, Any]  # a RowMapping, or a dict of the columns


def describe_many(svc: Controller, s: Session, vols: Sequence[VolumeFields], *,
                   within: Select[Any] | None = None,
                   new_tags: dict[str, dict[str, str]] | None = None,
                   health: dict[str, NodeHealth] | None = None) -> list[dict[str, Any]]:
    """VolumeOut's fields of each of ``vols``, in its order (``VolumePage``); ``within``: a query of
    ids that holds theirs (``filters.tags_of``); ``new_tags``: they were just inserted, with these tags;
    ``health``: their storage nodes' (``node_health``), already read."""
    vol_ids = [v["id"] for v in vols]
    fresh = new_tags is not None  # no attachment or migration to look up
    tags = new_tags if new_tags is not None else flt.tags_of(s, vol_ids, within=within)
    kms = encryption.kms_key_ids(s, {v["key_id"] for v in vols if v["key_id"] is not None})
    nodes = health if health is not None else node_health(
        s, {v["storage_node"] for v in vols}, timeout_s=svc.cfg.heartbeat_timeout_s,
        default_zone=svc.cfg.availability_zone)
    atts: dict[str, list[AttachmentOut]] = {vid: [] for vid in vol_ids}
    migrations = {} if fresh else {
        vid: MigrationProgressOut(operation_id=op_id, kind=kind, target_node=p.target_node,
                                  target_pool=p.target_pool, progress=p.progress, state=state)
        for vid, (op_id, kind, state, p) in migration_progress(s, vol_ids, within=within).items()}
    if vol_ids and not fresh:
        for a in s.scalars(select(Attachment).where(Attachment.volume_id.in_(within if within is not None else vol_ids),
                                                    Attachment.status != AttachmentState.DETACHED)):
            if a.volume_id not in atts:
                continue
            atts[a.volume_id].append(AttachmentOut(
                attachment_id=a.id, volume_id=a.volume_id, instance_id=a.instance_id, host=a.host, vm_id=a.vm_id,
                device=a.device, mode=a.mode, state=a.status, state_reason=a.status_reason, attach_time=a.created_at))
    out = []
    for v in vols:
        vid, node_name, key_id, status = v["id"], v["storage_node"], v["key_id"], v["status"]
        node = nodes.get(node_name)
        out.append({
            "volume_id": vid, "size_gib": v["size_gib"], "comment": v["comment"], "snapshot_id": v["snapshot_id"],
            "volume_type": v["volume_type"],
            "iops": volume_types.reported_iops(v["volume_type"], v["size_gib"], v["iops"]),
            "throughput": volume_types.reported_throughput(v["volume_type"], v["throughput"]),
            "multi_attach": v["multi_attach"], "encrypted": key_id is not None,
            "kms_key_id": kms.get(key_id) if key_id is not None else None,
            "placement": v["placement"], "host": v["host"], "persistent": v["persistent"], "status": str(status),
            "status_reason": v["status_reason"], "progress": v["progress"], "storage_node": node_name,
            "pool": v["pool"], "availability_zone": node.zone if node is not None else svc.cfg.availability_zone,
            "used_bytes": node.volume_usage.get(vid) if node is not None else None,
            "volume_status": volume_status(status, node), "created_at": v["created_at"],
            "tags": tags[vid], "attachments": atts[vid], "migration": migrations.get(vid),
        })
    return out
