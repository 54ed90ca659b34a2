"""Operation leases (several controllers on one database, docs/architecture.md "Several controllers").

The controller that begins an operation owns it; this renews the leases of everything it owns and
adopts the operations whose lease expired (their controller died or hangs), each with a new, higher
fence, claimed with ``SELECT … FOR UPDATE SKIP LOCKED`` so two survivors never adopt the same one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import and_, or_, select, update

from vbs.controller.db import Database, Operation
from vbs.controller.db.states import UNFINISHED_OPERATION

__all__ = ["OperationLeases"]

log = logging.getLogger(__name__)

# A controller acts on its operations only within this share of a lease since the start of its last
# renewal that succeeded: the rest is the margin for a call on its way while the lease runs out (an agent
# that already saw the new owner's fence refuses it anyway).
HELD_SHARE = 0.8


class OperationLeases:
    """The leases of one controller's operations: renewed, and adopted from others once expired."""

    def __init__(self, db: Database, owner: str, lease: timedelta, *, resume: Callable[[str], None]) -> None:
        """``resume(op_id)`` runs an operation this controller adopted."""
        self.db = db
        self.owner = owner
        self._lease = lease
        self._resume = resume
        self._stop = threading.Event()
        # Monotonic time of the start of the last renewal that succeeded; None until the loop runs (an
        # engine driven by hand, without the loop, is not limited).
        self._renewed: float | None = None

    def held(self) -> bool:
        """Whether this controller's leases are surely still its own: renewed within a share of a lease
        (by this machine's clock, from before the renewal's statement: the database's lease ends later)."""
        renewed = self._renewed
        return renewed is None or time.monotonic() - renewed < self._lease.total_seconds() * HELD_SHARE

    def adopt(self, *, everything: bool = False, own: bool = False, limit: int = 100) -> list[str]:
        """Take over unfinished operations whose lease expired (or that have no owner), each with a new
        fence, and resume them. Rows another controller is adopting at this moment are skipped."""
        with self.db.session() as s:
            now = self.db.clock(s)
            query = select(Operation).where(Operation.status.in_(UNFINISHED_OPERATION))
            if not everything:
                # Never this controller's own operations (a run of one may be under way here: its lease
                # is renewed, not adopted), except at start, when no run of this process exists yet.
                expired = or_(Operation.lease_until.is_(None), Operation.lease_until < now)
                orphaned = [Operation.owner.is_(None), and_(Operation.owner != self.owner, expired)]
                if own:
                    orphaned.append(Operation.owner == self.owner)
                query = query.where(or_(*orphaned))
            ops = s.scalars(query.order_by(Operation.created_at).limit(limit)
                            .with_for_update(skip_locked=True)).all()
            adopted = []
            for op in ops:
                if op.owner not in (None, self.owner):
                    log.warning("adopting operation %s (%s of %s) from controller %s, whose lease expired",
                                op.id, op.kind, op.resource_id, op.owner)
                op.owner, op.fence, op.lease_until = self.owner, self.db.next_fence(s), now + self._lease
                op.next_attempt_at = None
                adopted.append(op.id)
        for op_id in adopted:
            log.info("resuming operation %s", op_id)
            self._resume(op_id)
        return adopted

    def renew(self) -> int:
        """Extend the lease of every unfinished operation this controller owns."""
        started = time.monotonic()
        with self.db.session() as s:
            until = self.db.clock(s) + self._lease
            result = s.execute(update(Operation).where(Operation.owner == self.owner,
                                                       Operation.status.in_(UNFINISHED_OPERATION))
                               .values(lease_until=until))
        if self._renewed is not None:
            if not self.held():
                log.warning("leases renewed again after %.1f s without: acting on operations again",
                            time.monotonic() - self._renewed)
            self._renewed = max(self._renewed, started)
        return int(getattr(result, "rowcount", 0) or 0)

    def start(self, stop: threading.Event) -> None:
        """Renew and adopt every third of a lease, in a thread of its own, until ``stop`` is set."""
        self._stop = stop
        self._renewed = time.monotonic()
        threading.Thread(target=self._loop, name="workflow-leases", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(self._lease.total_seconds() / 3):
            try:
                self.renew()
                self.adopt()
            except Exception:
                log.exception("workflow lease loop")
