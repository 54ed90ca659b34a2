"""CreateSnapshots: a crash-consistent set of snapshots of the volumes attached to one instance.

The VM is paused (QMP ``stop`` drains its in-flight I/O), every volume's storage node takes its
point-in-time snapshot — the instant is fixed when ``ensure_snapshot`` first answers, even where the
copy itself continues — and the VM runs again; then the copies finish. The pause lasts as long as the
storage nodes take to fix their instants (milliseconds on reflink), and at most ``PAUSE_HOLD_S``: the
host agent resumes the VM by itself after that whatever happens to this controller.

Rolls back when interrupted: the snapshots are removed, marked ``error``, and the VM resumed. Once the
copies are made, each snapshot goes into the snapshot store (``stored.upload``), rolling forward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from pydantic import BaseModel
from sqlalchemy import select

from vbs.controller.db import Snapshot
from vbs.controller.db.states import SnapshotState
from vbs.controller.db.transitions import transition
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows import stored
from vbs.controller.workflows.definition import Params, Step, StepContext, Workflow
from vbs.errors import IncorrectState, PointInTimeUnavailable

PAUSE_HOLD_S = 30


class SetMember(BaseModel):
    snapshot_id: str
    volume_id: str
    node: str
    pool: str
    # Its pool's copy's share of its progress before the upload into the store; None: no store.
    store_share: int | None = None


class SnapshotSetParams(Params):
    host: str
    vm_id: str
    members: list[SetMember]


def _pause(ctx: StepContext[SnapshotSetParams]) -> None:
    ctx.services.agents.host(ctx.params.host).pause(ctx.params.vm_id, PAUSE_HOLD_S)


def _resume(ctx: StepContext[SnapshotSetParams]) -> None:
    ctx.services.agents.host(ctx.params.host).resume(ctx.params.vm_id)


def _fix_instants(ctx: StepContext[SnapshotSetParams]) -> None:
    """Each storage node takes its snapshot now, while the VM is paused: one instant for all."""
    for m in ctx.params.members:
        agent = ctx.services.agents.storage(m.node)
        try:
            shared.waiting(partial(agent.ensure_snapshot, m.pool, m.snapshot_id, m.volume_id),
                           limit_s=PAUSE_HOLD_S / 2)
        except PointInTimeUnavailable as exc:
            raise IncorrectState(f"The storage node of '{m.volume_id}' cannot snapshot it at one instant now "
                                 f"({exc.message}); a snapshot set needs pools that can.") from exc


def _remove_all(ctx: StepContext[SnapshotSetParams]) -> None:
    for m in ctx.params.members:
        ctx.services.agents.storage(m.node).remove_snapshot(m.pool, m.snapshot_id)


def _finish_copies(ctx: StepContext[SnapshotSetParams]) -> None:
    for m in ctx.params.members:
        agent = ctx.services.agents.storage(m.node)
        report = shared.progress_reporter(ctx, Snapshot, SnapshotState.PENDING, m.snapshot_id)
        shared.until_ready(partial(agent.ensure_snapshot, m.pool, m.snapshot_id, m.volume_id),
                           stored.scaled(report, 0, 100 if m.store_share is None else m.store_share),
                           unreachable_s=shared.patience(ctx))


def _store_all(ctx: StepContext[SnapshotSetParams]) -> None:
    """Each snapshot goes into the store (one after the other; each upload is parallel in itself)."""
    for m in ctx.params.members:
        if m.store_share is not None:
            stored.upload(ctx, m.node, m.pool, m.snapshot_id, m.store_share)


def _mark_all(to_state: str, why: str = "snapshot set failed and was rolled back", **values: Any) -> Any:
    def step(ctx: StepContext[SnapshotSetParams], reason: str | None = None) -> None:
        extra = dict(values)
        if reason is not None:
            extra["status_reason"] = f"{why}: {reason}"[:2000]
        with ctx.session() as s:
            for m in ctx.params.members:
                transition(s, Snapshot, m.snapshot_id, to_state, already_ok=True, **extra)

    return step


def _finished(ctx: StepContext[SnapshotSetParams]) -> bool:
    with ctx.services.db.read() as s:
        states = set(s.scalars(select(Snapshot.status).where(
            Snapshot.id.in_([m.snapshot_id for m in ctx.params.members]))))
    return SnapshotState.PENDING not in states


CREATE_SNAPSHOT_SET = Workflow(
    kind="create-snapshots",
    params=SnapshotSetParams,
    resume="rollback",
    steps=(Step("pause-vm", _pause, undo=_resume),
           Step("storage-snapshots", _fix_instants, undo=_remove_all),
           Step("resume-vm", _resume),
           Step("finish-copies", _finish_copies),
           # Forward from here on: the instants are fixed and copied; uploads resume after a restart.
           Step("store-uploads", _store_all),
           Step("mark-completed", _mark_all(SnapshotState.COMPLETED, progress=100), ends=True)),
    on_rollback=_mark_all(SnapshotState.ERROR),
    finished=_finished,
    forward_from="store-uploads",
    on_give_up=_mark_all(SnapshotState.ERROR, "the snapshots could not be stored", store_state=stored.FAILED),
)
