"""The controller's tables. Portable SQL only: the same schema runs on SQLite and PostgreSQL.

State columns are never used as locks: every change of ``status`` goes through a conditional
``UPDATE … WHERE id = ? AND status IN (…)`` whose allowed states come from ``states.py``
(see ``vbs.controller.db.transitions``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    false,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every database (SQLite drops the zone otherwise; PostgreSQL keeps
    the instant in ``timestamptz`` and answers in its session's zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        # PostgreSQL answers in its session's time zone (whatever the server's TimeZone is): back to UTC.
        return value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


# Resources made before tenants existed, and by the bootstrap keys, belong to this tenant.
DEFAULT_TENANT = "default"


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class VolumeUsage(Base):
    """What a tenant (scope "tenant", pool "") or a storage node's pool (scope "pool") holds: its volumes
    that are not deleted and their GiB. Kept by triggers on ``volumes`` (migration 0011_volume_usage),
    in the transaction that changes a volume: never written by the code."""

    __tablename__ = "volume_usage"

    scope: Mapped[str] = mapped_column(String(8), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    pool: Mapped[str] = mapped_column(String(64), primary_key=True)
    volumes: Mapped[int] = mapped_column(BigInteger)
    gib: Mapped[int] = mapped_column(BigInteger)


class _StoredResource:
    """The columns a volume and a snapshot both have: the storage node and pool that hold it, its state
    (why, how far along), and the tenant that owns it. The table puts them after the class's own columns;
    the order of a table's columns in the database is the migrations', not this one."""

    storage_node: Mapped[str] = mapped_column(String(64), index=True)
    pool: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), index=True)
    status_reason: Mapped[str | None] = mapped_column(Text)
    progress: Mapped[int] = mapped_column(Integer, default=0)
    tenant: Mapped[str] = mapped_column(String(64), index=True, default=DEFAULT_TENANT,
                                        server_default=DEFAULT_TENANT)


class Volume(_StoredResource, Base):
    __tablename__ = "volumes"
    # Keyset pages of a tenant's volumes, and the sums each create makes (quota, placement) from the
    # index alone (migration 0010_scale_indexes).
    __table_args__ = (
        Index("ix_volumes_tenant_id", "tenant", "id"),
        Index("ix_volumes_tenant_usage", "tenant", "status", "size_gib"),
        Index("ix_volumes_pool_usage", "storage_node", "pool", "status", "size_gib"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    size_gib: Mapped[int] = mapped_column(Integer)
    comment: Mapped[str] = mapped_column(String(255), default="")
    snapshot_id: Mapped[str | None] = mapped_column(String(32), index=True)
    volume_type: Mapped[str] = mapped_column(String(16))
    iops: Mapped[int | None] = mapped_column(Integer)
    throughput: Mapped[int | None] = mapped_column(Integer)
    multi_attach: Mapped[bool] = mapped_column(Boolean, default=False)
    placement: Mapped[str] = mapped_column(String(16))
    client_token: Mapped[str | None] = mapped_column(String(64), unique=True)
    request_digest: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]
    # Encrypted (a LUKS container): its data key (VolumeKey); None: not encrypted.
    key_id: Mapped[str | None] = mapped_column(String(32))
    # Placement "local": the host whose local pool holds it; whether it outlives its detach.
    host: Mapped[str | None] = mapped_column(String(64))
    persistent: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Snapshot(_StoredResource, Base):
    __tablename__ = "snapshots"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    volume_id: Mapped[str] = mapped_column(String(32), index=True)
    volume_size_gib: Mapped[int] = mapped_column(Integer)
    comment: Mapped[str] = mapped_column(String(255), default="")
    started_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    # CopySnapshot: the snapshot this one copies (which may not be deleted while the copy is pending).
    source_snapshot_id: Mapped[str | None] = mapped_column(String(32), index=True)
    # Encrypted: the data key (VolumeKey) of the volume it was taken of.
    key_id: Mapped[str | None] = mapped_column(String(32))
    # Encrypted under ``key_id`` though its data is no LUKS container: its blocks were put through the EBS
    # direct APIs as plaintext, kept as the snapshot store keeps every chunk (docs/ebs-direct.md
    # "Encrypted snapshots"); a volume made from it is encrypted under the key as it is restored.
    plain_data: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The snapshot store (docs/snapshots.md): None while it is kept in its pool only, "uploading",
    # "stored" once its manifest is in ``store`` (its storage nodes' description of it), or "error";
    # the bytes of its chunks that are not zeros; and whether its pool still holds its own copy (a
    # reflink or RBD pool keeps it as the fast tier, a copy pool gives it up once it is stored).
    store_state: Mapped[str | None] = mapped_column(String(16))
    store: Mapped[str | None] = mapped_column(String(1024))
    stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    pool_copy: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())


class DirectSnapshot(Base):
    """A snapshot written through the EBS direct APIs (StartSnapshot): how it was asked for, and, while
    it is pending, until when. Kept after it completes: ``parent_snapshot_id`` is its lineage
    (ListChangedBlocks compares snapshots of one lineage only)."""

    __tablename__ = "direct_snapshots"
    __table_args__ = (Index("uq_direct_snapshots_token", "tenant", "client_token", unique=True),)

    snapshot_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    client_token: Mapped[str | None] = mapped_column(String(64))
    request_digest: Mapped[str] = mapped_column(String(64))
    parent_snapshot_id: Mapped[str | None] = mapped_column(String(32), index=True)
    # The lineage: the source volume of the first ordinary snapshot up the parents, else the first
    # direct snapshot's own id.
    lineage: Mapped[str] = mapped_column(String(32), index=True)
    volume_size_bytes: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime]
    # "open" (blocks may be put), "completing" (CompleteSnapshot writes its manifest: no more blocks),
    # "done" or "failed"; since when (a completion that a crash left is open again after a while).
    state: Mapped[str] = mapped_column(String(16))
    state_changed_at: Mapped[datetime]


class DirectBlock(Base):
    """A block written by PutSnapshotBlock into a pending snapshot: the chunk that holds it (None: zeros)
    and the SHA-256 its writer sent (base64), for CompleteSnapshot's aggregate checksum."""

    __tablename__ = "direct_blocks"

    snapshot_id: Mapped[str] = mapped_column(String(32), ForeignKey("direct_snapshots.snapshot_id"),
                                             primary_key=True)
    block_index: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    chunk_id: Mapped[str | None] = mapped_column(String(64))
    checksum: Mapped[str] = mapped_column(String(64))


