"""Moving a volume to another storage agent (``vbs migrate-volume``), as an operator asks it.

What is checked before the operation starts, in the transaction that starts it (the volume's row is
locked first, as everywhere): the volume is available or in use; the target node is known, up, not
drained and serves a pool of the *same* shared storage (``PoolInfo.shared_id``) — for pools of files
the data would have to be copied, which is not done yet; no snapshot of the volume is being taken
(it would land on the old agent); and no export of the old agent serves the volume (a host that
reads it through that agent's export daemon would be cut off when the reconciler finds the export
orphaned). Hypervisors that open the storage themselves (native RBD) do not depend on the agent, so
a volume they have attached may move.
"""

from __future__ import annotations

from sqlalchemy import select

from vbs.controller.db import Node, Snapshot, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.tables import utcnow
from vbs.controller.nodes import is_alive, pool_of, storage_info
from vbs.controller.runtime import Controller
from vbs.controller.schemas import MigrateVolumeRequest, MigrationOut
from vbs.controller.states import SnapshotState, VolumeState
from vbs.controller.volumes import live_volume
from vbs.controller.workflows.moves import MigrateParams
from vbs.errors import IncorrectState, InvalidParameter

__all__ = ["migrate_volume"]


def migrate_volume(svc: Controller, volume_id: str, req: MigrateVolumeRequest, tenant: str) -> MigrationOut:
    with svc.db.session() as s:
        lock_rows(s, Volume, volume_id)
        vol = live_volume(s, volume_id, tenant)
        if vol.status not in (VolumeState.AVAILABLE, VolumeState.IN_USE):
            raise IncorrectState(f"The volume '{volume_id}' is '{vol.status}'; it must be available or in-use.")
        if req.storage_node == vol.storage_node and req.pool in (None, vol.pool):
            raise InvalidParameter(f"The volume '{volume_id}' is already served by '{vol.storage_node}'.")
        source_node = s.get(Node, (vol.storage_node, "storage"))
        source = pool_of(source_node, vol.pool)
        if source is None or source.shared_id is None:
            raise InvalidParameter(f"The volume '{volume_id}' is in the pool '{vol.pool}' of '{vol.storage_node}', "
                                   "which only that node serves: moving its data to another node is not supported "
                                   "yet (only storage several nodes share, such as a Ceph pool, can change agents).")
        target_node = s.get(Node, (req.storage_node, "storage"))
        if target_node is None:
            raise InvalidParameter(f"The storage node '{req.storage_node}' does not exist.")
        if not is_alive(target_node, svc.cfg.heartbeat_timeout_s, utcnow()):
            raise IncorrectState(f"The storage node '{req.storage_node}' is down.")
        if target_node.drained:
            raise IncorrectState(f"The storage node '{req.storage_node}' is drained.")
        target = next((p for p in storage_info(target_node).pools
                       if p.shared_id == source.shared_id and req.pool in (None, p.name)), None)
        if target is None:
            raise InvalidParameter(f"The storage node '{req.storage_node}' serves no pool of the storage "
                                   f"'{source.shared_id}'" + (f" named '{req.pool}'." if req.pool else "."))
        pending = s.scalar(select(Snapshot.id).where(Snapshot.volume_id == volume_id,
                                                     Snapshot.status == SnapshotState.PENDING))
        if pending is not None:
            raise IncorrectState(f"The snapshot '{pending}' of the volume '{volume_id}' is being taken; try again "
                                 "when it is completed.")
        # What the old agent last reported (still known when it is down).
        exported = sorted({e.host for e in storage_info(source_node).exports if e.key == volume_id}
                          if source_node is not None else set())
        if exported:
            raise IncorrectState(f"The volume '{volume_id}' is served to {', '.join(exported)} through an export of "
                                 f"'{vol.storage_node}'; detach it first.")
        params = MigrateParams(node=vol.storage_node, pool=vol.pool, target_node=target_node.name,
                               target_pool=target.name)
        op_id = svc.engine.begin(s, "migrate-volume", volume_id, params)
        out = MigrationOut(volume_id=volume_id, source_node=vol.storage_node, source_pool=vol.pool,
                           target_node=target_node.name, target_pool=target.name, operation_id=op_id)
    svc.engine.submit(op_id)
    return out

