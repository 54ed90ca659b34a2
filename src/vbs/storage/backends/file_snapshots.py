"""The snapshots of a ``file`` pool: each a point-in-time copy of its volume, as the pool can take
one (a reflink, the export daemon's copy, a copy here of a volume no host writes, or a hypervisor's
copy into a snapshot target); see ``vbs.storage.backends.file``. A copy pool whose snapshots go to the
snapshot store takes no copy where it can stream (``file_streams``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from vbs.errors import DriverError, IncorrectState, PointInTimeUnavailable
from vbs.pools.backend import ImageLayout
from vbs.pools.exports import ExportDriver, FileSource, PointInTimeCopier
from vbs.storage.backends import file_io
from vbs.storage.backends.file_copies import CopyJobs
from vbs.storage.backends.file_streams import Streams
from vbs.system.shared_extents import changed_extents
from vbs.wire.connection import Connection, HostIdentity
from vbs.wire.storage import ItemStatus

log = logging.getLogger("vbs.storage.backends.file")  # the backend's records keep their name

_INTERRUPTED = "the snapshot copy was interrupted; its point in time is lost: delete the snapshot and take another"


class Snapshots:
    """The snapshot calls of a ``FileBackend``, on its files and jobs and under their lock.

    ``exporting`` is the backend's set of volumes an export is being made for right now.
    """

    def __init__(self, files: CopyJobs, exports: ExportDriver | None, copier: PointInTimeCopier | None,
                 exporting: set[str], need_exports: Callable[[], ExportDriver], streams: Streams | None) -> None:
        """``streams``: the pool's snapshots go to the store, read in place (None: copied into the pool)."""
        self._files = files
        self._streams = streams
        self._exports = exports
        self._copier = copier
        self._exporting = exporting
        self._need_exports = need_exports
        self._plain: dict[str, str] = {}  # snapshot id -> volume it copies with no daemon

    def ensure(self, snapshot_id: str, volume_id: str) -> ItemStatus:
        files = self._files
        final = files.final("snapshot", snapshot_id)
        source = files.final("volume", volume_id)
        with files.lock:
            files.check_open()
            status = self._state(snapshot_id, volume_id, final)
            if status.state != "absent":
                return status
            if files.clone_method == "reflink":
                return files.clone("snapshot", snapshot_id, final, "volume", volume_id, None)
            if self._streams is not None and self._streams.viewer is not None:
                return self._streams.view(snapshot_id, volume_id, source)
            if self._copier is not None:
                return self._start_daemon_copy(snapshot_id, volume_id, source, final)
            if volume_id in self._exporting or (self._exports is not None and self._exports.is_exported(volume_id)):
                raise PointInTimeUnavailable(
                    f"The volume '{volume_id}' is exported to a host and this storage node cannot copy it at "
                    "one instant; its hypervisor must take the copy.")
            if self._streams is not None:
                return self._streams.hold(snapshot_id, volume_id, source)
            status = files.clone("snapshot", snapshot_id, final, "volume", volume_id, None)
            if status.state == "copying":
                self._plain[snapshot_id] = volume_id
            return status

    def status(self, snapshot_id: str) -> ItemStatus:
        final = self._files.final("snapshot", snapshot_id)
        with self._files.lock:
            status = self._files.status("snapshot", snapshot_id, final)
            if status.state == "absent" and self._streams is not None:
                return self._streams.status(snapshot_id) or status
            return status

    def layout(self, snapshot_id: str) -> ImageLayout | None:
        """How the upload must read the snapshot's image (None: a plain file)."""
        with self._files.lock:
            if self._streams is None or self._files.final("snapshot", snapshot_id).exists():
                return None
            return self._streams.layout(snapshot_id)

    def image(self, snapshot_id: str) -> Path:
        """What the snapshot store's upload reads: the snapshot's file, or its view or held volume."""
        final = self._files.final("snapshot", snapshot_id)
        with self._files.lock:
            if final.exists():
                return final
            image = self._streams.image(snapshot_id) if self._streams is not None else None
            if image is None:
                raise self._files.missing("snapshot", snapshot_id)
            return image

    def changed_since(self, snapshot_id: str, since: str) -> list[tuple[int, int]] | None:
        """The extents of the snapshot's image that may differ from ``since``'s: on a reflink pool, those its
        file does not share with ``since``'s file, where both are still reflinks of their volume; on a copy
        pool, those the export driver saw hosts write between the two snapshots' views (None: no such pair
        here, no extent map, or no tracking)."""
        files = self._files
        newer_path, older_path = files.final("snapshot", snapshot_id), files.final("snapshot", since)
        if files.clone_method != "reflink":
            if self._streams is None:
                return None
            with files.lock:
                return None if newer_path.exists() else self._streams.changed_since(snapshot_id, since)
        fds: list[int] = []
        try:
            with files.lock:  # both opened now stay readable whatever a removal does meanwhile
                for path in (older_path, newer_path):
                    fds.append(os.open(path, os.O_RDONLY | file_io.OPEN))
            return changed_extents(fds[0], fds[1])
        except FileNotFoundError:
            return None  # the previous snapshot left the pool: every chunk is read
        except OSError as exc:
            log.warning("snapshot %s: no extent map to compare with %s (%s): every chunk is read", snapshot_id,
                        since, exc.strerror)
            return None
        finally:
            for fd in fds:
                os.close(fd)

    def remove(self, snapshot_id: str) -> None:
        final = self._files.final("snapshot", snapshot_id)
        if self._streams is not None:
            self._streams.remove(snapshot_id)
        if self._copier is not None:
            self._copier.remove_copy(snapshot_id)
        if self._exports is not None:
            for export in self._exports.list_exports():
                if export.key == snapshot_id:
                    self._exports.remove_export(snapshot_id, export.host)
        self._files.remove("snapshot", snapshot_id)
        with self._files.lock:
            self._plain.pop(snapshot_id, None)
        log.debug("removed snapshot %s (%s)", snapshot_id, final.name)

    def target(self, snapshot_id: str, volume_id: str, host: HostIdentity) -> Connection:
        files = self._files
        final = files.final("snapshot", snapshot_id)
        source = files.final("volume", volume_id)
        exports = self._need_exports()
        partial = file_io.partial_of(final)
        with files.lock:
            files.check_open()
            if final.exists():
                raise IncorrectState(f"The snapshot '{snapshot_id}' is complete already.")
            if ("snapshot", snapshot_id) in files.jobs:
                raise IncorrectState(f"The snapshot '{snapshot_id}' is being copied on this node.")
            if not partial.exists():
                try:
                    size = os.stat(source).st_size
                except FileNotFoundError:
                    raise files.missing("volume", volume_id) from None
                file_io.create_sparse(partial, size, publish_it=False)
        return exports.ensure_export(snapshot_id, FileSource(partial), host, read_only=False)

    def finish_target(self, snapshot_id: str, host_name: str) -> ItemStatus:
        files = self._files
        final = files.final("snapshot", snapshot_id)
        exports = self._need_exports()
        exports.remove_export(snapshot_id, host_name)
        with files.lock:
            job = files.jobs.get(("snapshot", snapshot_id))
            if final.exists() or job is not None:
                return files.status("snapshot", snapshot_id, final)
            partial = file_io.partial_of(final)
            if not partial.exists():
                raise files.missing("snapshot", snapshot_id)
            # The hypervisor's copy wrote zeros as data (an iSCSI target has no other way): give the
            # space back before the snapshot is published.
            files.start_finish(snapshot_id, final, scan_data=True)
            return files.status("snapshot", snapshot_id, final)

    def plain_copies_of(self, volume_id: str) -> list[str]:
        """Snapshots being copied or read from ``volume_id`` here, with no daemon to see later writes
        (the caller holds the lock)."""
        for snap in [s for s, v in self._plain.items() if v == volume_id]:
            job = self._files.jobs.get(("snapshot", snap))
            # A published snapshot is done, even while its job thread is still returning.
            if job is None or not job.running or self._files.final("snapshot", snap).exists():
                del self._plain[snap]
        held = self._streams.holds_of(volume_id) if self._streams is not None else []
        return [s for s, v in self._plain.items() if v == volume_id] + held

    def forget(self) -> None:
        """The pool closes (the caller holds the lock)."""
        self._plain.clear()

    def _state(self, snapshot_id: str, volume_id: str, final: Path) -> ItemStatus:
        """Where a snapshot stands for an ``ensure``: ``absent`` means start it now."""
        files = self._files
        status = files.status("snapshot", snapshot_id, final)
        if status.state == "absent" and self._streams is not None:
            return self._streams.status(snapshot_id) or status  # a view or hold made already
        if status.state != "stalled":
            return status
        # A partial with no job of ours behind it: the export daemon's copy, a hypervisor's, or an
        # interrupted one.
        if self._copier is not None:
            copy = self._copier.ensure_copy(snapshot_id, volume_id, FileSource(files.final("volume", volume_id)),
                                            file_io.partial_of(final))
            if copy.state == "ready":
                files.start_finish(snapshot_id, final, scan_data=False)
                return files.status("snapshot", snapshot_id, final)
            return copy
        if self._exports is not None and self._exports.is_exported(snapshot_id):
            raise IncorrectState(f"The snapshot '{snapshot_id}' is being copied by a hypervisor; finish it there.")
        return ItemStatus(state="error", size_bytes=status.size_bytes, error=_INTERRUPTED)

    def _start_daemon_copy(self, snapshot_id: str, volume_id: str, source: Path, final: Path) -> ItemStatus:
        files = self._files
        try:
            size = os.stat(source).st_size
        except FileNotFoundError:
            raise files.missing("volume", volume_id) from None
        st = os.statvfs(files.path)
        if st.f_bavail * st.f_frsize < size:
            # The daemon's copy job allocates the whole size while it runs (zero ranges included);
            # the unwritten part is given back when it is done.
            raise DriverError(f"snapshot {snapshot_id}: a point-in-time copy of {volume_id} needs {size} bytes free "
                              f"in pool {files.name} while it runs")
        partial = file_io.partial_of(final)
        file_io.create_sparse(partial, size, publish_it=False)
        assert self._copier is not None
        try:
            status = self._copier.ensure_copy(snapshot_id, volume_id, FileSource(source), partial)
        except Exception:
            partial.unlink(missing_ok=True)
            raise
        if status.state == "ready":
            files.start_finish(snapshot_id, final, scan_data=False)
            return files.status("snapshot", snapshot_id, final)
        return status
