"""A ``file`` pool's folder as the agent reports it: made ready at start, whether it is lost
(docs/operations.md "A lost pool"), its room, the items it holds and what its volumes use."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vbs import ids
from vbs.errors import DriverError
from vbs.storage.backends.file_copies import DIRS, CopyJobs, Kind
from vbs.wire.storage import PoolInventory

log = logging.getLogger("vbs.storage.backends.file")  # the backend's records keep their name


class PoolFolder:
    """The folder ``path`` of pool ``name`` and its ``volumes`` and ``snapshots`` folders (made here).

    ``path`` must exist: creating it would silently fill the parent filesystem when the pool's own
    filesystem failed to mount.
    """

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        if not self.path.is_dir():
            raise DriverError(f"pool {name}: {self.path} is not a directory")
        try:
            for sub in DIRS.values():
                (self.path / sub).mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise DriverError(f"pool {name}: cannot prepare {self.path}: {exc.strerror}") from exc

    def lost(self) -> str | None:
        """Why the pool's storage is gone — its directory or one of its folders is no directory (removed, or
        its file system not mounted) — or None (docs/operations.md "A lost pool")."""
        for where in (self.path, *(self.path / sub for sub in DIRS.values())):
            if not where.is_dir():
                said = "".join(c if c.isprintable() else "?" for c in str(where))[:300]
                return f"{said} is gone"
        return None

    def room(self) -> tuple[int, int]:
        """The bytes of the pool's file system, and those free (none if it is gone)."""
        try:
            st = os.statvfs(self.path)
        except FileNotFoundError:
            return 0, 0
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def inventory(self, files: CopyJobs) -> PoolInventory:
        """The volumes and snapshots in the folders, complete or being written (also by a job of ``files``
        that has not made its file yet)."""
        found: dict[Kind, set[str]] = {"volume": set(), "snapshot": set()}
        with files.lock:
            if (lost := self.lost()) is not None:
                return PoolInventory(lost=lost)
            for kind, sub in DIRS.items():
                try:
                    with os.scandir(self.path / sub) as entries:
                        for entry in entries:
                            item_id = entry.name.removesuffix(".partial").removesuffix(".raw")
                            if entry.name.endswith((".raw", ".raw.partial")) and ids.is_valid(kind, item_id):
                                found[kind].add(item_id)
                except FileNotFoundError:  # removed since it was looked at
                    return PoolInventory(lost=self.lost() or f"pool {self.name}: its {sub} folder is gone")
                found[kind].update(item_id for (k, item_id), job in files.jobs.items() if k == kind and job.running)
        return PoolInventory(volumes=sorted(found["volume"]), snapshots=sorted(found["snapshot"]))

    def volume_usage(self) -> dict[str, int]:
        """Bytes allocated to each complete volume file (sparse: what was written, not the size)."""
        used: dict[str, int] = {}
        try:
            with os.scandir(self.path / DIRS["volume"]) as entries:
                for entry in entries:
                    volume_id = entry.name.removesuffix(".raw")
                    if entry.name.endswith(".raw") and ids.is_valid("volume", volume_id):
                        try:
                            used[volume_id] = entry.stat(follow_symlinks=False).st_blocks * 512
                        except FileNotFoundError:
                            continue  # removed meanwhile
        except FileNotFoundError:
            pass  # a lost pool: its heartbeat says so (PoolInfo.lost)
        except OSError as exc:
            log.warning("pool %s: cannot list volumes for their usage: %s", self.name, exc.strerror)
        return used
