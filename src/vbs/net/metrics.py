"""Prometheus metrics, the plumbing the three services share (docs/metrics.md lists every metric).

Each app has a registry of its own (tests run several services in one process): ``RequestMetrics``
counts its HTTP requests by route *template* (``/v1/volumes/{volume_id}``, never a raw path, so a
client cannot make new series) and status code, and times them; ``install_metrics`` serves the
registry as Prometheus text on ``GET /metrics``. Gauges that read state (the DB, the drivers) are
custom collectors, read at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import prometheus_client
from fastapi import Depends, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from starlette.responses import Response
from starlette.routing import BaseRoute, Match

from vbs.net.asgi import HttpMiddleware

__all__ = ["RequestMetrics", "install_metrics", "new_registry", "route_of", "ScrapeCollector", "METRICS_PATH",
           "ROUTE_KEY"]

METRICS_PATH = "/metrics"
# A handler that serves several operations on one path (the EC2 Query API's ``POST /``) names the
# one it served here, from a bounded set: it becomes the ``route`` label.
ROUTE_KEY = "vbs.metrics_route"
UNROUTED = "unrouted"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})

# ``*_created`` samples double every counter's series and nothing here needs them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


def new_registry() -> CollectorRegistry:
    """A registry for one app (not the process-wide default one)."""
    return CollectorRegistry(auto_describe=True)


def route_of(routes: Iterable[BaseRoute], scope: dict[str, Any]) -> str:
    """The path template of the route that served ``scope``: what its handler named (``ROUTE_KEY``),
    else the route routing chose, else one of the app's own routes that matches (a request refused
    on its head never reached routing), else ``unrouted`` (refused before routing, or no route: 404)."""
    named = scope.get(ROUTE_KEY)
    if isinstance(named, str):
        return named
    routed = scope.get("route")
    path = getattr(routed, "path", None)
    if isinstance(path, str):
        return path
    partial: str | None = None
    for route in routes:
        path = getattr(route, "path", None)
        if not isinstance(path, str):
            continue  # an included router: its routes are found by routing only
        match, _child = route.matches(scope)
        if match == Match.FULL:
            return path
        if match == Match.PARTIAL and partial is None:
            partial = path  # the path matches, the method does not: it answered 405
    return partial or UNROUTED


class RequestCounters:
    """The request metrics of one app (made once: the middleware stack may be built more than once)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("vbs_api_requests", "HTTP requests answered, by route template and status code.",
                                ["method", "route", "code"], registry=registry)
        self.latency = Histogram("vbs_api_request_duration_seconds",
                                 "Time from a request's arrival to the end of its answer, by route template.",
                                 ["method", "route"], registry=registry)


class RequestMetrics(HttpMiddleware):
    """ASGI middleware: ``vbs_api_requests_total{method,route,code}`` and
    ``vbs_api_request_duration_seconds{method,route}``, for every request, refused ones included
    (it sits outside the authentication checks)."""

    def __init__(self, app: Any, counters: RequestCounters, routes: Callable[[], Iterable[BaseRoute]]) -> None:
        super().__init__(app)
        self.routes = routes
        self.counters = counters

    async def http(self, scope: Any, receive: Any, send: Any) -> None:
        started = time.perf_counter()
        status = 500  # an exception that escapes the app is answered 500 by the server

        async def recording_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            method = scope.get("method", "")
            method = method if method in KNOWN_METHODS else "other"
            route = route_of(self.routes(), scope)
            self.counters.requests.labels(method, route, str(status)).inc()
            self.counters.latency.labels(method, route).observe(time.perf_counter() - started)


class ScrapeCollector(Collector):
    """A collector whose metrics a function makes at each scrape (from the DB, from drivers)."""

    def __init__(self, make: Callable[[], Iterable[Metric]]) -> None:
        self._make = make

    def collect(self) -> Iterable[Metric]:
        return list(self._make())

    def describe(self) -> Iterable[Metric]:
        return []  # unknown until a scrape: the registry must not call collect() at registration


def install_metrics(app: FastAPI, registry: CollectorRegistry,
                    authorize: Callable[[Request], Awaitable[None]] | None = None) -> None:
    """Count the app's requests and serve ``registry`` on ``GET /metrics``. Call it after the app's
    other middleware (it must be the outermost, to see refusals too). ``authorize`` runs first (a
    dependency: it raises to refuse); without it, the app's own checks on every path apply."""
    app.add_middleware(RequestMetrics, counters=RequestCounters(registry), routes=lambda: app.router.routes)

    async def allowed(request: Request) -> None:
        if authorize is not None:
            await authorize(request)

    @app.get(METRICS_PATH, include_in_schema=False, dependencies=[Depends(allowed)])
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
