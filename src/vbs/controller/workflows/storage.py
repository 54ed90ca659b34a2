"""What storage steps share: their node's agent, and waiting for a background copy with progress."""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import update

from vbs.controller.agents import ItemStatus, StorageAgent
from vbs.controller.db import Snapshot, Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.workflows.engine import StepContext
from vbs.errors import AgentUnavailable, DriverError

# Short copies finish between two polls: start polling fast, back off to the steady interval.
FIRST_POLL_S = 0.02
POLL_INTERVAL_S = 0.25
UNREACHABLE_LIMIT_S = 120.0


def until_ready(ensure: Callable[[], ItemStatus], on_progress: Callable[[int], None]) -> ItemStatus:
    """Repeat the idempotent ``ensure`` call until the item is ready.

    Polling with ``ensure`` rather than a read keeps the copy going if the agent restarted midway
    (it restarts an interrupted copy). An agent unreachable for too long fails the step.
    """
    last_progress = -1
    unreachable_since: float | None = None
    delay = FIRST_POLL_S
    while True:
        try:
            status = ensure()
            unreachable_since = None
        except AgentUnavailable as exc:
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since > UNREACHABLE_LIMIT_S:
                # Not "unreachable": earlier calls of this loop may have started work on the agent.
                raise AgentUnavailable(exc.message) from exc
            time.sleep(1.0)
            continue
        if status.state == "ready":
            return status
        if status.state == "error":
            raise DriverError(status.error or "the storage agent reported an error")
        if status.progress != last_progress:
            on_progress(status.progress)
            last_progress = status.progress
        time.sleep(delay)
        delay = min(POLL_INTERVAL_S, delay * 2)


def storage_agent(ctx: StepContext) -> StorageAgent:
    """The agent of the storage node the operation's resource lives on."""
    return ctx.services.agents.storage(ctx.params["node"])  # type: ignore[no-any-return]


def progress_reporter(ctx: StepContext, table: type[Volume] | type[Snapshot], while_in: str) -> Callable[[int], None]:
    """Mirror a copy's progress into the resource row, while the row is still ``while_in``."""

    def report(progress: int) -> None:
        with ctx.services.db.session() as s:
            s.execute(update(table).where(table.id == ctx.resource_id, table.status == while_in)
                      .values(progress=progress, updated_at=utcnow()))

    return report
