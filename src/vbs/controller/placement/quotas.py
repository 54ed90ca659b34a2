"""Per-tenant limits: how many volumes, how many GiB of them, and how many snapshots a tenant may hold.

Limits are per tenant, not per key: resources belong to a tenant and all of its keys share them, so
making more keys buys no more room. The defaults are config keys (``quota_volumes``, ``quota_gib``,
``quota_snapshots``). Checks run inside the transaction that inserts the resource: on SQLite writes
are serialised; on PostgreSQL each check first takes the tenant's advisory lock (``db.locks``), so two
concurrent creates (or a create and a modify) of one tenant cannot both slip under a limit. A create
of a network volume checks after its insert instead, under the usage row that insert locked
(``volumes._insert_volume``), and takes the tenant's lock shared, so that the checks which take it
exclusively (a growth, a local volume) still see it whole.

A pool may also limit the snapshots of one volume (RBD: 450 an image): its agent reports the limit
(``PoolInfo.max_snapshots_per_volume``) and the next snapshot is refused here, before anything is made.
The volume's row is locked by then (the create touches it first), so two creates cannot both pass.
"""

from __future__ import annotations

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from vbs.config import ControllerConfig
from vbs.controller.db import Node, Snapshot, Volume, VolumeUsage, plain
from vbs.controller.db.locks import lock_tenant
from vbs.controller.db.states import SnapshotState
from vbs.controller.fleet.nodes import storage_info
from vbs.controller.placement.growth import growing
from vbs.errors import LimitExceeded, VolumeSnapshotLimitExceeded


def check_volumes(s: Session, cfg: ControllerConfig, tenant: str, *, new_volumes: int, new_gib: int) -> None:
    """Refuse (``VolumeLimitExceeded``) what would take ``tenant`` over its volume count or GiB (growths
    in progress count: ``growth``)."""
    lock_tenant(s, tenant)
    count, gib = tenant_usage(s, tenant)
    gib += growing(s).tenants.get(tenant, 0)
    refuse_over_volume_quota(cfg, count + new_volumes, gib + new_gib)


def refuse_over_volume_quota(cfg: ControllerConfig, volumes: int, gib: int) -> None:
    """``VolumeLimitExceeded`` if a tenant would hold ``volumes`` volumes of ``gib`` GiB in all, over its limits."""
    if volumes > cfg.quota_volumes:
        raise LimitExceeded(f"The maximum number of volumes ({cfg.quota_volumes}) has been reached.",
                            code="VolumeLimitExceeded")
    if gib > cfg.quota_gib:
        raise LimitExceeded(f"This request would take the volumes' total size to {gib} GiB, above the "
                            f"limit of {cfg.quota_gib} GiB.", code="VolumeLimitExceeded")


def tenant_usage(s: Session, tenant: str) -> tuple[int, int]:
    """(volumes, GiB) that ``tenant`` holds, deleted volumes excepted: one row the database keeps
    (``VolumeUsage``), not a sum over the tenant's volumes."""
    row = plain.execute(s, _TENANT_USAGE, {"tenant": tenant}).one_or_none()  # this transaction's volumes count
    return (int(row.volumes), int(row.gib)) if row is not None else (0, 0)


_TENANT_USAGE = select(VolumeUsage.volumes, VolumeUsage.gib).where(
    VolumeUsage.scope == "tenant", VolumeUsage.owner == bindparam("tenant"), VolumeUsage.pool == "")


def check_snapshots(s: Session, cfg: ControllerConfig, tenant: str) -> None:
    """Refuse (``SnapshotLimitExceeded``) one more snapshot over ``tenant``'s limit."""
    lock_tenant(s, tenant)
    count = s.scalar(select(func.count()).select_from(Snapshot)
                     .where(Snapshot.tenant == tenant, Snapshot.status != SnapshotState.DELETED)) or 0
    if count + 1 > cfg.quota_snapshots:
        raise LimitExceeded(f"The maximum number of snapshots ({cfg.quota_snapshots}) has been reached.",
                            code="SnapshotLimitExceeded")


def check_volume_snapshots(s: Session, vol: Volume) -> None:
    """Refuse (``VolumeSnapshotLimitExceeded``) a snapshot of ``vol`` over its pool's limit per volume."""
    node = s.get(Node, (vol.storage_node, "storage"))
    pools = storage_info(node).pools if node is not None else []
    limit = next((p.max_snapshots_per_volume for p in pools if p.name == vol.pool), None)
    if limit is None:
        return
    count = s.scalar(select(func.count()).select_from(Snapshot)
                     .where(Snapshot.volume_id == vol.id, Snapshot.status != SnapshotState.DELETED)) or 0
    if count + 1 > limit:
        raise VolumeSnapshotLimitExceeded(
            f"The volume '{vol.id}' has {count} snapshots, the most its pool '{vol.pool}' allows ({limit}); "
            "delete one of them first.", volume_id=vol.id, limit=limit)
