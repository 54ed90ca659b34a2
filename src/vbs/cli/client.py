"""The CLI's connection to a controller, and waiting for long work with a progress bar."""

from __future__ import annotations

import time
from typing import Any

from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from vbs.web import ApiClient


def wait_for(client: ApiClient, path: str, *, busy: set[str], label: str, show: bool,
             interval: float = 0.25) -> dict[str, Any]:
    """Poll ``path`` until its status leaves ``busy``; show a progress bar on a terminal."""
    body: dict[str, Any] = client.call("GET", path)
    if body["status"] not in busy:
        return body
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  disable=not show, transient=False) as bar:
        task = bar.add_task(label, total=100)
        while body["status"] in busy:
            bar.update(task, completed=body.get("progress", 0))
            time.sleep(interval)
            body = client.call("GET", path)
        bar.update(task, completed=100 if body["status"] not in ("error",) else body.get("progress", 0))
    return body
