"""EC2 actions on snapshots' storage tiers: ModifySnapshotTier, RestoreSnapshotTier,
DescribeSnapshotTierStatus (vbs.controller.requests.snapshot_tiers)."""

from __future__ import annotations

from typing import Any

from vbs.controller.auth.keys import Principal
from vbs.controller.ec2.params import dry_run, matches, snapshot_id_of, tag_set
from vbs.controller.ec2.query import QueryParams
from vbs.controller.requests import snapshot_tiers as tiers
from vbs.controller.requests.filters import tags_of
from vbs.controller.requests.snapshot_permissions import owner_id
from vbs.controller.rest.schemas.tiers import MAX_RESTORE_DAYS
from vbs.controller.runtime import Controller

TIERS_PAGE = 1000
_FILTERS = {"snapshot-id", "volume-id", "last-tiering-operation"}


def modify_snapshot_tier(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
    tier = p.str("StorageTier", max_len=32) or "archive"
    dry_run(p)
    started = tiers.modify_tier(svc, snap_id, who.tenant, tier)
    return {"snapshotId": snap_id, "tieringStartTime": started}


def restore_snapshot_tier(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
    days = p.int("TemporaryRestoreDays", min=1, max=MAX_RESTORE_DAYS)
    permanent = p.bool("PermanentRestore")
    dry_run(p)
    started, days = tiers.restore_tier(svc, snap_id, who.tenant, days=days, permanent=permanent)
    return {"snapshotId": snap_id, "restoreStartTime": started, "restoreDuration": days,
            "isPermanentRestore": permanent}


def describe_snapshot_tier_status(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    filters = p.filters()
    max_results = p.int("MaxResults", min=5, max=TIERS_PAGE) or TIERS_PAGE
    token = p.str("NextToken", max_len=64)
    dry_run(p)
    found = tiers.describe_tiers(svc, who.tenant, None)
    found = [t for t in found if matches(filters, {"snapshot-id": [t.snapshot_id], "volume-id": [t.volume_id],
                                                   "last-tiering-operation": [t.last_status or ""]}, _FILTERS)]
    if token is not None:
        found = [t for t in found if t.snapshot_id > token]
    page, more = found[:max_results], len(found) > max_results
    with svc.db.read() as s:
        tags = tags_of(s, [t.snapshot_id for t in page])
    return {"snapshotTierStatusSet": [{
        "snapshotId": t.snapshot_id, "volumeId": t.volume_id, "status": t.status, "ownerId": owner_id(t.owner),
        "tagSet": tag_set(tags[t.snapshot_id]) if tags.get(t.snapshot_id) else None, "storageTier": t.storage_tier,
        "lastTieringStartTime": t.last_started_at, "lastTieringProgress": t.last_progress,
        "lastTieringOperationStatus": t.last_status, "lastTieringOperationStatusDetail": t.last_detail,
        "archivalCompleteTime": t.archived_at, "restoreExpiryTime": t.restore_expires_at,
    } for t in page], "nextToken": page[-1].snapshot_id if more and page else None}
