"""EBS states of each resource and the transitions allowed between them (DESIGN §3)."""

from __future__ import annotations

from enum import StrEnum


class VolumeState(StrEnum):
    CREATING = "creating"
    AVAILABLE = "available"
    IN_USE = "in-use"
    DELETING = "deleting"
    DELETED = "deleted"
    ERROR = "error"


class SnapshotState(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    ERROR = "error"
    DELETING = "deleting"
    DELETED = "deleted"


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


VOLUME_TRANSITIONS: dict[VolumeState, frozenset[VolumeState]] = {
    VolumeState.CREATING: frozenset({VolumeState.AVAILABLE, VolumeState.ERROR}),
    VolumeState.AVAILABLE: frozenset({VolumeState.IN_USE, VolumeState.DELETING}),
    VolumeState.IN_USE: frozenset({VolumeState.AVAILABLE, VolumeState.IN_USE}),
    VolumeState.DELETING: frozenset({VolumeState.DELETED}),
    VolumeState.ERROR: frozenset({VolumeState.DELETING}),
    VolumeState.DELETED: frozenset(),
}

SNAPSHOT_TRANSITIONS: dict[SnapshotState, frozenset[SnapshotState]] = {
    SnapshotState.PENDING: frozenset({SnapshotState.COMPLETED, SnapshotState.ERROR}),
    SnapshotState.COMPLETED: frozenset({SnapshotState.DELETING}),
    SnapshotState.ERROR: frozenset({SnapshotState.DELETING}),
    SnapshotState.DELETING: frozenset({SnapshotState.DELETED}),
    SnapshotState.DELETED: frozenset(),
}


def volume_sources(target: VolumeState) -> frozenset[VolumeState]:
    """Every state from which a volume may move to ``target``."""
    return frozenset(s for s, targets in VOLUME_TRANSITIONS.items() if target in targets)


def snapshot_sources(target: SnapshotState) -> frozenset[SnapshotState]:
    return frozenset(s for s, targets in SNAPSHOT_TRANSITIONS.items() if target in targets)
