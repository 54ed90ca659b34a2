"""EBS states of each resource and the transitions allowed between them (README "Concepts",
docs/operations.md): ``transitions.transition`` refuses any change they do not allow. Which operations
may overlap on one resource is each workflow's ``exclusive`` (``vbs.controller.workflows.registry``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

__all__ = [
    "VolumeState",
    "SnapshotState",
    "AttachmentState",
    "OperationState",
    "VOLUME_TRANSITIONS",
    "SNAPSHOT_TRANSITIONS",
    "ATTACHMENT_TRANSITIONS",
    "LIVE_ATTACHMENT",
    "GONE_VOLUME",
    "GONE_SNAPSHOT",
    "UNFINISHED_OPERATION",
    "sources",
]


class VolumeState(StrEnum):
    CREATING = "creating"
    AVAILABLE = "available"
    IN_USE = "in-use"
    DELETING = "deleting"
    DELETED = "deleted"
    ERROR = "error"
    # Deleted into the Recycle Bin (docs/recycle-bin.md): kept, hidden, restored or deleted when its retention ends.
    RECOVERABLE = "recoverable"


class SnapshotState(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    ERROR = "error"
    DELETING = "deleting"
    DELETED = "deleted"
    # In the Recycle Bin (EC2's own name for it; docs/recycle-bin.md).
    RECOVERABLE = "recoverable"


class AttachmentState(StrEnum):
    ATTACHING = "attaching"
    ATTACHED = "attached"
    DETACHING = "detaching"
    DETACHED = "detached"
    BUSY = "busy"


class OperationState(StrEnum):
    RUNNING = "running"
    ROLLING_BACK = "rolling-back"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled-back"
    FAILED = "failed"


VOLUME_TRANSITIONS: Mapping[VolumeState, frozenset[VolumeState]] = {
    VolumeState.CREATING: frozenset({VolumeState.AVAILABLE, VolumeState.ERROR}),
    # available -> error: its data file vanished (reconciliation).
    VolumeState.AVAILABLE: frozenset({VolumeState.IN_USE, VolumeState.DELETING, VolumeState.ERROR,
                                      VolumeState.RECOVERABLE}),
    # in-use -> in-use: a second attachment of a multi-attach volume reserves it again.
    VolumeState.IN_USE: frozenset({VolumeState.AVAILABLE, VolumeState.IN_USE}),
    # deleting -> error: the storage node stayed unreachable; deleting again is allowed.
    VolumeState.DELETING: frozenset({VolumeState.DELETED, VolumeState.ERROR}),
    VolumeState.ERROR: frozenset({VolumeState.DELETING}),
    VolumeState.DELETED: frozenset(),
    # Restored, or deleted for good once its retention ends.
    VolumeState.RECOVERABLE: frozenset({VolumeState.AVAILABLE, VolumeState.DELETING}),
}

SNAPSHOT_TRANSITIONS: Mapping[SnapshotState, frozenset[SnapshotState]] = {
    SnapshotState.PENDING: frozenset({SnapshotState.COMPLETED, SnapshotState.ERROR}),
    SnapshotState.COMPLETED: frozenset({SnapshotState.DELETING, SnapshotState.ERROR, SnapshotState.RECOVERABLE}),
    SnapshotState.ERROR: frozenset({SnapshotState.DELETING}),
    SnapshotState.DELETING: frozenset({SnapshotState.DELETED, SnapshotState.ERROR}),
    SnapshotState.DELETED: frozenset(),
    SnapshotState.RECOVERABLE: frozenset({SnapshotState.COMPLETED, SnapshotState.DELETING}),
}

# A volume or snapshot in one of these states is gone as far as its user can tell: not described, not
# used, not tagged ("not found"). The Recycle Bin's are gone until restored (docs/recycle-bin.md).
GONE_VOLUME = frozenset({VolumeState.DELETED, VolumeState.RECOVERABLE})
GONE_SNAPSHOT = frozenset({SnapshotState.DELETING, SnapshotState.DELETED, SnapshotState.RECOVERABLE})

ATTACHMENT_TRANSITIONS: Mapping[AttachmentState, frozenset[AttachmentState]] = {
    # attaching -> detached: the attach failed and was rolled back.
    AttachmentState.ATTACHING: frozenset({AttachmentState.ATTACHED, AttachmentState.DETACHED}),
    AttachmentState.ATTACHED: frozenset({AttachmentState.DETACHING}),
    # detaching -> busy: the guest holds on to the disk, or its host stayed unreachable.
    AttachmentState.DETACHING: frozenset({AttachmentState.DETACHED, AttachmentState.BUSY}),
    AttachmentState.BUSY: frozenset({AttachmentState.DETACHING}),
    AttachmentState.DETACHED: frozenset(),
}

# An attachment that holds (or may hold) an export and a disk in a VM.
LIVE_ATTACHMENT = frozenset({AttachmentState.ATTACHING, AttachmentState.ATTACHED, AttachmentState.DETACHING,
                             AttachmentState.BUSY})

UNFINISHED_OPERATION = frozenset({OperationState.RUNNING, OperationState.ROLLING_BACK})

S = TypeVar("S", bound=StrEnum)


def sources(table: Mapping[S, frozenset[S]], target: S) -> frozenset[S]:
    """Every state from which ``table`` allows a move to ``target``."""
    return frozenset(s for s, targets in table.items() if target in targets)
