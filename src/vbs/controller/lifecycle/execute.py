"""One run of a policy's schedule (docs/lifecycle-policies.md, "Runs"): snapshot each target through the
ordinary create-snapshot and create-snapshots requests, with the policy's tags, then retire the schedule's
older snapshots of each target (delete them through the ordinary delete path, or archive them).

A target's snapshots are begun in the same transaction that records them on the run's row, conditional on
this controller still holding the run: a run taken over by another controller (docs/scale-out.md,
"Lifecycle policies") snapshots only the targets not recorded yet, and a controller that lost its run
makes nothing more. Retention is idempotent, so the new holder simply runs it again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import and_, or_, select

from vbs.controller.db import Attachment, Instance, LifecyclePolicy, PolicyRun, Snapshot, Tag, Volume
from vbs.controller.db.states import AttachmentState, SnapshotState, VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.lifecycle.retention import Kept, retire
from vbs.controller.requests import filters as flt
from vbs.controller.requests.create_snapshot import begin_snapshot
from vbs.controller.requests.create_snapshots import begin_snapshot_set
from vbs.controller.requests.delete_snapshot import delete_snapshot
from vbs.controller.requests.describe_snapshots import effective_tier, tiers_of
from vbs.controller.requests.snapshot_locks import SnapshotLocked
from vbs.controller.requests.snapshot_tiers import modify_tier
from vbs.controller.requests.tags import set_tags
from vbs.controller.rest.schemas.snapshots import CreateSnapshotRequest, CreateSnapshotSetRequest
from vbs.controller.runtime import Controller
from vbs.errors import NotFound, VbsError

__all__ = ["execute", "POLICY_TAG", "SCHEDULE_TAG", "RUNNING"]

log = logging.getLogger(__name__)

POLICY_TAG = "aws:dlm:lifecycle-policy-id"
SCHEDULE_TAG = "aws:dlm:lifecycle-schedule-name"
RUNNING, SUCCEEDED, FAILED, SKIPPED = "running", "succeeded", "failed", "skipped"
ERROR_MAX = 2000
CRASH_KIND = "lifecycle-run"  # VBS_CRASH_AT=lifecycle-run:snapshot:done (vbs.controller.workflows.faults)
TAKEN_OVER = "taken over by another controller"
POLICY_DELETED = "stopped: its policy was deleted"


class _LostRun(Exception):
    """The run is no longer this controller's: another took it over, or its policy (and with it the run's
    row) was deleted. Stop, changing nothing more."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@dataclass
class _Run:
    svc: Controller
    owner: str
    run_id: str
    policy: LifecyclePolicy
    schedule: dict[str, Any]
    done: dict[str, Any]
    started: datetime


def _held(row: PolicyRun | None, run: _Run) -> PolicyRun:
    """The run's row if this controller still holds it; else _LostRun, saying why."""
    if row is None:
        raise _LostRun(POLICY_DELETED)  # deleting a policy deletes its runs (lifecycle.policies)
    if row.controller != run.owner or row.status != RUNNING:
        raise _LostRun(TAKEN_OVER)
    return row


def _still_held(run: _Run) -> None:
    """Before each retirement: a deleted policy's snapshots stay (docs/lifecycle-policies.md, "Runs")."""
    with run.svc.db.read() as s:
        _held(s.get(PolicyRun, run.run_id), run)


def _record_target(s: Any, run: _Run, target: str, snapshot_ids: list[str]) -> None:
    row = _held(s.get(PolicyRun, run.run_id, with_for_update=True), run)
    row.targets = {**(row.targets or {}), target: snapshot_ids}


def _user_tags(run: _Run, instance_id: str | None) -> dict[str, str]:
    tags: dict[str, str] = {}
    stamp = run.started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    for t in run.schedule.get("VariableTags", []):
        tags[t["Key"]] = (instance_id or "") if t["Value"] == "$(instance-id)" else stamp
    tags.update({t["Key"]: t["Value"] for t in run.schedule.get("TagsToAdd", [])})
    return tags


def _system_tags(run: _Run) -> dict[str, str]:
    return {POLICY_TAG: run.policy.id, SCHEDULE_TAG: run.schedule["Name"]}


def _comment(run: _Run) -> str:
    return f"Created for policy: {run.policy.id} schedule: {run.schedule['Name']}"[:255]


