"""Reconciliation: compare what the agents really have with what the DB says should exist, and repair.

Level-triggered: every pass looks at the whole picture, so a missed event (an agent restart, a lost
export daemon, a crash between steps) is healed by the next pass. Resources that an operation is
working on right now are left alone. Deleting something the DB does not know waits for a grace
period (it must be seen as an orphan on two passes at least that far apart), so a pass that races
a workflow never removes what the workflow is making.

Repairs: a missing export of an attached volume is re-created; an orphan export is removed; an
orphan pool file is removed; an orphan disk in a VM is force-unplugged; an available volume or a
completed snapshot whose file vanished is marked ``error`` with the reason (a snapshot the store holds
only loses its pool copy), and so are those of a pool whose storage is gone once it has stayed gone for
the grace period (docs/operations.md "A lost pool"). Everything found is in
the report, which ``vbs check`` prints, with what pools keep that is not a finding: images of deleted
volumes in the trash (and why), clone chains deeper than one and background flattens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from sqlalchemy import ColumnElement, and_, select, update
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.cluster import SingletonLease
from vbs.controller.db import Attachment, Instance, Node, Operation, Snapshot, Volume, plain
from vbs.controller.db.states import UNFINISHED_OPERATION, AttachmentState, SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.db.transitions import try_transition
from vbs.controller.fleet.nodes import host_identity, host_info, is_alive, storage_info
from vbs.controller.services import Services
from vbs.controller.workflows.attach_volume import volume_limits
from vbs.controller.workflows.copy_snapshot import scratch_ids
from vbs.controller.workflows.migrate_instance import migrating_volume_ids
from vbs.controller.workflows.stored import STORED
from vbs.errors import NotFound, VbsError
from vbs.net.repeating import Periodic
from vbs.wire.storage import ExportInfo, PoolInventory

log = logging.getLogger(__name__)

LIVE_VOLUME = (VolumeState.AVAILABLE, VolumeState.IN_USE)
MUST_BE_EXPORTED = (AttachmentState.ATTACHED, AttachmentState.BUSY)
MAY_BE_EXPORTED = (AttachmentState.ATTACHING, AttachmentState.DETACHING, *MUST_BE_EXPORTED)
# A volume or snapshot row changed less than this before its pool was listed is not judged missing yet.
SETTLE_MARGIN_S = 5.0


# What a pass reads of each volume or snapshot row, as plain driver rows (a node may hold 100,000:
# SQLAlchemy's rows and its datetime processing cost more than the read itself): the id, where the row
# says the file is, its state, whether a file is expected for it (live, or on its way in or out) and
# whether it is owed (live, and unchanged since shortly before the pool was listed).
_ID, _NODE, _POOL, _STATUS, _EXPECTED, _OWED = range(6)


# Of each kind of row, the states whose file must be there (live) and those whose file may be (expected:
# live, or on its way in or out).
_FILE_STATES: dict[type[Volume] | type[Snapshot], tuple[list[str], list[str]]] = {
    # recoverable (in the Recycle Bin, docs/recycle-bin.md): its file stays until its retention ends.
    Volume: (sorted(LIVE_VOLUME), sorted({*LIVE_VOLUME, VolumeState.CREATING, VolumeState.DELETING,
                                          VolumeState.RECOVERABLE})),
    Snapshot: ([SnapshotState.COMPLETED],
               sorted({SnapshotState.COMPLETED, SnapshotState.PENDING, SnapshotState.DELETING,
                       SnapshotState.RECOVERABLE})),
}


class Held:
    """The volume (or snapshot) rows a pass compares with the files pools list, as sets of ids."""

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows
        self.expected = {r[_ID] for r in rows if r[_EXPECTED]}

    @classmethod
    def read(cls, s: Session, table: type[Volume] | type[Snapshot], *where: ColumnElement[bool],
             settled_before: datetime) -> Held:
        live, expected = _FILE_STATES[table]
        query = select(table.id, table.storage_node, table.pool, table.status, table.status.in_(expected),
                       and_(table.status.in_(live), table.updated_at <= settled_before)).where(*where)
        return cls(plain.driver_rows(s, query))

    def ids(self) -> set[str]:
        return {r[_ID] for r in self.rows}

    def owed_in(self, node: str, pool: str) -> set[str]:
        """The ids whose file ``pool`` of ``node`` must hold: rows recorded there, and, of a pool several
        agents serve, those recorded on the other agents."""
        return {r[_ID] for r in self.rows if r[_OWED] and (r[_POOL] == pool or r[_NODE] != node)}

    @cached_property
    def status_of(self) -> dict[str, str]:
        """Each row's state by id: read only for what a pass reports, once at most."""
        return {r[_ID]: r[_STATUS] for r in self.rows}


