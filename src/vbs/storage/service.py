"""Running the storage agent: its drivers found by name in the registries, its API and heartbeat."""

from __future__ import annotations

import itertools
import logging
import threading
from datetime import UTC, datetime
from typing import Any

from vbs import drivers
from vbs.config import NO_SNAPSHOT_STORE, SnapshotStoreConfig, StorageAgentConfig
from vbs.errors import DriverError, VbsError
from vbs.net.heartbeat import Heartbeat
from vbs.net.web import BoundedServer, serve_agent
from vbs.pools.backend import Backend, ReportsUsage
from vbs.pools.exports import ExportDriver
from vbs.snapshot_store.contract import SnapshotStore
from vbs.storage.api import create_app
from vbs.storage.archive_tier import ArchiveTier
from vbs.storage.probe import install_probe, probe_auth
from vbs.storage.store_gc import StoreGc
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.trust import agent_security
from vbs.wire.storage import MAX_USAGE_REPORTED, StorageHeartbeat

log = logging.getLogger(__name__)

DAEMON_CHECK_INTERVAL_S = 1.0


def build_drivers(cfg: StorageAgentConfig) -> tuple[ExportDriver, dict[str, Backend]]:
    """The export driver and the pools this agent's config names (``export``, ``backend``, ``pools``).

    One backend per pool, all serving hosts through the one export driver: a backend's
    ``from_config`` reads its pool from ``pool_name``/``pool_path``, as it does on a one-pool node.
    """
    export_cls: Any = drivers.load("export", cfg.export)
    state_dir = cfg.state_dir.resolve() / cfg.export
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    exports = export_cls.from_config(cfg, state_dir)
    if not isinstance(exports, ExportDriver):
        raise DriverError(f"export driver {cfg.export!r} does not fulfil the ExportDriver contract")
    backend_cls: Any = drivers.load("backend", cfg.backend)
    backends: dict[str, Backend] = {}
    for pool in cfg.served_pools():
        backend = backend_cls.from_config(cfg.for_pool(pool), exports)
        if not isinstance(backend, Backend):
            raise DriverError(f"backend {cfg.backend!r} does not fulfil the Backend contract")
        if backend.name in backends:
            raise DriverError(f"backend {cfg.backend!r} named two pools {backend.name!r}")
        backends[backend.name] = backend
    return exports, backends


def build_store(cfg: StorageAgentConfig, *, archive: bool = False) -> SnapshotStore | None:
    """The snapshot store this agent's config names (``[storage_agent.snapshot_store]``; with ``archive``,
    the archive store: ``[storage_agent.archive_store]``), or None (``driver = "none"``: snapshots stay in
    their pools; archived ones in the snapshot store). Only set up here: the store is first reached with the
    store key the controller hands over with an upload or a restore."""
    section: SnapshotStoreConfig = cfg.archive_store if archive else cfg.snapshot_store
    if section.driver == NO_SNAPSHOT_STORE:
        return None
    store_cls: Any = drivers.load("snapshot_store", section.driver)
    store = store_cls.from_config(section.options(),
                                  default_dir=cfg.state_dir.resolve() / ("archive" if archive else "snapshots"))
    if not isinstance(store, SnapshotStore):
        raise DriverError(f"snapshot store driver {section.driver!r} does not fulfil the SnapshotStore contract")
    return store


def collectors(cfg: StorageAgentConfig, store: SnapshotStore | None, archive: SnapshotStore | None) -> list[StoreGc]:
    """The garbage collections of the agent's stores, each on its own section's schedule."""
    found = [StoreGc(store, interval_s=cfg.snapshot_store.gc_interval_s, grace_s=cfg.snapshot_store.gc_grace_s)
             ] if store is not None else []
    if archive is not None:
        found.append(StoreGc(archive, interval_s=cfg.archive_store.gc_interval_s,
                             grace_s=cfg.archive_store.gc_grace_s))
    return found


