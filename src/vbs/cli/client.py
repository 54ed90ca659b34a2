"""The CLI's connection to a controller, and waiting for long work with a progress bar."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vbs.api_client import ApiClient

Body = dict[str, Any]


def watch(fetch: Callable[[], Body], *, done: Callable[[Body], bool], progress: Callable[[Body], int | None],
          label: str, show: bool, interval: float = 0.2, first: Body | None = None) -> Body:
    """Call ``fetch`` until ``done``; on a terminal (``show``), a bar of ``progress`` (0-100, or None while
    unknown) with the time spent. What ``fetch`` answered last."""
    body = first if first is not None else fetch()
    if done(body) and not show:
        return body
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    # Work that finished already still shows its (full) bar: every --wait on a terminal looks the same.
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  disable=not show, transient=False) as bar:
        task = bar.add_task(label, total=100)
        while not done(body):
            bar.update(task, completed=progress(body) or 0)
            time.sleep(interval)
            body = fetch()
        bar.update(task, completed=progress(body) or 0)
    return body


def wait_for(client: ApiClient, path: str, *, busy: set[str], label: str, show: bool,
             interval: float = 0.25) -> Body:
    """Poll a volume or snapshot at ``path`` until its status leaves ``busy``, with its progress."""
    return watch(lambda: client.call("GET", path), done=lambda b: b["status"] not in busy,
                 progress=lambda b: 100 if b["status"] not in busy | {"error"} else b.get("progress", 0),
                 label=label, show=show, interval=interval)


def step_progress(operation: Body) -> int:
    """How far an operation is, by its steps done (its resource has no progress of its own)."""
    steps = operation.get("steps") or []
    if not steps:
        return 0
    return 100 * sum(1 for s in steps if s["state"] in ("done", "skipped")) // len(steps)


def wait_operation(client: ApiClient, operation_id: str, *, label: str, show: bool) -> Body:
    """Poll an operation until it ends, with a bar of its steps."""
    return watch(lambda: client.call("GET", f"/v1/operations/{operation_id}"),
                 done=lambda op: op["status"] not in ("running", "rolling-back"), progress=step_progress,
                 label=label, show=show)
