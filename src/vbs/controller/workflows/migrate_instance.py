"""The migrate-instance workflow: an instance's VBS disks follow it as it live-migrates to another host.

VBS does not launch VMs: the orchestrator starts the destination QEMU (same VM id, ``-incoming
defer``) on the target host, whose agent reports it ``inmigrate``. Then, for every attachment of the
instance: the volume is exported to the target host too (its own export and credentials), the target
agent plugs the same disks into the waiting VM in the source's PCI slots, and the source streams the
guest over (QEMU's ``migrate``; with ``external`` the orchestrator issues it and VBS only waits).
Once the guest runs on the target, the source's disks are unplugged, the source host's exports
removed and the attachments (and the instance) recorded on the target host.

The point of no return is the migration's completion, and the VMs' run states are its truth, not the
steps' records (``locate``): before it, any failure or a controller restart rolls back (the target's
disks unplugged, its exports removed, a running migration cancelled, a source whose destination died
after the switch-over resumed); after it, the operation goes forward (``Workflow.committed``). Every
undo that would cross that point refuses, so a roll-back racing a completing migration stops and
goes forward at its next attempt.
"""

from __future__ import annotations

import logging
import time
from enum import StrEnum
from functools import partial
from typing import Any

from pydantic import BaseModel
from sqlalchemy import delete, select, update

from vbs.controller.db import Attachment, Instance, Node
from vbs.controller.db.states import LIVE_ATTACHMENT
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import host_identity, host_info
from vbs.controller.workflows.attach_volume import hypervisor_limits
from vbs.controller.workflows.definition import Params, Step, StepContext, Workflow
from vbs.controller.workflows.steps import data_key, waiting
from vbs.errors import DriverError, IncorrectState, NotFound, VbsError
from vbs.wire.host import MIGRATION_ACTIVE_STATES, MigrationInfo, QoS
from vbs.wire.qos import ExportLimits
from vbs.wire.storage import ConnectionAnswer

__all__ = ["MIGRATE_INSTANCE", "LiveMigrationParams", "MigratingDisk", "GuestAt", "locate_guest",
           "migrating_volume_ids"]

log = logging.getLogger(__name__)

POLL_S = 0.5
FAILED_STATES = frozenset({"failed", "cancelled"})


class MigratingDisk(BaseModel):
    """One attachment of the instance, as the target host must open it."""

    attachment_id: str
    volume_id: str
    node: str
    pool: str
    serial: str
    read_only: bool = False
    qos: QoS | None = None  # operations begun before ``limits``
    # The volume's limits: the storage node enforces them where it can, else the target's hypervisor.
    limits: ExportLimits | None = None


class LiveMigrationParams(Params):
    vm_id: str
    source_host: str
    target_host: str
    disks: list[MigratingDisk]
    # The orchestrator issues the migrate itself (detected from heartbeats): VBS prepares and waits.
    external: bool = False
    # How long the migration itself may take (the stream, or an external orchestrator to start it).
    timeout_s: float = 600.0
    progress: int = 0


class GuestAt(StrEnum):
    """Where the guest runs, as the two VMs' states tell."""

    SOURCE = "source"  # the source runs it (no migration, or one that failed or was cancelled)
    IN_FLIGHT = "in-flight"  # a migration is streaming or switching over: wait, touch nothing
    TARGET = "target"  # the switch-over completed: the destination runs it (the point of no return)
    STRANDED = "stranded"  # the source handed it over (postmigrate) but the destination is gone
    NOWHERE = "nowhere"  # no source VM and no destination that took it over (both gone)


