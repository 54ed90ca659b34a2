"""Fencing tokens between controllers and agents (docs/architecture.md §6).

Every operation has a fence: a number from one counter in the metadata DB that grows each time a
controller takes the operation (at its start, and again when another controller adopts it after
its lease expired). While a controller runs an operation, every agent call it makes carries
``X-VBS-Fence: <resource id> <fence>`` (set here with ``fenced()``; ``vbs.net.web.ApiClient`` sends it).
An agent remembers the highest fence it saw per resource (``FenceBook``) and refuses a lower one
with ``StaleFence``: a controller that was paused past its lease and wakes up cannot undo what the
operation's new owner did there. The controller's own DB writes for the operation are conditional on
its owner and fence as well (``vbs.controller.workflows.engine``).

A controller that cannot renew its leases (cut from the database) may already have lost its operations
without any agent having heard of the new owner yet: ``fenced(..., held=…)`` makes every agent call of
the block first ask whether this controller still holds its leases, and ``current()`` raises
``LeaseLost`` instead of a header when it does not, so the call is never sent.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from vbs.errors import InvalidParameter, LeaseLost, StaleFence

__all__ = ["FENCE_HEADER", "FenceBook", "current", "fenced", "parse"]

log = logging.getLogger(__name__)

FENCE_HEADER = "x-vbs-fence"
MAX_FENCE = (1 << 63) - 1
_VALUE = re.compile(r"([a-z]{1,8}-[0-9a-f]{8,32}) ([0-9]{1,19})")
# How long an agent remembers a resource's fence after it last saw it, and how many it keeps: a
# controller paused longer than this is also stopped by its conditional DB writes.
KEEP_S = 7 * 86400
KEEP_MAX = 200_000
COMPACT_EVERY_S = 86400.0

_current: ContextVar[tuple[str, int, Callable[[], bool] | None] | None] = ContextVar("vbs_fence", default=None)


@contextmanager
def fenced(resource_id: str, fence: int, held: Callable[[], bool] | None = None) -> Iterator[None]:
    """Agent calls made in this block (this thread) carry ``resource_id``'s fence; with ``held``, each is
    made only while ``held()`` says the caller still holds its lease."""
    token = _current.set((resource_id, fence, held))
    try:
        yield
    finally:
        _current.reset(token)


def current() -> str | None:
    """The header value for the calls being made now, if they run under a fence; ``LeaseLost`` if the
    caller no longer holds its lease (the call must not be made)."""
    value = _current.get()
    if value is None:
        return None
    resource_id, fence, held = value
    if held is not None and not held():
        raise LeaseLost(f"{resource_id}: this controller could not renew its leases in time; it makes no "
                        "agent call until it can (another controller may own the operation by now)")
    return f"{resource_id} {fence}"


def parse(value: str) -> tuple[str, int]:
    m = _VALUE.fullmatch(value)
    if m is None or int(m.group(2)) > MAX_FENCE:
        raise InvalidParameter("malformed fencing header")
    return m.group(1), int(m.group(2))


class FenceBook:
    """The highest fence an agent saw per resource; kept in ``path`` (0600) when one is given, so an
    agent restart does not forget it.

    The file is a log, one ``<resource> <fence> <time>`` line per new highest fence, appended and
    fsynced (a call's cost does not grow with the number of resources); it is rewritten with only
    the live entries once it holds more than twice as many lines as there are entries, once it holds
    more than ``KEEP_MAX`` entries, and at least daily (entries older than ``KEEP_S`` go then)."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, float]] = {}
        self._lines = 0
        self._compacted_at = time.time()
        if path is not None and path.exists():
            try:
                self._load(path.read_text())
            except (OSError, UnicodeDecodeError) as exc:
                # Forgetting is safe only because the controllers' DB writes are fenced too.
                log.warning("fence book %s unreadable (%s): starting empty", path, type(exc).__name__)

    def _load(self, text: str) -> None:
        bad = 0
        for line in text.splitlines():
            self._lines += 1
            parts = line.split(" ")
            try:
                resource, fence = parse(f"{parts[0]} {parts[1]}")
                at = float(parts[2])
            except (InvalidParameter, IndexError, ValueError):
                bad += 1
                continue
            seen = self._seen.get(resource)
            if seen is None or fence >= seen[0]:
                self._seen[resource] = (fence, max(at, seen[1]) if seen else at)
        if bad:
            log.warning("fence book %s: %d unreadable lines skipped", self._path, bad)

    def admit(self, header_value: str) -> None:
        """Accept a call carrying ``header_value`` or raise ``StaleFence`` (``InvalidParameter`` if
        it is malformed)."""
        resource, fence = parse(header_value)
        with self._lock:
            seen = self._seen.get(resource)
            if seen is not None and fence < seen[0]:
                raise StaleFence(f"{resource}: fence {fence} is older than {seen[0]}; the operation has a new "
                                 "owner", resource=resource)
            now = time.time()
            changed = seen is None or fence > seen[0]
            self._seen[resource] = (fence, now)
            if changed:
                self._record(resource, fence, now)

    def _record(self, resource: str, fence: int, now: float) -> None:
        if self._path is None:
            return
        if (self._lines >= 2 * len(self._seen) + 1000 or len(self._seen) > KEEP_MAX
                or now - self._compacted_at > COMPACT_EVERY_S):
            self._compact(now)
            return
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, f"{resource} {fence} {now:.3f}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self._lines += 1

    def _compact(self, now: float) -> None:
        """Rewrite the file with the entries seen within ``KEEP_S``, at most ``KEEP_MAX`` of them."""
        assert self._path is not None
        keep = sorted(self._seen.items(), key=lambda kv: kv[1][1], reverse=True)[:KEEP_MAX]
        self._seen = {k: v for k, v in keep if v[1] >= now - KEEP_S}
        tmp = self._path.with_name(self._path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{k} {v[0]} {v[1]:.3f}\n" for k, v in self._seen.items())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)
        self._lines = len(self._seen)
        self._compacted_at = now
