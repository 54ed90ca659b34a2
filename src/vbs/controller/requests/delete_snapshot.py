"""DeleteSnapshot as the API offers it: refused while it is locked (LockSnapshot) or a volume is being made
from it, else put in the Recycle Bin if a retention rule matches it (docs/recycle-bin.md), else moved to
``deleting`` with its operation in one transaction and handed to the delete-snapshot workflow.
"""

from __future__ import annotations

from sqlalchemy import exists, select
from sqlalchemy.orm import aliased

from vbs import ids
from vbs.controller.db import Snapshot, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import GONE_SNAPSHOT, SnapshotState, VolumeState
from vbs.controller.db.transitions import transition
from vbs.controller.requests import recycle_bin
from vbs.controller.requests import snapshot_permissions as sharing
from vbs.controller.requests.describe_snapshots import describe_many, snapshot_not_found
from vbs.controller.requests.snapshot_locks import refuse_if_locked
from vbs.controller.rest.schemas.snapshots import SnapshotOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.delete_snapshot import DELETE_SNAPSHOT
from vbs.controller.workflows.steps import StorageParams
from vbs.errors import SnapshotInUse


def delete_snapshot(svc: Controller, snapshot_id: str, tenant: str) -> SnapshotOut:
    ids.check("snapshot", snapshot_id)
    with svc.db.session() as s:
        lock_rows(s, Snapshot, snapshot_id)  # a LockSnapshot of it waits for this delete, or this for it
        snap = s.get(Snapshot, snapshot_id)
        if snap is None or snap.status in GONE_SNAPSHOT or snap.tenant != tenant:
            raise snapshot_not_found(snapshot_id)
        refuse_if_locked(s, snapshot_id)  # whoever asks, an admin too
        copying = exists().where(Volume.snapshot_id == snapshot_id, Volume.status == VolumeState.CREATING)
        if s.scalar(select(copying)):
            raise SnapshotInUse(f"The snapshot '{snapshot_id}' is being copied into a new volume; "
                                "delete it when that volume is available.")
        copy = aliased(Snapshot)
        copied = exists().where(copy.source_snapshot_id == snapshot_id, copy.status == SnapshotState.PENDING)
        if s.scalar(select(copied)):
            raise SnapshotInUse(f"The snapshot '{snapshot_id}' is being copied (CopySnapshot); "
                                "delete it when the copy is completed.")
        if snap.status == SnapshotState.COMPLETED and recycle_bin.keep_deleted(
                svc, s, recycle_bin.SNAPSHOT, snapshot_id, tenant, ~copying, ~copied):
            s.refresh(snap)  # in the Recycle Bin: kept, grants and all, until restored or its retention ends
            return describe_many(s, [snap])[0]
        transition(s, Snapshot, snapshot_id, SnapshotState.DELETING, ~copying, ~copied)
        sharing.forget(s, [snapshot_id])
        op_id = svc.engine.begin(s, DELETE_SNAPSHOT, snapshot_id, StorageParams(node=snap.storage_node,
                                                                                   pool=snap.pool))
        s.refresh(snap)
        out = describe_many(s, [snap])[0]
    svc.engine.submit(op_id)
    return out