class SnapshotLock(Base):
    """LockSnapshot's lock of a snapshot against deletion (vbs.controller.requests.snapshot_locks): its mode
    (governance, compliance), until when, and a compliance lock's cooling-off period."""

    __tablename__ = "snapshot_locks"

    snapshot_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    mode: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]
    duration_start: Mapped[datetime]
    expires_at: Mapped[datetime]
    duration_days: Mapped[int | None] = mapped_column(Integer)
    cool_off_hours: Mapped[int | None] = mapped_column(Integer)
    cool_off_expires_at: Mapped[datetime | None]


class SnapshotTier(Base):
    """A snapshot's storage tier once it was ever moved (vbs.controller.requests.snapshot_tiers): ``archive``
    (its pool's fast copy dropped; volumes are not made from it until it is restored) or ``standard``, and
    its last tiering operation as EC2's DescribeSnapshotTierStatus shows it."""

    __tablename__ = "snapshot_tiers"

    snapshot_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tier: Mapped[str] = mapped_column(String(16))
    last_status: Mapped[str] = mapped_column(String(40))
    last_started_at: Mapped[datetime]
    last_progress: Mapped[int] = mapped_column(Integer, default=0)
    last_detail: Mapped[str | None] = mapped_column(Text)
    archived_at: Mapped[datetime | None]
    # A temporary restore: when the snapshot goes back to the archive tier.
    restore_expires_at: Mapped[datetime | None]
    # The separate archive store that holds it (archived, or restored for now); None: there is none.
    archive_store: Mapped[str | None] = mapped_column(String(1024))


class VolumeKey(Base):
    """The data key of an encrypted volume, and of its snapshots and clones (a clone of a LUKS container
    opens with the same passphrase), sealed with the controller's master key."""

    __tablename__ = "volume_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    sealed_key: Mapped[str] = mapped_column(Text)
    kms_key_id: Mapped[str] = mapped_column(String(2048))
    created_at: Mapped[datetime]


class SnapshotPermission(Base):
    """ModifySnapshotAttribute's createVolumePermission: a tenant (or ``all``) that may make volumes from a
    snapshot, and copy it, though another tenant owns it."""

    __tablename__ = "snapshot_permissions"

    snapshot_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    grantee: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)


class AccessKeyRecord(Base):
    """An access key made by ``vbs create-key``: its tenant, its role and its secret, sealed.

    SigV4 needs the secret itself (not a hash), so it is kept encrypted with the controller's
    master key (``vbs.controller.auth.keys``); the row alone reveals nothing usable.
    """

    __tablename__ = "access_keys"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    role: Mapped[str] = mapped_column(String(16))
    sealed_secret: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]


class Tag(Base):
    __tablename__ = "tags"

    resource_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[str] = mapped_column(String(256), default="")