def locate_guest(source: MigrationInfo | None, target: MigrationInfo | None, target_has_disks: bool) -> GuestAt:
    """Decide from the VMs' own states (None: that VM is gone) where the guest is.

    The destination counts as running the guest only once it left ``inmigrate`` with the disks
    plugged *and* the source handed the guest over (``postmigrate``) or is gone: a destination that
    was never an incoming VM, or a source still running, is not a completed migration.
    """
    if source is not None and source.status != "postmigrate":
        # Still the source's (a migration that failed, was cancelled, or never started; or one that
        # completed and whose source someone ran again), unless one is streaming or switching over.
        return GuestAt.IN_FLIGHT if source.state in MIGRATION_ACTIVE_STATES else GuestAt.SOURCE
    if target is not None and target.status != "inmigrate" and target_has_disks:
        return GuestAt.TARGET
    if source is None:
        # The source went: the guest is on the destination if it took it over (above), else in flight
        # while the destination still waits, or lost.
        return GuestAt.IN_FLIGHT if target is not None and target.state not in (None, *FAILED_STATES) \
            else GuestAt.NOWHERE
    # The source handed the guest over (postmigrate).
    if target is None or target.state in FAILED_STATES:
        return GuestAt.STRANDED
    return GuestAt.IN_FLIGHT


def migrating_volume_ids(params: dict[str, Any]) -> list[str]:
    """The volumes an unfinished migrate-instance operation moves (the reconciler leaves them alone)."""
    disks = params.get("disks")
    if not isinstance(disks, list):
        return []
    return [d["volume_id"] for d in disks if isinstance(d, dict) and isinstance(d.get("volume_id"), str)]


# -- reading the two VMs --------------------------------------------------------------------------

def _info(ctx: StepContext[LiveMigrationParams], host: str) -> MigrationInfo | None:
    try:
        return ctx.services.agents.host(host).migration_info(ctx.params.vm_id)
    except NotFound:
        return None


def _target_has_disks(ctx: StepContext[LiveMigrationParams]) -> bool:
    p = ctx.params
    try:
        plugged = {d.serial for d in ctx.services.agents.host(p.target_host).list_disks(p.vm_id) if d.connected}
    except NotFound:
        return False
    return all(d.serial in plugged for d in p.disks)


def locate(ctx: StepContext[LiveMigrationParams]) -> GuestAt:
    """``locate_guest`` from the agents. A source host that does not answer (it may be the reason for
    the migration) is no obstacle once the destination runs the guest: QEMU starts an incoming VM only
    when its migration completed."""
    p = ctx.params
    try:
        source: MigrationInfo | None = _info(ctx, p.source_host)
    except VbsError as exc:
        target = _info(ctx, p.target_host)
        if target is not None and target.status == "running" and _target_has_disks(ctx):
            return GuestAt.TARGET
        raise exc
    target = _info(ctx, p.target_host)
    has_disks = target is not None and target.status != "inmigrate" and _target_has_disks(ctx)
    return locate_guest(source, target, has_disks)


def guest_moved(ctx: StepContext[LiveMigrationParams]) -> bool:
    return locate(ctx) == GuestAt.TARGET


def _refuse_if_moved(ctx: StepContext[LiveMigrationParams], what: str) -> GuestAt:
    at = locate(ctx)
    if at in (GuestAt.TARGET, GuestAt.IN_FLIGHT):
        raise IncorrectState(f"cannot {what}: the guest of {ctx.params.vm_id} is {at.value} "
                             f"(on {ctx.params.target_host} or switching over); the migration goes forward")
    return at


# -- steps ----------------------------------------------------------------------------------------

def _target_node(ctx: StepContext[LiveMigrationParams]) -> Node:
    with ctx.services.db.read() as s:
        node = s.get(Node, (ctx.params.target_host, "host"))
    if node is None:
        raise NotFound(f"host {ctx.params.target_host} is not known", code="InvalidHost.NotFound")
    return node


def export_to_target(ctx: StepContext[LiveMigrationParams]) -> None:
    """Open every volume to the target host too: its own export and credentials, kept in memory only."""
    node = _target_node(ctx)
    identity, protocols = host_identity(node), host_info(node).capabilities.protocols
    for d in ctx.params.disks:
        agent = ctx.services.agents.storage(d.node)
        ctx.memo[d.serial] = waiting(partial(agent.connection_for, d.pool, d.volume_id, identity, d.read_only,
                                             protocols, limits=d.limits), limit_s=ctx.services.cfg.give_up_after_s)


