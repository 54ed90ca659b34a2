"""CopySnapshot as the API offers it: a new snapshot of the caller's from one it owns or was shared,
filled by the copy-snapshot workflow.
"""

from __future__ import annotations

from sqlalchemy import update

from vbs import ids
from vbs.controller.auth import encryption
from vbs.controller.db import Node, Snapshot
from vbs.controller.db.states import GONE_SNAPSHOT, SnapshotState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import pool_of
from vbs.controller.placement import quotas
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.requests.describe_snapshots import describe_many, snapshot_not_found
from vbs.controller.requests.snapshot_tiers import refuse_if_moved_out
from vbs.controller.requests.tags import set_tags
from vbs.controller.rest.schemas.snapshots import CopySnapshotRequest, SnapshotOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.copy_snapshot import COPY_SNAPSHOT, CopySnapshotParams
from vbs.controller.workflows.stored import copy_share
from vbs.errors import IncorrectState


def copy_snapshot(svc: Controller, req: CopySnapshotRequest, tenant: str) -> SnapshotOut:
    """A new snapshot of the tenant's with the data of ``req.source_snapshot_id`` (its own, or one shared with
    it), made where the source lives; the source may not be deleted until the copy is completed."""
    with svc.db.session() as s:
        source = s.get(Snapshot, req.source_snapshot_id)
        if source is None or source.status in GONE_SNAPSHOT \
                or not sharing.usable(s, source, tenant):
            raise snapshot_not_found(req.source_snapshot_id)
        refuse_if_moved_out(s, source.id)
        # Touching the source in this transaction makes a concurrent delete of it wait for us.
        hit = s.execute(update(Snapshot).where(Snapshot.id == source.id, Snapshot.status == SnapshotState.COMPLETED)
                        .values(updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
        if hit != 1:
            raise IncorrectState(f"The snapshot '{source.id}' is '{source.status}'; it must be completed.",
                                 code="IncorrectState")
        key_id, reencrypt, source_key_id = encryption.key_for_copy(
            s, svc.master_key, source.key_id, encrypted=req.encrypted, kms_key_id=req.kms_key_id,
            source_plain=source.plain_data)
        pool = pool_of(s.get(Node, (source.storage_node, "storage")), source.pool)
        if reencrypt and (pool is None or not pool.encryption):
            raise IncorrectState(f"The pool of the snapshot '{source.id}' cannot make encrypted copies.")
        quotas.check_snapshots(s, svc.cfg, tenant)
        now = utcnow()
        snap = Snapshot(id=ids.new_id("snapshot"), volume_id=source.volume_id, volume_size_gib=source.volume_size_gib,
                        comment=req.comment, storage_node=source.storage_node, pool=source.pool,
                        status=SnapshotState.PENDING, progress=0, started_at=now, updated_at=now, tenant=tenant,
                        source_snapshot_id=source.id, key_id=key_id)
        s.add(snap)
        s.flush()
        set_tags(s, snap.id, req.tags)
        op_id = svc.engine.begin(s, COPY_SNAPSHOT, snap.id, CopySnapshotParams(
            node=source.storage_node, pool=source.pool, source_snapshot_id=source.id,
            scratch_volume_id=ids.new_id("volume"), size_gib=source.volume_size_gib,
            encrypted=key_id is not None, key_id=key_id if reencrypt else None, source_key_id=source_key_id,
            store_share=copy_share(s, source.storage_node, source.pool)))
        out = describe_many(s, [snap])[0]
    svc.engine.submit(op_id)
    return out
