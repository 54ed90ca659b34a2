"""The items of a ``file`` pool and the background jobs that make them: where each file is and what
state it is in, and the copies (clones, re-encryptions, pulls, the finish of a copy made elsewhere)
with their progress, errors and cancel. Callers hold ``lock`` where a method says nothing else."""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path
from typing import Literal

from pydantic import SecretStr

from vbs import ids
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound
from vbs.pools.backend import Fill
from vbs.pools.exports import PointInTimeCopier
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.storage.backends import file_io
from vbs.storage.backends.file_io import CloneMethod
from vbs.storage.copy import CopyJob, Job, ProgressCallback, sparsify
from vbs.storage.luks import convert_to_luks, header_bytes
from vbs.storage.pull import pull
from vbs.wire.connection import NbdConnection
from vbs.wire.storage import ItemStatus

log = logging.getLogger("vbs.storage.backends.file")  # the backend's records keep their name

Kind = Literal["volume", "snapshot"]

# A cancelled copy stops after its current chunk; this only guards against a hung device.
STOP_TIMEOUT = 120.0
DIRS: dict[Kind, str] = {"volume": "volumes", "snapshot": "snapshots"}
_PULL_SECRETS = ".vbs-pull"  # the key files and client certificate of pulls from other nodes (0700)
_NOT_FOUND_CODES: dict[Kind, str] = {
    "volume": "InvalidVolume.NotFound",
    "snapshot": "InvalidSnapshot.NotFound",
}