def unexport_from_target(ctx: StepContext[LiveMigrationParams]) -> None:
    _refuse_if_moved(ctx, "remove the target's exports")
    _unexport(ctx, ctx.params.target_host)


def _unexport(ctx: StepContext[LiveMigrationParams], host: str) -> None:
    """Remove each volume's export to ``host``, unless another live attachment there still uses it."""
    for d in ctx.params.disks:
        with ctx.services.db.read() as s:
            shared = s.scalar(select(Attachment.id).where(
                Attachment.volume_id == d.volume_id, Attachment.host == host, Attachment.id != d.attachment_id,
                Attachment.status.in_(LIVE_ATTACHMENT)))
        if shared is None:
            ctx.services.agents.storage(d.node).remove_connection(d.pool, d.volume_id, host)


def plug_into_target(ctx: StepContext[LiveMigrationParams]) -> None:
    """Plug each disk into the waiting destination VM, in the PCI slot the source gave it."""
    p = ctx.params
    source, target = ctx.services.agents.host(p.source_host), ctx.services.agents.host(p.target_host)
    state = target.migration_info(p.vm_id)
    if state.status != "inmigrate":
        if _target_has_disks(ctx):
            return  # plugged before the switch-over (a repeated step after it)
        raise IncorrectState(f"VM {p.vm_id} on {p.target_host} is {state.status}, not waiting for an incoming "
                             "migration: start the destination QEMU with -incoming defer")
    try:
        on_source = source.list_disks(p.vm_id)
    except NotFound:
        on_source = []
    # The destination must get exactly the source's devices, else QEMU refuses the stream at the end.
    strays = sorted(d.serial for d in on_source if not d.connected or d.serial not in {x.serial for x in p.disks})
    if strays:
        raise IncorrectState(f"VM {p.vm_id} on {p.source_host} holds disks {', '.join(strays)} that VBS detached "
                             "(its guest has not released them) or does not know: it cannot be migrated with them")
    slots = {d.serial: d.pci_slot for d in on_source}
    for d in p.disks:
        answer: ConnectionAnswer | None = ctx.memo.get(d.serial)
        if answer is None:
            export_to_target(ctx)
            answer = ctx.memo[d.serial]
        target.attach(p.vm_id, d.serial, answer.connection, read_only=d.read_only,
                      qos=hypervisor_limits(d.limits, d.qos, answer), luks=data_key(ctx, d.volume_id),
                      pci_slot=slots.get(d.serial))


def unplug_from_target(ctx: StepContext[LiveMigrationParams]) -> None:
    _refuse_if_moved(ctx, "unplug the target's disks")
    p = ctx.params
    host = ctx.services.agents.host(p.target_host)
    for d in p.disks:
        host.detach(p.vm_id, d.serial, force=True, timeout=2.0)


def live_migrate(ctx: StepContext[LiveMigrationParams]) -> None:
    """Have the source stream the guest to the destination (or, ``external``, wait for the orchestrator's
    migration) until the destination runs it; a failed or cancelled migration fails the step."""
    p = ctx.params
    if not p.external and locate(ctx) == GuestAt.SOURCE:
        listening = ctx.services.agents.host(p.target_host).listen_for_migration(p.vm_id)
        if listening.uri is None:
            raise DriverError(f"VM {p.vm_id} on {p.target_host} did not say where it listens")
        ctx.services.agents.host(p.source_host).migrate(p.vm_id, listening.uri)
        log.info("operation %s: %s streams from %s to %s (%s)", ctx.operation_id, p.vm_id, p.source_host,
                 p.target_host, listening.uri)
    deadline = time.monotonic() + p.timeout_s
    while True:
        source, target = _info(ctx, p.source_host), _info(ctx, p.target_host)
        has_disks = target is not None and target.status != "inmigrate" and _target_has_disks(ctx)
        at = locate_guest(source, target, has_disks)
        if at == GuestAt.TARGET:
            if source is not None and source.total_time_ms is not None:
                log.info("operation %s: %s runs on %s: the migration took %d ms, the guest stopped for %s ms",
                         ctx.operation_id, p.vm_id, p.target_host, source.total_time_ms, source.downtime_ms)
            return
        if at != GuestAt.IN_FLIGHT and not (p.external and at == GuestAt.SOURCE and target is not None):
            why = (source.error if source is not None and source.error else None) or f"the guest is {at.value}"
            raise DriverError(f"the live migration of {p.vm_id} to {p.target_host} did not complete: {why}")
        _report_progress(ctx, source)
        if time.monotonic() >= deadline:
            raise DriverError(f"the live migration of {p.vm_id} did not complete within {p.timeout_s:g}s")
        time.sleep(POLL_S)


