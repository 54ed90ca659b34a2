"""The storage agent's side of a separate archive store (docs/snapshot-tiers.md): moving a snapshot's
manifest and chunks from the snapshot store into the archive store and back, as jobs with progress.

- **Archive** (``archive``): the snapshot is copied into the archive store (``copy_snapshot``: only the
  chunks it lacks, each checked against its id), then its manifest leaves the snapshot store, whose
  garbage collection then frees the chunks no other manifest lists. Run again, it finds the archive's
  manifest and only makes sure the standard one is gone: so the end of a temporary restore is an archive.
- **Restore** (``restore``): copied back into the snapshot store; a ``permanent`` one then leaves the
  archive store.
- Deleting a snapshot (``delete``) deletes its manifest from the archive store too.

Each step ends with the copy made before the source is touched, so a crash anywhere leaves the snapshot
whole in one store at least and the call made again carries on. The store key arrives with each call and
is kept only for the job's life.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import SecretStr

from vbs.errors import DriverError, IncorrectState, NotFound, RetryLater
from vbs.snapshot_store import StoreKey, open_store
from vbs.snapshot_store.contract import SnapshotStore
from vbs.snapshot_store.format import manifest_key
from vbs.snapshot_store.manifests import delete_snapshot, find_manifest
from vbs.snapshot_store.transfer import copy_snapshot
from vbs.storage.copy import Job
from vbs.wire.storage import StoredStatus, TierMove

__all__ = ["ArchiveTier"]

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class _Move:
    """One move of a snapshot between the stores: from ``source`` into ``target``, then ``drop`` (the
    store that forgets it afterwards, or None)."""

    source: SnapshotStore
    target: SnapshotStore
    drop: SnapshotStore | None
    what: str


class ArchiveTier:
    """This agent's archive store (None: it has none) beside its snapshot store, and the moves under way."""

    def __init__(self, store: SnapshotStore | None, archive: SnapshotStore | None,
                 location: str | None = None) -> None:
        self.store = store
        self.archive = archive
        self._location = location
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[str, Job]] = {}  # snapshot id: (the move's kind, its job)
        self._opened: set[str] = set()

    @property
    def location(self) -> str | None:
        """How the pools report the archive store (None: there is none)."""
        if self.archive is None:
            return None
        return self._location or self.archive.describe()

    def _stores(self) -> tuple[SnapshotStore, SnapshotStore]:
        if self.store is None or self.archive is None:
            raise DriverError("this storage agent has no archive store ([storage_agent.archive_store] driver "
                              "= \"none\")")
        return self.store, self.archive

    def _tenant_key(self, secret: SecretStr, tenant: str) -> bytes:
        key = StoreKey(bytes.fromhex(secret.get_secret_value()))
        check = key.check_value()
        if check not in self._opened:
            store, archive = self._stores()
            open_store(store, key)
            open_store(archive, key)  # made on first use; refused if another key made it
            with self._lock:
                self._opened.add(check)
        return key.tenant_key(tenant)

    def archive_snapshot(self, snapshot_id: str, req: TierMove) -> StoredStatus:
        """Move the snapshot into the archive store (a job), or say how far it got."""
        store, archive = self._stores()
        return self._move(snapshot_id, req, "archive", _Move(store, archive, store, "archive"))

    def restore(self, snapshot_id: str, req: TierMove) -> StoredStatus:
        """Copy the snapshot back into the snapshot store (a job; ``permanent``: then out of the archive)."""
        store, archive = self._stores()
        kind = "permanent-restore" if req.permanent else "restore"
        return self._move(snapshot_id, req, kind, _Move(archive, store, archive if req.permanent else None,
                                                         "restore from the archive"))

    def _done(self, move: _Move, snapshot_id: str) -> bool:
        """Whether the move has nothing left to do: the target holds it, and the dropped store does not."""
        return move.target.has(manifest_key(snapshot_id)) and (
            move.drop is None or not move.drop.has(manifest_key(snapshot_id)))

    def _move(self, snapshot_id: str, req: TierMove, kind: str, move: _Move) -> StoredStatus:
        with self._lock:
            found = self._jobs.get(snapshot_id)
            if found is not None:
                answer = self._answer(snapshot_id, kind, *found)
                if answer is not None:
                    return answer
        if self._done(move, snapshot_id):
            if move.drop is not None:
                delete_snapshot(move.drop, snapshot_id)  # the marker a copy into it that stopped halfway left
            return StoredStatus(state="ready", progress=100, store=self.location, pool_copy=False)
        if find_manifest(move.source, snapshot_id) is None and find_manifest(move.target, snapshot_id) is None:
            raise NotFound(f"neither {move.source.describe()} nor {move.target.describe()} holds {snapshot_id}",
                           code="InvalidSnapshot.NotFound", snapshot_id=snapshot_id)
        tenant_key = self._tenant_key(req.store_key, req.tenant)
        held = find_manifest(move.source, snapshot_id) or find_manifest(move.target, snapshot_id)
        if held is not None and held.tenant != req.tenant:
            raise IncorrectState(f"the snapshot store holds {snapshot_id} for another tenant", snapshot_id=snapshot_id)

        def work(cancel: threading.Event, progress: Callable[[int, int], None]) -> None:
            done = copy_snapshot(move.source, move.target, snapshot_id, tenant_key=tenant_key, progress=progress)
            if move.drop is not None and not cancel.is_set():
                delete_snapshot(move.drop, snapshot_id)  # its chunks go with the dropped store's next GC
            log.info("snapshot %s: %s done (%d chunks, %d sent, %d bytes)%s", snapshot_id, move.what, done.chunks,
                     done.chunks_put, done.bytes_put, f"; {move.drop.describe()} forgot it" if move.drop else "")

        job = Job(work, size_bytes=0, name=f"vbs-tier-{snapshot_id}", what=move.what)
        with self._lock:
            if snapshot_id in self._jobs:  # another call started one meanwhile
                return StoredStatus(state="copying", store=self.location)
            self._jobs[snapshot_id] = (kind, job)
        try:
            job.start()
        except BaseException:
            with self._lock:
                self._jobs.pop(snapshot_id, None)
            raise
        log.info("snapshot %s: %s from %s into %s", snapshot_id, move.what, move.source.describe(),
                 move.target.describe())
        return StoredStatus(state="copying", store=self.location)

    def _answer(self, snapshot_id: str, kind: str, job_kind: str, job: Job) -> StoredStatus | None:
        """What a move under way or ended says (the caller holds the lock); None: start anew."""
        if job.running:
            if job_kind != kind:
                raise RetryLater(f"the snapshot {snapshot_id} is being moved ({job_kind}) already")
            return StoredStatus(state="copying", progress=job.progress, store=self.location)
        del self._jobs[snapshot_id]  # ended: said once, then the stores themselves answer
        if job.state == "failed" and job_kind == kind:
            log.warning("snapshot %s: %s", snapshot_id, job.error)
            if isinstance(job.exception, RetryLater):
                raise job.exception  # a store is down: the controller retries later
            return StoredStatus(state="error", error=job.error, store=self.location)
        return None

    def delete(self, snapshot_id: str) -> None:
        """Forget the snapshot in the archive store (a move under way is stopped first). Idempotent."""
        if self.archive is None:
            return
        with self._lock:
            found = self._jobs.pop(snapshot_id, None)
        if found is not None:
            found[1].cancel()
            if not found[1].wait(STOP_TIMEOUT_S):
                raise DriverError(f"the move of {snapshot_id} did not stop within {STOP_TIMEOUT_S:g}s")
        delete_snapshot(self.archive, snapshot_id)
        log.info("snapshot %s deleted from the archive store %s", snapshot_id, self.archive.describe())

    def close(self) -> None:
        with self._lock:
            jobs = [job for _, job in self._jobs.values()]
            self._jobs.clear()
        for job in jobs:
            job.cancel()
        for job in jobs:
            job.wait(STOP_TIMEOUT_S)
