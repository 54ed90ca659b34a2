"""What the rbd backend reads of Ceph's trash and clone chains, and its background flattens.

Ceph 16 with clone v2 (the cluster requires mimic clients): ``rbd snap rm`` of a snapshot that has
clones moves it to the image's ``trash`` snapshot namespace (renamed to a UUID), and Ceph removes it
by itself when its last clone is removed or flattened. ``rbd trash mv`` takes an image with
snapshots too; a trashed image is reached by its id (``--image-id``: ``snap ls``, ``snap rm``,
``info``), not by name, so a clone of one of its snapshots needs it restored under a name first.

A flatten (``rbd flatten``) copies every block a clone still reads from its parents into the clone
itself, cutting it from the chain. It runs as a child process whose stderr says how far it is
(``\\rImage flatten: 37% complete...``); at most ``max_running`` run at once, the rest wait in
order. An interrupted flatten (agent stop, volume deleted) keeps what it copied: the next one
resumes. ``prepare`` runs before each flatten and ``finish`` after it, whatever its end: the backend
switches the image's object map off and on again around it (librbd marks an object as existing
before its copy-up writes it, and a flatten skips the objects the map marks, so after an interrupted
copy-up a flatten with the map on would leave a hole that reads as zeros once the parent is cut).
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from vbs import ids
from vbs.errors import DriverError
from vbs.system.processes import minimal_environment, stop_child
from vbs.wire.storage import FlattenProgress

__all__ = ["RETIRED_PREFIX", "TrashEntry", "Snap", "parse_trash", "parse_snaps", "parse_parent",
           "parse_flatten_progress", "parse_watchers", "volume_of", "Flattener"]

log = logging.getLogger(__name__)

RETIRED_PREFIX = "vbs-retired-"
IMAGE_ID_RE = re.compile(r"[0-9a-f]{1,64}")
_PROGRESS_RE = re.compile(rb"(\d{1,3})% complete")
STOP_TIMEOUT_S = 10.0


def volume_of(image: str) -> str | None:
    """The volume an image of VBS holds (``vol-…``, or ``vbs-retired-vol-…`` of a deleted one)."""
    volume = image.removeprefix(RETIRED_PREFIX)
    return volume if ids.is_valid("volume", volume) else None


@dataclass
class Snap:
    """One snapshot of an image: its name (a UUID in the trash namespace) and size."""

    name: str
    size: int
    trashed: bool


@dataclass
class TrashEntry:
    """An image of VBS in Ceph's trash, and what keeps it there."""

    id: str
    name: str
    snaps: list[Snap] = field(default_factory=list)
    size: int = 0
    parent: tuple[str, str] | None = None  # (image, snapshot) it was cloned from

    @property
    def live_snapshots(self) -> list[Snap]:
        return [s for s in self.snaps if not s.trashed]

    @property
    def kept_for(self) -> Literal["snapshots", "children", "nothing"]:
        """``snapshots``: VBS snapshots of it are live; ``children``: only deleted snapshots that
        clones still read from; ``nothing``: the purge removes it."""
        if self.live_snapshots:
            return "snapshots"
        return "children" if self.snaps else "nothing"


def _json_list(text: str, what: str) -> list[Any]:
    answer = json.loads(text or "[]")
    if not isinstance(answer, list):
        raise DriverError(f"{what}: unexpected answer")
    return answer


def parse_trash(text: str) -> list[TrashEntry]:
    """``rbd trash ls --all --format json``: the entries whose name is a VBS image's."""
    out = []
    for entry in _json_list(text, "rbd trash ls"):
        if not isinstance(entry, dict):
            continue
        image_id, name = entry.get("id"), entry.get("name")
        if isinstance(image_id, str) and IMAGE_ID_RE.fullmatch(image_id) and isinstance(name, str) \
                and volume_of(name) is not None:
            out.append(TrashEntry(id=image_id, name=name))
    return out


