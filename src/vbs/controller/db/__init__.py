"""Metadata storage: SQLAlchemy tables, the engine and its migrations."""

from vbs.controller.db.session import Database
from vbs.controller.db.tables import (
    AccessKeyRecord,
    Attachment,
    Base,
    ControllerRecord,
    FenceCounter,
    Instance,
    LeaseRecord,
    Node,
    Operation,
    OperationStep,
    Snapshot,
    SnapshotPermission,
    Tag,
    Volume,
    VolumeKey,
    VolumeModification,
    VolumeUsage,
)

__all__ = [
    "Database",
    "Base",
    "Volume",
    "Snapshot",
    "SnapshotPermission",
    "Attachment",
    "Instance",
    "Tag",
    "Node",
    "Operation",
    "OperationStep",
    "VolumeModification",
    "VolumeKey",
    "VolumeUsage",
    "AccessKeyRecord",
    "ControllerRecord",
    "LeaseRecord",
    "FenceCounter",
]
