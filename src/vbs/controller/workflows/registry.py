"""Every workflow the controller runs, in one list: what the engine resumes from operation rows by their
kind, and where the overlap rules (``exclusive``) are read from."""

from __future__ import annotations

from typing import Any

from vbs.controller.workflows.archive_snapshot import ARCHIVE_SNAPSHOT
from vbs.controller.workflows.attach_volume import ATTACH_VOLUME
from vbs.controller.workflows.copy_snapshot import COPY_SNAPSHOT
from vbs.controller.workflows.create_snapshot import CREATE_SNAPSHOT
from vbs.controller.workflows.create_snapshots import CREATE_SNAPSHOT_SET
from vbs.controller.workflows.create_volume import CREATE_VOLUME
from vbs.controller.workflows.definition import Workflow
from vbs.controller.workflows.delete_snapshot import DELETE_SNAPSHOT
from vbs.controller.workflows.delete_volume import DELETE_VOLUME
from vbs.controller.workflows.detach_volume import DETACH_VOLUME
from vbs.controller.workflows.local_volumes import LOCAL_WORKFLOWS
from vbs.controller.workflows.migrate_instance import MIGRATE_INSTANCE
from vbs.controller.workflows.migrate_volume import MIGRATE_VOLUME, MIGRATE_VOLUME_COPY, MIGRATE_VOLUME_MIRROR
from vbs.controller.workflows.modify_volume import MODIFY_VOLUME
from vbs.controller.workflows.restore_snapshot_tier import RESTORE_SNAPSHOT_TIER

__all__ = ["WORKFLOWS", "EXCLUSIVE_KINDS"]

WORKFLOWS: tuple[Workflow[Any], ...] = (
    CREATE_VOLUME, DELETE_VOLUME, CREATE_SNAPSHOT, DELETE_SNAPSHOT, ATTACH_VOLUME, DETACH_VOLUME, MODIFY_VOLUME,
    MIGRATE_VOLUME, COPY_SNAPSHOT, CREATE_SNAPSHOT_SET, MIGRATE_INSTANCE, *LOCAL_WORKFLOWS, MIGRATE_VOLUME_COPY,
    MIGRATE_VOLUME_MIRROR, ARCHIVE_SNAPSHOT, RESTORE_SNAPSHOT_TIER,
)

# One unfinished operation of these kinds per resource (the DB's partial unique index; docs/operations.md).
EXCLUSIVE_KINDS = frozenset(w.kind for w in WORKFLOWS if w.exclusive)