def parse_snaps(text: str) -> list[Snap]:
    """``rbd snap ls --all --format json``: user snapshots and those in the trash namespace (others,
    such as mirroring's, are not VBS's and are skipped)."""
    out = []
    for entry in _json_list(text, "rbd snap ls"):
        if not isinstance(entry, dict):
            continue
        name, size = entry.get("name"), entry.get("size")
        ns = entry.get("namespace")
        kind = ns.get("type") if isinstance(ns, dict) else "user"
        if isinstance(name, str) and isinstance(size, int) and kind in ("user", "trash"):
            out.append(Snap(name=name, size=size, trashed=kind == "trash"))
    return out


def parse_parent(info: dict[str, Any]) -> tuple[str, str, str | None] | None:
    """The ``parent`` of ``rbd info --format json``: (image, snapshot, image id if it is trashed)."""
    parent = info.get("parent")
    if not isinstance(parent, dict):
        return None
    image, snap, image_id = parent.get("image"), parent.get("snapshot"), parent.get("id")
    if not isinstance(image, str) or not isinstance(snap, str):
        return None
    trashed = parent.get("trash") is True and isinstance(image_id, str) and IMAGE_ID_RE.fullmatch(image_id)
    return image, snap, image_id if trashed else None


def parse_watchers(text: str) -> int:
    """``rbd status --format json``: how many clients have the image open (watch it)."""
    answer = json.loads(text or "{}")
    watchers = answer.get("watchers") if isinstance(answer, dict) else None
    if not isinstance(watchers, list):
        raise DriverError("rbd status: unexpected answer")
    return len(watchers)


def parse_flatten_progress(stderr: bytes) -> int | None:
    """The last percentage ``rbd flatten`` wrote to its stderr (None before the first)."""
    found = _PROGRESS_RE.findall(stderr)
    return min(100, int(found[-1])) if found else None


@dataclass
class _Job:
    volume: str
    progress: int = 0
    proc: subprocess.Popen[bytes] | None = None
    cancelled: bool = False


