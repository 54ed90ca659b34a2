"""The public REST API ``/v1`` and the agents' internal endpoints: thin handlers over the domain.

Each route group lives in a module of its own (``volume_routes``, ``snapshot_routes``, ``node_routes``…);
this one assembles them, in the order FastAPI matches them, with ``/health`` and the OpenAPI document."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request

from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.rest.admin_routes import admin_routes
from vbs.controller.rest.internal_routes import internal_router
from vbs.controller.rest.key_routes import key_routes
from vbs.controller.rest.lock_routes import lock_routes
from vbs.controller.rest.node_routes import node_routes
from vbs.controller.rest.operation_routes import operation_routes
from vbs.controller.rest.policy_routes import policy_routes
from vbs.controller.rest.recycle_bin_routes import recycle_bin_routes
from vbs.controller.rest.snapshot_routes import snapshot_routes
from vbs.controller.rest.tag_routes import tag_routes
from vbs.controller.rest.tier_routes import tier_routes
from vbs.controller.rest.volume_routes import volume_routes


def public_router(auth: Authenticator) -> APIRouter:
    async def authenticated(request: Request) -> None:
        request.state.caller = auth.check(request, await request.body())

    r = APIRouter(prefix="/v1", dependencies=[Depends(authenticated)])
    volume_routes(r)
    tag_routes(r)
    snapshot_routes(r)
    lock_routes(r)
    tier_routes(r)
    recycle_bin_routes(r)
    policy_routes(r)
    node_routes(r)
    admin_routes(r)
    operation_routes(r)
    key_routes(r)
    return r


def install_routes(app: FastAPI, auth: Authenticator, *, insecure: bool) -> None:
    @app.get("/health", include_in_schema=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    async def authenticated(request: Request) -> None:
        auth.check(request, await request.body())

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authenticated)])
    def openapi() -> dict[str, Any]:
        return app.openapi()

    app.include_router(public_router(auth))
    app.include_router(internal_router(insecure=insecure))
