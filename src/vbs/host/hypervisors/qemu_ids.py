"""The QEMU ids of a VBS disk and of its point-in-time copies, all derived from the virtio serial.

Attach, detach and crash cleanup find a disk's devices, nodes, objects and jobs by these names alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vbs.connectors import QemuIds
from vbs.errors import InvalidParameter
from vbs.wire.host import SERIAL_RE

__all__ = ["DiskIds", "disk_ids", "CopyIds", "copy_ids", "copy_ids_of"]

# A copy id (a snapshot id) without its dash becomes part of node names: at most 22 characters.
_COPY_ID_RE = re.compile(r"^[A-Za-z0-9]{1,8}-?[A-Za-z0-9]{1,17}$")



@dataclass(frozen=True)
class DiskIds:
    """QEMU ids of one disk. Node names are limited to 31 characters: 4 + 20 + 7 fits.

    The connection has two generations of ids that alternate at each online resize: ``proto``,
    ``secret`` and ``tls`` (what attach uses), and the same with a ``2`` suffix. The format node has
    two names that alternate at each move to another storage node (a mirror replaces the whole chain
    under the device): ``raw`` is the one in use once ``settled`` resolved it, ``raw2`` the other.
    """

    device: str
    proto: str
    raw: str
    raw2: str
    throttle: str
    dead: str  # the always-failing node a forced detach puts under the raw node
    throttle_group: str
    secret: str
    tls: str
    proto2: str
    secret2: str
    tls2: str
    copy_job_prefix: str  # every point-in-time copy job of this disk has an id starting so
    luks_secret: str  # the passphrase of an encrypted volume's LUKS container (its format node is ``raw``)
    mirror_job: str  # the job that moves the disk onto another storage node's export
    iothread: str  # the disk's own I/O thread on a host with ``iothreads`` (qemu_disk_bus)

    @property
    def generations(self) -> tuple[QemuIds, QemuIds]:
        return QemuIds(self.proto, self.secret, self.tls), QemuIds(self.proto2, self.secret2, self.tls2)

    @property
    def nodes_top_down(self) -> tuple[str, ...]:
        return (self.throttle, self.raw, self.raw2, self.dead, self.proto, self.proto2)

    @property
    def objects(self) -> tuple[str, ...]:
        # The I/O thread last: deleted once the nodes that ran in it are (remove_nodes).
        return (self.throttle_group, self.secret, self.tls, self.secret2, self.tls2, self.luks_secret, self.iothread)


def disk_ids(serial: str) -> DiskIds:
    if not isinstance(serial, str) or not SERIAL_RE.fullmatch(serial):
        raise InvalidParameter(f"invalid disk serial {serial!r} (a volume id without its dash)")
    p = f"vbs-{serial}"
    return DiskIds(
        device=f"{p}-dev",
        proto=f"{p}-proto",
        raw=f"{p}-raw",
        raw2=f"{p}-raw2",
        throttle=f"{p}-thr",
        dead=f"{p}-dead",
        throttle_group=f"{p}-tg",
        secret=f"{p}-sec",
        tls=f"{p}-tls",
        proto2=f"{p}-proto2",
        secret2=f"{p}-sec2",
        tls2=f"{p}-tls2",
        copy_job_prefix=f"{p}-copy-",
        luks_secret=f"{p}-key",
        mirror_job=f"{p}-mirror",
        iothread=f"{p}-io",
    )


@dataclass(frozen=True)
class CopyIds:
    """QEMU ids of one point-in-time copy of a disk: its job, the copy-before-write filter QEMU
    inserts above the raw node, and the target's protocol node and objects (29 characters at most)."""

    job: str
    filter: str
    target: QemuIds


def copy_ids(serial: str, copy_id: str) -> CopyIds:
    prefix = disk_ids(serial).copy_job_prefix
    if not isinstance(copy_id, str) or not _COPY_ID_RE.fullmatch(copy_id):
        raise InvalidParameter(f"invalid copy id {copy_id!r} (a snapshot id)")
    return copy_ids_of(prefix, copy_id.replace("-", ""))


def copy_ids_of(job_prefix: str, key: str) -> CopyIds:
    p = f"vbs-{key}"
    return CopyIds(job=f"{job_prefix}{key}", filter=f"{p}-cbw", target=QemuIds(f"{p}-tgt", f"{p}-sec", f"{p}-tls"))
