"""What a workflow is: its typed parameters, its steps (``do`` and ``undo``), what a step sees, and the
rules of its ending and resumption. The engine (``engine.py``) runs them; each workflow module under
``vbs.controller.workflows`` declares one or a few, and ``registry.py`` lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from vbs.controller.services import Services

__all__ = ["Params", "StepContext", "Step", "Workflow", "P"]


class Params(BaseModel):
    """A workflow's parameters, persisted in its operation row (never a secret).

    Keys an older controller wrote and this one no longer has are ignored when a row is read.
    """

    model_config = ConfigDict(extra="ignore")


P = TypeVar("P", bound=Params)


@dataclass
class StepContext(Generic[P]):
    """What a step sees: its operation, the workflow's parameters (persisted) and the services.

    ``memo`` holds what earlier steps of this run learned and must not be persisted (a connection
    with its secrets); it is empty after a restart. ``save()`` persists ``params`` at once (steps
    record there what an undo must know before they act).
    """

    operation_id: str
    resource_id: str
    params: P
    services: Services
    memo: dict[str, Any] = field(default_factory=dict)
    # This run's fencing token, and the check that this controller still owns the operation (run
    # last in every transaction a step writes in: the lock order is resource rows, then operation).
    fence: int = 0
    guard: Callable[[Session], None] = lambda _s: None
    save: Callable[[], None] = lambda: None
    # The engine's open transaction while a closing step or an ending runs (see session()).
    tx: Session | None = field(default=None, repr=False)
    # The workflow's kind and when the operation began (its metrics: vbs.controller.metrics).
    kind: str = ""
    started_at: datetime | None = None

    @contextmanager
    def session(self) -> Iterator[Session]:
        """The transaction a step writes in: the one that ends the operation while a closing step
        or an ending runs, else a transaction of its own."""
        if self.tx is not None:
            yield self.tx
            return
        with self.services.db.session() as s:
            yield s
            self.guard(s)  # last, so that the operation row is locked after the resource rows


@dataclass(frozen=True)
class Step(Generic[P]):
    name: str
    do: Callable[[StepContext[P]], None]
    undo: Callable[[StepContext[P]], None] | None = None
    # A roll-forward step that may be left out once its retries are exhausted (a forced detach
    # whose host never answers: removing the export cuts the VM off all the same).
    skippable: Callable[[StepContext[P]], bool] | None = None
    # A DB-only last step, run in the transaction that ends the operation (writes via ctx.session()).
    ends: bool = False


@dataclass(frozen=True)
class Workflow(Generic[P]):
    """One kind of operation: its name (recorded in its operation rows), its typed parameters, its
    steps and how it ends. ``begin`` takes the workflow itself, so the type checker matches the params.

    ``exclusive``: at most one unfinished exclusive operation per resource, enforced by the DB's partial
    unique index on operations(resource_id) (docs/architecture.md, "Operations and their overlaps"):
    delete, attach, detach, modify and migrate of a volume exclude each other and themselves, a
    snapshot is deleted alone, while a snapshot may be taken during an attach, detach or modify.
    """

    kind: str
    params: type[P]
    resume: Literal["rollback", "forward"]
    steps: tuple[Step[P], ...]
    exclusive: bool = False
    # Roll-back workflows: put the resource back once every step is undone (or abandoned).
    on_rollback: Callable[[StepContext[P], str], None] | None = None
    # A failure this accepts as final ends the operation at once (no retry).
    gives_up: Callable[[StepContext[P], Exception], bool] | None = None
    # Roll-forward workflows: retries are exhausted; leave the resource in a stable state.
    on_give_up: Callable[[StepContext[P], str], None] | None = None
    # Roll-back workflows: whether the resource already reached its final state (the last step, a
    # DB transition, ran but the controller died before recording it): then resuming finishes.
    finished: Callable[[StepContext[P]], bool] | None = None
    # Roll-back workflows with a point of no return outside VBS (a live migration that completed: the
    # guest runs at its destination): once this says it is passed, reading the world, not the steps,
    # the operation goes forward instead, after a failure, on resume, and from a roll-back under way
    # (an undo that would cross it must refuse, so the roll-back stops there and is retried).
    committed: Callable[[StepContext[P]], bool] | None = None
    # Roll-back workflows with a point of no return (a live migration's pivot): once this step has
    # started, the operation rolls forward instead (a failure is retried, a restart carries on).
    forward_from: str | None = None

    def __post_init__(self) -> None:
        if any(step.ends for step in self.steps[:-1]):
            raise ValueError(f"{self.kind}: only the last step may end the operation")
        if self.forward_from is not None and self.forward_from not in (step.name for step in self.steps):
            raise ValueError(f"{self.kind}: forward_from names no step")

    def rolls_back_at(self, pos: int) -> bool:
        """Whether a failure at step ``pos`` (or a restart there) rolls the operation back."""
        if self.resume != "rollback":
            return False
        names = [step.name for step in self.steps]
        return self.forward_from is None or pos < names.index(self.forward_from)

    def rolls_back_after(self, steps: dict[int, str]) -> bool:
        """Whether a restart that found ``steps`` (position: state) rolls the operation back."""
        reached = [pos for pos, state in steps.items() if state in ("started", "done", "skipped")]
        return self.rolls_back_at(max(reached, default=0))
