"""The delete-volume workflow (rolls forward): the storage node removes the volume, then it is marked
deleted.
"""

from __future__ import annotations

from vbs.controller.db import Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.workflows import steps as shared
from vbs.controller.workflows.create_volume import remove_from_storage

DELETE_VOLUME = shared.deletion("delete-volume", Volume, remove_from_storage, exclusive=True,
                                deleted_at=utcnow)
