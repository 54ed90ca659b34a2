"""GiB promised to volumes that are growing: modifications accepted, their volumes not grown yet.

A growth is checked against its tenant's quota and its pool's room when it is accepted, but its
volume's size (and so the usage rows the database keeps, ``VolumeUsage``) changes only when the
modification's workflow records it. Until then every other check of the same quota or pool must
count it too, or a create accepted meanwhile could take the GiB the growth was promised.

The growths that count are those committed before the check's locks were granted: a growth holds
placement and its tenant exclusively (``db.locks``) until it commits, so none can be accepted while
a create holds them shared. A growth that completes meanwhile moves from here to the usage rows in
one transaction; a check that read it here before may count it twice, which only errs on the side
of refusing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from vbs.controller.db import Volume, VolumeModification, plain

__all__ = ["GROWING_STATES", "Growing", "growing"]

# The states of a modification whose workflow has not finished (completed or failed).
GROWING_STATES = ("modifying", "optimizing")


@dataclass(frozen=True)
class Growing:
    """GiB still to be added by accepted growths, per tenant and per (storage node, pool)."""

    tenants: dict[str, int] = field(default_factory=dict)
    pools: dict[tuple[str, str], int] = field(default_factory=dict)


def growing(session: Session) -> Growing:
    """Every growth in progress, in one statement (through the index on the modifications' state)."""
    tenants: dict[str, int] = {}
    pools: dict[tuple[str, str], int] = {}
    for tenant, node, pool, gib in plain.execute(session, _GROWING):
        tenants[tenant] = tenants.get(tenant, 0) + int(gib)
        pools[(node, pool)] = pools.get((node, pool), 0) + int(gib)
    return Growing(tenants, pools)


_GROWING = (
    select(Volume.tenant, Volume.storage_node, Volume.pool,
           func.sum(VolumeModification.target_size_gib - VolumeModification.original_size_gib))
    .join(Volume, Volume.id == VolumeModification.volume_id)
    .where(VolumeModification.state.in_(GROWING_STATES),
           VolumeModification.target_size_gib > VolumeModification.original_size_gib)
    .group_by(Volume.tenant, Volume.storage_node, Volume.pool)
)
