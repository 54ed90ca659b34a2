"""EC2 actions on the Recycle Bin: ListSnapshotsInRecycleBin, RestoreSnapshotFromRecycleBin,
ListVolumesInRecycleBin, RestoreVolumeFromRecycleBin (vbs.controller.requests.recycle_bin;
docs/recycle-bin.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vbs.controller.auth.keys import Principal
from vbs.controller.ec2.params import MAX_TOKEN, act_unless_dry_run, dry_run, snapshot_id_of, volume_id_of
from vbs.controller.ec2.query import QueryParams
from vbs.controller.ec2.snapshot_actions import snapshot_item
from vbs.controller.requests import recycle_bin as bin_req
from vbs.controller.requests.describe_snapshots import get_snapshot
from vbs.controller.runtime import Controller

# Their largest pages (EC2: ListSnapshotsInRecycleBin 5-1000, ListVolumesInRecycleBin 5-500).
SNAPSHOTS_PAGE, VOLUMES_PAGE = 1000, 500


def _page_of(p: QueryParams, id_param: str, id_of: Callable[[str], str], largest: int
             ) -> tuple[list[str], int | None, str | None]:
    """A List*InRecycleBin's ids (``id_param``, each checked by ``id_of``), page size and token; refused
    here if the request is a dry run."""
    resource_ids = [id_of(v) for v in p.list(id_param)]
    max_results = p.int("MaxResults", min=5, max=largest)
    token = p.str("NextToken", max_len=MAX_TOKEN)
    dry_run(p)
    return resource_ids, max_results, token


def list_snapshots_in_recycle_bin(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    found, next_token = bin_req.list_snapshots(svc, who.tenant, *_page_of(p, "SnapshotId", snapshot_id_of,
                                                                          SNAPSHOTS_PAGE))
    return {"snapshotSet": [{"snapshotId": x.snapshot_id, "recycleBinEnterTime": x.entered_at,
                             "recycleBinExitTime": x.exits_at, "description": x.description,
                             "volumeId": x.volume_id} for x in found], "nextToken": next_token}


def restore_snapshot_from_recycle_bin(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    snap_id = snapshot_id_of(p.str("SnapshotId", max_len=64))
    dry_run(p)
    bin_req.restore(svc, who.tenant, bin_req.SNAPSHOT, snap_id)
    return snapshot_item(get_snapshot(svc, snap_id, who.tenant))


def list_volumes_in_recycle_bin(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    found, next_token = bin_req.list_volumes(svc, who.tenant, *_page_of(p, "VolumeId", volume_id_of, VOLUMES_PAGE))
    return {"volumeSet": [{"volumeId": v.volume_id, "volumeType": v.volume_type, "state": "recoverable",
                           "size": v.size_gib, "iops": v.iops, "throughput": v.throughput,
                           "availabilityZone": v.availability_zone, "snapshotId": v.snapshot_id,
                           "createTime": v.created_at, "recycleBinEnterTime": v.entered_at,
                           "recycleBinExitTime": v.exits_at} for v in found], "nextToken": next_token}


def restore_volume_from_recycle_bin(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    vol_id = volume_id_of(p.str("VolumeId", max_len=64))
    return act_unless_dry_run(p, lambda: bin_req.restore(svc, who.tenant, bin_req.VOLUME, vol_id))