@dataclass
class Finding:
    # orphan-file, missing-file, lost-pool, orphan-export, missing-export, orphan-disk, missing-disk, released-disk,
    # unreachable, incoming-migration
    kind: str
    node: str
    resource_id: str
    detail: str
    action: str = "reported"  # what the repair did: reported, waiting, repaired, failed


@dataclass
class PoolDetails:
    """What a pool keeps besides volumes and snapshots (RBD): its trash, deep clone chains, flattens."""

    node: str
    pool: str
    trash: list[dict[str, Any]]
    chains: list[dict[str, Any]]
    flattens: list[dict[str, Any]]

    @classmethod
    def of(cls, node: str, pool: str, items: PoolInventory) -> PoolDetails | None:
        if not (items.trash or items.chains or items.flattens):
            return None
        return cls(node, pool, [t.model_dump() for t in items.trash], [c.model_dump() for c in items.chains],
                   [f.model_dump() for f in items.flattens])


@dataclass
class Report:
    checked_at: str
    storage_nodes: int = 0
    hosts: int = 0
    findings: list[Finding] = field(default_factory=list)
    pools: list[PoolDetails] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings

    def as_dict(self) -> dict[str, Any]:
        return {"checked_at": self.checked_at, "storage_nodes": self.storage_nodes, "hosts": self.hosts,
                "clean": self.clean, "findings": [asdict(f) for f in self.findings],
                "pools": [asdict(p) for p in self.pools]}


