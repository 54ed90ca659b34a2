"""The migrate-volume workflows: another storage node serves a volume from now on; it keeps its id.

Three ways, chosen when the operation starts (controller/moves.py):

- ``migrate-volume`` (shared storage, ``PoolInfo.shared_id``: one Ceph pool): the data stays where it
  is, so the move is instant. The target agent must see the volume, then the volume and its
  snapshots are recorded on the target in the transaction that ends the operation.
- ``migrate-volume-copy`` (an available volume between pools of files): the old node exports the
  volume to the new node, which pulls it (``vbs.storage.pull``), with progress; then the row moves,
  the export goes and the old copy is deleted.
- ``migrate-volume-mirror`` (an attached volume, on a hypervisor that mirrors): the new node makes an
  empty volume and exports it to the VM's host, whose hypervisor mirrors the disk onto it while the
  guest runs (``blockdev-mirror``), with progress; once the copy is in step the hypervisor switches
  the disk onto it (``job-complete``: the guest sees no pause), then the row moves, the old export
  goes and the old copy is deleted.

Both copies roll back at every step before the switch (the mirror cancelled, the new copy and every
export made for it removed: the volume stays where it was, untouched) and roll forward from it
(``forward_from``): once the guest writes to the new copy, or the row names it, the old one is only
removed. Snapshots of a volume of files stay where they are: each is a file of its own (reflink or
copy) that does not read from its volume, and its row keeps its node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Select, select, update
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Attachment, Node, Operation, Snapshot, Volume
from vbs.controller.db.states import UNFINISHED_OPERATION, AttachmentState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import host_identity, host_info
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows.attach_volume import volume_limits
from vbs.controller.workflows.definition import Step, StepContext, Workflow
from vbs.controller.workflows.steps import StorageParams
from vbs.errors import IncorrectState, MirrorLost, NotFound
from vbs.wire.connection import Connection, HostIdentity, NbdConnection

__all__ = ["MIGRATE_VOLUME", "MIGRATE_VOLUME_COPY", "MIGRATE_VOLUME_MIRROR", "MIGRATION_KINDS", "MigrateParams",
           "migration_progress"]



class MigrateParams(StorageParams):
    """``node``/``pool``: where the volume is served from now; ``target_*``: where from next.
    ``size_gib``: the volume's size (the copy's); ``host``/``vm_id``: the VM whose hypervisor mirrors
    an attached volume; ``progress``: how far the copy is (what describe-volumes shows)."""

    target_node: str
    target_pool: str
    size_gib: int = 0
    host: str | None = None
    vm_id: str | None = None
    progress: int = 0


# -- shared storage: an instant switch --------------------------------------------------------------


def seen_by_target(ctx: StepContext[MigrateParams]) -> None:
    p = ctx.params
    status = ctx.services.agents.storage(p.target_node).volume_status(p.target_pool, ctx.resource_id)
    if status.state != "ready":
        raise IncorrectState(f"The storage node '{p.target_node}' does not see the volume '{ctx.resource_id}' in its "
                             f"pool '{p.target_pool}' ({status.state}): it is not the same storage.")


def _move_row(ctx: StepContext[MigrateParams], *, with_snapshots: bool) -> None:
    p = ctx.params
    with ctx.session() as s:
        s.execute(update(Volume).where(Volume.id == ctx.resource_id, Volume.storage_node == p.node,
                                       Volume.pool == p.pool)
                  .values(storage_node=p.target_node, pool=p.target_pool, updated_at=utcnow()))
        if with_snapshots:
            # Snapshots of a shared image are the same image's: served by the same agent.
            s.execute(update(Snapshot).where(Snapshot.volume_id == ctx.resource_id, Snapshot.storage_node == p.node,
                                             Snapshot.pool == p.pool)
                      .values(storage_node=p.target_node, pool=p.target_pool))


def switch(ctx: StepContext[MigrateParams]) -> None:
    _move_row(ctx, with_snapshots=True)


def finished(ctx: StepContext[MigrateParams]) -> bool:
    with ctx.services.db.read() as s:
        vol = s.get(Volume, ctx.resource_id)
        return vol is not None and (vol.storage_node, vol.pool) == (ctx.params.target_node, ctx.params.target_pool)


MIGRATE_VOLUME = Workflow(
    kind="migrate-volume",
    exclusive=True,
    params=MigrateParams,
    resume="rollback",
    steps=(Step("check-target", seen_by_target), Step("switch", switch, ends=True)),
    finished=finished,
)


# -- what both copies share ----------------------------------------------------------------------------


def _report(ctx: StepContext[MigrateParams]) -> Any:
    """Record the copy's progress in the operation's parameters (what describe-volumes reads)."""

    def report(progress: int) -> None:
        if progress > ctx.params.progress:
            ctx.params.progress = progress
            ctx.save()

    return report


def _switch_files(ctx: StepContext[MigrateParams]) -> None:
    _move_row(ctx, with_snapshots=False)
    ctx.params.progress = 100
    ctx.save()


def _remove_old_copy(ctx: StepContext[MigrateParams]) -> None:
    shared.storage_agent(ctx).remove_volume(ctx.params.pool, ctx.resource_id)


def _remove_new_copy(ctx: StepContext[MigrateParams]) -> None:
    p = ctx.params
    ctx.services.agents.storage(p.target_node).remove_volume(p.target_pool, ctx.resource_id)


def _done(ctx: StepContext[MigrateParams]) -> None:
    """The closing record: the row already names the new node (``switch``)."""


def _leftover(_ctx: StepContext[MigrateParams]) -> bool:
    """What the old node keeps once it stops answering is the reconciler's: no row names it there any
    more (an orphan file, an export without an attachment), so it goes when the node is back."""
    return True


def _copying(kind: str, copy: tuple[Step[MigrateParams], ...], unexport: Step[MigrateParams], *,
             forward_from: str, gives_up: Callable[[StepContext[MigrateParams], Exception], bool] | None = None
             ) -> Workflow[MigrateParams]:
    """A move by a copy: the ``copy`` steps make the new copy, then the row names it (``switch``),
    ``unexport`` removes the old copy's export and the old copy goes (both left to the reconciler if
    the old node stays away)."""
    return Workflow(
        kind=kind,
        exclusive=True,
        params=MigrateParams,
        resume="rollback",
        steps=(*copy,
               Step("switch", _switch_files),
               unexport,
               Step("remove-old-copy", _remove_old_copy, skippable=_leftover),
               Step("finish", _done, ends=True)),
        forward_from=forward_from,
        gives_up=gives_up,
    )


# -- an available volume between pools of files: the new node pulls it ---------------------------------


def _target_identity(ctx: StepContext[MigrateParams]) -> HostIdentity:
    """The new storage node as the old one's export sees a client: its name (the ACL, the certificate's
    CN) and the address it reported."""
    with ctx.services.db.read() as s:
        node = s.get(Node, (ctx.params.target_node, "storage"))
    if node is None:
        raise NotFound(f"storage node {ctx.params.target_node} is not known")
    return HostIdentity(name=node.name, address=node.address)


def _export_to_target(ctx: StepContext[MigrateParams]) -> NbdConnection:
    p = ctx.params
    # Unlimited: the copy is not the guest's I/O (the volume's limits hold on its hosts' exports).
    conn = shared.storage_agent(ctx).connection_for(p.pool, ctx.resource_id, _target_identity(ctx),
                                                    read_only=True).connection
    if not isinstance(conn, NbdConnection):
        raise IncorrectState(f"The storage node '{p.node}' serves the volume '{ctx.resource_id}' over "
                             f"{conn.protocol}; a storage node pulls volumes over NBD only.")
    return conn


def _open_for_target(ctx: StepContext[MigrateParams]) -> None:
    _export_to_target(ctx)


def _close_for_target(ctx: StepContext[MigrateParams]) -> None:
    shared.storage_agent(ctx).remove_connection(ctx.params.pool, ctx.resource_id, ctx.params.target_node)


def _pull(ctx: StepContext[MigrateParams]) -> None:
    p = ctx.params
    source = _export_to_target(ctx)  # the same export again (idempotent): its key is never persisted
    # The file's size, not the volume's: an encrypted volume's LUKS header moves with it.
    size_bytes = shared.storage_agent(ctx).volume_status(p.pool, ctx.resource_id).size_bytes
    target = ctx.services.agents.storage(p.target_node)
    shared.until_ready(lambda: target.pull_volume(p.target_pool, ctx.resource_id, size_bytes, source),
                       _report(ctx), unreachable_s=shared.patience(ctx))


MIGRATE_VOLUME_COPY = _copying(
    "migrate-volume-copy",
    (Step("export-to-target", _open_for_target, undo=_close_for_target),
     Step("copy", _pull, undo=_remove_new_copy)),
    Step("unexport", _close_for_target, skippable=_leftover),
    forward_from="switch",
)


# -- an attached volume: the hypervisor mirrors it onto the new node's export ------------------------------


def _host(ctx: StepContext[MigrateParams]) -> tuple[str, str]:
    p = ctx.params
    if p.host is None or p.vm_id is None:
        raise IncorrectState(f"operation {ctx.operation_id} names no VM to move the volume under")
    return p.host, p.vm_id


def _new_connection(ctx: StepContext[MigrateParams]) -> Connection:
    p = ctx.params
    host, _vm = _host(ctx)
    with ctx.services.db.read() as s:
        node = s.get(Node, (host, "host"))
        mode = s.scalar(select(Attachment.mode).where(Attachment.volume_id == ctx.resource_id,
                                                      Attachment.host == host,
                                                      Attachment.status == AttachmentState.ATTACHED))
        vol = s.get(Volume, ctx.resource_id)
    if node is None:
        raise NotFound(f"host {host} is not known")
    if vol is None:
        raise NotFound(f"volume {ctx.resource_id} is gone", code="InvalidVolume.NotFound")
    target = ctx.services.agents.storage(p.target_node)
    # The new export enforces the volume's limits from the pivot on, as the old one did.
    return target.connection_for(p.target_pool, ctx.resource_id, host_identity(node), read_only=mode == "ro",
                                 protocols=host_info(node).capabilities.protocols,
                                 limits=volume_limits(ctx.services.cfg, vol)).connection


def _empty_target(ctx: StepContext[MigrateParams]) -> None:
    p = ctx.params
    target = ctx.services.agents.storage(p.target_node)
    shared.until_ready(lambda: target.ensure_volume(p.target_pool, ctx.resource_id, p.size_gib, None),
                       lambda _progress: None, unreachable_s=shared.patience(ctx))


def _export_to_host(ctx: StepContext[MigrateParams]) -> None:
    _new_connection(ctx)


def _unexport_from(node: str, pool: str) -> Any:
    def step(ctx: StepContext[MigrateParams]) -> None:
        host, _vm = _host(ctx)
        ctx.services.agents.storage(getattr(ctx.params, node)).remove_connection(
            getattr(ctx.params, pool), ctx.resource_id, host)

    return step


def _mirror(ctx: StepContext[MigrateParams], *, pivot: bool) -> None:
    host, vm_id = _host(ctx)
    agent = ctx.services.agents.host(host)
    serial = ids.virtio_serial(ctx.resource_id)
    target = _new_connection(ctx)
    shared.until_ready(lambda: agent.ensure_mirror(vm_id, serial, target, pivot=pivot), _report(ctx),
                       unreachable_s=shared.patience(ctx))


def _start_mirror(ctx: StepContext[MigrateParams]) -> None:
    _mirror(ctx, pivot=False)


def _pivot(ctx: StepContext[MigrateParams]) -> None:
    _mirror(ctx, pivot=True)


def _cancel_mirror(ctx: StepContext[MigrateParams]) -> None:
    host, vm_id = _host(ctx)
    ctx.services.agents.host(host).remove_mirror(vm_id, ids.virtio_serial(ctx.resource_id))


MIGRATE_VOLUME_MIRROR = _copying(
    "migrate-volume-mirror",
    (Step("target-volume", _empty_target, undo=_remove_new_copy),
     Step("export-to-host", _export_to_host, undo=_unexport_from("target_node", "target_pool")),
     Step("mirror", _start_mirror, undo=_cancel_mirror),
     Step("pivot", _pivot)),
    Step("remove-old-export", _unexport_from("node", "pool"), skippable=_leftover),
    forward_from="pivot",
    # The host says the disk never switched (its mirror was cancelled, its VM restarted): the volume's
    # data is where its row says; the new copy and its export are orphans the reconciler removes.
    gives_up=lambda _ctx, exc: isinstance(exc, MirrorLost),
)

# The kinds of every migrate-volume workflow: what a describe reads as "this volume is moving".
MIGRATION_KINDS = (MIGRATE_VOLUME.kind, MIGRATE_VOLUME_COPY.kind, MIGRATE_VOLUME_MIRROR.kind)


def migration_progress(session: Session, volume_ids: list[str], *,
                       within: Select[Any] | None = None) -> dict[str, tuple[str, str, str, MigrateParams]]:
    """The unfinished migration of each of ``volume_ids`` that has one: its operation's id, kind and
    state, and its parameters (``within``: as in ``filters.tags_of``)."""
    if not volume_ids:
        return {}
    found: dict[str, tuple[str, str, str, MigrateParams]] = {}
    wanted = set(volume_ids)
    for op in session.scalars(select(Operation).where(Operation.resource_id.in_(within if within is not None
                                                                                 else volume_ids),
                                                      Operation.kind.in_(MIGRATION_KINDS),
                                                      Operation.status.in_(UNFINISHED_OPERATION))):
        if op.resource_id in wanted:
            found[op.resource_id] = (op.id, op.kind, op.status, MigrateParams.model_validate(op.params))
    return found
