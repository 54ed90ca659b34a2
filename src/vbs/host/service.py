"""Running the host agent: the QEMU driver over a directory of QMP sockets, its API and heartbeat."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import uvicorn
from fastapi import FastAPI

from vbs.config import HostAgentConfig
from vbs.errors import VbsError
from vbs.heartbeat import Heartbeat
from vbs.host.api import create_app
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.web import ApiClient, BoundedServer

log = logging.getLogger(__name__)


def serve(cfg: HostAgentConfig) -> None:
    cfg.vm_dir.mkdir(parents=True, exist_ok=True)
    driver = QemuDriver(cfg.vm_dir.resolve(), qmp_timeout=cfg.qmp_timeout_s)
    app = create_app(driver, cfg.agent_token, cfg.node_name)
    url = cfg.advertise_url or f"http://{cfg.host}:{cfg.port}"
    server = BoundedServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_keep_alive=5))
    started_at = datetime.now(UTC).isoformat()

    def report() -> dict[str, Any]:
        try:
            vms: list[dict[str, Any]] | None = [asdict(vm) for vm in driver.list_vms()]
        except VbsError as exc:
            log.warning("listing VMs failed: %s", exc.message)
            vms = None  # unknown this time: the controller keeps what it knew
        return {"name": cfg.node_name, "url": url, "address": cfg.address, "initiator_name": cfg.initiator_name,
                "started_at": started_at, "vms": vms}

    heartbeat = Heartbeat(ApiClient(cfg.controller_url, cfg.agent_token), "/internal/v1/host-heartbeat", report,
                          interval=cfg.heartbeat_interval_s, ready=lambda: server.started)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, so cleanup must happen here.
        heartbeat.stop()

    app.router.lifespan_context = lifespan
    heartbeat.start()
    log.info("host agent %s serving on %s, VMs from %s", cfg.node_name, url, cfg.vm_dir)
    try:
        server.run()
    finally:
        heartbeat.stop()