class CopyJobs:
    """The files of pool ``name`` under ``path`` and the jobs that write them, under ``lock``.

    Only caller threads touch ``jobs`` (under the lock); job threads only touch files, so waiting
    for a cancelled job while holding the lock cannot deadlock.
    """

    def __init__(self, name: str, path: Path, *, clone_method: CloneMethod, chunk_bytes: int,
                 copier: PointInTimeCopier | None, x509: X509Files | None) -> None:
        self.name = name
        self.path = path
        self.clone_method = clone_method
        self.lock = threading.Lock()
        self.jobs: dict[tuple[Kind, str], Job] = {}
        self.closed = False
        self._chunk_bytes = chunk_bytes
        self._copier = copier
        # This node's certificate, as the client of another node's export it pulls a volume from.
        self._x509 = x509

    # -- where items are and how they stand -----------------------------------------------------------

    def final(self, kind: Kind, item_id: str) -> Path:
        ids.check(kind, item_id)
        return self.path / DIRS[kind] / f"{item_id}.raw"

    def check_open(self) -> None:
        if self.closed:
            raise DriverError(f"pool {self.name} is closed")

    def job(self, kind: Kind, item_id: str) -> Job | None:
        """The job of an item if it still runs or its failure is still to be reported."""
        job = self.jobs.get((kind, item_id))
        if job is not None and not (job.running or job.state == "failed"):
            del self.jobs[(kind, item_id)]
            return None
        return job

    def status(self, kind: Kind, item_id: str, final: Path) -> ItemStatus:
        # The job first, then the file: a job publishes its file before it stops running, so a job seen
        # finished has its file there. (The other order raced: a file not there yet, then its job done and
        # forgotten, then no partial either read as "absent".)
        job = self.job(kind, item_id)
        if job is not None and job.running:
            return ItemStatus(state="copying", size_bytes=job.size_bytes, progress=job.progress)
        if final.exists():
            return file_io.ready(final)
        if job is not None:
            return ItemStatus(state="error", size_bytes=job.size_bytes, error=job.error)
        try:
            return ItemStatus(state="stalled", size_bytes=os.lstat(file_io.partial_of(final)).st_size)
        except FileNotFoundError:
            return ItemStatus(state="absent")

    def missing(self, kind: Kind, item_id: str) -> IncorrectState | NotFound:
        final = self.final(kind, item_id)
        if self.job(kind, item_id) is not None or file_io.partial_of(final).exists():
            return IncorrectState(f"The {kind} '{item_id}' is not ready yet.")
        return NotFound(f"The {kind} '{item_id}' does not exist.", code=_NOT_FOUND_CODES[kind])

    # -- the jobs ---------------------------------------------------------------------------------

    def clone(
        self,
        kind: Kind,
        item_id: str,
        final: Path,
        source_kind: Kind,
        source_id: str,
        size_bytes: int | None,
        *,
        container: bool = False,
    ) -> ItemStatus:
        """Make ``final`` a copy of the source item: a reflink at once, or a copy job started now. A
        ``container``'s size is its payload's (its LUKS header on top)."""
        partial = file_io.partial_of(final)
        try:
            src_fd = os.open(self.final(source_kind, source_id), os.O_RDONLY | file_io.OPEN)
        except FileNotFoundError:
            # A stalled partial whose source is gone can never finish: drop it with the error.
            partial.unlink(missing_ok=True)
            raise self.missing(source_kind, source_id) from None
        try:
            source_size = os.fstat(src_fd).st_size
            if size_bytes is not None and container:
                size_bytes += header_bytes(self.final(source_kind, source_id))
            if size_bytes is not None and size_bytes < source_size:
                raise InvalidParameter(
                    f"The size {size_bytes} is smaller than the snapshot {source_id} ({source_size})"
                )
            size = max(source_size, size_bytes or 0)
            cloned = self.clone_method == "reflink" and file_io.reflink(src_fd, partial, size)
            if not cloned:
                job = CopyJob(
                    src_fd,
                    partial,
                    size,
                    on_success=functools.partial(file_io.publish, partial, final),
                    chunk_bytes=self._chunk_bytes,
                    name=f"vbs-copy-{item_id}",
                )
        except BaseException:
            os.close(src_fd)
            raise
        if cloned:
            os.close(src_fd)
            try:
                file_io.publish(partial, final)
            except OSError as exc:
                partial.unlink(missing_ok=True)
                raise DriverError(f"clone {item_id}: {exc.strerror}") from exc
            return file_io.ready(final)
        job.start()  # owns src_fd from here on
        self.jobs[(kind, item_id)] = job
        log.info("copying %s %s from %s %s", kind, item_id, source_kind, source_id)
        return ItemStatus(state="copying", size_bytes=size, progress=job.progress)

    def convert(self, volume_id: str, final: Path, source_id: str, size_bytes: int, passphrase: SecretStr,
                source_passphrase: SecretStr | None) -> ItemStatus:
        """Start re-encrypting snapshot ``source_id`` into ``final`` (a job: every block is written anew)."""
        source = self.final("snapshot", source_id)
        if not source.exists():
            raise self.missing("snapshot", source_id)
        partial = file_io.partial_of(final)
        partial.unlink(missing_ok=True)

        def work(_cancel: object, _progress: object) -> None:
            convert_to_luks(source, partial, size_bytes, passphrase, source_passphrase)

        job = Job(work, size_bytes=size_bytes, on_success=functools.partial(file_io.publish, partial, final),
                  on_failure=lambda: partial.unlink(missing_ok=True), name=f"vbs-encrypt-{volume_id}")
        job.start()
        self.jobs[("volume", volume_id)] = job
        log.info("re-encrypting snapshot %s into volume %s", source_id, volume_id)
        return ItemStatus(state="copying", size_bytes=size_bytes, progress=0)

    def pull(self, volume_id: str, final: Path, size_bytes: int, source: NbdConnection) -> ItemStatus:
        """Start pulling what ``source`` serves into the volume's partial (``vbs.storage.pull``)."""
        file_io.create_sparse(final, size_bytes, publish_it=False, at=file_io.partial_of(final))
        secrets_dir = self.path / _PULL_SECRETS
        secrets_dir.mkdir(mode=0o700, exist_ok=True)
        x509_dir = qemu_x509_dir(self._x509, secrets_dir / "x509", "client") if self._x509 else None
        work = functools.partial(pull, source, file_io.partial_of(final), size_bytes, secrets_dir=secrets_dir,
                                 x509_dir=x509_dir)
        job = Job(lambda cancel, progress: work(cancel=cancel, progress=progress), size_bytes=size_bytes,
                  on_success=functools.partial(file_io.publish, file_io.partial_of(final), final),
                  on_failure=lambda: file_io.partial_of(final).unlink(missing_ok=True),
                  name=f"vbs-pull-{volume_id}")
        job.start()
        self.jobs[("volume", volume_id)] = job
        log.info("pulling volume %s from %s", volume_id, source.host or source.socket)
        return ItemStatus(state="copying", size_bytes=size_bytes, progress=0)

    def fill(self, volume_id: str, final: Path, size_bytes: int, fill: Fill, *, what: str) -> ItemStatus:
        """Start ``fill`` writing the volume's partial (made anew: it reads as zeros), published when it is
        done, removed if it fails."""
        partial = file_io.partial_of(final)
        partial.unlink(missing_ok=True)
        job = Job(lambda cancel, progress: fill(partial, cancel, progress), size_bytes=size_bytes,
                  on_success=functools.partial(file_io.publish, partial, final),
                  on_failure=lambda: partial.unlink(missing_ok=True), name=f"vbs-fill-{volume_id}", what=what)
        job.start()
        self.jobs[("volume", volume_id)] = job
        log.info("filling volume %s (%s)", volume_id, what)
        return ItemStatus(state="copying", size_bytes=size_bytes, progress=0)

    def start_finish(self, snapshot_id: str, final: Path, *, scan_data: bool) -> None:
        """Give back the space a copy made by someone else allocated for zeros, then publish it."""
        partial = file_io.partial_of(final)

        def work(cancel: threading.Event, progress: ProgressCallback) -> None:
            fd = os.open(partial, os.O_RDWR | file_io.OPEN)
            try:
                sparsify(fd, scan_data=scan_data, cancel=cancel, progress=progress)
            finally:
                os.close(fd)

        def publish() -> None:
            file_io.publish(partial, final)
            if self._copier is not None:
                # Only now: until the snapshot is published, the daemon's record of the copy is what
                # tells a finished copy from one to start (a new one would be of a later instant).
                try:
                    self._copier.remove_copy(snapshot_id)
                except DriverError as exc:
                    log.warning("snapshot %s: the export daemon's copy record stays: %s", snapshot_id, exc.message)

        job = Job(work, size_bytes=os.lstat(partial).st_size, on_success=publish, on_failure=partial.unlink,
                  name=f"vbs-finish-{snapshot_id}")
        job.start()
        self.jobs[("snapshot", snapshot_id)] = job

    def remove(self, kind: Kind, item_id: str) -> None:
        """Stop the item's job, if any, and remove its files (takes the lock)."""
        final = self.final(kind, item_id)
        with self.lock:
            job = self.jobs.pop((kind, item_id), None)
            if job is not None:
                job.cancel()
                if not job.wait(STOP_TIMEOUT):
                    self.jobs[(kind, item_id)] = job
                    raise DriverError(f"remove {item_id}: its copy did not stop within {STOP_TIMEOUT:g}s")
            try:
                file_io.partial_of(final).unlink(missing_ok=True)
                final.unlink(missing_ok=True)
                file_io.fsync_dir(final.parent)
            except OSError as exc:
                raise DriverError(f"remove {item_id}: {exc.strerror}") from exc

    def close(self) -> list[Job]:
        """Mark the pool closed and cancel every job (the caller holds the lock and waits for them)."""
        self.closed = True
        jobs = list(self.jobs.values())
        self.jobs.clear()
        for job in jobs:
            job.cancel()
        return jobs
