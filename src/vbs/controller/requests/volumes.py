"""Volume operations as the API offers them: create, delete, describe.

Each call validates, makes its conditional state change and records its operation in one
transaction, then hands the operation to the workflow engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from pydantic_core import to_json
from sqlalchemy import ColumnElement, Select, and_, bindparam, exists, false, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vbs import ids
from vbs.config import ControllerConfig
from vbs.controller.auth import encryption
from vbs.controller.db import Attachment, Node, Snapshot, Volume, VolumeUsage, plain
from vbs.controller.db.locks import lock_for_create, lock_rows, lock_storage, lock_tenant
from vbs.controller.db.states import AttachmentState, SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.db.transitions import transition
from vbs.controller.fleet.nodes import (
    Chosen,
    NodeHealth,
    Placement,
    choose_local_pool,
    choose_placement,
    health_of,
    node_health,
    volume_status,
    zone_of,
)
from vbs.controller.placement import quotas, volume_types
from vbs.controller.requests import filters as flt
from vbs.controller.requests import snapshot_permissions as snapshot_sharing
from vbs.controller.requests.tags import set_tags
from vbs.controller.rest.schemas import AttachmentOut, CreateVolumeRequest, MigrationProgressOut, VolumeList, VolumeOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.create_delete_volume import CREATE_VOLUME, DELETE_VOLUME, CreateVolumeParams
from vbs.controller.workflows.local_volumes import CREATE_LOCAL_VOLUME, DELETE_LOCAL_VOLUME, CreateLocalVolumeParams
from vbs.controller.workflows.migrate_volume import migration_progress
from vbs.controller.workflows.steps import StorageParams
from vbs.errors import (
    IdempotentParameterMismatch,
    IncorrectState,
    InsufficientCapacity,
    InvalidParameter,
    MissingParameter,
    NotFound,
    VolumeInUse,
)


def volume_not_found(volume_id: str) -> NotFound:
    return NotFound(f"The volume '{volume_id}' does not exist.", code="InvalidVolume.NotFound")


def live_volume(s: Session, volume_id: str, tenant: str) -> Volume:
    """The tenant's volume row, unless it is unknown, another tenant's or deleted (``InvalidVolume.NotFound``,
    as EC2 answers: another tenant's volume does not exist for this caller)."""
    vol = s.get(Volume, ids.check("volume", volume_id))
    if vol is None or vol.status == VolumeState.DELETED or vol.tenant != tenant:
        raise volume_not_found(volume_id)
    return vol


# Fields newer than some stored digests: left out when not given, so that a request retried with its
# client token across an upgrade still matches the digest an older controller stored.
_DIGEST_OPTIONAL = ("availability_zone", "storage_node", "pool", "host")


def _digest(req: CreateVolumeRequest) -> str:
    body = req.model_dump(exclude={"client_token"})
    for key in _DIGEST_OPTIONAL:
        if body[key] is None:
            del body[key]
    if not body["persistent"]:
        del body["persistent"]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def create_volume(svc: Controller, req: CreateVolumeRequest, tenant: str) -> VolumeOut:
    return VolumeOut.model_validate(create_volume_fields(svc, req, tenant))


def create_volume_json(svc: Controller, req: CreateVolumeRequest, tenant: str) -> bytes:
    """The REST API's answer to a create, encoded from the fields as a page is (``VolumePage.json``):
    no model made, validated, dumped and validated again on the way out."""
    return to_json(create_volume_fields(svc, req, tenant))


def create_volume_fields(svc: Controller, req: CreateVolumeRequest, tenant: str) -> dict[str, Any]:
    if req.placement == "shared" and (req.host is not None or req.persistent):
        raise InvalidParameter("host and persistent are for placement 'local' (a volume in a host's local pool).")
    digest = _digest(req)
    try:
        try:
            out, op_id = _create_in_one_transaction(svc, req, digest, tenant, exclusive=False)
        except _RoomTaken:
            # Creates that committed meanwhile took the room placement found: place again, alone.
            out, op_id = _create_in_one_transaction(svc, req, digest, tenant, exclusive=True)
    except IntegrityError:
        # Another request with the same client token won the race: answer with its volume.
        with svc.db.session() as s:
            answer = _volume_of_client_token(svc, s, req, digest, tenant)
            if answer is None:
                raise
            return answer
    if op_id is not None:
        svc.engine.submit(op_id)
    return out


def _create_in_one_transaction(svc: Controller, req: CreateVolumeRequest, digest: str, tenant: str, *,
                               exclusive: bool) -> tuple[dict[str, Any], str | None]:
    """The new volume's fields and its create operation, committed (or the volume of the request's
    client token, and no operation)."""
    with svc.db.session() as s:
        answer = _volume_of_client_token(svc, s, req, digest, tenant) if req.client_token is not None else None
        if answer is not None:
            return answer, None
        volume, op_id, health = _insert_volume(svc, s, req, digest, tenant, exclusive=exclusive)
        return _describe_fields(svc, s, volume, new_tags=req.tags, health=health), op_id


def _volume_of_client_token(svc: Controller, s: Session, req: CreateVolumeRequest, digest: str,
                            tenant: str) -> dict[str, Any] | None:
    """The fields of the volume an earlier request with this one's client token made (None: none did);
    ``IdempotentParameterMismatch`` if that request was another tenant's or asked for something else."""
    existing = s.scalar(select(Volume).where(Volume.client_token == req.client_token))
    if existing is None:
        return None
    if existing.tenant != tenant or existing.request_digest != digest:
        raise IdempotentParameterMismatch("The client token was already used with different parameters.")
    return _describe_fields(svc, s, existing)


class _RoomTaken(Exception):
    """Creates that committed while this one ran took the room its placement had found."""


def _insert_volume(svc: Controller, s: Session, req: CreateVolumeRequest, digest: str,
                   tenant: str, *, exclusive: bool = False) -> tuple[Volume, str, dict[str, NodeHealth] | None]:
    """The new volume, its create operation, and the health of its storage node as placement read it
    (None: ask the database).

    On PostgreSQL, creates do not wait for each other until their inserts (``db.locks``): placement
    reads the nodes and their promises holding placement and the tenant shared, then the insert
    updates (and locks until commit) the tenant's and the pool's usage rows, and the quota and the
    pool's room are checked on those rows, which now hold every create committed before and this
    one. A pool that filled up meanwhile raises ``_RoomTaken``: the caller tries again ``exclusive``,
    holding placement alone, as every create did before.
    """
    if req.placement == "local":
        return (*_insert_local_volume(svc, s, req, digest, tenant), None)
    cfg = svc.cfg
    # Read before the locks below; the fewer statements a create makes between its insert and its
    # commit, the more creates complete at once (several controllers on PostgreSQL).
    stamp = svc.engine.stamp(s)
    want = Placement(zone=req.availability_zone, node=req.storage_node, pool=req.pool)
    snap: Snapshot | None = None
    if req.snapshot_id is not None:
        snap = _usable_snapshot(s, req.snapshot_id, tenant)
        for asked, there, what in ((req.storage_node, snap.storage_node, "storage node"),
                                   (req.pool, snap.pool, "pool")):
            if asked is not None and asked != there:
                raise InvalidParameter(f"A volume made from the snapshot '{snap.id}' is made where it lives, on "
                                       f"{what} {there}, not {asked}.")
        # Where the snapshot lives, drained or not: draining stops new volumes, not clones of what it holds.
        want = Placement(zone=req.availability_zone, node=snap.storage_node, pool=snap.pool, drained_ok=True)
    size = _checked_size(svc, req, snap)
    key_id, written_encrypted, source_key_id = _volume_key(s, svc, req, snap)
    # A new encrypted volume is formatted (or re-encrypted) by its pool; a clone copies its snapshot's container.
    want = replace(want, encrypted=written_encrypted)
    if not exclusive:
        lock_for_create(s, tenant)
    chosen = choose_placement(s, size, timeout_s=cfg.heartbeat_timeout_s, overcommit=cfg.overcommit_ratio,
                              default_zone=cfg.availability_zone, want=want, shared=not exclusive)
    if exclusive:
        lock_tenant(s, tenant, shared=True)
    if chosen.pool.shared_id is not None:  # its agents' creates update different usage rows
        lock_storage(s, chosen.pool.shared_id)
    node, pool = chosen.row.name, chosen.pool.name
    now = utcnow()
    volume_id = ids.new_id("volume")
    # The operation's rows first: no other transaction waits on them, and the volume's insert below
    # starts what other creates of its tenant or pool wait for until this one commits.
    op_id = svc.engine.begin(s, CREATE_VOLUME, volume_id, CreateVolumeParams(
        node=node, pool=pool, size_gib=size, snapshot_id=req.snapshot_id, encrypted=key_id is not None,
        format_key=written_encrypted, source_key_id=source_key_id), new_resource=True, stamp=stamp)
    health = health_of([chosen.row], now=now, timeout_s=cfg.heartbeat_timeout_s, default_zone=cfg.availability_zone)
    volume = Volume(
        id=volume_id, size_gib=size, comment=req.comment, snapshot_id=req.snapshot_id,
        volume_type=req.volume_type, iops=req.iops, throughput=req.throughput, multi_attach=req.multi_attach,
        placement=req.placement, storage_node=node, pool=pool, status=VolumeState.CREATING, progress=0, tenant=tenant,
        client_token=req.client_token, request_digest=digest, created_at=now, updated_at=now, key_id=key_id,
    )
    s.add(volume)
    s.flush()  # the usage rows of its tenant and pool are now this transaction's until it commits
    _check_after_insert(s, cfg, tenant, chosen, exclusive=exclusive)
    if req.tags:
        set_tags(s, volume.id, req.tags)
    return volume, op_id, health


def _check_after_insert(s: Session, cfg: ControllerConfig, tenant: str, chosen: Chosen, *, exclusive: bool) -> None:
    """The tenant's quota and the pool's room, read in one statement from the usage rows the volume's
    insert locked: they count every create committed before and this one."""
    volumes = gib = 0
    promised: dict[tuple[str, str], int] = {}
    for scope, owner, pool, count, size in plain.execute(s, _USAGE_AFTER_INSERT, {
            "tenant": tenant, "nodes": sorted({node for node, _ in chosen.storage})}):
        if scope == "tenant":
            volumes, gib = int(count), int(size)
        else:
            promised[(owner, pool)] = int(size)
    quotas.refuse_over_volume_quota(cfg, volumes, gib + chosen.growing.tenants.get(tenant, 0))
    if not chosen.still_has_room(promised, cfg.overcommit_ratio):
        if not exclusive:
            raise _RoomTaken
        raise InsufficientCapacity(f"The pool {chosen.pool.name} on {chosen.row.name} has promised all it may "
                                   f"(capacity x overcommit ratio {cfg.overcommit_ratio:g}).", status=400)


_USAGE_AFTER_INSERT = select(VolumeUsage.scope, VolumeUsage.owner, VolumeUsage.pool, VolumeUsage.volumes,
                             VolumeUsage.gib).where(or_(
                                 and_(VolumeUsage.scope == "tenant", VolumeUsage.owner == bindparam("tenant"),
                                      VolumeUsage.pool == ""),
                                 and_(VolumeUsage.scope == "pool",
                                      VolumeUsage.owner.in_(bindparam("nodes", expanding=True)))))


def _checked_size(svc: Controller, req: CreateVolumeRequest, snap: Snapshot | None) -> int:
    """The new volume's size: as asked, or its snapshot's; at least the snapshot's, within the service's
    limit and the volume type's rules."""
    size = req.size_gib
    if snap is not None:
        size = size if size is not None else snap.volume_size_gib
        if size < snap.volume_size_gib:
            raise InvalidParameter(
                f"The volume size ({size} GiB) must be at least the snapshot size ({snap.volume_size_gib} GiB).")
    if size is None:
        raise MissingParameter("The request must contain the parameter size_gib (or a snapshot_id).")
    if size > svc.cfg.max_volume_gib:
        raise InvalidParameter(f"The volume size {size} GiB exceeds this service's limit of "
                               f"{svc.cfg.max_volume_gib} GiB.")
    volume_types.check(req.volume_type, size, req.iops, req.throughput, req.multi_attach)
    return size


def _usable_snapshot(s: Session, snapshot_id: str, tenant: str) -> Snapshot:
    """The completed snapshot a new volume is made from, touched in this transaction so that a concurrent
    delete-snapshot waits for it."""
    snap = s.get(Snapshot, snapshot_id)
    if snap is None or snap.status in (SnapshotState.DELETING, SnapshotState.DELETED) \
            or not snapshot_sharing.usable(s, snap, tenant):
        raise NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")
    hit = s.execute(update(Snapshot).where(Snapshot.id == snap.id, Snapshot.status == SnapshotState.COMPLETED)
                    .values(updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
    if hit != 1:
        raise IncorrectState(f"The snapshot '{snap.id}' is '{snap.status}'; it must be completed.")
    return snap


def _insert_local_volume(svc: Controller, s: Session, req: CreateVolumeRequest, digest: str,
                         tenant: str) -> tuple[Volume, str]:
    """A volume in the local pool of ``req.host`` (semi-shared storage): its storage node is that host."""
    cfg = svc.cfg
    if req.host is None:
        raise MissingParameter("A local volume needs the parameter host: the hypervisor node whose local pool "
                               "holds it.")
    if req.encrypted or req.kms_key_id is not None or req.multi_attach:
        raise InvalidParameter("A local volume is neither encrypted nor multi-attach.")
    if req.storage_node is not None or req.pool is not None or req.availability_zone is not None:
        raise InvalidParameter("A local volume is placed by host, not by zone, storage node or pool.")
    snap = _usable_snapshot(s, req.snapshot_id, tenant) if req.snapshot_id is not None else None
    if snap is not None and snap.key_id is not None:
        raise InvalidParameter(f"The snapshot '{snap.id}' is encrypted; a local volume cannot be made from it.")
    size = _checked_size(svc, req, snap)
    pool = choose_local_pool(s, req.host, size, timeout_s=cfg.heartbeat_timeout_s, overcommit=cfg.overcommit_ratio)
    quotas.check_volumes(s, cfg, tenant, new_volumes=1, new_gib=size)
    now = utcnow()
    volume = Volume(
        id=ids.new_id("volume"), size_gib=size, comment=req.comment, snapshot_id=req.snapshot_id,
        volume_type=req.volume_type, iops=req.iops, throughput=req.throughput, multi_attach=False,
        placement="local", storage_node=req.host, pool=pool, host=req.host, persistent=req.persistent,
        status=VolumeState.CREATING, progress=0, tenant=tenant, client_token=req.client_token, request_digest=digest,
        created_at=now, updated_at=now,
    )
    s.add(volume)
    s.flush()
    set_tags(s, volume.id, req.tags)
    op_id = svc.engine.begin(s, CREATE_LOCAL_VOLUME, volume.id, CreateLocalVolumeParams(
        host=req.host, pool=pool, size_gib=size, snapshot_id=req.snapshot_id,
        snapshot_node=snap.storage_node if snap else None, snapshot_pool=snap.pool if snap else None,
        scratch_volume_id=ids.new_id("volume") if snap else None), new_resource=True)
    return volume, op_id


def _volume_key(s: Session, svc: Controller, req: CreateVolumeRequest,
                snap: Snapshot | None) -> tuple[str | None, bool, str | None]:
    """(the new volume's data key, whether its pool writes it encrypted, the key its snapshot opens with
    for that): a clone of an encrypted snapshot shares its key, as on EBS; asked for another KMS key, or
    encryption of a plain snapshot, the pool re-encrypts the data under a new key as it copies it."""
    if not req.encrypted and req.kms_key_id is None and (snap is None or snap.key_id is None):
        return None, False, None  # the plain case, most of them
    key_id, source_key_id = encryption.key_for_copy(s, svc.master_key, snap.key_id if snap else None,
                                                    encrypted=req.encrypted, kms_key_id=req.kms_key_id)
    if snap is None:
        return key_id, key_id is not None, None
    return key_id, key_id != snap.key_id, source_key_id


def delete_volume(svc: Controller, volume_id: str, tenant: str) -> VolumeOut:
    with svc.db.session() as s:
        # Locked first, the row and its attachments and snapshots are read as they are once every
        # earlier change of the volume committed (PostgreSQL; SQLite serialises writers anyway).
        lock_rows(s, Volume, ids.check("volume", volume_id))
        vol = live_volume(s, volume_id, tenant)
        if vol.status == VolumeState.IN_USE:
            raise VolumeInUse(f"The volume '{volume_id}' is attached; detach it first.")
        pending = exists().where(Snapshot.volume_id == volume_id, Snapshot.status == SnapshotState.PENDING)
        if s.scalar(select(pending)):
            raise IncorrectState(f"The volume '{volume_id}' has a snapshot in progress; delete it when it completes.")
        live_attachment = exists().where(Attachment.volume_id == volume_id,
                                         Attachment.status != AttachmentState.DETACHED)
        transition(s, Volume, volume_id, VolumeState.DELETING, ~pending, ~live_attachment)
        op_id = svc.engine.begin(s, DELETE_LOCAL_VOLUME if vol.placement == "local" else DELETE_VOLUME,
                                 volume_id, StorageParams(node=vol.storage_node, pool=vol.pool))
        s.refresh(vol)
        out = _describe_one(svc, s, vol)
    svc.engine.submit(op_id)
    return out


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
    column_filters = {name: values for name, values in filters.items() if name != "availability-zone"}
    history = VolumeState.DELETED in filters.get("status", ()) or (deleted_by_id and bool(volume_ids))
    shown = or_(Volume.status != VolumeState.DELETED, Volume.deleted_at >= retention) if history \
        else Volume.status != VolumeState.DELETED
    # Plain rows, not ORM objects: a page is read once and described, and 1,000 tracked objects cost
    # more to load and to read than the rows themselves.
    stmt = select(*Volume.__table__.columns).where(Volume.tenant == tenant, shown,
                                                   *flt.where_clauses(column_filters, Volume.id, VOLUME_FILTERS))
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
        return VolumePage(_describe_many(svc, s, rows, within=stmt.with_only_columns(Volume.id)), token)


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


def _describe_one(svc: Controller, s: Session, vol: Volume) -> VolumeOut:
    return VolumeOut.model_validate(_describe_fields(svc, s, vol))


def _describe_fields(svc: Controller, s: Session, vol: Volume, *, new_tags: dict[str, str] | None = None,
                     health: dict[str, NodeHealth] | None = None) -> dict[str, Any]:
    """VolumeOut's fields of ``vol``; ``new_tags``: this transaction just inserted it with these tags, so it
    has no attachment or migration yet and only its node is read (the answer of every create), unless
    ``health`` holds that node's."""
    fields = {key: getattr(vol, key) for key in _COLUMNS}
    return _describe_many(svc, s, [fields], new_tags=None if new_tags is None else {vol.id: dict(new_tags)},
                          health=health)[0]


# A volume as described: its table's columns by name. Read through a mapping: a Row's attributes cost
# about 0.4 µs each (SQLAlchemy 2.1), ten times a mapping's, and a page of 1,000 reads 25,000.
VolumeFields = Mapping[Any, Any]  # a RowMapping, or a dict of the columns


def _describe_many(svc: Controller, s: Session, vols: Sequence[VolumeFields], *,
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
