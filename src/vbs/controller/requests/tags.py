"""Tags on volumes and snapshots (EBS CreateTags / DeleteTags semantics)."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.db import Snapshot, Tag, Volume
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import GONE_SNAPSHOT, GONE_VOLUME
from vbs.controller.rest.schemas.common import TAGS_MAX
from vbs.errors import InvalidParameter, NotFound


def _check_resources(session: Session, resource_ids: list[str], tenant: str) -> None:
    """Only the caller's tenant's live volumes and snapshots exist for it. Their rows are locked (in id
    order): tag changes of one resource take turns, as the tag limit and the insert-or-update read first."""
    for rid in resource_ids:
        if not ids.is_valid("volume", rid) and not ids.is_valid("snapshot", rid):
            raise InvalidParameter(f"Invalid resource id {rid[:80]!r}: expecting a volume or snapshot id.",
                                   code="InvalidID")
    lock_rows(session, Snapshot, *(rid for rid in resource_ids if ids.is_valid("snapshot", rid)))
    lock_rows(session, Volume, *(rid for rid in resource_ids if ids.is_valid("volume", rid)))
    for rid in resource_ids:
        if ids.is_valid("volume", rid):
            found = session.scalar(select(Volume.id).where(Volume.id == rid, Volume.tenant == tenant,
                                                           Volume.status.not_in(GONE_VOLUME)))
            if found is None:
                raise NotFound(f"The volume '{rid}' does not exist.", code="InvalidVolume.NotFound")
        else:
            found = session.scalar(select(Snapshot.id).where(Snapshot.id == rid, Snapshot.tenant == tenant,
                                                             Snapshot.status.not_in(GONE_SNAPSHOT)))
            if found is None:
                raise NotFound(f"The snapshot '{rid}' does not exist.", code="InvalidSnapshot.NotFound")


def set_tags(session: Session, resource_id: str, tags: dict[str, str]) -> None:
    """Add or overwrite tags of a resource the caller was already allowed to touch."""
    existing = {t.key: t for t in session.scalars(select(Tag).where(Tag.resource_id == resource_id))}
    if len(set(existing) | set(tags)) > TAGS_MAX:
        raise InvalidParameter(f"A resource can have at most {TAGS_MAX} tags.", code="TagLimitExceeded")
    for key, value in tags.items():
        if key in existing:
            existing[key].value = value
        else:
            session.add(Tag(resource_id=resource_id, key=key, value=value))


def create_tags(session: Session, resource_ids: list[str], tags: dict[str, str], tenant: str) -> None:
    _check_resources(session, resource_ids, tenant)
    for rid in resource_ids:
        set_tags(session, rid, tags)


def delete_tags(session: Session, resource_ids: list[str], keys: list[str], tenant: str) -> None:
    _check_resources(session, resource_ids, tenant)
    stmt = delete(Tag).where(Tag.resource_id.in_(resource_ids))
    if keys:
        stmt = stmt.where(Tag.key.in_(keys))
    session.execute(stmt)


def delete_tag_pairs(session: Session, resource_ids: list[str], pairs: list[tuple[str, str | None]],
                     tenant: str) -> None:
    """EC2 DeleteTags: a key alone deletes it; a key with a value deletes it only if the value matches."""
    _check_resources(session, resource_ids, tenant)
    if not pairs:
        session.execute(delete(Tag).where(Tag.resource_id.in_(resource_ids)))
        return
    for key, value in pairs:
        stmt = delete(Tag).where(Tag.resource_id.in_(resource_ids), Tag.key == key)
        if value is not None:
            stmt = stmt.where(Tag.value == value)
        session.execute(stmt)
