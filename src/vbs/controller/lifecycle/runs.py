"""The controllers' scheduler of lifecycle policies (docs/lifecycle-policies.md, docs/scale-out.md
"Lifecycle policies"). Every controller runs it; exactly one runs each due time:

- **The insert is the claim.** A due time is a pure function of the schedule (lifecycle.schedule), so every
  controller computes the same ones; the run row of (policy, schedule, due time) is unique, and the one
  controller whose insert succeeds takes that run (the others' inserts fail, and they go on).
- **Nothing is skipped silently.** A due time that passed while no controller ran it (all were down, or the
  one holding the loop was busy with a long run), older than the schedule's latest one, gets a ``skipped``
  row saying so; the latest one is still run, late.
- **Old runs are forgotten** (``purge``): finished runs older than ``operation_retention_s``, but for each
  schedule's newest, which says up to where its due times were taken.
- **A run whose controller died is taken over.** A ``running`` row whose controller no longer renews its
  row in ``controllers`` (cluster.py) within a lease is taken by a conditional update (one survivor wins)
  and carried on from where it was: its targets already recorded are not snapshotted again (execute.py).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError

from vbs import ids
from vbs.controller.cluster import live_controllers
from vbs.controller.db import Database, LifecyclePolicy, PolicyRun
from vbs.controller.lifecycle.execute import RUNNING, SKIPPED, execute
from vbs.controller.lifecycle.schedule import CronError, cadence_of
from vbs.controller.runtime import Controller
from vbs.net.repeating import Periodic

__all__ = ["LifecycleScheduler", "MISSED", "purge"]

log = logging.getLogger(__name__)

MISSED = "missed: no controller ran the policy at its due time (every controller was down, or busy with an " \
         "earlier run); the schedule's next due time was run instead"
SKIPPED_PER_PASS = 100  # missed due times recorded per schedule and pass (the rest at the next passes)
PURGE_INTERVAL_S = 3600.0
PURGE_BATCH = 1000


class LifecycleScheduler:
    """Runs the due schedules of every enabled policy, on this controller's ``owner`` id."""

    def __init__(self, svc: Controller, owner: str, *, lease_s: float, poll_s: float) -> None:
        self.svc, self.owner, self.lease_s, self.poll_s = svc, owner, lease_s, poll_s
        self._purged_at = 0.0
        self._passes = Periodic("lifecycle-policies", lambda: self.poll_s, self._background_pass, log=log,
                                what="lifecycle policies")

    def start(self) -> None:
        self._passes.start()

    def stop(self) -> None:
        self._passes.stop()

    def _background_pass(self) -> None:
        self.tick()
        if time.monotonic() - self._purged_at >= PURGE_INTERVAL_S:
            self._purged_at = time.monotonic()
            purge(self.svc.db, self.svc.cfg.operation_retention_s)

    def tick(self) -> int:
        """One pass: take over orphaned runs, claim the due ones, run them; how many runs it carried out."""
        taken = [*self._orphans(), *self._claim_due()]
        for run_id in taken:
            if self._passes.stopping.is_set():
                break
            execute(self.svc, self.owner, run_id)
        return len(taken)

    def _orphans(self) -> list[str]:
        """Runs left ``running`` by a controller that is gone (or by this one before a restart), taken over."""
        db = self.svc.db
        live = set(live_controllers(db, self.lease_s))
        with db.read() as s:
            rows = s.execute(select(PolicyRun.id, PolicyRun.controller).where(PolicyRun.status == RUNNING)).all()
        taken = []
        for run_id, holder in rows:
            if holder != self.owner and holder in live:
                continue
            with db.session() as s:
                hit = s.execute(update(PolicyRun).where(PolicyRun.id == run_id, PolicyRun.status == RUNNING,
                                                        PolicyRun.controller == holder)
                                .values(controller=self.owner)).rowcount  # type: ignore[attr-defined]
            if hit == 1:
                if holder != self.owner:
                    log.info("lifecycle run %s taken over from controller %s, which is gone", run_id, holder)
                taken.append(str(run_id))
        return taken

    def _claim_due(self) -> list[str]:
        db = self.svc.db
        with db.read() as s:
            now = db.clock(s)
            policies = list(s.scalars(select(LifecyclePolicy).where(LifecyclePolicy.state == "ENABLED")
                                      .order_by(LifecyclePolicy.id)))
            s.expunge_all()
        claimed = []
        for policy in policies:
            for schedule in policy.details.get("Schedules", []):
                run_id = self._claim(policy, str(schedule["Name"]), schedule["CreateRule"], now)
                if run_id is not None:
                    claimed.append(run_id)
        return claimed

    def _claim(self, policy: LifecyclePolicy, name: str, rule: dict[str, object], now: datetime) -> str | None:
        try:
            cadence = cadence_of(dict(rule))
        except CronError:
            return None  # refused when the policy was written; not reachable
        due = cadence.last_due(now)
        if due is None or due <= policy.schedules_from:
            return None  # nothing due since the policy was made, enabled or given its document
        with self.svc.db.read() as s:
            last = s.scalar(select(func.max(PolicyRun.due_at)).where(PolicyRun.policy_id == policy.id,
                                                                   PolicyRun.schedule_name == name))
        if last is not None and last >= due:
            return None  # taken (or skipped) already
        since = max(policy.schedules_from, last) if last is not None else policy.schedules_from
        for missed in cadence.due_between(since, due, SKIPPED_PER_PASS):
            if missed < due:
                self._insert(policy.id, name, missed, SKIPPED, now, MISSED)
        return self._insert(policy.id, name, due, RUNNING, now, None)

    def _insert(self, policy_id: str, name: str, due: datetime, status: str, now: datetime,
                error: str | None) -> str | None:
        """The run row of this due time, if this controller's insert is the first; else None."""
        run_id = ids.new_id("policy-run")
        try:
            with self.svc.db.session() as s:
                s.add(PolicyRun(id=run_id, policy_id=policy_id, schedule_name=name, due_at=due, status=status,
                                controller=self.owner, started_at=now, finished_at=now if status == SKIPPED else None,
                                targets={}, deleted=[], error=error))
        except IntegrityError:
            return None  # another controller took it (or the policy was deleted meanwhile)
        if status == SKIPPED:
            log.warning("lifecycle policy %s schedule %r: due time %s %s", policy_id, name, due, MISSED)
            return None
        log.info("lifecycle policy %s schedule %r: run %s due %s taken", policy_id, name, run_id, due)
        return run_id


def purge(db: Database, retention_s: float) -> int:
    """Forget finished runs older than ``retention_s`` but each schedule's newest; how many (a batch at most).
    Every controller may run it: deleting what another deleted already deletes nothing."""
    with db.session() as s:
        cutoff = db.clock(s) - timedelta(seconds=retention_s)
        newest = dict(((p, n), due) for p, n, due in s.execute(
            select(PolicyRun.policy_id, PolicyRun.schedule_name, func.max(PolicyRun.due_at))
            .group_by(PolicyRun.policy_id, PolicyRun.schedule_name)).all())
        old = s.execute(select(PolicyRun.id, PolicyRun.policy_id, PolicyRun.schedule_name, PolicyRun.due_at).where(
            PolicyRun.status != RUNNING, PolicyRun.due_at < cutoff).limit(PURGE_BATCH)).all()
        gone = [run_id for run_id, policy_id, name, due in old if due < newest[(policy_id, name)]]
        if gone:
            s.execute(delete(PolicyRun).where(PolicyRun.id.in_(gone)))
    return len(gone)
