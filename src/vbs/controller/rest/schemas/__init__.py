"""The REST API's request and response models (pydantic), apart from the DB tables: one module per resource
(``volumes``, ``snapshots``, ``nodes``…), every public name re-exported here.

Requests are strict: unknown fields, wrong JSON types and out-of-range values are refused at the
edge with ``InvalidParameterValue`` before anything reaches the domain or a driver.
"""

from __future__ import annotations

from vbs.controller.rest.schemas.advice import AdviceModelOut, AdviceOption, AdviceOut, MeasuredProbe
from vbs.controller.rest.schemas.common import (
    COMMENT_MAX,
    MAX_SIZE_GIB,
    TAG_KEY_MAX,
    TAG_VALUE_MAX,
    TAGS_MAX,
    ClientToken,
    Comment,
    KmsKeyId,
    NodeName,
    PoolName,
    StorageZone,
    Tags,
    VolumeType,
)
from vbs.controller.rest.schemas.keys import CreateKeyRequest, KeyList, KeyOut
from vbs.controller.rest.schemas.nodes import (
    ControllerList,
    ControllerOut,
    DrainOut,
    DrainRequest,
    HostList,
    HostOut,
    InstanceList,
    InstanceMigrationOut,
    InstanceOut,
    MigrateInstanceRequest,
    PoolOut,
    ResidentOut,
    StorageNodeList,
    StorageNodeOut,
    ZoneList,
    ZoneOut,
)
from vbs.controller.rest.schemas.operations import OperationList, OperationOut, StepOut
from vbs.controller.rest.schemas.snapshots import (
    CopySnapshotRequest,
    CreateSnapshotRequest,
    CreateSnapshotSetRequest,
    Grantee,
    SnapshotList,
    SnapshotOut,
    SnapshotPermissionsOut,
    SnapshotPermissionsRequest,
    SnapshotSetOut,
)
from vbs.controller.rest.schemas.tags import CreateTagsRequest, DeleteTagsRequest
from vbs.controller.rest.schemas.volumes import (
    DEVICE_RE,
    INSTANCE_REF_RE,
    AttachmentOut,
    AttachVolumeRequest,
    CreateVolumeRequest,
    DetachVolumeRequest,
    MigrateVolumeRequest,
    MigrationOut,
    MigrationProgressOut,
    ModificationList,
    ModificationOut,
    ModifyVolumeRequest,
    VolumeList,
    VolumeOut,
)

__all__ = [
    "AdviceModelOut", "AdviceOption", "AdviceOut", "AttachVolumeRequest", "AttachmentOut", "COMMENT_MAX",
    "ClientToken", "Comment", "ControllerList", "ControllerOut", "CopySnapshotRequest", "CreateKeyRequest",
    "CreateSnapshotRequest", "CreateSnapshotSetRequest", "CreateTagsRequest", "CreateVolumeRequest", "DEVICE_RE",
    "DeleteTagsRequest", "DetachVolumeRequest", "DrainOut", "DrainRequest", "Grantee", "HostList", "HostOut",
    "INSTANCE_REF_RE", "InstanceList", "InstanceMigrationOut", "InstanceOut", "KeyList", "KeyOut", "KmsKeyId",
    "MAX_SIZE_GIB", "MeasuredProbe", "MigrateInstanceRequest", "MigrateVolumeRequest", "MigrationOut",
    "MigrationProgressOut", "ModificationList", "ModificationOut", "ModifyVolumeRequest", "NodeName", "OperationList",
    "OperationOut", "PoolName", "PoolOut", "ResidentOut", "SnapshotList", "SnapshotOut", "SnapshotPermissionsOut",
    "SnapshotPermissionsRequest", "SnapshotSetOut", "StepOut", "StorageNodeList", "StorageNodeOut", "StorageZone",
    "TAGS_MAX", "TAG_KEY_MAX", "TAG_VALUE_MAX", "Tags", "VolumeList", "VolumeOut", "VolumeType", "ZoneList", "ZoneOut",
]
