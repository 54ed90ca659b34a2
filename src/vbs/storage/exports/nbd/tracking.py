"""Changed-block tracking for the snapshot store's incremental uploads from copy pools (docs/snapshots.md
"Incremental uploads"): which blocks hosts wrote between two point-in-time views, told by the daemon
without reading the volume.

When a view of a volume starts, a dirty bitmap (QEMU's, in the daemon's memory, one bit per 512 KiB
block: the store's block) goes on the raw node of the chain the view sits in, before the view's filter
goes in: from then on every write through that chain sets its block's bit. A later view's upload asks
for the bitmap of the previous stored snapshot's view: its set blocks are the only ones that may differ
(more than changed, never less: the bits set after the later view's instant are extra, never missing).

The bitmap is trusted only while it can have seen every write: it lives on the chain's raw node, so it
goes with the chain (a volume no host writes to has its chain closed when its view ends) and with the
daemon (a restart loses it); and whenever a new writable chain of a volume opens (a resize, or a host
that cannot join the old chain), the bitmaps of its other chains are removed first, so none of them can
answer for writes it did not see. Without a bitmap the upload reads and hashes every chunk, as before.

QMP tells a bitmap's count, never its bits: they are read by merging the bitmap into a persistent bitmap
of a scratch qcow2 node, closing that node (QEMU then writes the bitmap into the file) and reading the
file (``vbs.qemu.qcow2_bitmaps``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

from vbs.errors import DriverError
from vbs.qemu.qcow2_bitmaps import read_bitmap
from vbs.qemu.qmp import QmpCommandError
from vbs.snapshot_store.format import BLOCK_SIZE
from vbs.system import argv

from .daemon import Monitor

log = logging.getLogger(__name__)

BLOCK = BLOCK_SIZE  # the bitmaps' granularity: the snapshot store's manifest block (EBS's block)
PREFIX = "vbsd."
KEEP = 4  # bitmaps per chain: the newest views' (a deleted snapshot's predecessor may become a parent)
READ_NODE = "vbsbitmapread"
READ_BITMAP = "changes"


def bitmap_name(view_id: str) -> str:
    """The bitmap a view starts: its start time first, so that names sort oldest first."""
    return f"{PREFIX}{time.time_ns():020d}.{view_id}"


def view_of(name: str) -> str | None:
    """The view id a bitmap name carries (None: not one of ours)."""
    parts = name.split(".", 2)
    return parts[2] if len(parts) == 3 and name.startswith(PREFIX) else None


class Tracking:
    """Starts, drops and reads the driver's dirty bitmaps; scratch qcow2 files go in ``work_dir``."""

    def __init__(self, monitor: Monitor, work_dir: Path) -> None:
        self._monitor, self._work_dir = monitor, work_dir

    def bitmaps(self, node: str) -> list[str]:
        """The names of our bitmaps on ``node``, oldest first (none if the daemon has no such node)."""
        for n in self._monitor.q("query-named-block-nodes", {"flat": True}):
            if n["node-name"] == node:
                return sorted(str(b["name"]) for b in n.get("dirty-bitmaps", []) if view_of(str(b.get("name", ""))))
        return []

    def start(self, node: str, view_id: str) -> None:
        """Record, from now on, the blocks written through ``node`` (a chain's raw node) for ``view_id``;
        the oldest bitmaps beyond ``KEEP`` go."""
        have = self.bitmaps(node)
        if not any(view_of(b) == view_id for b in have):  # a start repeated after an interruption keeps its first
            try:
                self._monitor.q("block-dirty-bitmap-add", {"node": node, "name": bitmap_name(view_id),
                                                           "granularity": BLOCK, "persistent": False})
            except QmpCommandError as exc:  # an optimisation: the view stands without it
                log.warning("no changed-block bitmap for view %s on %s (%s): its successor's upload reads every "
                            "chunk", view_id, node, exc.desc)
                return
            have = self.bitmaps(node)
        for old in have[:-KEEP]:
            self._remove(node, old)

    def drop(self, nodes: Iterable[str]) -> None:
        """Remove our bitmaps from ``nodes`` (the raw nodes of a volume's other chains, before a new
        writable chain opens: they would not see its writes)."""
        for node in nodes:
            for name in self.bitmaps(node):
                self._remove(node, name)
                log.info("dropped the changed-block bitmap %s of %s: a new chain of its volume opens", name, node)

    def _remove(self, node: str, name: str) -> None:
        try:
            self._monitor.q("block-dirty-bitmap-remove", {"node": node, "name": name})
        except QmpCommandError as exc:
            log.warning("could not remove the changed-block bitmap %s of %s: %s", name, node, exc.desc)

    def changes(self, node: str, since_view: str, size: int) -> list[tuple[int, int]] | None:
        """The byte extents written through ``node`` since the view ``since_view`` started (within
        ``size``), or None: no bitmap of that view is on the node."""
        name = next((b for b in self.bitmaps(node) if view_of(b) == since_view), None)
        if name is None:
            return None
        self._work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        scratch = self._work_dir / "changes.qcow2"
        self._close_read_node()
        scratch.unlink(missing_ok=True)
        try:
            argv.run(["qemu-img", "create", "-q", "-f", "qcow2", str(scratch), str(-(-size // 512) * 512)],
                     timeout=60)
            scratch.chmod(0o600)
            self._monitor.q("blockdev-add", {"driver": "qcow2", "node-name": READ_NODE,
                                             "file": {"driver": "file", "filename": str(scratch)}})
            try:
                self._monitor.q("block-dirty-bitmap-add", {"node": READ_NODE, "name": READ_BITMAP,
                                                           "granularity": BLOCK, "persistent": True})
                self._monitor.q("block-dirty-bitmap-merge", {"node": READ_NODE, "target": READ_BITMAP,
                                                             "bitmaps": [{"node": node, "name": name}]})
            finally:
                self._close_read_node()  # QEMU writes the persistent bitmap into the file as it closes it
            granularity, extents = read_bitmap(scratch, READ_BITMAP)
        except (QmpCommandError, DriverError, ValueError, KeyError, OSError) as exc:
            log.warning("could not read the changed-block bitmap %s of %s (%s): every chunk is read", name, node,
                        exc)
            return None
        finally:
            scratch.unlink(missing_ok=True)
        if granularity != BLOCK:
            return None
        return [(start, min(length, size - start)) for start, length in extents if start < size]

    def _close_read_node(self) -> None:
        if READ_NODE in self._monitor.live_nodes():
            self._monitor.q("blockdev-del", {"node-name": READ_NODE})
