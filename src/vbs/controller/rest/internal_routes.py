"""The agents' endpoints under ``/internal/v1`` (heartbeats, probe targets), out of the OpenAPI document,
and the tests' failure injection and step holds under ``/test`` (only with ``VBS_TEST_HOOKS=1``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from vbs.controller.fleet.nodes import live_storage_nodes, record_host_heartbeat, record_storage_heartbeat
from vbs.controller.rest.queries import Services
from vbs.controller.runtime import Controller
from vbs.errors import AuthFailure, UnauthorizedOperation
from vbs.trust.node_credentials import REFUSED, NodeIdentity
from vbs.trust.pki import PeerCertificate
from vbs.versions import Peer
from vbs.wire.base import Ack
from vbs.wire.host import HostHeartbeat
from vbs.wire.probes import MAX_PROBES, ProbeTarget, ProbeTargets
from vbs.wire.storage import StorageHeartbeat


def internal_router(*, insecure: bool) -> APIRouter:
    """The agents' endpoints. A node token says which node calls (the edge checked it and left the
    node in the request's state; a request without one passes only on an ``--insecure``
    controller): a node reports only as itself, and a storage node's token is no host's."""
    r = APIRouter(prefix="/internal/v1", include_in_schema=False)

    def same_node(request: Request, kind: str, name: str, address: str) -> None:
        who: NodeIdentity | None = getattr(request.state, "node", None)
        if who is None:
            if insecure:
                return
            raise AuthFailure(REFUSED)
        if who.kind != kind or who.name != name:
            raise UnauthorizedOperation(f"the credential of {who.kind} node {who.name} cannot report as "
                                        f"{kind} node {name[:63]}")
        cert: PeerCertificate | None = getattr(request.state, "node_cert", None)
        if cert is not None and not cert.names_address(address):
            # Hosts connect to the address a storage node reports, and exports admit a host's
            # address: a node reports only an address its certificate names.
            raise UnauthorizedOperation(f"{kind} node {name} reports the address {address[:255]!r}, which its "
                                        "certificate does not name")

    def heartbeat(request: Request, svc: Controller, kind: str, body: StorageHeartbeat | HostHeartbeat,
                  record: Callable[[Session, Peer | None], None]) -> Ack:
        """A node's heartbeat, recorded once it came from that node (``same_node``), with the versions its
        headers named (the edge checked them: ``request.state.versions``)."""
        same_node(request, kind, body.name, body.address)
        sender: Peer | None = getattr(request.state, "versions", None)
        with svc.db.session() as s:
            record(s, sender)
        return Ack()

    @r.post("/storage-heartbeat")
    def storage_heartbeat(body: StorageHeartbeat, request: Request, svc: Services) -> Ack:
        return heartbeat(request, svc, "storage", body, lambda s, v: record_storage_heartbeat(s, body, v))

    @r.post("/host-heartbeat")
    def host_heartbeat(body: HostHeartbeat, request: Request, svc: Services) -> Ack:
        return heartbeat(request, svc, "host", body, lambda s, v: record_host_heartbeat(s, body, v))

    @r.get("/probe-targets")
    def probe_targets(request: Request, svc: Services) -> ProbeTargets:
        """The live storage nodes a host probes, each with a ticket its agent accepts (vbs.trust.probe_tickets)."""
        who: NodeIdentity | None = getattr(request.state, "node", None)
        if who is None and not insecure:
            raise AuthFailure(REFUSED)
        if who is not None and who.kind != "host":
            raise UnauthorizedOperation("only hosts probe storage nodes")
        host = who.name if who is not None else "insecure-host"
        with svc.db.read() as s:
            nodes = [(n.name, n.url) for n in live_storage_nodes(s, svc.cfg.heartbeat_timeout_s)][:MAX_PROBES]
        return ProbeTargets(targets=[ProbeTarget(storage_node=name, url=url, ticket=svc.agents.probe_ticket(name, host))
                                     for name, url in nodes])

    if os.environ.get("VBS_TEST_HOOKS") == "1":
        r.include_router(test_hooks_router())

    return r


class StepHook(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(max_length=32)
    step: str = Field(max_length=64)
    when: Literal["before", "after"] = "before"


def test_hooks_router() -> APIRouter:
    """Failure injection and step holds for the tests (only with ``VBS_TEST_HOOKS=1``)."""
    r = APIRouter(prefix="/test")

    @r.post("/fail-step")
    def fail_step(body: StepHook, svc: Services) -> dict[str, str]:
        svc.engine.faults.inject_failure(body.kind, body.step, body.when)
        return {"status": "armed"}

    @r.post("/hold-step")
    def hold_step(body: StepHook, svc: Services) -> dict[str, str]:
        svc.engine.faults.hold(body.kind, body.step)
        return {"status": "armed"}

    @r.post("/held-step")
    def held_step(body: StepHook, svc: Services) -> dict[str, bool]:
        return {"held": svc.engine.faults.held(body.kind, body.step)}

    @r.post("/release-step")
    def release_step(body: StepHook, svc: Services) -> dict[str, str]:
        svc.engine.faults.release(body.kind, body.step)
        return {"status": "released"}

    return r
