"""The snapshot store's side of an ``rbd`` pool (docs/snapshots.md "RBD pools"): reading a snapshot for an
upload, incremental by the changed extents Ceph reports, and writing a volume restored from the store.

- **A snapshot's reader** (``open_snapshot``): the snapshot's ``rbd export-diff`` stream (``rbd_diff``).
  When the volume's previous stored snapshot is still a snapshot of the same image, ``rbd diff
  --from-snap PREV --whole-object`` (the object map's fast-diff where the image has it) lists the objects
  written or discarded since it: the upload takes every other chunk from PREV's manifest unread, and the
  stream carries only the changed objects. Otherwise it reads the whole image (its allocated objects:
  the rest reads as zeros), and chunks the store holds are still not sent again. A snapshot whose
  volume was deleted before its upload (the image in the RBD trash has no name, and the tool reads by
  name) is read through a clone of it made for the upload and removed after it.
- **A restore** (``fill``): the volume is made as the image ``vbs-partial-<volume>`` (no listing takes it
  for a volume), written through ``rbd import-diff`` in a job with progress, and renamed to the volume's
  name once every chunk is written and checked. A failed restore removes it (and answers ``error`` once);
  one interrupted by an agent restart is started over, and a removal of the volume removes it too.

The pool's snapshots stay in the pool as the fast tier: clones of them stay instant.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vbs import ids
from vbs.errors import DriverError, NotFound
from vbs.pools.backend import StreamFill, check_size
from vbs.storage.backends.rbd_chains import TrashEntry
from vbs.storage.backends.rbd_cli import ENOENT, RbdTools
from vbs.storage.backends.rbd_clones import IMAGE_FEATURES, Clones
from vbs.storage.backends.rbd_diff import DiffReader, DiffWriter
from vbs.storage.copy import Job, ProgressCallback
from vbs.wire.storage import ItemStatus

__all__ = ["StoredImages", "SnapshotStream", "PARTIAL_PREFIX", "READING_PREFIX", "parse_diff"]

log = logging.getLogger("vbs.storage.backends.rbd")

PARTIAL_PREFIX = "vbs-partial-"
READING_PREFIX = "vbs-reading-"
STOP_TIMEOUT_S = 120.0


def parse_diff(text: str, size: int) -> list[tuple[int, int]]:
    """``rbd diff --format json``: the (offset, length) extents it lists, written or discarded alike."""
    try:
        entries = json.loads(text or "[]")
    except ValueError:
        raise DriverError("rbd diff: an answer that is not JSON") from None
    extents: list[tuple[int, int]] = []
    for entry in entries if isinstance(entries, list) else [None]:
        offset = entry.get("offset") if isinstance(entry, dict) else None
        length = entry.get("length") if isinstance(entry, dict) else None
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0 \
                or offset + length > size:
            raise DriverError("rbd diff: an unexpected extent")
        extents.append((offset, length))
    return extents


@dataclass
class SnapshotStream:
    """A snapshot's bytes (``read_at``), its size, and the byte extents changed since ``since`` (None: the
    pool cannot tell, every chunk is read)."""

    reader: DiffReader
    size: int
    since: str | None
    changed: list[tuple[int, int]] | None
    cleanup: Callable[[], None] | None = None  # after reading: what was made to read it goes

    def read_at(self, offset: int, length: int) -> bytes:
        return self.reader.read_at(offset, length)

    def close(self) -> None:
        self.reader.close()
        if self.cleanup is not None:
            self.cleanup()


class StoredImages:
    """Snapshot readers and restore jobs of the pool ``cli`` reaches; ``lock`` is the backend's (one tool
    call at a time), taken for the listing a reader starts from and the clones and removals it makes."""

    def __init__(self, cli: RbdTools, lock: threading.Lock, clones: Clones) -> None:
        self._cli = cli
        self._lock = lock
        self._clones = clones
        self._jobs_lock = threading.Lock()
        self._jobs: dict[str, Job] = {}

    # -- reading a snapshot --------------------------------------------------------------------------

    def open_snapshot(self, snapshot_id: str, since: str | None) -> SnapshotStream:
        ids.check("snapshot", snapshot_id)
        if since is not None:
            ids.check("snapshot", since)
        cli = self._cli
        with self._lock:
            listing = cli.listing()
        found = listing.snapshots.get(snapshot_id)
        if found is None:
            raise NotFound(f"The snapshot '{snapshot_id}' does not exist.", code="InvalidSnapshot.NotFound")
        image, size = found
        entry = listing.trash.get(image)
        if entry is not None:
            return self._open_trashed(entry, snapshot_id, size)
        previous = listing.snapshots.get(since) if since is not None else None
        changed: list[tuple[int, int]] | None = None
        if previous is not None and previous[0] == image:
            changed = parse_diff(cli.rbd("diff", "--from-snap", str(since), "--whole-object", "--format", "json",
                                         cli.spec(image, snapshot_id)), size)
        else:
            since = None

        def argv(start: str | None) -> list[str]:
            return cli.argv("rbd", "export-diff", "--no-progress", "--whole-object",
                            *(("--from-snap", start) if start is not None else ()), cli.spec(image, snapshot_id), "-")

        reader = DiffReader(argv, size, since=since, zero_from=previous[1] if previous and since else 0,
                            timeout_s=cli.timeout_s, what=f"pool {cli.name}: rbd export-diff of {snapshot_id}")
        return SnapshotStream(reader, size, since, changed)

    def _open_trashed(self, entry: TrashEntry, snapshot_id: str, size: int) -> SnapshotStream:
        """A snapshot of a volume deleted before its upload (its image in the RBD trash, with no name) is read
        through a clone of it made for the upload, ``vbs-reading-<snapshot>``, removed after it: a full read."""
        cli = self._cli
        name = READING_PREFIX + snapshot_id
        with self._lock:
            self._clones.reading_clone(entry, snapshot_id, name)

        def argv(start: str | None) -> list[str]:
            return cli.argv("rbd", "export-diff", "--no-progress", "--whole-object", cli.spec(name), "-")

        def remove() -> None:
            with self._lock:
                cli.rbd_tolerant("rm", "--no-progress", cli.spec(name), tolerate=(ENOENT,))

        try:
            reader = DiffReader(argv, size, since=None, zero_from=0, timeout_s=cli.timeout_s,
                                what=f"pool {cli.name}: rbd export-diff of {snapshot_id} (through {name})")
        except BaseException:
            remove()
            raise
        return SnapshotStream(reader, size, None, None, remove)

    # -- restores ----------------------------------------------------------------------------------------

    def status(self, volume_id: str, *, forget: bool = False) -> ItemStatus | None:
        """The volume's restore here: ``copying``, or ``error`` (None: none, or it ended well). ``forget``: an
        error is said this once, and the next call starts over."""
        with self._jobs_lock:
            job = self._jobs.get(volume_id)
            if job is None or job.state == "done":
                return None
            if job.running or not job.wait(0):  # not ended until a failed one's partial is gone
                return ItemStatus(state="copying", size_bytes=job.size_bytes, progress=job.progress)
            if forget:
                del self._jobs[volume_id]
        if job.state == "failed":
            return ItemStatus(state="error", size_bytes=job.size_bytes, error=job.error)
        return None

    def fill(self, volume_id: str, size_bytes: int, fill: StreamFill, *, what: str) -> ItemStatus:
        """Make the volume's partial image anew and start ``fill`` writing it. The caller holds the backend's
        lock and has checked that the volume has no image and no restore running."""
        ids.check("volume", volume_id)
        check_size(size_bytes)
        cli = self._cli
        partial = PARTIAL_PREFIX + volume_id
        self.remove_partial(volume_id)
        cli.rbd("create", "--size", f"{size_bytes}B", "--image-feature", IMAGE_FEATURES, cli.spec(partial))

        def work(cancel: threading.Event, progress: ProgressCallback) -> None:
            writer = DiffWriter(cli.argv("rbd", "import-diff", "--no-progress", "-", cli.spec(partial)),
                                timeout_s=cli.timeout_s, what=f"pool {cli.name}: rbd import-diff into {volume_id}")
            try:
                fill(writer, cancel, progress)
            finally:
                writer.close()

        def publish() -> None:
            cli.rbd("rename", cli.spec(partial), cli.spec(volume_id))

        # Neither end takes the backend's lock: a removal of the volume waits for the job's end without it.
        job = Job(work, size_bytes=size_bytes, on_success=publish, on_failure=lambda: self._drop_partial(volume_id),
                  name=f"vbs-fill-{volume_id}", what=what)
        job.start()
        with self._jobs_lock:
            self._jobs[volume_id] = job
        log.info("pool %s: filling volume %s (%s)", cli.name, volume_id, what)
        return ItemStatus(state="copying", size_bytes=size_bytes, progress=0)

    def remove_partial(self, volume_id: str) -> None:
        partial = PARTIAL_PREFIX + volume_id
        try:
            self._cli.rbd_tolerant("rm", "--no-progress", self._cli.spec(partial), tolerate=(ENOENT,))
        except DriverError as exc:
            raise DriverError(f"pool {self._cli.name}: the partial image {partial} could not be removed: "
                              f"{exc.message}") from None

    def _drop_partial(self, volume_id: str) -> None:
        """After a failed restore: its partial goes (if that fails too, the next restore or removal retries)."""
        try:
            self.remove_partial(volume_id)
        except DriverError as exc:
            log.warning("%s", exc.message)

    def stop(self, volume_id: str) -> None:
        """Stop the volume's restore, if any, and wait for its end (without the backend's lock)."""
        with self._jobs_lock:
            job = self._jobs.pop(volume_id, None)
        if job is None:
            return
        job.cancel()
        if not job.wait(STOP_TIMEOUT_S):
            with self._jobs_lock:
                self._jobs.setdefault(volume_id, job)
            raise DriverError(f"remove {volume_id}: its restore did not stop within {STOP_TIMEOUT_S:g}s")

    def close(self) -> None:
        """Stop every restore (their partial images stay: a later call starts over)."""
        with self._jobs_lock:
            jobs = list(self._jobs.values())
            self._jobs.clear()
        for job in jobs:
            job.cancel()
        for job in jobs:
            job.wait(STOP_TIMEOUT_S)
