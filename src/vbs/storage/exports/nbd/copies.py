"""Point-in-time copies the NBD daemon takes of what it serves: a ``blockdev-backup`` job from the
key's newest chain into a target file, its progress and outcome, and its cancel."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from vbs.errors import DriverError, InvalidParameter, NotFound, RetryLater
from vbs.qemu.qmp import QmpCommandError, QmpConnectionError
from vbs.storage.exports.supervised import file_size
from vbs.system.files import fsync_path
from vbs.wire.storage import ItemStatus

from .chains import Chains
from .daemon import Monitor
from .limits import Limits
from .state import Book, Copy, Job, Live, Served, copy_names, new_chain

log = logging.getLogger(__name__)

INTERRUPTED = "the copy was interrupted; its point in time is lost"


class Copies:
    """Starts, reports and ends the copies the desired state in ``book`` records."""

    def __init__(self, monitor: Monitor, chains: Chains, limits: Limits, book: Book, *, copy_speed: int) -> None:
        self.copy_speed = copy_speed
        self._monitor, self._chains, self._limits, self._book = monitor, chains, limits, book

    def find(self, copy_id: str) -> tuple[Served, Copy] | None:
        return self._book.find_copy(copy_id)

    def start(self, copy_id: str, served: Served, target: Path, live: Live) -> tuple[Served, Copy]:
        size = file_size(served.key, Path(served.path))
        try:
            target_size = target.stat().st_size
        except FileNotFoundError:
            raise NotFound(f"copy target {target} does not exist", code="InvalidSnapshot.NotFound") from None
        if target_size != size:
            raise InvalidParameter(f"copy target {target} has {target_size} bytes, {served.key} has {size}")
        chain = served.newest()
        if chain is None:
            # Opened writable: a host that attaches during the copy joins this chain, below the filter.
            chain = new_chain(served.key, served.next_gen(), False, self._limits.fair_group(served))
        elif chain.size != size or any(not e.read_only and e.gen != chain.gen for e in served.exports):
            # Writes through another chain would not pass the copy's filter: wait until every
            # writer is on the newest one (a refresh retired, or an export older than this agent gone).
            raise RetryLater(f"hosts of {served.key} do not all write through its newest chain yet "
                             "(a resize is not finished); copy it after")
        copy = Copy(id=copy_id, gen=chain.gen, target=str(target), size=size)
        new = served.chain(chain.gen) is None
        if new:
            served.chains.append(chain)
        served.copies.append(copy)
        self._book.desired()[served.key] = served
        job, target_node, filter_node = copy_names(copy_id)

        def undo() -> None:
            served.copies.remove(copy)
            try:
                self._chains.del_nodes((target_node,), live)
                self._chains.collect(served, live)
            except DriverError as exc:
                log.error("could not undo the start of copy %s: %s", copy_id, exc.message)

        with self._book.first(undo):  # recorded before the job starts: a daemon restart is then an error
            self._chains.open_chain(served, chain, live)
            self._chains.del_nodes((target_node,), live)  # the leftover of an interrupted start
            # Written through the page cache: the job writes chunks of at most 1 MiB, and each O_DIRECT
            # write waits for the disk (a 1 GiB copy: 530-570 MB/s direct, 680-830 buffered).
            # The backend's finishing pass fsyncs the file before it is published, and QEMU flushes
            # the node as it closes it.
            self._chains.add_file_node(target_node, str(target), read_only=False, what=copy_id, buffered=True)
            live.nodes[target_node] = size
            backup: dict[str, Any] = {"job-id": job, "device": chain.top(), "target": target_node,
                                      "sync": "full", "auto-dismiss": False, "filter-node-name": filter_node}
            if self.copy_speed:
                backup["speed"] = self.copy_speed
            self._monitor.q("blockdev-backup", backup)
            live.jobs[job] = Job(status="created", error=None, done=0, total=size)
            live.nodes[filter_node] = size
            self._book.save()  # with the size of a new chain
        log.info("copying %s into %s at one instant (copy %s)", served.key, target, copy_id)
        return served, copy

    def status(self, served: Served, copy: Copy, live: Live) -> ItemStatus:
        if copy.outcome == "copying":
            job = live.jobs.get(copy_names(copy.id)[0])
            if job is not None and job.status != "concluded":
                return ItemStatus(state="copying", size_bytes=copy.size, progress=job.percent())
            succeeded = job is not None and not job.error
            if succeeded:
                self._flush_target(copy)  # before the outcome: a failed flush is asked again next time
            copy.outcome = "ready" if succeeded else "error"
            copy.error = (job.error or None) if job is not None else INTERRUPTED
            self._book.save()  # the outcome first: the job that tells it goes next
            log.info("copy %s of %s: %s%s", copy.id, served.key, copy.outcome, f" ({copy.error})" if copy.error else "")
        self.end(copy.id, live)
        if self._chains.collect(served, live):
            self._book.save()
        return ItemStatus(state=copy.outcome, size_bytes=copy.size, progress=100 if copy.outcome == "ready" else 0,
                          error=copy.error)

    @staticmethod
    def _flush_target(copy: Copy) -> None:
        """The target was written through the page cache: durable before the copy is called ready."""
        try:
            fsync_path(copy.target)
        except OSError as exc:
            raise DriverError(f"copy {copy.id}: cannot flush {copy.target}: {exc.strerror}") from exc

    def end(self, copy_id: str, live: Live) -> None:
        """Cancel the copy's job if it runs, dismiss it and close its target node."""
        job_id, target_node, _ = copy_names(copy_id)
        job = live.jobs.get(job_id)
        if job is not None:
            if job.status != "concluded":
                self._cancel(job_id)
            self._monitor.q("job-dismiss", {"id": job_id})
            del live.jobs[job_id]
            live.nodes = self._monitor.live_nodes()  # its filter is gone
        self._chains.del_nodes((target_node,), live)

    def _cancel(self, job_id: str) -> None:
        qmp = self._monitor.connected()
        mark = qmp.event_mark()
        try:
            self._monitor.q("job-cancel", {"id": job_id})
        except QmpCommandError as exc:
            log.info("cancelling %s: %s", job_id, exc.desc)  # it concluded meanwhile
            return
        try:
            qmp.wait_event("JOB_STATUS_CHANGE", lambda e: e.get("data", {}).get("id") == job_id
                           and e["data"].get("status") == "concluded", since=mark, timeout=self._monitor.timeout)
        except QmpConnectionError:
            self._wait_job_concluded(job_id)  # event lost (reconnect): the daemon's state decides

    def _wait_job_concluded(self, job_id: str) -> None:
        timeout = self._monitor.timeout
        deadline = time.monotonic() + timeout
        while any(j["id"] == job_id and j["status"] != "concluded" for j in self._monitor.q("query-jobs")):
            if time.monotonic() >= deadline:
                raise DriverError(f"copy job {job_id} still running {timeout:g}s after its cancel")
            time.sleep(0.05)
