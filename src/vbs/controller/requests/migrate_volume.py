"""Moving a volume to another storage agent (``vbs migrate-volume``), as an operator asks it.

What is checked before the operation starts, in the transaction that starts it (the volume's row is
locked first, as everywhere): the volume is available or in use; the target node is known, up and
not drained; no snapshot of the volume is being taken (it would land on the old agent). Then the
way it moves (workflows/moves.py):

- a pool of the *same* shared storage (``PoolInfo.shared_id``) on the target: the agent changes, the
  data stays. Refused while an export of the old agent serves the volume (a host that reads it
  through that agent's export daemon would be cut off when the reconciler finds the export
  orphaned); hypervisors that open the storage themselves (native RBD) do not depend on the agent.
- otherwise the data is copied into a pool of the target's own (files), with room for it: an
  available volume is pulled by the target node; an attached one is mirrored by the hypervisor of its
  one VM (``capabilities.mirror``; not an encrypted volume, whose mirror would carry the plaintext,
  nor one attached to several VMs, nor one being attached or detached).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs.controller.db import Attachment, Node, Snapshot, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import AttachmentState, SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import GIB, host_info, is_alive, pool_of, storage_info
from vbs.controller.requests.describe_volumes import live_volume
from vbs.controller.rest.schemas.volumes import MigrateVolumeRequest, MigrationOut
from vbs.controller.runtime import Controller
from vbs.controller.workflows import Workflow
from vbs.controller.workflows.migrate_volume import (
    MIGRATE_VOLUME,
    MIGRATE_VOLUME_COPY,
    MIGRATE_VOLUME_MIRROR,
    MigrateParams,
)
from vbs.errors import IncorrectState, InsufficientCapacity, InvalidParameter
from vbs.wire.storage import PoolInfo

__all__ = ["migrate_volume"]


def migrate_volume(svc: Controller, volume_id: str, req: MigrateVolumeRequest, tenant: str) -> MigrationOut:
    with svc.db.session() as s:
        lock_rows(s, Volume, volume_id)
        vol = live_volume(s, volume_id, tenant)
        if vol.status not in (VolumeState.AVAILABLE, VolumeState.IN_USE):
            raise IncorrectState(f"The volume '{volume_id}' is '{vol.status}'; it must be available or in-use.")
        if vol.placement == "local":
            raise InvalidParameter(f"The volume '{volume_id}' is local to the host '{vol.storage_node}': snapshot it "
                                   "and create a shared volume from the snapshot instead.")
        if req.storage_node == vol.storage_node and req.pool in (None, vol.pool):
            raise InvalidParameter(f"The volume '{volume_id}' is already served by '{vol.storage_node}'.")
        source_node = s.get(Node, (vol.storage_node, "storage"))
        source = pool_of(source_node, vol.pool)
        if source is None:
            raise IncorrectState(f"The storage node '{vol.storage_node}' has not reported the pool '{vol.pool}' of "
                                 f"the volume '{volume_id}'; try again once it heartbeats.")
        target_node = s.get(Node, (req.storage_node, "storage"))
        if target_node is None:
            raise InvalidParameter(f"The storage node '{req.storage_node}' does not exist.")
        if not is_alive(target_node, svc.cfg.heartbeat_timeout_s, utcnow()):
            raise IncorrectState(f"The storage node '{req.storage_node}' is down.")
        if target_node.drained:
            raise IncorrectState(f"The storage node '{req.storage_node}' is drained.")
        pending = s.scalar(select(Snapshot.id).where(Snapshot.volume_id == volume_id,
                                                     Snapshot.status == SnapshotState.PENDING))
        if pending is not None:
            raise IncorrectState(f"The snapshot '{pending}' of the volume '{volume_id}' is being taken; try again "
                                 "when it is completed.")
        shared = _same_storage(source, target_node, req)
        params = MigrateParams(node=vol.storage_node, pool=vol.pool, target_node=target_node.name,
                               target_pool="", size_gib=vol.size_gib)
        workflow: Workflow[MigrateParams]
        if shared is not None:
            _not_exported(source_node, vol)
            workflow, params.target_pool = MIGRATE_VOLUME, shared.name
        else:
            params.target_pool = _own_pool(target_node, req, vol).name
            if vol.status == VolumeState.AVAILABLE:
                workflow = MIGRATE_VOLUME_COPY
            else:
                workflow = MIGRATE_VOLUME_MIRROR
                params.host, params.vm_id = _mirroring_vm(s, vol)
        op_id = svc.engine.begin(s, workflow, volume_id, params)
        out = MigrationOut(volume_id=volume_id, source_node=vol.storage_node, source_pool=vol.pool,
                           target_node=target_node.name, target_pool=params.target_pool, operation_id=op_id)
    svc.engine.submit(op_id)
    return out


def _same_storage(source: PoolInfo, target_node: Node, req: MigrateVolumeRequest) -> PoolInfo | None:
    """The target's pool of the storage the volume is on (shared storage only), if it has one."""
    if source.shared_id is None:
        return None
    pools = storage_info(target_node).pools
    found = next((p for p in pools if p.shared_id == source.shared_id and req.pool in (None, p.name)), None)
    if found is None and not any(p.shared_id is None and req.pool in (None, p.name) for p in pools):
        raise InvalidParameter(f"The storage node '{req.storage_node}' serves no pool of the storage "
                               f"'{source.shared_id}'" + (f" named '{req.pool}'." if req.pool else "."))
    return found


