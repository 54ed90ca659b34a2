"""How the ``rbd`` backend asks Ceph: the ``rbd`` and ``ceph`` tools run as child processes with
timeouts, and their JSON answers parsed into what the backend reads (the pool's listing, its fsid,
its capacity).

Why the ``rbd`` and ``ceph`` command-line tools and not the python3-rbd bindings: a librbd or
librados call can block for ever (a mon or OSD that does not answer; Cinder wraps every call in a
thread with a timeout and still leaks the thread), and a hung call holds the GIL-free C library
inside the agent. A child process run with a timeout is killed when it overruns, and nothing of it
stays in the agent; ``--format json`` gives typed answers. The cost, a process start plus a cephx
session per call (50-170 ms on a loaded machine), is why the calls of the snapshot path go to one
long-lived child that holds the bindings (``rbd_worker``): the same timeouts, the same answers, the
tool as its fallback. The tools get an argv list (no shell), a minimal
environment, the cluster's ``ceph.conf`` and the cephx user name: the key is read by the tool from
the keyring file the conf names and never appears on an argv or in a log.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vbs import ids
from vbs.errors import DriverError
from vbs.storage.backends.rbd_chains import TrashEntry, parse_parent, parse_snaps, parse_trash, volume_of
from vbs.storage.backends.rbd_worker import SYSTEM_PYTHON, RbdWorker, WorkerError
from vbs.system.processes import minimal_environment
from vbs.wire.storage import MAX_CHAIN_DEPTH

__all__ = ["RbdTools", "ToolError", "Listing", "parse_listing", "parse_pool_stats", "parse_fsid"]

COMMAND_TIMEOUT_S = 60.0
_FSID_RE = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
# What the rbd tool exits with (the errno of the failed call).
ENOENT, EBUSY, EEXIST, EINVAL, ENOTEMPTY = 2, 16, 17, 22, 39


@dataclass
class Listing:
    """What ``rbd ls -l`` (and the trash) say of a pool: volume sizes, each snapshot's image and
    size, the images renamed ``vbs-retired-…``, the trashed images by name, and who is whose clone."""

    volumes: dict[str, int] = field(default_factory=dict)
    snapshots: dict[str, tuple[str, int]] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)
    trash: dict[str, TrashEntry] = field(default_factory=dict)
    parents: dict[str, tuple[str, str]] = field(default_factory=dict)

    def chain(self, image: str) -> list[str]:
        """The parents of ``image``, nearest first, as ``image@snapshot``."""
        links: list[str] = []
        while image in self.parents and len(links) < MAX_CHAIN_DEPTH:
            image, snap = self.parents[image]
            links.append(f"{image}@{snap}")
        return links

    def depth(self, image: str) -> int:
        """How many clones deep ``image`` is (0: not a clone)."""
        return len(self.chain(image))

    def has_clones(self, image: str) -> bool:
        """Whether a clone (live or trashed) reads from a snapshot of ``image``."""
        return any(parent == image for parent, _ in self.parents.values())

    def add_trashed(self, entry: TrashEntry) -> None:
        self.trash[entry.name] = entry
        if entry.parent is not None:
            self.parents[entry.name] = entry.parent
        for snap in entry.live_snapshots:
            if ids.is_valid("snapshot", snap.name):
                self.snapshots[snap.name] = (entry.name, snap.size)


def parse_listing(text: str) -> Listing:
    """``rbd ls -l --format json`` of a pool. Entries that are not VBS's (other names) are skipped."""
    listing = Listing()
    entries = json.loads(text or "[]")
    if not isinstance(entries, list):
        raise DriverError("rbd ls: unexpected answer")
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        image, size, snap = entry.get("image"), entry.get("size"), entry.get("snapshot")
        if not isinstance(image, str) or not isinstance(size, int):
            continue
        volume = volume_of(image)
        if volume is None:
            continue
        if snap is None:
            if image == volume:
                listing.volumes[volume] = size
            else:
                listing.retired.add(image)
            parent = parse_parent(entry)
            if parent is not None:
                listing.parents[image] = parent[:2]
        elif ids.is_valid("snapshot", snap):
            listing.snapshots[snap] = (image, size)
    return listing


def parse_fsid(text: str) -> str:
    """``ceph fsid --format json``: the cluster's fsid (a UUID)."""
    answer = json.loads(text)
    fsid = answer.get("fsid") if isinstance(answer, dict) else None
    if not isinstance(fsid, str) or not re.fullmatch(_FSID_RE, fsid):
        raise DriverError("ceph fsid: unexpected answer")
    return fsid


