"""Conditional state changes: ``UPDATE … WHERE id = ? AND status IN (…)``, never read-then-write.

Every change of a volume's, snapshot's or attachment's ``status`` goes through ``transition``, and
the states it may start from come from ``states.py``'s tables: a change the table does not allow
cannot be written. A lost race shows up as zero rows updated and is answered with
``IncorrectState`` (or the resource's ``NotFound`` when the row does not exist at all).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from functools import cache
from typing import Any, cast

from sqlalchemy import ColumnElement, Table, Update, bindparam, select
from sqlalchemy.orm import Session

from vbs.controller.db import plain
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import (
    ATTACHMENT_TRANSITIONS,
    SNAPSHOT_TRANSITIONS,
    VOLUME_TRANSITIONS,
    AttachmentState,
    SnapshotState,
    VolumeState,
    sources,
)
from vbs.controller.db.tables import Attachment, Snapshot, Volume, utcnow
from vbs.errors import IncorrectState, NotFound

__all__ = ["transition", "try_transition", "Stateful"]

Stateful = type[Volume] | type[Snapshot] | type[Attachment]

_TABLES: dict[type[Any], tuple[Mapping[Any, frozenset[Any]], type[StrEnum], str, str]] = {
    Volume: (VOLUME_TRANSITIONS, VolumeState, "volume", "InvalidVolume.NotFound"),
    Snapshot: (SNAPSHOT_TRANSITIONS, SnapshotState, "snapshot", "InvalidSnapshot.NotFound"),
    Attachment: (ATTACHMENT_TRANSITIONS, AttachmentState, "attachment", "InvalidAttachment.NotFound"),
}


def _allowed(table: Stateful, to_state: str, from_states: Iterable[str] | None) -> list[str]:
    rules, enum, label, _ = _TABLES[table]
    target = enum(to_state)
    legal = sources(rules, target)
    if from_states is None:
        return sorted(str(s) for s in legal)
    wanted = {enum(s) for s in from_states}
    if not wanted or not wanted <= legal:
        # A programming error, not a lost race: the table is the one place that says what may happen.
        raise ValueError(f"a {label} may not go from {sorted(str(s) for s in wanted - legal)} to {target}")
    return sorted(str(s) for s in wanted)


def try_transition(session: Session, table: Stateful, resource_id: str, to_state: str,
                   *conditions: ColumnElement[bool], from_states: Iterable[str] | None = None,
                   **values: Any) -> bool:
    """Move one row to ``to_state`` if it is in a state the table allows (all of them, or those of
    ``from_states``) and ``conditions`` hold; return whether it moved. One statement: the guard
    and the change cannot be separated by another writer.

    ``conditions`` read other rows (no live attachment, no pending snapshot): the row is locked
    first, so that on PostgreSQL they are evaluated after every writer that took this row before us
    committed (an UPDATE that waited for the row would re-check only the row itself, and see the
    other rows as they were when it started). Writers that make such a condition false (attach,
    create-snapshot, create-volume from a snapshot) change this row in their transaction."""
    allowed = _allowed(table, to_state, from_states)
    values = {"status": str(to_state), "updated_at": utcnow(), **values}
    stmt = _plain_update(table, frozenset(values))
    if conditions:
        lock_rows(session, table, resource_id)
        stmt = stmt.where(*conditions)
    result = plain.execute(session, stmt, plain.bound(values, id=resource_id, states=allowed))
    return bool(result.rowcount == 1)


@cache
def _plain_update(table: Stateful, columns: frozenset[str]) -> Update:
    """UPDATE ``table`` SET ``columns`` WHERE id = ``w_id`` AND status IN ``w_states``: built once (the
    common case, a workflow's closing step or an API change, adds no condition to it)."""
    core = cast(Table, table.__table__)
    return plain.update_of(core, columns, core.c.id == bindparam("w_id"),
                           core.c.status.in_(bindparam("w_states", expanding=True)))


def transition(session: Session, table: Stateful, resource_id: str, to_state: str,
               *conditions: ColumnElement[bool], from_states: Iterable[str] | None = None, already_ok: bool = False,
               **values: Any) -> None:
    """``try_transition``, or raise: ``NotFound`` if there is no such row, else ``IncorrectState``.

    Extra ``conditions`` join the WHERE clause (e.g. "no pending snapshot of this volume").
    ``already_ok``: a row already in ``to_state`` is success (a workflow step repeated after a
    crash finds its own work done).
    """
    if try_transition(session, table, resource_id, to_state, *conditions, from_states=from_states, **values):
        return
    current = session.scalar(select(table.status).where(table.id == resource_id))
    _, _, label, not_found = _TABLES[table]
    if current is None:
        raise NotFound(f"The {label} '{resource_id}' does not exist.", code=not_found)
    if already_ok and current == to_state:
        return
    allowed = _allowed(table, to_state, from_states)
    if current in allowed:
        raise IncorrectState(f"The {label} '{resource_id}' cannot become {to_state} now: "
                             "another change of it is in progress.")
    raise IncorrectState(f"The {label} '{resource_id}' is '{current}'; this needs it to be {' or '.join(allowed)}.")