class Flattener:
    """Background ``rbd flatten`` of volumes, at most ``max_running`` at once, queued in order.

    ``argv(volume)`` is the flatten's command line; ``should_run(volume)`` is asked just before one
    starts (a chain may have become short enough meanwhile); ``prepare(volume)``, if given, runs after
    it and before the flatten, and ``finish(volume)`` after the flatten however it ended (also when
    ``prepare`` failed half-way); ``done(volume, ok)`` is told when one ends. ``peak`` is the most
    ``rbd flatten`` processes that ever ran at once (what the tests check, not a timing).
    """

    def __init__(self, argv: Callable[[str], list[str]], *, max_running: int, stall_s: float,
                 should_run: Callable[[str], bool], done: Callable[[str, bool], None],
                 prepare: Callable[[str], None] | None = None,
                 finish: Callable[[str], None] | None = None) -> None:
        if max_running < 1:
            raise DriverError("max_running must be at least 1")
        self._argv = argv
        self.max_running = max_running
        self._stall_s = stall_s
        self._should_run = should_run
        self._prepare = prepare
        self._finish = finish
        self._done = done
        self._cond = threading.Condition()
        self._queued: dict[str, _Job] = {}
        self._running: dict[str, _Job] = {}
        self._threads: dict[str, threading.Thread] = {}
        self.peak = 0
        self._processes = 0
        self.completed: list[str] = []
        self._closed = False

    def submit(self, volume: str) -> None:
        """Flatten ``volume`` when a slot is free (nothing if it is queued or running already)."""
        with self._cond:
            if self._closed or volume in self._queued or volume in self._running:
                return
            self._queued[volume] = _Job(volume)
            self._dispatch()

    def progress(self, volume: str) -> int | None:
        """How far ``volume``'s flatten is (0 while queued), or None if none is pending."""
        with self._cond:
            job = self._running.get(volume) or self._queued.get(volume)
            return None if job is None else job.progress

    def report(self) -> list[FlattenProgress]:
        with self._cond:
            return ([FlattenProgress(volume_id=j.volume, state="running", progress=j.progress)
                     for j in self._running.values()]
                    + [FlattenProgress(volume_id=j.volume, state="queued", progress=0) for j in self._queued.values()])

    def cancel(self, volume: str) -> None:
        """Stop ``volume``'s flatten (or take it off the queue) and wait until its process is gone."""
        with self._cond:
            self._queued.pop(volume, None)
            job = self._running.get(volume)
            thread = self._threads.get(volume)
            if job is None:
                return
            job.cancelled = True
            proc = job.proc
            log.info("flatten of %s: cancelling", volume)
        if proc is not None:
            stop_child(proc, timeout=STOP_TIMEOUT_S, what="rbd flatten")
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def close(self) -> None:
        """Stop every flatten; what they copied stays, and the next start resumes them."""
        with self._cond:
            self._closed = True
            self._queued.clear()
            running = list(self._running)
        for volume in running:
            self.cancel(volume)

    def wait_idle(self, timeout: float) -> bool:
        """Whether every flatten ended within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued and not self._running, timeout)

    # -- inside ------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Start queued jobs while slots are free (the caller holds the condition)."""
        while self._queued and len(self._running) < self.max_running and not self._closed:
            volume = next(iter(self._queued))
            job = self._queued.pop(volume)
            self._running[volume] = job
            thread = threading.Thread(target=self._run, args=(job,), name=f"flatten-{volume}", daemon=True)
            self._threads[volume] = thread
            thread.start()
        self._cond.notify_all()

    def _run(self, job: _Job) -> None:
        ok = False
        try:
            if self._should_run(job.volume) and not job.cancelled:
                try:
                    if self._prepare is not None:
                        self._prepare(job.volume)
                    ok = self._flatten(job)
                finally:
                    self._finished(job.volume)
        except Exception:  # noqa: BLE001 - a failed flatten is retried by the next scan; the agent goes on
            log.exception("flatten of %s failed", job.volume)
        finally:
            with self._cond:
                self._running.pop(job.volume, None)
                self._threads.pop(job.volume, None)
                if ok:
                    self.completed.append(job.volume)
                self._dispatch()
            if not job.cancelled:
                self._done(job.volume, ok)

    def _finished(self, volume: str) -> None:
        """``finish``; its failure is logged and does not undo a flatten that completed."""
        if self._finish is None:
            return
        try:
            self._finish(volume)
        except Exception:  # noqa: BLE001 - logged; the flatten's own outcome stands
            log.exception("after the flatten of %s", volume)

    def _flatten(self, job: _Job) -> bool:
        with self._cond:
            if job.cancelled:
                return False
            proc = subprocess.Popen(self._argv(job.volume), env=minimal_environment(),  # noqa: S603
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            job.proc = proc
            log.info("flatten of %s started", job.volume)
            self._processes += 1
            self.peak = max(self.peak, self._processes)
        try:
            return self._follow(job, proc)
        finally:
            with self._cond:
                self._processes -= 1

    def _follow(self, job: _Job, proc: subprocess.Popen[bytes]) -> bool:
        """Read the flatten's progress until it ends: whether it completed."""
        assert proc.stderr is not None
        tail = b""
        while True:
            ready, _, _ = select.select([proc.stderr], [], [], self._stall_s)
            if not ready:  # no word for too long: stop it; the next scan starts it again
                log.warning("flatten of %s made no progress for %gs; stopped", job.volume, self._stall_s)
                stop_child(proc, timeout=STOP_TIMEOUT_S, what="rbd flatten")
                return False
            chunk = os.read(proc.stderr.fileno(), 65536)  # unbuffered: nothing waits unseen behind select
            if not chunk:
                break
            tail = (tail + chunk)[-512:]
            pct = parse_flatten_progress(tail)
            if pct is not None:
                with self._cond:
                    job.progress = min(pct, 99)
        rc = proc.wait()
        log.info("flatten of %s ended (exit %d%s)", job.volume, rc, ", cancelled" if job.cancelled else "")
        if rc != 0 and not job.cancelled:
            last = (tail.decode(errors="replace").replace("\r", "\n").strip().splitlines() or [""])[-1][:300]
            log.warning("flatten of %s failed (%d): %s", job.volume, rc, last)
        return rc == 0 and not job.cancelled
