"""The typed wire between the controller and its agents, imported by both sides.

Every request and answer of the storage and host agent APIs is a model here; errors travel as
``vbs.errors`` classes (see ``vbs.errors.from_body``). Nothing else crosses a service boundary.

- ``vbs.wire.connection``: how a host reaches a volume (``NbdConnection``, ``IscsiConnection``…);
- ``vbs.wire.storage``: volumes, snapshots, pools, exports, the storage heartbeat;
- ``vbs.wire.host``: VMs, disks, hypervisor capabilities, the host heartbeat.
"""

from vbs.wire.base import SnapshotId, VolumeId, Wire
from vbs.wire.connection import Connection, FileConnection, HostIdentity, IscsiConnection, NbdConnection

__all__ = [
    "Wire",
    "Connection",
    "HostIdentity",
    "NbdConnection",
    "IscsiConnection",
    "FileConnection",
    "VolumeId",
    "SnapshotId",
]