def _not_exported(source_node: Node | None, vol: Volume) -> None:
    # What the old agent last reported (still known when it is down).
    exported = sorted({e.host for e in storage_info(source_node).exports if e.key == vol.id}
                      if source_node is not None else set())
    if exported:
        raise IncorrectState(f"The volume '{vol.id}' is served to {', '.join(exported)} through an export of "
                             f"'{vol.storage_node}'; detach it first.")


def _own_pool(target_node: Node, req: MigrateVolumeRequest, vol: Volume) -> PoolInfo:
    """The target's pool of its own (files) that takes a copy of the volume: the one named, or the
    first with room."""
    pools = [p for p in storage_info(target_node).pools if p.shared_id is None and req.pool in (None, p.name)]
    if not pools:
        raise InvalidParameter(f"The storage node '{req.storage_node}' has no pool of its own"
                               + (f" named '{req.pool}'" if req.pool else "") + " to copy the volume into.")
    needed = vol.size_gib * GIB
    roomy = [p for p in pools if p.free_bytes >= needed]
    if not roomy:
        raise InsufficientCapacity(f"The storage node '{req.storage_node}' has no room for the volume "
                                   f"'{vol.id}' ({vol.size_gib} GiB).")
    return roomy[0]


def _mirroring_vm(s: Session, vol: Volume) -> tuple[str, str]:
    """The host and VM whose hypervisor mirrors the attached volume onto its new node."""
    live = list(s.scalars(select(Attachment).where(Attachment.volume_id == vol.id,
                                                   Attachment.status != AttachmentState.DETACHED)))
    if len(live) != 1:
        raise IncorrectState(f"The volume '{vol.id}' is attached to {len(live)} VMs; an attached volume moves "
                             "under the one VM it is attached to.")
    att = live[0]
    if att.status != AttachmentState.ATTACHED:
        raise IncorrectState(f"The attachment of the volume '{vol.id}' is '{att.status}'; try again once it settles.")
    if vol.key_id is not None:
        raise IncorrectState(f"The volume '{vol.id}' is encrypted: a hypervisor's mirror would carry its plaintext; "
                             "detach it to move it.")
    host = s.get(Node, (att.host, "host"))
    if host is None or not host_info(host).capabilities.mirror:
        raise IncorrectState(f"The hypervisor of host '{att.host}' cannot move an attached disk to another storage "
                             f"node; detach the volume '{vol.id}' to move it.")
    return att.host, att.vm_id
