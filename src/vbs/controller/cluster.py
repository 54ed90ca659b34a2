"""Several controllers on one database (docs/architecture.md §6): who runs, and who runs the singleton loops.

Each controller keeps a row in ``controllers`` (its id, URL, start and last renewal by the DB's
clock) for ``vbs describe-controllers``. A singleton loop (the reconciler, housekeeping) runs on one
controller at a time: before each pass it takes or renews a ``SingletonLease``; another controller
takes the lease over only once it expired, with a higher fence.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from vbs.controller.db import ControllerRecord, Database, LeaseRecord, Operation
from vbs.controller.db.states import UNFINISHED_OPERATION
from vbs.controller.rest.schemas.nodes import ControllerOut

log = logging.getLogger(__name__)


class SingletonLease:
    """The right to run the loop ``name`` for ``ttl_s``, held by ``owner`` while it renews it."""

    def __init__(self, db: Database, name: str, owner: str, ttl_s: float) -> None:
        self.db, self.name, self.owner = db, name, owner
        self._ttl = timedelta(seconds=ttl_s)

    def hold(self) -> bool:
        """Take the lease (free, expired, or already ours) and extend it; False if another controller
        holds it."""
        try:
            with self.db.session() as s:
                now = self.db.clock(s)
                row = s.get(LeaseRecord, self.name, with_for_update=True)
                if row is None:
                    s.add(LeaseRecord(name=self.name, owner=self.owner, lease_until=now + self._ttl,
                                      fence=self.db.next_fence(s)))
                    s.flush()
                    log.info("%s now runs on this controller (%s)", self.name, self.owner)
                    return True
                if row.owner != self.owner and row.lease_until >= now:
                    return False
                if row.owner != self.owner:
                    log.info("%s taken over from controller %s, whose lease expired", self.name, row.owner)
                    row.owner, row.fence = self.owner, self.db.next_fence(s)
                row.lease_until = now + self._ttl
                return True
        except IntegrityError:
            return False  # another controller inserted the row first


class ControllerRegistry:
    """This controller's row in ``controllers``, renewed by the engine's lease loop."""

    def __init__(self, db: Database, controller_id: str, url: str) -> None:
        self.db, self.id, self.url = db, controller_id, url
        self._started: datetime | None = None

    def renew(self) -> None:
        with self.db.session() as s:
            now = self.db.clock(s)
            self._started = self._started or now
            row = s.get(ControllerRecord, self.id, with_for_update=True)
            if row is None:
                s.add(ControllerRecord(id=self.id, url=self.url, started_at=self._started, last_seen=now))
            else:
                row.url, row.started_at, row.last_seen = self.url, self._started, now


def live_controllers(db: Database, within_s: float) -> list[str]:
    """Ids of the controllers that renewed their row in the last ``within_s`` (none on a schema that
    predates the ``controllers`` table)."""
    try:
        with db.read() as s:
            since = db.clock(s) - timedelta(seconds=within_s)
            return list(s.scalars(select(ControllerRecord.id).where(ControllerRecord.last_seen >= since)))
    except (OperationalError, ProgrammingError):
        return []


def describe_controllers(db: Database, lease_s: float) -> list[ControllerOut]:
    """Every controller that ran on this database, live ones (renewed within a lease) first."""
    with db.read() as s:
        now = db.clock(s)
        held = dict(s.execute(select(Operation.owner, func.count()).where(
            Operation.status.in_(UNFINISHED_OPERATION), Operation.owner.is_not(None)).group_by(Operation.owner)).all())
        loops: dict[str, list[str]] = {}
        for lease in s.scalars(select(LeaseRecord).where(LeaseRecord.lease_until >= now)):
            loops.setdefault(lease.owner, []).append(lease.name)
        rows = s.scalars(select(ControllerRecord).order_by(ControllerRecord.id)).all()
        out = [ControllerOut(controller_id=r.id, url=r.url, started_at=r.started_at, last_seen=r.last_seen,
                             state="up" if r.last_seen >= now - timedelta(seconds=lease_s) else "down",
                             operations_held=int(held.get(r.id, 0)), singletons=sorted(loops.get(r.id, [])))
               for r in rows]
    return sorted(out, key=lambda c: (c.state != "up", c.controller_id))
