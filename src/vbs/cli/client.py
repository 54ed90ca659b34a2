"""The CLI's connection to a controller, and waiting for long work with a progress bar.

A wait asks the controller to answer once the work is done (a long-poll, ``GET …?wait=N``) rather than
polling: the answer comes as soon as the operation ends, not at the next tick of a loop. An older
controller that refuses the parameter (4xx) is polled as before; one that ignores it answers at
once, and ``watch`` keeps its old pace then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vbs.errors import VbsError

if TYPE_CHECKING:
    from vbs.net.api_client import ApiClient

Body = dict[str, Any]

# How long one long-poll may wait on the server: without a bar, long (one request per operation); with
# a bar, a second (the bar moves with each answer).
LONG_POLL_S = 30
BAR_POLL_S = 1
HTTP_MARGIN_S = 10.0  # the HTTP timeout of a long-poll: its wait, and this much for the answer to come


class LongPoll:
    """A GET of ``path`` that waits on the controller until it is settled (``?wait=``); after a 4xx
    to the parameter (an older controller), plain GETs from then on."""

    def __init__(self, client: ApiClient, path: str, *, show: bool) -> None:
        self.client = client
        self.path = path
        self.wait_s = BAR_POLL_S if show else LONG_POLL_S
        self.supported = True

    def __call__(self) -> Body:
        if self.supported:
            try:
                answer: Body = self.client.call("GET", self.path, params={"wait": str(self.wait_s)},
                                                timeout=self.wait_s + HTTP_MARGIN_S)
                return answer
            except VbsError as exc:
                if exc.status not in (400, 422):
                    raise
                self.supported = False
        plain: Body = self.client.call("GET", self.path)
        return plain


def watch(fetch: Callable[[], Body], *, done: Callable[[Body], bool], progress: Callable[[Body], int | None],
          label: str, show: bool, interval: float = 0.2, first: Body | None = None) -> Body:
    """Call ``fetch`` until ``done``; on a terminal (``show``), a bar of ``progress`` (0-100, or None while
    unknown) with the time spent. What ``fetch`` answered last."""
    body = first if first is not None else fetch()
    answered = time.monotonic()
    if done(body) and not show:
        return body
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    # Work that finished already still shows its (full) bar: every --wait on a terminal looks the same.
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  disable=not show, transient=False) as bar:
        task = bar.add_task(label, total=100)
        while not done(body):
            bar.update(task, completed=progress(body) or 0)
            # A long-poll that ran its wait asks again at once; a plain GET keeps the polling pace.
            time.sleep(max(0.0, interval - (time.monotonic() - answered)))
            body = fetch()
            answered = time.monotonic()
        bar.update(task, completed=progress(body) or 0)
    return body


def wait_for(client: ApiClient, path: str, *, busy: set[str], label: str, show: bool,
             interval: float = 0.25) -> Body:
    """Wait until the volume or snapshot at ``path`` leaves ``busy`` (its progress on the bar)."""
    return watch(LongPoll(client, path, show=show), done=lambda b: b["status"] not in busy,
                 progress=lambda b: 100 if b["status"] not in busy | {"error"} else b.get("progress", 0),
                 label=label, show=show, interval=interval)


def wait_gone(client: ApiClient, path: str, first: Body, *, label: str, show: bool) -> Body:
    """Wait until the resource at ``path`` (answered ``first`` to its DELETE) is deleted: a resource
    whose GET answers 404 once it is gone ends ``deleted``."""
    poll = LongPoll(client, path, show=show)

    def fetch() -> Body:
        try:
            return poll()
        except VbsError as exc:
            if exc.status != 404:
                raise
            return {**first, "status": "deleted"}

    return watch(fetch, done=lambda b: b["status"] != "deleting",
                 progress=lambda b: 0 if b["status"] == "deleting" else 100, label=label, show=show)


def step_progress(operation: Body) -> int:
    """How far an operation is, by its steps done (its resource has no progress of its own)."""
    steps = operation.get("steps") or []
    if not steps:
        return 0
    return 100 * sum(1 for s in steps if s["state"] in ("done", "skipped")) // len(steps)


def wait_operation(client: ApiClient, operation_id: str, *, label: str, show: bool) -> Body:
    """Wait until an operation ends, with a bar of its steps."""
    return watch(LongPoll(client, f"/v1/operations/{operation_id}", show=show),
                 done=lambda op: op["status"] not in ("running", "rolling-back"), progress=step_progress,
                 label=label, show=show)
