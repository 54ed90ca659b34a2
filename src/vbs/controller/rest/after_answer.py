"""Work a request hands on, started once the request's answer is sent.

A create, snapshot or attach records its operation and answers; the operation's workflow runs in the
engine's threads. Started at once, it takes the interpreter (one lock for every thread) from the
thread that is still encoding and sending the answer, and the caller waits for work it did not ask
to wait for: a create's answer took 17 ms instead of 12 (idle, one create at a time). So the engine
hands its start to ``after_answer``, and ``AfterAnswer`` (ASGI middleware) runs it once the app
returned: the answer is on its way, or the request failed or its client went away. Outside a request
(the engine's own retries, adoption, the reconciler) ``after_answer`` runs the work at once.

Nothing is lost if the process dies in between: the operation is already committed, and a
controller resumes every unfinished operation when it starts (or adopts it when its lease expires).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from vbs.net.asgi import HttpMiddleware

log = logging.getLogger(__name__)

# The request's list of work to start; None outside a request. A handler in a worker thread sees the
# same list (the thread runs in a copy of the request's context, which holds the same object).
_pending: ContextVar[list[Callable[[], object]] | None] = ContextVar("vbs_after_answer", default=None)


def after_answer(work: Callable[[], object]) -> None:
    """Run ``work`` once the current request's answer is sent; at once outside a request."""
    pending = _pending.get()
    if pending is None:
        work()
    else:
        pending.append(work)


class AfterAnswer(HttpMiddleware):
    """ASGI middleware: what a request's handler left with ``after_answer`` runs once the app has
    returned, whether it answered, failed or lost its client."""

    async def http(self, scope: Any, receive: Any, send: Any) -> None:
        pending: list[Callable[[], object]] = []
        token = _pending.set(pending)
        try:
            await self.app(scope, receive, send)
        finally:
            _pending.reset(token)
            for work in pending:
                try:
                    work()
                except Exception:
                    log.exception("starting work after an answer")
