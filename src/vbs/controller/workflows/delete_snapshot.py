"""The delete-snapshot workflow (rolls forward): the snapshot's manifest goes from the snapshot store and its
copy from its pool (its chunks go with the store's garbage collection), then it is marked deleted.
"""

from __future__ import annotations

from vbs.controller.db import Snapshot
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows.create_snapshot import remove_snapshot_everywhere

DELETE_SNAPSHOT = shared.deletion("delete-snapshot", Snapshot, remove_snapshot_everywhere, exclusive=True)
