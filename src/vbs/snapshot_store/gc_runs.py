"""How an upload learns that a garbage collection ran beside it: the GC's run objects.

Every collection writes ``gc/runs/<run id>`` (its start and deadline) before it reads anything, and
``gc/done/<run id>`` when it stops. An upload lists both before its first chunk and again after it
has written its claims; if a run began in between, or any run it saw was unfinished, the upload
waits until those runs are done (or past their deadline) and then checks that every chunk it claims
is still there, putting back any that went (docs/snapshots.md, "Garbage collection").
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from vbs.snapshot_store.contract import ObjectMissing, SnapshotStore

__all__ = ["GcRun", "RunsSeen", "begin_run", "end_run", "prune_runs", "runs_seen", "overlapped", "wait_for_runs",
           "CLOCK_SKEW_S", "RUNS_KEPT_S"]

RUNS = "gc/runs/"
DONE = "gc/done/"
# Finished runs are kept this long; an upload that takes longer checks all its chunks whatever it saw.
RUNS_KEPT_S = 30 * 24 * 3600.0
# How far apart the clocks of two machines sharing a store may be (NTP keeps them far closer).
CLOCK_SKEW_S = 60.0


@dataclass(frozen=True)
class GcRun:
    run_id: str
    started_at: float
    deadline: float


@dataclass(frozen=True)
class RunsSeen:
    """The runs a listing found: begun, and of those (or of older ones) finished."""

    started: frozenset[str]
    finished: frozenset[str]


def begin_run(store: SnapshotStore, now: float, max_duration_s: float) -> GcRun:
    run = GcRun(f"{int(now):010d}-{secrets.token_hex(4)}", now, now + max_duration_s)
    doc = {"run_id": run.run_id, "started_at": run.started_at, "deadline": run.deadline}
    store.put(RUNS + run.run_id, json.dumps(doc).encode())
    return run


def end_run(store: SnapshotStore, run: GcRun, now: float) -> None:
    store.put(DONE + run.run_id, json.dumps({"run_id": run.run_id, "finished_at": now}).encode())


def prune_runs(store: SnapshotStore, finished_before: float, *, keep: str = "") -> int:
    """Forget runs (but ``keep``) that finished before ``finished_before``; the run object goes first,
    so a crash between the two deletes leaves a finished run, never one that seems to be running."""
    pruned = 0
    for info in list(store.list(DONE)):
        run_id = info.key[len(DONE):]
        if info.modified < finished_before and run_id != keep:
            store.delete(RUNS + run_id)
            store.delete(info.key)
            pruned += 1
    return pruned


def runs_seen(store: SnapshotStore) -> RunsSeen:
    started = frozenset(info.key[len(RUNS):] for info in store.list(RUNS))
    finished = frozenset(info.key[len(DONE):] for info in store.list(DONE))
    return RunsSeen(started, finished)


def overlapped(before: RunsSeen, after: RunsSeen) -> bool:
    """Whether a run may have swept between the two listings: one began, or one was not finished."""
    return bool(after.started - before.started) or bool((before.started | after.started) - after.finished)


def _deadline(store: SnapshotStore, run_id: str) -> float | None:
    try:
        doc = json.loads(store.get(RUNS + run_id))
        return float(doc["deadline"])
    except ObjectMissing:
        return None  # pruned: it had finished
    except (ValueError, KeyError, TypeError):
        return 0.0  # unreadable: wait for it as if its deadline were now


def wait_for_runs(store: SnapshotStore, seen: RunsSeen, *, poll_s: float = 5.0, clock: Callable[[], float] = time.time,
                  sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once every run that ``seen`` shows unfinished has finished or passed its deadline (a
    collection stops deleting at its deadline, so one that crashed is not waited for forever)."""
    pending = set(seen.started - seen.finished)
    deadlines = {run_id: _deadline(store, run_id) for run_id in pending}
    while pending:
        finished = {info.key[len(DONE):] for info in store.list(DONE)}
        now = clock()
        for run_id in list(pending):
            deadline = deadlines[run_id]
            if run_id in finished or deadline is None or now > deadline + CLOCK_SKEW_S:
                pending.discard(run_id)
        if pending:
            sleep(poll_s)
