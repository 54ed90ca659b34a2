"""DeleteVolume as the API offers it: only an available volume with no snapshot in progress, put in the
Recycle Bin if a retention rule matches it (docs/recycle-bin.md; not a local volume), else moved to
``deleting`` with its operation in one transaction, then handed to the delete-volume workflow.
"""

from __future__ import annotations

from sqlalchemy import exists, select

from vbs import ids
from vbs.controller.db import Attachment, Snapshot, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import AttachmentState, SnapshotState, VolumeState
from vbs.controller.db.transitions import transition
from vbs.controller.requests import recycle_bin
from vbs.controller.requests.describe_volumes import describe_one, live_volume
from vbs.controller.rest.schemas.volumes import VolumeOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows.delete_volume import DELETE_VOLUME
from vbs.controller.workflows.local_volumes import DELETE_LOCAL_VOLUME
from vbs.controller.workflows.steps import StorageParams
from vbs.errors import (
    IncorrectState,
    VolumeInUse,
)


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
        if vol.status == VolumeState.AVAILABLE and vol.placement != "local" and recycle_bin.keep_deleted(
                svc, s, recycle_bin.VOLUME, volume_id, tenant, ~pending, ~live_attachment):
            s.refresh(vol)  # in the Recycle Bin: kept until restored or its retention ends
            return describe_one(svc, s, vol)
        transition(s, Volume, volume_id, VolumeState.DELETING, ~pending, ~live_attachment,
                   from_states=[VolumeState.AVAILABLE, VolumeState.ERROR])
        op_id = svc.engine.begin(s, DELETE_LOCAL_VOLUME if vol.placement == "local" else DELETE_VOLUME,
                                 volume_id, StorageParams(node=vol.storage_node, pool=vol.pool))
        s.refresh(vol)
        out = describe_one(svc, s, vol)
    svc.engine.submit(op_id)
    return out
