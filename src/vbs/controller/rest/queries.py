"""What every ``/v1`` route group shares: the dependencies that name the services and the caller, the
query parameters of a describe (bounded at the edge: 400, never 500), and a GET's wait until settled."""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, Query, Request

from vbs.controller.auth.authenticator import require_admin
from vbs.controller.auth.keys import Principal
from vbs.controller.requests.filters import DEFAULT_PAGE, MAX_RESULTS
from vbs.controller.rest.completion import MAX_WAIT_S, long_poll, recheck_interval
from vbs.controller.runtime import Controller


class _HasStatus(Protocol):
    @property
    def status(self) -> str: ...


S = TypeVar("S", bound=_HasStatus)


# The dependencies below only read the request: ``async`` runs them on the event loop, where a plain
# function would cost a worker-thread round trip each (two of a request's three hops before).
async def services(request: Request) -> Controller:
    return request.app.state.services  # type: ignore[no-any-return]


# Query parameters of every describe, bounded at the edge (400, never 500). Made per use, not shared:
# FastAPI records each parameter's name on its Query object, so one object must not serve two parameters.
def max_results_query() -> Any:
    return Query(default=None, description=f"1-{MAX_RESULTS}; default {DEFAULT_PAGE}")


def next_token_query() -> Any:
    return Query(default=None, max_length=160)


def wait_query() -> Any:
    return Query(default=0, ge=0, le=MAX_WAIT_S,
                 description=f"0-{MAX_WAIT_S}: seconds to wait until the answer is settled (a long-poll)")


async def settled_read(svc: Controller, key: str, read: Callable[[], S], busy: Container[str], wait_s: int) -> S:
    """``read()`` at once, or once its status is none of ``busy`` within ``wait_s`` seconds
    (``vbs.controller.rest.completion``): one wait for a volume, a snapshot and an operation."""
    return await long_poll(svc.engine.ends, key, read, lambda x: x.status not in busy, wait_s,
                           recheck_interval(svc.db.dialect))


def ids_query() -> Any:
    return Query(default=[], max_length=1000)


def filters_query() -> Any:
    return Query(default=[], max_length=50, description="name=value, e.g. status=available")


async def caller(request: Request) -> Principal:
    """Who sent this request (``authenticated`` ran first: it is a dependency of every public route)."""
    return request.state.caller  # type: ignore[no-any-return]


async def admin(who: Principal = Depends(caller)) -> Principal:
    return require_admin(who)


# A route's parameters ``svc: Services`` and ``who: Caller``: the services, and who sent the request.
Services = Annotated[Controller, Depends(services)]
Caller = Annotated[Principal, Depends(caller)]
