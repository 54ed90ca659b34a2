"""Conditional state changes: ``UPDATE … WHERE id = ? AND status IN (…)``, never read-then-write.

A lost race shows up as zero rows updated and is answered with ``IncorrectState`` (or the
resource's ``NotFound`` when the row does not exist at all).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.orm import Session

from vbs.controller.db.tables import Snapshot, Volume, utcnow
from vbs.errors import IncorrectState, NotFound

_NOT_FOUND = {Volume: "InvalidVolume.NotFound", Snapshot: "InvalidSnapshot.NotFound"}
_LABEL = {Volume: "volume", Snapshot: "snapshot"}


def transition(
    session: Session,
    table: type[Volume] | type[Snapshot],
    resource_id: str,
    from_states: Iterable[str],
    to_state: str,
    *conditions: ColumnElement[bool],
    **values: Any,
) -> None:
    """Move one row from any of ``from_states`` to ``to_state`` atomically, or raise.

    Extra ``conditions`` join the WHERE clause (e.g. "no pending snapshot of this volume"), so the
    guard and the change are one statement.
    """
    allowed = [str(s) for s in from_states]
    stmt = (
        update(table)
        .where(table.id == resource_id, table.status.in_(allowed), *conditions)
        .values(status=str(to_state), updated_at=utcnow(), **values)
        .execution_options(synchronize_session=False)
    )
    if session.execute(stmt).rowcount == 1:  # type: ignore[attr-defined]
        return
    current = session.scalar(select(table.status).where(table.id == resource_id))
    label = _LABEL[table]
    if current is None:
        raise NotFound(f"The {label} '{resource_id}' does not exist.", code=_NOT_FOUND[table])
    raise IncorrectState(
        f"The {label} '{resource_id}' is '{current}'; this needs it to be {' or '.join(allowed)}."
    )
