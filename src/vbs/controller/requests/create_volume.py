"""CreateVolume as the API offers it: validated, placed by the scheduler and recorded with its operation in
one transaction (idempotent by client token), then handed to the create-volume workflow.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

from pydantic_core import to_json
from sqlalchemy import and_, bindparam, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vbs import ids
from vbs.config import ControllerConfig
from vbs.controller.auth import encryption
from vbs.controller.db import Node, Snapshot, Volume, VolumeUsage, plain
from vbs.controller.db.locks import lock_for_create, lock_storage, lock_tenant
from vbs.controller.db.states import GONE_SNAPSHOT, SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.describe_nodes import NodeHealth, health_of
from vbs.controller.fleet.nodes import is_alive, pool_of
from vbs.controller.placement import quotas, volume_types
from vbs.controller.placement.scheduler import Chosen, Placement, choose_local_pool, choose_placement
from vbs.controller.requests import snapshot_permissions as snapshot_sharing
from vbs.controller.requests.describe_volumes import describe_fields
from vbs.controller.requests.snapshot_tiers import refuse_if_archived
from vbs.controller.requests.tags import set_tags
from vbs.controller.rest.schemas.volumes import CreateVolumeRequest, VolumeOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows import stored
from vbs.controller.workflows.create_volume import CREATE_VOLUME, CreateVolumeParams
from vbs.controller.workflows.local_volumes import CREATE_LOCAL_VOLUME, CreateLocalVolumeParams
from vbs.errors import (
    IdempotentParameterMismatch,
    IncorrectState,
    InsufficientCapacity,
    InvalidParameter,
    MissingParameter,
    NotFound,
)

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
        return describe_fields(svc, s, volume, new_tags=req.tags, health=health), op_id


def _volume_of_client_token(svc: Controller, s: Session, req: CreateVolumeRequest, digest: str,
                            tenant: str) -> dict[str, Any] | None:
    """The fields of the volume an earlier request with this one's client token made (None: none did);
    ``IdempotentParameterMismatch`` if that request was another tenant's or asked for something else."""
    existing = s.scalar(select(Volume).where(Volume.client_token == req.client_token))
    if existing is None:
        return None
    if existing.tenant != tenant or existing.request_digest != digest:
        raise IdempotentParameterMismatch("The client token was already used with different parameters.")
    return describe_fields(svc, s, existing)


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
        want = _where_from_snapshot(s, cfg, snap, req)
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
        raise MissingParameter("The request must contain the parameter size_gib (or snapshot_id).")
    if size > svc.cfg.max_volume_gib:
        raise InvalidParameter(f"The volume size {size} GiB exceeds this service's limit of "
                               f"{svc.cfg.max_volume_gib} GiB.")
    volume_types.check(req.volume_type, size, req.iops, req.throughput, req.multi_attach)
    return size


def _where_from_snapshot(s: Session, cfg: ControllerConfig, snap: Snapshot, req: CreateVolumeRequest) -> Placement:
    """Where a volume made from ``snap`` goes: beside its pool's copy (a clone: instant on reflink and RBD)
    while that pool holds one, its node is alive and the request names no other place; else, for a
    snapshot in the snapshot store, wherever placement finds room among the pools that reach that store
    (the volume is hydrated from it: another node, another pool, its origin gone)."""
    elsewhere = any(asked is not None and asked != there
                    for asked, there in ((req.storage_node, snap.storage_node), (req.pool, snap.pool)))
    in_store = snap.store_state == stored.STORED and snap.store is not None
    if snap.pool_copy and not elsewhere:
        origin = s.get(Node, (snap.storage_node, "storage"))
        origin_pool = pool_of(origin, snap.pool) if origin is not None else None
        # A lost pool (docs/operations.md "A lost pool") holds no copy any more, whatever its row says.
        origin_up = origin is not None and is_alive(origin, cfg.heartbeat_timeout_s, utcnow()) \
            and origin_pool is not None and origin_pool.lost is None
        if origin_up or not in_store:
            # Where the snapshot lives, drained or not: draining stops new volumes, not clones of what it holds.
            return Placement(zone=req.availability_zone, node=snap.storage_node, pool=snap.pool, drained_ok=True)
    if in_store:
        return Placement(zone=req.availability_zone, node=req.storage_node, pool=req.pool, store=snap.store)
    asked, there, what = ((req.storage_node, snap.storage_node, "storage node")
                          if req.storage_node not in (None, snap.storage_node) else (req.pool, snap.pool, "pool"))
    raise InvalidParameter(f"A volume made from the snapshot '{snap.id}' is made where it lives, on {what} {there}, "
                           f"not {asked}: it is not in the snapshot store.")


def _usable_snapshot(s: Session, snapshot_id: str, tenant: str) -> Snapshot:
    """The completed snapshot a new volume is made from, touched in this transaction so that a concurrent
    delete-snapshot waits for it."""
    snap = s.get(Snapshot, snapshot_id)
    if snap is None or snap.status in GONE_SNAPSHOT \
            or not snapshot_sharing.usable(s, snap, tenant):
        raise NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")
    refuse_if_archived(s, snap.id)
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
    encryption of a plain snapshot, the pool re-encrypts the data under a new key as it copies it; a snapshot
    encrypted over plaintext blocks (``plain_data``) is encrypted as it is copied."""
    if not req.encrypted and req.kms_key_id is None and (snap is None or snap.key_id is None):
        return None, False, None  # the plain case, most of them
    copy = encryption.key_for_copy(s, svc.master_key, snap.key_id if snap else None, encrypted=req.encrypted,
                                   kms_key_id=req.kms_key_id, source_plain=snap is not None and snap.plain_data)
    return copy.key_id, copy.rewrite, copy.source_key_id