class _SharedPools:
    """The pools several storage agents serve (same ``PoolInfo.shared_id``), as their heartbeats say."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], str] = {}
        self._members: dict[str, set[tuple[str, str]]] = {}
        self._checked: set[str] = set()

    def add(self, node: Node) -> None:
        for p in storage_info(node).pools:
            if p.shared_id is not None:
                self._ids[(node.name, p.name)] = p.shared_id
                self._members.setdefault(p.shared_id, set()).add((node.name, p.name))

    def members_of(self, node: str, pool: str) -> set[tuple[str, str]] | None:
        shared_id = self._ids.get((node, pool))
        return None if shared_id is None else self._members[shared_id]

    def first_check(self, node: str, pool: str) -> bool:
        shared_id = self._ids[(node, pool)]
        first = shared_id not in self._checked
        self._checked.add(shared_id)
        return first


class Reconciler:
    def __init__(self, svc: Services, *, grace_s: float, interval_s: float,
                 lease: SingletonLease | None = None,
                 on_findings: Callable[[list[tuple[str, str]]], None] | None = None) -> None:
        """``on_findings`` hears of each pass's findings as (kind, action) pairs (the drift metrics)."""
        # With several controllers, the background passes run on the one that holds this lease.
        self._lease = lease
        self._on_findings = on_findings
        self.svc = svc
        self.grace_s = grace_s
        self.interval_s = interval_s
        self._first_seen: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()
        self._passes = Periodic("reconcile", lambda: self.interval_s, self._background_pass, log=log,
                                what="reconcile pass failed")
        # Starts the live-migration workflow for instances whose VM an orchestrator is migrating to
        # another host (vbs.controller.requests.migrate_instance, set by the app): (instance, target host) of each.
        self.follow_incoming: Callable[[], list[tuple[str, str]]] | None = None
        # Starts the detach of a busy attachment whose guest let its disk go late (by attachment id; the app
        # sets it: vbs.controller.requests.detach_volume.finish_released); None: only reported.
        self.finish_released: Callable[[str], str | None] | None = None

    # -- the loop ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._passes.start()

    def stop(self) -> None:
        self._passes.stop()

    def _background_pass(self) -> None:
        if self._lease is not None and not self._lease.hold():
            return
        report = self.run(repair=True)
        for f in report.findings:
            log.warning("reconcile: %s %s on %s: %s (%s)", f.kind, f.resource_id, f.node, f.detail, f.action)

    # -- one pass ----------------------------------------------------------------------------------

    def run(self, *, repair: bool, ignore_grace: bool = False) -> Report:
        # What a pass reads (nodes, busy resources, every row of a storage node) it reads in read-only
        # transactions: on SQLite a writing one would hold the write lock while thousands of rows load,
        # and every create, attach and heartbeat would wait for it. Repairs write in their own.
        with self._lock:
            report = Report(checked_at=utcnow().isoformat())
            busy = self._busy_resources()
            seen: set[tuple[str, str, str]] = set()
            shared = _SharedPools()
            with self.svc.db.read() as s:
                # Hosts first: an orphan disk is unplugged before its export goes, as in a detach (a
                # VM whose storage vanished first waits on its reconnect delay before it lets go).
                nodes = sorted(s.scalars(select(Node)), key=lambda n: n.kind != "host")
                for n in nodes:
                    if n.kind == "storage":
                        shared.add(n)
            now = utcnow()
            for node in nodes:
                if not is_alive(node, self.svc.cfg.heartbeat_timeout_s, now):
                    continue
                try:
                    if node.kind == "storage":
                        report.storage_nodes += 1
                        self._check_storage(node, busy, report, seen, repair, ignore_grace, shared)
                    else:
                        report.hosts += 1
                        self._check_host(node, busy, report, seen, repair, ignore_grace)
                except VbsError as exc:
                    report.findings.append(Finding("unreachable", node.name, node.name, exc.message))
            # Forget orphans that went away by themselves.
            self._first_seen = {k: v for k, v in self._first_seen.items() if k in seen}
            if repair and self.follow_incoming is not None:
                for instance_id, target in self.follow_incoming():
                    report.findings.append(Finding("incoming-migration", target, instance_id, "an orchestrator "
                                                   "migrates the instance here: its VBS disks follow it", "started"))
        if self._on_findings is not None:
            self._on_findings([(f.kind, f.action) for f in report.findings])
        return report

    def _busy_resources(self) -> set[str]:
        with self.svc.db.read() as s:
            rows = s.execute(select(Operation.resource_id, Operation.params)
                             .where(Operation.status.in_(UNFINISHED_OPERATION))).all()
        return ({rid for rid, _ in rows} | {x for _, params in rows for x in scratch_ids(params or {})}
                | {x for _, params in rows for x in migrating_volume_ids(params or {})})

    def _orphan_due(self, key: tuple[str, str, str], seen: set[tuple[str, str, str]], ignore_grace: bool) -> bool:
        seen.add(key)
        first = self._first_seen.setdefault(key, time.monotonic())
        return ignore_grace or time.monotonic() - first >= self.grace_s

    # -- storage nodes -----------------------------------------------------------------------------

    def _check_storage(self, node: Node, busy: set[str], report: Report, seen: set[tuple[str, str, str]],
                       repair: bool, ignore_grace: bool, shared: _SharedPools) -> None:
        agent = self.svc.agents.storage(node.name)
        listed_at = utcnow()
        inventory = agent.inventory()
        exports = agent.list_exports()
        # A row that changed since shortly before the listing may be a create (or a clone, a snapshot)
        # that ended after the agent listed its pool: its file is there, only not in this listing. It
        # is judged by a later pass. (A pass over 100,000 files takes a good part of a second: creates
        # finish meanwhile, and were marked lost before.) The margin covers the clocks of other controllers.
        settled_before = listed_at - timedelta(seconds=SETTLE_MARGIN_S)
        with self.svc.db.read() as s:
            on_node = (Volume.storage_node == node.name, Volume.placement != "local")
            volumes = Held.read(s, Volume, *on_node, settled_before=settled_before)
            # A snapshot whose pool gave its copy up (it lives in the snapshot store) has no file to judge.
            snaps = Held.read(s, Snapshot, Snapshot.storage_node == node.name, Snapshot.pool_copy.is_(True),
                              settled_before=settled_before)
            atts = list(s.scalars(select(Attachment).join(Volume, Volume.id == Attachment.volume_id)
                                  .where(*on_node, Attachment.status.in_(MAY_BE_EXPORTED))))
            hosts = {n.name: n for n in s.scalars(select(Node).where(Node.kind == "host"))}
        for pool, items in inventory.pools.items():
            details = PoolDetails.of(node.name, pool, items)
            members = shared.members_of(node.name, pool)
            if members is None:  # this node's own pool: its rows, those of this pool are owed
                vols, snps = volumes, snaps
            elif not shared.first_check(node.name, pool):
                continue  # a pool several agents serve is checked once, by the first of them that answers
            else:  # every row of the shared storage, whichever agent it is recorded on
                vols = self._rows_on(Volume, members, settled_before)
                snps = self._rows_on(Snapshot, members, settled_before)
            if details is not None:
                report.pools.append(details)
            lost = None
            if items.lost is not None:
                lost = self._lost_pool(node.name, pool, items.lost, report, seen, repair, ignore_grace)
                if lost is None:
                    continue  # not judged before the loss has lasted its grace period
            self._check_files(node.name, pool, "volume", items.volumes, vols, busy, report, seen,
                              repair, ignore_grace, lost=lost)
            self._check_files(node.name, pool, "snapshot", items.snapshots, snps, busy, report, seen,
                              repair, ignore_grace, lost=lost)
        # Native RBD grants are the cluster's (cephx users), so every agent of a shared pool lists them
        # all: those of volumes another agent of it serves are that agent's to check, not orphans here.
        elsewhere = {(n, p) for pool in inventory.pools for (n, p) in shared.members_of(node.name, pool) or ()
                     if n != node.name}
        if elsewhere:
            theirs = self._rows_on(Volume, elsewhere, settled_before).ids()
            exports = [e for e in exports if not (e.protocol == "rbd" and e.key in theirs)]
        self._check_exports(node.name, exports, atts, hosts, busy, report, seen, repair, ignore_grace)

    def _volume(self, volume_id: str) -> Volume:
        with self.svc.db.read() as s:
            vol = s.get(Volume, volume_id)
        if vol is None:
            raise NotFound(f"The volume '{volume_id}' does not exist.")
        return vol

    def _rows_on(self, table: type[Volume] | type[Snapshot], members: set[tuple[str, str]],
                 settled_before: datetime) -> Held:
        in_pool = (Snapshot.pool_copy.is_(True),) if table is Snapshot else ()
        with self.svc.db.read() as s:
            held = Held.read(s, table, table.storage_node.in_(sorted({n for n, _ in members})), *in_pool,
                             settled_before=settled_before)
        return Held([r for r in held.rows if (r[_NODE], r[_POOL]) in members])

    def _lost_pool(self, node: str, pool: str, why: str, report: Report, seen: set[tuple[str, str, str]],
                   repair: bool, ignore_grace: bool) -> str | None:
        """A pool whose storage is gone (docs/operations.md "A lost pool"): the reason its live volumes are
        lost, once a repairing pass has seen it gone for the grace period (at once for ``vbs check``'s
        report and ``--now``); None while it waits, in case the storage comes back (a file system mounted
        again)."""
        finding = Finding("lost-pool", node, pool, why)
        report.findings.append(finding)
        if repair and not self._orphan_due(("lost-pool", node, pool), seen, ignore_grace):
            finding.action = "waiting"
            return None
        return f"its pool {pool} on {node} is lost ({why})"

    def _check_files(self, node: str, pool: str, kind: str, present: list[str], held: Held, busy: set[str],
                     report: Report, seen: set[tuple[str, str, str]], repair: bool, ignore_grace: bool,
                     lost: str | None = None) -> None:
        """``held``: the rows recorded where ``present`` is (this node's; every agent's of a shared pool),
        read after the agent listed ``present``. Set differences: a pass compares 100,000 ids. ``lost``:
        the pool is lost (it lists nothing), and this is why."""
        agent = self.svc.agents.storage(node)
        present_set = set(present)
        orphans = present_set - held.expected - busy
        for item_id in sorted(orphans):
            row_status = held.status_of.get(item_id)
            finding = Finding("orphan-file", node, item_id, f"{kind} file in pool {pool} with "
                              f"{'no row' if row_status is None else 'row ' + row_status}")
            report.findings.append(finding)
            if repair and self._orphan_due(("file", node, item_id), seen, ignore_grace):
                try:
                    (agent.remove_volume if kind == "volume" else agent.remove_snapshot)(pool, item_id)
                    finding.action = "repaired"
                except VbsError as exc:
                    finding.action = f"failed: {exc.message}"
            elif repair:
                finding.action = "waiting"
        for item_id in sorted(held.owed_in(node, pool) - present_set - busy):
            finding = Finding("missing-file", node, item_id,
                              f"{kind} is {held.status_of[item_id]} but {lost or 'its file is gone'}")
            report.findings.append(finding)
            if repair:
                finding.action = "repaired" if self._mark_lost(kind, item_id, lost) else "reported"

    def _mark_lost(self, kind: str, item_id: str, lost: str | None = None) -> bool:
        """An available volume or a completed snapshot without data becomes ``error`` (in-use: reported: its
        export may still hold the file open); a snapshot the store holds only loses its pool copy."""
        reason = lost or "its data file vanished from the storage node"
        with self.svc.db.session() as s:
            if kind == "volume":
                return try_transition(s, Volume, item_id, VolumeState.ERROR, from_states=[VolumeState.AVAILABLE],
                                      status_reason=reason)
            kept = plain.execute(s, update(Snapshot).where(
                Snapshot.id == item_id, Snapshot.status == SnapshotState.COMPLETED, Snapshot.store_state == STORED,
                Snapshot.pool_copy.is_(True)).values(pool_copy=False, updated_at=utcnow()))
            if kept.rowcount == 1:
                log.warning("snapshot %s: %s; it lives on in the snapshot store", item_id, reason)
                return True
            return try_transition(s, Snapshot, item_id, SnapshotState.ERROR, from_states=[SnapshotState.COMPLETED],
                                  status_reason=reason)

    def _check_exports(self, node: str, exports: list[ExportInfo], atts: list[Attachment], hosts: dict[str, Node],
                       busy: set[str], report: Report, seen: set[tuple[str, str, str]], repair: bool,
                       ignore_grace: bool) -> None:
        agent = self.svc.agents.storage(node)
        have = {(e.key, e.host) for e in exports}
        may = {(a.volume_id, a.host) for a in atts}
        for vol_id, host in sorted(have - may):
            if vol_id in busy:
                continue
            finding = Finding("orphan-export", node, vol_id, f"exported to {host} without a live attachment")
            report.findings.append(finding)
            if repair and self._orphan_due(("export", vol_id, host), seen, ignore_grace):
                try:
                    agent.remove_export(vol_id, host)
                    finding.action = "repaired"
                except VbsError as exc:
                    finding.action = f"failed: {exc.message}"
            elif repair:
                finding.action = "waiting"
        for att in atts:
            if att.status not in MUST_BE_EXPORTED or (att.volume_id, att.host) in have or att.volume_id in busy:
                continue
            finding = Finding("missing-export", node, att.volume_id, f"attached to {att.host} but not exported")
            report.findings.append(finding)
            host_node = hosts.get(att.host)
            if repair and host_node is not None:
                try:
                    vol = self._volume(att.volume_id)
                    agent.connection_for(vol.pool, att.volume_id, host_identity(host_node), att.mode == "ro",
                                         host_info(host_node).capabilities.protocols,
                                         limits=volume_limits(self.svc.cfg, vol))
                    finding.action = "repaired"
                except VbsError as exc:
                    finding.action = f"failed: {exc.message}"

    # -- hosts -------------------------------------------------------------------------------------

    def _check_host(self, node: Node, busy: set[str], report: Report, seen: set[tuple[str, str, str]],
                    repair: bool, ignore_grace: bool) -> None:
        agent = self.svc.agents.host(node.name)
        with self.svc.db.read() as s:
            vms = list(s.scalars(select(Instance).where(Instance.host == node.name, Instance.state == "running")))
            atts = list(s.scalars(select(Attachment).where(Attachment.host == node.name,
                                                           Attachment.status.in_(MAY_BE_EXPORTED))))
        for vm in vms:
            try:
                disks = agent.list_disks(vm.vm_id)
            except NotFound:
                continue  # the VM is gone since the last heartbeat: it holds no disk, the next one says so
            except VbsError as exc:
                report.findings.append(Finding("unreachable", node.name, vm.id, f"VM {vm.vm_id}: {exc.message}"))
                continue
            expected = {ids.virtio_serial(a.volume_id): a for a in atts if a.vm_id == vm.vm_id}
            for disk in disks:
                serial = disk.serial
                volume_id = ids.volume_of_serial(serial) or serial
                if serial in expected or volume_id in busy:
                    continue
                finding = Finding("orphan-disk", node.name, volume_id, f"plugged into VM {vm.vm_id} without a "
                                  "live attachment")
                report.findings.append(finding)
                if repair and self._orphan_due(("disk", vm.id, serial), seen, ignore_grace):
                    if self._claimed_since(node.name, vm.vm_id, volume_id):
                        finding.action = "waiting"  # attached again since this pass read the DB: not an orphan
                        continue
                    try:
                        agent.detach(vm.vm_id, serial, force=True, timeout=10.0)
                        finding.action = "repaired"
                    except VbsError as exc:
                        finding.action = f"failed: {exc.message}"
                elif repair:
                    finding.action = "waiting"
            plugged = {d.serial for d in disks}
            for serial, att in expected.items():
                if att.status not in MUST_BE_EXPORTED or serial in plugged or att.volume_id in busy:
                    continue
                if att.status == AttachmentState.BUSY:
                    # Its detach gave up waiting, and the guest has let the disk go since: finish the detach.
                    report.findings.append(self._released(node.name, vm.vm_id, att, repair))
                else:
                    report.findings.append(Finding("missing-disk", node.name, att.volume_id,
                                                   f"attached to VM {vm.vm_id} per the DB, not in the VM"))

    def _claimed_since(self, host: str, vm_id: str, volume_id: str) -> bool:
        """Whether the volume has a live attachment to this VM, or an operation under way, now: read again just
        before an orphan disk is unplugged, for an attach that began after the pass read the DB (its host step
        comes after its storage step, so it cannot have plugged the disk in the moments since)."""
        with self.svc.db.read() as s:
            live = s.scalar(select(Attachment.id).where(
                Attachment.volume_id == volume_id, Attachment.host == host, Attachment.vm_id == vm_id,
                Attachment.status.in_(MAY_BE_EXPORTED)).limit(1))
            running = s.scalar(select(Operation.id).where(
                Operation.resource_id == volume_id, Operation.status.in_(UNFINISHED_OPERATION)).limit(1))
        return live is not None or running is not None

    def _released(self, node: str, vm_id: str, att: Attachment, repair: bool) -> Finding:
        finding = Finding("released-disk", node, att.volume_id, f"busy in VM {vm_id}, whose guest has let it go")
        if repair and self.finish_released is not None:
            try:
                finding.action = "repaired" if self.finish_released(att.id) else "reported"
            except VbsError as exc:
                finding.action = f"failed: {exc.message}"
        return finding