class Node(Base):
    """A storage node or a hypervisor host, as last reported by its agent's heartbeat.

    ``drained`` is the operator's (``vbs drain-storage-node``), never a heartbeat's: a drained storage
    node takes no new volumes, except clones of the snapshots it holds."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    url: Mapped[str] = mapped_column(String(255))
    address: Mapped[str] = mapped_column(String(255))
    info: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    started_at: Mapped[datetime | None]
    last_heartbeat: Mapped[datetime]
    drained: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Instance(Base):
    """A VM discovered by a host agent."""

    __tablename__ = "instances"
    __table_args__ = (Index("ix_instances_host_vm", "host", "vm_id", unique=True),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    host: Mapped[str] = mapped_column(String(64))
    vm_id: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(255), default="")
    state: Mapped[str] = mapped_column(String(16))
    first_seen: Mapped[datetime]
    last_seen: Mapped[datetime]
    # The ids external clouds give the VM, as its host agent reports them: a JSON object
    # {"nova": "<uuid>"} (VmInfo.cloud_ids), which instance-id resolvers look up.
    cloud_ids: Mapped[str] = mapped_column(String(2048), default="{}")


class Attachment(Base):
    """A volume's attachment to a VM on a host; ``status`` moves as states.py's table allows."""

    __tablename__ = "attachments"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    volume_id: Mapped[str] = mapped_column(String(32), ForeignKey("volumes.id"), index=True)
    instance_id: Mapped[str | None] = mapped_column(String(32))
    host: Mapped[str] = mapped_column(String(64))
    vm_id: Mapped[str] = mapped_column(String(64))
    device: Mapped[str] = mapped_column(String(32))
    mode: Mapped[str] = mapped_column(String(2))
    status: Mapped[str] = mapped_column(String(16), index=True)
    status_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


_UNFINISHED_EXCLUSIVE = text("status IN ('running', 'rolling-back') AND exclusive")


class Operation(Base):
    """One multi-step workflow; its steps are recorded before and after each agent call.

    ``params`` is the workflow's typed parameters (never a secret). ``exclusive`` operations
    (``Workflow.exclusive``) are one at a time per resource while unfinished: a partial unique
    index says so, on SQLite and PostgreSQL alike.
    """

    __tablename__ = "operations"
    __table_args__ = (
        Index("uq_operations_exclusive_unfinished", "resource_id", unique=True,
              sqlite_where=_UNFINISHED_EXCLUSIVE, postgresql_where=_UNFINISHED_EXCLUSIVE),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    resource_id: Mapped[str] = mapped_column(String(32), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    exclusive: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None]
    failing_since: Mapped[datetime | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    # The controller running it, until when (DB clock), and its fencing token (docs/architecture.md §6).
    owner: Mapped[str | None] = mapped_column(String(64), index=True)
    lease_until: Mapped[datetime | None]
    fence: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class ControllerRecord(Base):
    """A controller that runs (or ran) on this database, as its lease loop last renewed it."""

    __tablename__ = "controllers"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime]
    last_seen: Mapped[datetime]


class LeaseRecord(Base):
    """A singleton loop's lease: one controller at a time runs the loop ``name``."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64))
    lease_until: Mapped[datetime]
    fence: Mapped[int] = mapped_column(BigInteger)


class FenceCounter(Base):
    """SQLite's source of fences (PostgreSQL has the ``vbs_fence`` sequence): one row."""

    __tablename__ = "fence_counter"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


class OperationStep(Base):
    __tablename__ = "operation_steps"

    operation_id: Mapped[str] = mapped_column(String(32), ForeignKey("operations.id"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime]


class VolumeModification(Base):
    """One ModifyVolume request and how far it got (EC2 DescribeVolumesModifications)."""

    __tablename__ = "volume_modifications"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    volume_id: Mapped[str] = mapped_column(String(32), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    status_message: Mapped[str | None] = mapped_column(Text)
    original_size_gib: Mapped[int] = mapped_column(Integer)
    target_size_gib: Mapped[int] = mapped_column(Integer)
    original_volume_type: Mapped[str] = mapped_column(String(16))
    target_volume_type: Mapped[str] = mapped_column(String(16))
    original_iops: Mapped[int | None] = mapped_column(Integer)
    target_iops: Mapped[int | None] = mapped_column(Integer)
    original_throughput: Mapped[int | None] = mapped_column(Integer)
    target_throughput: Mapped[int | None] = mapped_column(Integer)
    progress: Mapped[int] = mapped_column(Integer, default=0)
    start_time: Mapped[datetime]
    end_time: Mapped[datetime | None]