def _report_progress(ctx: StepContext[LiveMigrationParams], source: MigrationInfo | None) -> None:
    if source is None or not source.total_bytes:
        return
    done = source.total_bytes - source.remaining_bytes
    progress = max(0, min(99, done * 100 // source.total_bytes))
    if progress > ctx.params.progress:
        ctx.params.progress = progress
        ctx.save()


def stop_migration(ctx: StepContext[LiveMigrationParams]) -> None:
    """Cancel a migration that has not completed; run a source again whose destination died after the
    switch-over. An external orchestrator's migration is its own to cancel."""
    at = _refuse_if_moved(ctx, "cancel the migration")
    p = ctx.params
    if p.external or at == GuestAt.NOWHERE:
        return
    ctx.services.agents.host(p.source_host).cancel_migration(p.vm_id, resume=at == GuestAt.STRANDED)


def unplug_from_source(ctx: StepContext[LiveMigrationParams]) -> None:
    """Close the source VM's connections (the guest left it; its QEMU is the orchestrator's to quit). A
    migrated VM's guest cannot release a device, so the detach cuts the I/O path at once (waiting for
    an acknowledgement that cannot come would only add to the migration's time)."""
    if not guest_moved(ctx):
        raise IncorrectState(f"the guest of {ctx.params.vm_id} does not run on {ctx.params.target_host}")
    p = ctx.params
    host = ctx.services.agents.host(p.source_host)
    for d in p.disks:
        host.detach(p.vm_id, d.serial, force=True, timeout=0.1)


def unexport_from_source(ctx: StepContext[LiveMigrationParams]) -> None:
    _unexport(ctx, ctx.params.source_host)


def switch_host(ctx: StepContext[LiveMigrationParams]) -> None:
    """Record the attachments and the instance on the target host (the instance keeps its id; the row
    its heartbeat made for the destination VM goes, and the source's leftover VM gets a new one)."""
    p = ctx.params
    with ctx.session() as s:
        for d in p.disks:
            s.execute(update(Attachment).where(Attachment.id == d.attachment_id, Attachment.host == p.source_host)
                      .values(host=p.target_host, updated_at=utcnow()))
        s.execute(delete(Instance).where(Instance.host == p.target_host, Instance.vm_id == p.vm_id,
                                         Instance.id != ctx.resource_id))
        s.execute(update(Instance).where(Instance.id == ctx.resource_id)
                  .values(host=p.target_host, state="running", last_seen=utcnow()))
        ctx.params.progress = 100


MIGRATE_INSTANCE = Workflow(
    kind="migrate-instance",
    exclusive=True,
    params=LiveMigrationParams,
    resume="rollback",
    steps=(Step("target-export", export_to_target, undo=unexport_from_target),
           Step("target-plug", plug_into_target, undo=unplug_from_target),
           Step("live-migrate", live_migrate, undo=stop_migration),
           # Past the point of no return the attachments must reach the target whatever the source's side
           # does: a source host (or storage node) that keeps failing is left out, and the reconciler
           # removes what it holds (its exports are orphans once the attachments say the target).
           Step("source-unplug", unplug_from_source, skippable=lambda ctx: True),
           Step("source-unexport", unexport_from_source, skippable=lambda ctx: True),
           Step("switch-host", switch_host, ends=True)),
    committed=guest_moved,
)
