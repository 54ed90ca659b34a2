"""The migrate-volume workflow: another storage agent serves a volume from now on.

Only for storage that several agents serve (``PoolInfo.shared_id``: one Ceph pool): the data stays
where it is, so the move is instant. The target agent is first asked for the volume (it must see it:
the same cluster), then the volume and its snapshots are recorded on the target in the transaction
that ends the operation. Any failure rolls it back at once (nothing to undo): a target that does not
see the volume, or does not answer; the operation's error says which. Moving data between pools of
files is not done here.
"""

from __future__ import annotations

from sqlalchemy import update

from vbs.controller.db import Snapshot, Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.workflows.engine import Step, StepContext, Workflow
from vbs.controller.workflows.storage import StorageParams
from vbs.errors import IncorrectState

__all__ = ["MIGRATE_VOLUME", "MigrateParams"]


class MigrateParams(StorageParams):
    """``node``/``pool``: where the volume is served from now; ``target_*``: where from next."""

    target_node: str
    target_pool: str


def seen_by_target(ctx: StepContext[MigrateParams]) -> None:
    p = ctx.params
    status = ctx.services.agents.storage(p.target_node).volume_status(p.target_pool, ctx.resource_id)
    if status.state != "ready":
        raise IncorrectState(f"The storage node '{p.target_node}' does not see the volume '{ctx.resource_id}' in its "
                             f"pool '{p.target_pool}' ({status.state}): it is not the same storage.")


def switch(ctx: StepContext[MigrateParams]) -> None:
    p = ctx.params
    with ctx.session() as s:
        s.execute(update(Volume).where(Volume.id == ctx.resource_id, Volume.storage_node == p.node,
                                       Volume.pool == p.pool)
                  .values(storage_node=p.target_node, pool=p.target_pool, updated_at=utcnow()))
        # Its snapshots are snapshots of the same image: served by the same agent.
        s.execute(update(Snapshot).where(Snapshot.volume_id == ctx.resource_id, Snapshot.storage_node == p.node,
                                         Snapshot.pool == p.pool)
                  .values(storage_node=p.target_node, pool=p.target_pool))


def finished(ctx: StepContext[MigrateParams]) -> bool:
    with ctx.services.db.read() as s:
        vol = s.get(Volume, ctx.resource_id)
        return vol is not None and (vol.storage_node, vol.pool) == (ctx.params.target_node, ctx.params.target_pool)


MIGRATE_VOLUME = Workflow(
    kind="migrate-volume",
    params=MigrateParams,
    resume="rollback",
    steps=(Step("check-target", seen_by_target), Step("switch", switch, ends=True)),
    finished=finished,
)