def store_location(cfg: StorageAgentConfig, store: SnapshotStore | None) -> str | None:
    """How this agent's pools report their store. A ``dir`` store in its default place (the agent's state
    directory) is this node's own, whatever its path says on other machines: it is reported with the
    node's name, so no other node is taken to share it. A store whose place is given (an NFS mount, a
    bucket) is reported as itself: every agent that names the same one shares it."""
    if store is None:
        return None
    if cfg.snapshot_store.driver == "dir" and "path" not in cfg.snapshot_store.options():
        return f"{store.describe()} on {cfg.node_name}"
    return store.describe()


def volume_usage(backends: dict[str, Backend]) -> dict[str, int]:
    """The bytes each volume holds, from the pools whose backend can tell; the first MAX_USAGE_REPORTED."""
    used: dict[str, int] = {}
    for backend in backends.values():
        if isinstance(backend, ReportsUsage):
            used.update(backend.volume_usage())
    return dict(itertools.islice(sorted(used.items()), MAX_USAGE_REPORTED))


def watch_daemon(exports: ExportDriver, stop: threading.Event) -> None:
    """Restart the export daemon if it dies, re-creating every export that should exist."""
    while not stop.wait(DAEMON_CHECK_INTERVAL_S):
        try:
            exports.check()
        except VbsError as exc:
            log.warning("export daemon check failed: %s", exc.message)


def serve(cfg: StorageAgentConfig) -> None:
    sec = agent_security.prepare("storage agent", cfg, cfg.state_dir.resolve(),
                                 node_name=cfg.node_name, fence_file=cfg.state_dir.resolve() / "fences.json")
    exports, backends = build_drivers(cfg)
    store = build_store(cfg)
    archive = build_store(cfg, archive=True)
    exports.start()
    auth = probe_auth(sec.auth, sec.token, insecure=sec.insecure, node_name=cfg.node_name)
    stored = StoredSnapshots(store, store_location(cfg, store), ArchiveTier(store, archive))
    gcs = collectors(cfg, store, archive)
    app = create_app(backends, exports, auth, cfg.node_name, stored)
    install_probe(app)
    url = cfg.advertise_url or f"{sec.scheme}://{cfg.host}:{cfg.port}"
    started_at = datetime.now(UTC)
    # Where hosts reach this node's exports: the controller refuses connections to anywhere else.
    address = str(getattr(exports, "advertise_host", None) or cfg.export_host)

    def report() -> StorageHeartbeat:
        return StorageHeartbeat(name=cfg.node_name, url=url, address=address, started_at=started_at,
                                pools=[stored.pool_info(b) for b in backends.values()], exports=exports.list_exports(),
                                availability_zone=cfg.availability_zone, volume_usage=volume_usage(backends))

    def heartbeat(server: BoundedServer) -> Heartbeat:
        controllers = sec.controller(cfg.controller_url, label=f"storage agent {cfg.node_name}")
        return Heartbeat(controllers, "/internal/v1/storage-heartbeat", report,
                         interval=cfg.heartbeat_interval_s, ready=lambda: server.started)

    stop = threading.Event()
    watcher = threading.Thread(target=watch_daemon, args=(exports, stop), name="export-watch", daemon=True)

    def shutdown() -> None:
        stop.set()
        watcher.join(timeout=5)
        for collector in gcs:
            collector.stop()
        stored.close()
        exports.stop()
        for b in backends.values():
            b.close()
        log.info("storage agent %s stopped", cfg.node_name)

    watcher.start()
    for collector in gcs:
        collector.start()
    log.info("storage agent %s serving on %s (backend %s, pools %s, export %s, snapshots to %s)", cfg.node_name, url,
             cfg.backend, ", ".join(backends), cfg.export, store.describe() if store is not None else "no store")
    if archive is not None:
        log.info("archived snapshots go to %s", archive.describe())
    serve_agent(app, cfg.host, cfg.port, heartbeat=heartbeat, shutdown=shutdown, tls=sec.tls)
