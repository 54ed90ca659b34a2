"""Running the storage agent: build the backend and export drivers from config, serve, heartbeat."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import uvicorn
from fastapi import FastAPI

from vbs.config import StorageAgentConfig
from vbs.errors import VbsError
from vbs.heartbeat import Heartbeat
from vbs.storage.api import create_app
from vbs.storage.backends.base import Backend
from vbs.storage.backends.file import FileBackend
from vbs.storage.exports.base import ExportDriver
from vbs.web import ApiClient, BoundedServer

log = logging.getLogger(__name__)

DAEMON_CHECK_INTERVAL_S = 1.0


def export_driver(cfg: StorageAgentConfig) -> ExportDriver:
    state = cfg.state_dir.resolve()
    if cfg.export == "iscsi":
        from vbs.storage.exports.iscsi import IscsiExportDriver

        state = state / "iscsi"
        state.mkdir(parents=True, exist_ok=True)
        return IscsiExportDriver(state, listen_host=cfg.export_host, port=cfg.iscsi_port,
                                 control_port=cfg.iscsi_control)
    from vbs.storage.exports.nbd import NbdExportDriver

    state = state / "nbd"
    state.mkdir(parents=True, exist_ok=True)
    return NbdExportDriver(state, listen_host=cfg.export_host, port=cfg.nbd_port, tls=cfg.nbd_tls)


def watch_daemon(exports: ExportDriver, stop: threading.Event) -> None:
    """Restart the export daemon if it dies, re-creating every export that should exist."""
    while not stop.wait(DAEMON_CHECK_INTERVAL_S):
        try:
            exports.check()
        except VbsError as exc:
            log.warning("export daemon check failed: %s", exc.message)


def serve(cfg: StorageAgentConfig) -> None:
    backends: dict[str, Backend] = {
        cfg.pool_name: FileBackend(cfg.pool_name, cfg.pool_path.resolve(), clone_method=cfg.clone_method)
    }
    exports = export_driver(cfg)
    exports.start()
    app = create_app(backends, exports, cfg.agent_token, cfg.node_name)
    url = cfg.advertise_url or f"http://{cfg.host}:{cfg.port}"
    server = BoundedServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_keep_alive=5))
    started_at = datetime.now(UTC).isoformat()

    def report() -> dict[str, Any]:
        return {
            "name": cfg.node_name, "url": url, "address": cfg.host, "started_at": started_at,
            "pools": [{**asdict(b.pool_info()), "path": str(b.pool_info().path)} for b in backends.values()],
            "exports": [f"{e.volume_id}@{e.host}" for e in exports.list_exports()],
        }

    heartbeat = Heartbeat(ApiClient(cfg.controller_url, cfg.agent_token), "/internal/v1/storage-heartbeat", report,
                          interval=cfg.heartbeat_interval_s, ready=lambda: server.started)
    stop = threading.Event()
    watcher = threading.Thread(target=watch_daemon, args=(exports, stop), name="export-watch", daemon=True)

    def shutdown() -> None:
        if stop.is_set():
            return
        stop.set()
        heartbeat.stop()
        watcher.join(timeout=5)
        exports.stop()
        for b in backends.values():
            b.close()
        log.info("storage agent %s stopped", cfg.node_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, so cleanup must happen here.
        shutdown()

    app.router.lifespan_context = lifespan
    heartbeat.start()
    watcher.start()
    log.info("storage agent %s serving on %s (export %s)", cfg.node_name, url, exports.protocol)
    try:
        server.run()
    finally:
        shutdown()