def _tagged(pairs: list[dict[str, Any]], prefix: str) -> Any:
    """The ids of resources (of ``prefix``) carrying any of the tags ``pairs``."""
    return select(Tag.resource_id).where(Tag.resource_id.like(f"{prefix}-%"), or_(*(
        and_(Tag.key == p["Key"], Tag.value == p["Value"]) for p in pairs)))


def _targets(run: _Run) -> list[str]:
    """The volumes (available or in use) or running instances the policy targets now, by id."""
    details, tenant = run.policy.details, run.policy.tenant
    with run.svc.db.read() as s:
        if details["ResourceTypes"] == ["VOLUME"]:
            return list(s.scalars(select(Volume.id).where(
                Volume.id.in_(_tagged(details["TargetTags"], "vol")), Volume.tenant == tenant,
                Volume.status.in_([VolumeState.AVAILABLE, VolumeState.IN_USE])).order_by(Volume.id)))
        # An instance's tags: VBS instances carry their VM's name as the tag Name (docs/lifecycle-policies.md).
        names = [p["Value"] for p in details["TargetTags"] if p["Key"] == "Name"]
        owned = select(Volume.id).where(Volume.tenant == tenant)
        with_volumes = select(Attachment.instance_id).where(Attachment.status == AttachmentState.ATTACHED,
                                                            Attachment.volume_id.in_(owned))
        return list(s.scalars(select(Instance.id).where(Instance.name.in_(names), Instance.state == "running",
                                                        Instance.id.in_(with_volumes)).order_by(Instance.id)))


def _snapshot_volume(run: _Run, volume_id: str) -> None:
    svc = run.svc
    with svc.db.session() as s:
        tags = dict(flt.tags_of(s, [volume_id])[volume_id]) if run.schedule.get("CopyTags") else {}
        tags.update(_user_tags(run, None))
        op_id, snap = begin_snapshot(svc, s, CreateSnapshotRequest(volume_id=volume_id, comment=_comment(run),
                                                                   tags=tags), run.policy.tenant)
        set_tags(s, snap.id, _system_tags(run))
        _record_target(s, run, volume_id, [snap.id])
    svc.engine.submit(op_id)


def _snapshot_instance(run: _Run, instance_id: str) -> None:
    svc, tenant = run.svc, run.policy.tenant
    excluded_tags = (run.policy.details.get("Parameters") or {}).get("ExcludeDataVolumeTags") or []
    with svc.db.session() as s:
        excluded: list[str] = []
        if excluded_tags:
            attached = select(Attachment.volume_id).where(Attachment.instance_id == instance_id,
                                                          Attachment.status == AttachmentState.ATTACHED)
            excluded = list(s.scalars(select(Volume.id).where(Volume.id.in_(attached), Volume.tenant == tenant,
                                                              Volume.id.in_(_tagged(excluded_tags, "vol")))))
        req = CreateSnapshotSetRequest(instance_id=instance_id, comment=_comment(run),
                                       tags=_user_tags(run, instance_id),
                                       copy_tags_from_volume=bool(run.schedule.get("CopyTags")),
                                       exclude_volume_ids=excluded)
        op_id, snaps = begin_snapshot_set(svc, s, req, tenant)
        for snap in snaps:
            set_tags(s, snap.id, _system_tags(run))
        _record_target(s, run, instance_id, [x.id for x in snaps])
    svc.engine.submit(op_id)


def _retention(run: _Run, volume_ids: list[str], now: datetime) -> tuple[list[str], list[str]]:
    """Retire the schedule's older snapshots of each volume; (the snapshots retired, notes)."""
    svc, tenant = run.svc, run.policy.tenant
    retired: list[str] = []
    notes: list[str] = []
    for volume_id in volume_ids:
        with svc.db.read() as s:
            snaps = list(s.scalars(_schedule_snapshots(run, volume_id)))
            tiers = tiers_of(s, [x.id for x in snaps])
        kept = [Kept(x.id, x.started_at, x.status == SnapshotState.COMPLETED,
                     effective_tier(tiers.get(x.id), now) == "archive" or (
                         tiers.get(x.id) is not None and tiers[x.id].last_status == "archival-in-progress"))
                for x in snaps]
        to_archive, to_delete = retire(kept, run.schedule["RetainRule"], run.schedule.get("ArchiveRule"), now)
        for snap_id in to_archive:
            _still_held(run)
            try:
                modify_tier(svc, snap_id, tenant, "archive")
                retired.append(snap_id)
            except VbsError as exc:
                notes.append(f"{snap_id} not archived: {exc.message}")
        for snap_id in to_delete:
            _still_held(run)
            try:
                delete_snapshot(svc, snap_id, tenant)
                retired.append(snap_id)
            except SnapshotLocked as exc:
                notes.append(f"{snap_id} kept: {exc.message}")
            except NotFound:
                pass  # deleted meanwhile (by hand, or by a run taken over)
            except VbsError as exc:
                notes.append(f"{snap_id} not deleted yet (retried at the next run): {exc.message}")
    return retired, notes


