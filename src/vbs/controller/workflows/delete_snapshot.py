"""The delete-snapshot workflow (rolls forward): the storage node removes the snapshot, then it is marked
deleted.
"""

from __future__ import annotations

from vbs.controller.db import Snapshot
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows.create_snapshot import remove_snapshot

DELETE_SNAPSHOT = shared.deletion("delete-snapshot", Snapshot, remove_snapshot, exclusive=True)
