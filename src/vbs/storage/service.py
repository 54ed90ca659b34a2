"""Running the storage agent: build the backends from config, serve the API, heartbeat."""

from __future__ import annotations

import logging

import uvicorn

from vbs.config import StorageAgentConfig
from vbs.storage.api import create_app
from vbs.storage.backends.base import Backend
from vbs.storage.backends.file import FileBackend
from vbs.storage.heartbeat import Heartbeat
from vbs.web import ApiClient

log = logging.getLogger(__name__)


def serve(cfg: StorageAgentConfig) -> None:
    backends: dict[str, Backend] = {
        cfg.pool_name: FileBackend(cfg.pool_name, cfg.pool_path.resolve(), clone_method=cfg.clone_method)
    }
    app = create_app(backends, cfg.agent_token, cfg.node_name)
    url = cfg.advertise_url or f"http://{cfg.host}:{cfg.port}"
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning"))
    heartbeat = Heartbeat(
        ApiClient(cfg.controller_url, cfg.agent_token), name=cfg.node_name, url=url,
        address=cfg.host, backends=backends, interval=cfg.heartbeat_interval_s, ready=lambda: server.started,
    )
    heartbeat.start()
    log.info("storage agent %s serving on %s", cfg.node_name, url)
    try:
        server.run()
    finally:
        heartbeat.stop()
        for b in backends.values():
            b.close()
