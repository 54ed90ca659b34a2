"""Live-migrating an instance with its VBS disks (``vbs migrate-instance``), and noticing an orchestrator's.

What is checked before the operation starts, in the transaction that starts it (the volumes' rows
locked first, then the instance's, as everywhere): the instance runs; the target host is another
one, up, and both hosts' hypervisors can live-migrate (and the target opens encrypted volumes if
any is); the orchestrator's destination VM (same VM id) is reported waiting for the migration
(``incoming``, from the target's heartbeat); every VBS attachment of the instance is ``attached``
(none being made or removed). While the operation runs, attach and detach on the instance are
refused (``attachments.migration_in_progress``).

``start_external_migrations`` is the reconciler's: an instance with VBS attachments whose VM id
shows up ``incoming`` on another host (an orchestrator started a destination and will ``migrate``
itself) gets the same workflow with ``external``: VBS prepares the target and follows the switch-over.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Attachment, Instance, Node, Operation, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import LIVE_ATTACHMENT, AttachmentState
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import host_info, is_alive
from vbs.controller.requests.attach_volume import instance_not_found
from vbs.controller.rest.schemas.nodes import InstanceMigrationOut, MigrateInstanceRequest
from vbs.controller.runtime import Controller
from vbs.controller.workflows.attach_volume import volume_limits
from vbs.controller.workflows.migrate_instance import MIGRATE_INSTANCE, LiveMigrationParams, MigratingDisk
from vbs.errors import AgentUnavailable, IncorrectState, InvalidParameter, VbsError

__all__ = ["migrate_instance", "start_external_migrations", "INCOMING"]

log = logging.getLogger(__name__)

# An instance whose VM waits for a live migration (QEMU ``inmigrate``): the destination of one.
INCOMING = "incoming"
# How long a destination VM waits before VBS takes its migration for an orchestrator's: a `vbs
# migrate-instance` run meanwhile issues the migrate itself.
EXTERNAL_GRACE_S = 5.0


def migrate_instance(svc: Controller, instance_id: str, req: MigrateInstanceRequest) -> InstanceMigrationOut:
    ids.check("instance", instance_id)
    out = _begin(svc, instance_id, req.host, external=False, timeout_s=req.timeout_s)
    svc.engine.submit(out.operation_id)
    return out


def _begin(svc: Controller, instance_id: str, target_host: str, *, external: bool,
           timeout_s: float) -> InstanceMigrationOut:
    with svc.db.session() as s:
        # The volumes first (db.locks' order), then the instance; the attachments are read again under them.
        volume_ids = sorted(set(s.scalars(select(Attachment.volume_id).where(
            Attachment.instance_id == instance_id, Attachment.status.in_(LIVE_ATTACHMENT)))))
        lock_rows(s, Volume, *volume_ids)
        lock_rows(s, Instance, instance_id)
        inst = s.get(Instance, instance_id)
        if inst is None:
            raise instance_not_found(f"'{instance_id}'")
        if inst.state != "running":
            raise IncorrectState(f"The instance '{instance_id}' is {inst.state}, not running.",
                                 code="IncorrectInstanceState")
        if target_host == inst.host:
            raise InvalidParameter(f"The instance '{instance_id}' runs on '{target_host}' already.")
        _check_hosts(s, svc, inst, target_host)
        atts = list(s.scalars(select(Attachment).where(Attachment.host == inst.host, Attachment.vm_id == inst.vm_id,
                                                       Attachment.status.in_(LIVE_ATTACHMENT))
                              .order_by(Attachment.created_at)))
        unsettled = [a.volume_id for a in atts if a.status != AttachmentState.ATTACHED]
        if unsettled:
            raise IncorrectState(f"The volumes {', '.join(unsettled)} of '{instance_id}' are being attached or "
                                 "detached (or busy); migrate when they are settled.")
        disks = []
        for a in atts:
            vol = s.get(Volume, a.volume_id)
            assert vol is not None
            if vol.placement == "local":
                raise IncorrectState(f"The volume '{vol.id}' is local to '{vol.storage_node}' and cannot "
                                     "follow the instance to another host: detach it (or snapshot it) first.")
            if vol.key_id is not None and not host_info(_host(s, target_host)).capabilities.luks:
                raise IncorrectState(f"The volume '{vol.id}' is encrypted and the hypervisor of '{target_host}' "
                                     "cannot open encrypted volumes.")
            disks.append(MigratingDisk(attachment_id=a.id, volume_id=vol.id, node=vol.storage_node, pool=vol.pool,
                                       serial=ids.virtio_serial(vol.id), read_only=a.mode == "ro",
                                       limits=volume_limits(svc.cfg, vol)))
        params = LiveMigrationParams(vm_id=inst.vm_id, source_host=inst.host, target_host=target_host, disks=disks,
                                     external=external, timeout_s=timeout_s)
        op_id = svc.engine.begin(s, MIGRATE_INSTANCE, instance_id, params)
        return InstanceMigrationOut(instance_id=instance_id, vm_id=inst.vm_id, source_host=inst.host,
                                    target_host=target_host, volume_ids=[d.volume_id for d in disks],
                                    external=external, operation_id=op_id)


def _host(s: Session, name: str) -> Node:
    node = s.get(Node, (name, "host"))
    if node is None:
        raise InvalidParameter(f"The host '{name[:64]}' does not exist.")
    return node


def _check_hosts(s: Session, svc: Controller, inst: Instance, target_host: str) -> None:
    now = utcnow()
    for name in (inst.host, target_host):
        node = _host(s, name)
        if not is_alive(node, svc.cfg.heartbeat_timeout_s, now):
            raise AgentUnavailable(f"The host agent of '{name}' is not reporting; cannot migrate.")
        if not host_info(node).capabilities.live_migration:
            raise IncorrectState(f"The hypervisor driver of '{name}' cannot live-migrate a VM (the qemu driver "
                                 "can, with its disks on virtio-blk).")
    waiting = s.scalar(select(Instance.state).where(Instance.host == target_host, Instance.vm_id == inst.vm_id))
    if waiting != INCOMING:
        raise IncorrectState(f"No VM '{inst.vm_id}' waits for an incoming migration on '{target_host}' "
                             f"({waiting or 'none reported'}): start the destination QEMU there with the same "
                             "VM id and -incoming defer first.", code="IncorrectInstanceState")


def start_external_migrations(svc: Controller, grace_s: float = EXTERNAL_GRACE_S) -> list[tuple[str, str]]:
    """Start the workflow (``external``) for each instance with VBS attachments whose VM id another host
    reports ``incoming`` for ``grace_s`` at least (so that a ``vbs migrate-instance`` for it, which
    issues the migrate itself, starts first)."""
    cutoff = utcnow() - timedelta(seconds=grace_s)
    with svc.db.read() as s:
        incoming = list(s.execute(select(Instance.host, Instance.vm_id, Instance.first_seen).where(
            Instance.state == INCOMING, Instance.first_seen <= cutoff)))
        candidates = []
        for target_host, vm_id, waiting_since in incoming:
            source = s.scalar(select(Instance).where(Instance.vm_id == vm_id, Instance.host != target_host,
                                                     Instance.state == "running"))
            if source is None:
                continue
            # A destination a migration already tried (and rolled back from) is not taken again: the
            # orchestrator starts a new one to retry.
            tried = s.scalar(select(Operation.id).where(Operation.kind == MIGRATE_INSTANCE.kind,
                                                        Operation.resource_id == source.id,
                                                        Operation.created_at >= waiting_since))
            if tried is not None:
                continue
            attached = s.scalar(select(Attachment.id).where(Attachment.host == source.host,
                                                            Attachment.vm_id == vm_id,
                                                            Attachment.status.in_(LIVE_ATTACHMENT)))
            if attached is not None:
                candidates.append((source.id, target_host))
    started = []
    for instance_id, target_host in candidates:
        try:
            out = _begin(svc, instance_id, target_host, external=True, timeout_s=svc.cfg.give_up_after_s)
        except VbsError as exc:
            log.info("not following the incoming migration of %s to %s: %s", instance_id, target_host, exc.message)
            continue
        log.warning("instance %s: its VM waits for a live migration on %s; preparing its VBS disks there (%s)",
                    instance_id, target_host, out.operation_id)
        svc.engine.submit(out.operation_id)
        started.append((instance_id, target_host))
    return started