def _schedule_snapshots(run: _Run, volume_id: str) -> Any:
    """The schedule's live snapshots of the volume, newest first."""
    return (select(Snapshot).where(
        Snapshot.tenant == run.policy.tenant, Snapshot.volume_id == volume_id,
        Snapshot.status.in_([SnapshotState.PENDING, SnapshotState.COMPLETED]),
        Snapshot.id.in_(select(Tag.resource_id).where(Tag.key == POLICY_TAG, Tag.value == run.policy.id)),
        Snapshot.id.in_(select(Tag.resource_id).where(Tag.key == SCHEDULE_TAG, Tag.value == run.schedule["Name"])))
        .order_by(Snapshot.started_at.desc(), Snapshot.id.desc()))


def _volumes_of(run: _Run, done: dict[str, Any]) -> list[str]:
    if run.policy.details["ResourceTypes"] == ["VOLUME"]:
        return sorted(done)
    snapshot_ids = [x for ids in done.values() for x in ids]
    with run.svc.db.read() as s:
        return sorted(set(s.scalars(select(Snapshot.volume_id).where(Snapshot.id.in_(snapshot_ids)))))


def finish(svc: Controller, owner: str, run_id: str, status: str, error: str | None,
           retired: list[str] | None = None) -> bool:
    """End the run (if this controller still holds it)."""
    with svc.db.session() as s:
        row = s.get(PolicyRun, run_id, with_for_update=True)
        if row is None or row.controller != owner or row.status != RUNNING:
            return False
        row.status, row.finished_at = status, utcnow()
        row.error = error[:ERROR_MAX] if error else None
        row.deleted = list(retired or [])
    return True


def execute(svc: Controller, owner: str, run_id: str) -> None:
    """Carry the run out to its end (or until another controller takes it over)."""
    with svc.db.read() as s:
        row = s.get(PolicyRun, run_id)
        policy = s.get(LifecyclePolicy, row.policy_id) if row is not None else None
        if row is None or row.status != RUNNING or row.controller != owner:
            return
        if policy is not None:
            s.expunge(policy)
        done, started = dict(row.targets or {}), row.started_at or utcnow()
    schedules = policy.details.get("Schedules", []) if policy is not None else []
    schedule = next((x for x in schedules if x["Name"] == row.schedule_name), None)
    if policy is None or schedule is None:
        finish(svc, owner, run_id, SKIPPED, "the policy was deleted, or no longer has this schedule")
        return
    run = _Run(svc, owner, run_id, policy, schedule, done, started)
    notes: list[str] = []
    failed = False
    try:
        for target in _targets(run):
            if target in done:
                continue  # a controller before this one snapshotted it
            try:
                (_snapshot_volume if target.startswith("vol-") else _snapshot_instance)(run, target)
                svc.engine.faults.maybe_crash(CRASH_KIND, "snapshot", "done")
                # A test may hold the run here, its first target's snapshot begun (VBS_TEST_HOOKS=1).
                svc.engine.faults.before_call(CRASH_KIND, "next-target")
            except (VbsError, ValidationError, ValueError) as exc:
                failed = True
                notes.append(f"{target}: {getattr(exc, 'message', None) or str(exc).splitlines()[0]}")
        with svc.db.read() as s:
            got = s.get(PolicyRun, run_id)
            done = dict(got.targets or {}) if got is not None else done
        retired, retention_notes = _retention(run, _volumes_of(run, done), utcnow())
    except _LostRun as lost:
        log.info("lifecycle run %s %s", run_id, lost.why)
        return
    finish(svc, owner, run_id, FAILED if failed else SUCCEEDED, "; ".join([*notes, *retention_notes]) or None,
           retired)
