"""What the storage and host agents' HTTP APIs both start from: errors answered as ``vbs.wire``
bodies, the node token checked before anything else, the request metrics and ``/health``."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.responses import Response

from vbs.net.metrics import install_metrics
from vbs.net.web import PreAuth, Scope, install_error_handlers


def agent_app(title: str, auth: Callable[[Scope], Response | None], node_name: str,
              registry: CollectorRegistry) -> FastAPI:
    """The agent's app, its routes yet to come; ``registry``: what ``/metrics`` serves."""
    app = FastAPI(title=title, version="1", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(PreAuth, check=auth)
    # Behind the node token, like the rest of the agent's API.
    install_metrics(app, registry)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "node": node_name}

    return app
