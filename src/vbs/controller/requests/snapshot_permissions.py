"""Snapshots shared between tenants (EBS createVolumePermission).

The owner of a snapshot grants a tenant — or ``all`` tenants — the right to make volumes from it and to
copy it; nothing else (describe its attribute, modify, delete) is theirs. A grantee is named by its
tenant name; EC2 clients see the default tenant's account id as ``000000000000`` (``owner_id``).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import ColumnElement, delete, or_, select
from sqlalchemy.orm import Session

from vbs import ids
from vbs.controller.auth.keys import TENANT_RE
from vbs.controller.db import Snapshot, SnapshotPermission
from vbs.controller.db.locks import lock_rows
from vbs.controller.db.states import GONE_SNAPSHOT
from vbs.controller.db.tables import DEFAULT_TENANT
from vbs.errors import InvalidParameter, NotFound

ALL = "all"
DEFAULT_ACCOUNT_ID = "000000000000"
MAX_GRANTEES = 100


def owner_id(tenant: str) -> str:
    """The account id EC2 clients see for a tenant."""
    return DEFAULT_ACCOUNT_ID if tenant == DEFAULT_TENANT else tenant


def tenant_of(account: str) -> str:
    """The tenant an account id (or tenant name) names; InvalidParameter if it names none."""
    if account == DEFAULT_ACCOUNT_ID:
        return DEFAULT_TENANT
    if not TENANT_RE.fullmatch(account):
        raise InvalidParameter(f"Invalid user id {account[:64]!r}: a tenant name, or {DEFAULT_ACCOUNT_ID}.")
    return account


def visible_to(tenant: str) -> ColumnElement[bool]:
    """Snapshots ``tenant`` owns or may use."""
    granted = select(SnapshotPermission.snapshot_id).where(SnapshotPermission.grantee.in_([tenant, ALL]))
    return or_(Snapshot.tenant == tenant, Snapshot.id.in_(granted))


def usable(s: Session, snap: Snapshot, tenant: str) -> bool:
    """Whether ``tenant`` may make a volume from (or copy) ``snap``."""
    if snap.tenant == tenant:
        return True
    return s.scalar(select(SnapshotPermission.grantee).where(SnapshotPermission.snapshot_id == snap.id,
                                                             SnapshotPermission.grantee.in_([tenant, ALL]))) is not None


def owned_snapshot(s: Session, snapshot_id: str, tenant: str, *, lock: bool = False) -> Snapshot:
    """``snapshot_id`` if ``tenant`` owns it and it is not being deleted; NotFound otherwise. ``lock``: its
    row is locked first (a change that must take turns with a delete of it)."""
    ids.check("snapshot", snapshot_id)
    if lock:
        lock_rows(s, Snapshot, snapshot_id)
    snap = s.get(Snapshot, snapshot_id)
    if snap is None or snap.tenant != tenant or snap.status in GONE_SNAPSHOT:
        raise NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")
    return snap


def grantees(s: Session, snapshot_id: str) -> list[str]:
    return sorted(s.scalars(select(SnapshotPermission.grantee).where(SnapshotPermission.snapshot_id == snapshot_id)))


def modify(s: Session, snapshot_id: str, tenant: str, *, add: Iterable[str], remove: Iterable[str]) -> list[str]:
    """Grant ``add`` and revoke ``remove`` (tenant names or ``all``); the grantees after."""
    owned_snapshot(s, snapshot_id, tenant)
    add, remove = set(add), set(remove)
    if add & remove:
        raise InvalidParameter(f"{sorted(add & remove)[0]!r} is both added and removed.",
                               code="InvalidParameterCombination")
    if tenant in add:
        raise InvalidParameter("A snapshot's owner may always use it: do not add your own account.")
    have = set(grantees(s, snapshot_id))
    if len(have | add) > MAX_GRANTEES:
        raise InvalidParameter(f"A snapshot can be shared with at most {MAX_GRANTEES} accounts.")
    for grantee in sorted(add - have):
        s.add(SnapshotPermission(snapshot_id=snapshot_id, grantee=grantee))
    if remove:
        s.execute(delete(SnapshotPermission).where(SnapshotPermission.snapshot_id == snapshot_id,
                                                   SnapshotPermission.grantee.in_(sorted(remove))))
    s.flush()
    return grantees(s, snapshot_id)


def forget(s: Session, snapshot_ids: Iterable[str]) -> None:
    """Drop the grants of deleted snapshots."""
    s.execute(delete(SnapshotPermission).where(SnapshotPermission.snapshot_id.in_(list(snapshot_ids))))
