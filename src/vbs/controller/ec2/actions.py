"""The EC2 actions VBS answers: each action's name and the handler that runs it, in one table.

Each handler reads its parameters through ``QueryParams``, builds the same request models the REST
API validates, calls the same domain functions, and returns the body of the XML answer; they live by
resource in ``volume_actions``, ``snapshot_actions``, ``tag_actions`` and ``instance_actions``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vbs.controller.auth.keys import Principal
from vbs.controller.ec2.instance_actions import describe_availability_zones, describe_instances
from vbs.controller.ec2.lock_actions import describe_locked_snapshots, lock_snapshot, unlock_snapshot
from vbs.controller.ec2.query import QueryParams
from vbs.controller.ec2.recycle_bin_actions import (
    list_snapshots_in_recycle_bin,
    list_volumes_in_recycle_bin,
    restore_snapshot_from_recycle_bin,
    restore_volume_from_recycle_bin,
)
from vbs.controller.ec2.snapshot_actions import (
    copy_snapshot,
    create_snapshot,
    create_snapshots,
    delete_snapshot,
    describe_snapshot_attribute,
    describe_snapshots,
    modify_snapshot_attribute,
    reset_snapshot_attribute,
)
from vbs.controller.ec2.tag_actions import create_tags, delete_tags, describe_tags
from vbs.controller.ec2.tier_actions import describe_snapshot_tier_status, modify_snapshot_tier, restore_snapshot_tier
from vbs.controller.ec2.volume_actions import (
    attach_volume,
    create_volume,
    delete_volume,
    describe_volume_attribute,
    describe_volume_status,
    describe_volumes,
    describe_volumes_modifications,
    detach_volume,
    modify_volume,
)
from vbs.controller.runtime import Controller

Handler = Callable[[Controller, QueryParams, Principal], dict[str, Any]]


HANDLERS: dict[str, Handler] = {
    "CreateVolume": create_volume,
    "DeleteVolume": delete_volume,
    "DescribeVolumes": describe_volumes,
    "DescribeVolumeStatus": describe_volume_status,
    "ModifyVolume": modify_volume,
    "DescribeVolumesModifications": describe_volumes_modifications,
    "AttachVolume": attach_volume,
    "DetachVolume": detach_volume,
    "CreateSnapshot": create_snapshot,
    "DeleteSnapshot": delete_snapshot,
    "DescribeSnapshots": describe_snapshots,
    "CopySnapshot": copy_snapshot,
    "CreateSnapshots": create_snapshots,
    "DescribeSnapshotAttribute": describe_snapshot_attribute,
    "ModifySnapshotAttribute": modify_snapshot_attribute,
    "ResetSnapshotAttribute": reset_snapshot_attribute,
    "LockSnapshot": lock_snapshot,
    "UnlockSnapshot": unlock_snapshot,
    "DescribeLockedSnapshots": describe_locked_snapshots,
    "ModifySnapshotTier": modify_snapshot_tier,
    "RestoreSnapshotTier": restore_snapshot_tier,
    "DescribeSnapshotTierStatus": describe_snapshot_tier_status,
    "DescribeVolumeAttribute": describe_volume_attribute,
    "CreateTags": create_tags,
    "DeleteTags": delete_tags,
    "DescribeTags": describe_tags,
    "DescribeInstances": describe_instances,
    "DescribeAvailabilityZones": describe_availability_zones,
    "ListSnapshotsInRecycleBin": list_snapshots_in_recycle_bin,
    "RestoreSnapshotFromRecycleBin": restore_snapshot_from_recycle_bin,
    "ListVolumesInRecycleBin": list_volumes_in_recycle_bin,
    "RestoreVolumeFromRecycleBin": restore_volume_from_recycle_bin,
}