def parse_pool_stats(text: str, pool: str) -> tuple[int, int]:
    """``ceph df --format json``: the (capacity, free) bytes of ``pool``, after its replication."""
    answer = json.loads(text)
    for entry in answer.get("pools", []) if isinstance(answer, dict) else []:
        if isinstance(entry, dict) and entry.get("name") == pool:
            stats = entry.get("stats", {})
            stored, free = stats.get("stored", 0), stats.get("max_avail", 0)
            if isinstance(stored, int) and isinstance(free, int) and stored >= 0 and free >= 0:
                return stored + free, free
    raise DriverError(f"ceph df does not list the pool {pool!r}")


class ToolError(DriverError):
    """A tool exited non-zero; ``errno`` is its exit status (the errno of the failed call)."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno


class RbdTools:
    """The tools against one Ceph pool, as one cephx user, each call bounded by ``timeout_s``."""

    def __init__(self, name: str, ceph_conf: Path, ceph_user: str, rbd_pool: str, timeout_s: float, *,
                 worker: bool = True, worker_python: Path = SYSTEM_PYTHON) -> None:
        self.name, self.ceph_conf, self.ceph_user, self.rbd_pool = name, ceph_conf, ceph_user, rbd_pool
        self.timeout_s = timeout_s
        # The snapshot path's calls, through one long-lived child (``rbd_worker``); None: the tool only.
        self.worker = RbdWorker(name, ceph_conf, ceph_user, rbd_pool, timeout_s, worker_python) if worker else None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def argv(self, tool: str, *args: str) -> list[str]:
        t = int(self.timeout_s)
        return [tool, "--conf", str(self.ceph_conf), "--id", self.ceph_user,
                "--rados-mon-op-timeout", str(t), "--rados-osd-op-timeout", str(t),
                "--client-mount-timeout", str(t), *args]

    def tool(self, tool: str, *args: str, timeout_s: float | None = None) -> str:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            proc = subprocess.run(self.argv(tool, *args), env=minimal_environment(),  # noqa: S603
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit + 5)
        except subprocess.TimeoutExpired:
            raise DriverError(f"pool {self.name}: {tool} {args[0]} did not answer within {limit:g}s") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [""])[-1][:500]
            raise ToolError(f"pool {self.name}: {tool} {args[0]} failed: {last}", proc.returncode)
        return proc.stdout

    def rbd(self, *args: str, timeout_s: float | None = None) -> str:
        if self.worker is not None and timeout_s is None:
            try:
                out = self.worker.call(args)
            except WorkerError as exc:
                raise ToolError(exc.message, exc.errno) from None
            if out is not None:
                return out
        return self.tool("rbd", *args, timeout_s=timeout_s)  # progress goes to stderr, which only an error shows

    def rbd_tolerant(self, *args: str, tolerate: tuple[int, ...]) -> None:
        """An rbd call whose failure with one of the errnos ``tolerate`` means it needs doing no more."""
        try:
            self.rbd(*args)
        except ToolError as exc:
            if exc.errno not in tolerate:
                raise

    def spec(self, image: str, snap: str | None = None) -> str:
        return f"{self.rbd_pool}/{image}" + (f"@{snap}" if snap else "")

    def by_id(self, image_id: str) -> tuple[str, ...]:
        """A trashed image, which has no name: its pool and id."""
        return ("--pool", self.rbd_pool, "--image-id", image_id)

    def info(self, *image: str) -> dict[str, Any] | None:
        """``rbd info`` of an image (a spec, or ``by_id``), or None if it is absent."""
        try:
            info = json.loads(self.rbd("info", "--format", "json", *image))
        except ToolError as exc:
            if exc.errno == ENOENT:
                return None
            raise
        if not isinstance(info, dict) or not isinstance(info.get("size"), int):
            raise DriverError(f"pool {self.name}: rbd info {image[-1]}: no size")
        return info

    def image_size(self, image: str) -> int | None:
        """The size of a named image, or None if it is absent."""
        info = self.info(self.spec(image))
        return None if info is None else int(info["size"])

    def listing(self) -> Listing:
        listing = parse_listing(self.rbd("ls", "-l", "--format", "json", self.rbd_pool))
        for entry in parse_trash(self.rbd("trash", "ls", "--all", "--format", "json", self.rbd_pool)):
            try:
                entry.snaps = parse_snaps(self.rbd("snap", "ls", "--all", "--format", "json", *self.by_id(entry.id)))
                info = self.info(*self.by_id(entry.id))
            except ToolError as exc:
                if exc.errno != ENOENT:
                    raise
                continue  # purged meanwhile
            if info is None:
                continue
            entry.size = info["size"]
            parent = parse_parent(info)
            entry.parent = None if parent is None else parent[:2]
            listing.add_trashed(entry)
        return listing
