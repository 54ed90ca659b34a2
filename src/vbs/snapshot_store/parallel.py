"""Many store calls at once: the store's latency, not its bandwidth, bounds one call at a time.

Hashing (hashlib), compression (zstandard), ``os.pread``/``os.pwrite`` and the store's I/O all
release the GIL, so threads give real parallelism here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["bounded_map"]

T = TypeVar("T")
R = TypeVar("R")


def bounded_map(fn: Callable[[T], R], items: Iterable[T], parallel: int) -> Iterator[R]:
    """``fn`` over ``items`` in ``parallel`` threads, at most ``2 * parallel`` items in memory; results
    in completion order. The first error cancels what has not started and is raised."""
    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="snapshot-store") as pool:
        running: set[Future[R]] = set()
        source = iter(items)
        try:
            for item in source:
                running.add(pool.submit(fn, item))
                if len(running) >= 2 * parallel:
                    done, running = _settle(running)
                    yield from (f.result() for f in done)
            while running:
                done, running = _settle(running)
                yield from (f.result() for f in done)
        finally:
            for f in running:
                f.cancel()


def _settle(running: set[Future[R]]) -> tuple[set[Future[R]], set[Future[R]]]:
    done, pending = wait(running, return_when=FIRST_COMPLETED)
    return set(done), set(pending)
