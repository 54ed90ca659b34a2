"""The controller application: DB migrations, workflow engine and API wired together."""

from __future__ import annotations

import gc
import logging
import re
import socket
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from fastapi import FastAPI, Request
from sqlalchemy import delete, select

from vbs.config import ControllerConfig
from vbs.controller import console
from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.auth.keys import KeyStore, MasterKey
from vbs.controller.cluster import ControllerRegistry, SingletonLease
from vbs.controller.db import Attachment, Database, Tag, Volume
from vbs.controller.db.session import redact
from vbs.controller.db.states import VolumeState
from vbs.controller.db.tables import utcnow
from vbs.controller.ebs import api as ebs_api
from vbs.controller.ebs.writes import expire_pending
from vbs.controller.ec2 import api as ec2_api
from vbs.controller.fleet.agents import AgentDirectory
from vbs.controller.fleet.reconcile import Reconciler
from vbs.controller.lifecycle import api as dlm_api
from vbs.controller.lifecycle.runs import LifecycleScheduler
from vbs.controller.metrics import ControllerMetrics
from vbs.controller.rbin import api as rbin_api
from vbs.controller.requests import recycle_bin
from vbs.controller.requests.detach_volume import finish_released
from vbs.controller.requests.migrate_instance import start_external_migrations
from vbs.controller.requests.snapshot_tiers import expire_restores
from vbs.controller.resolvers import Resolvers
from vbs.controller.rest import edge
from vbs.controller.rest.after_answer import AfterAnswer
from vbs.controller.rest.routes import install_routes
from vbs.controller.runtime import Controller
from vbs.controller.services import Services
from vbs.controller.workflows import WorkflowEngine
from vbs.controller.workflows.registry import WORKFLOWS
from vbs.errors import InvalidParameter
from vbs.net import web
from vbs.net.metrics import install_metrics
from vbs.net.web import PreAuth, RequestBounds, install_error_handlers
from vbs.trust import credentials
from vbs.trust.fail_closed import check_start, harden
from vbs.trust.node_credentials import NodeKeyring
from vbs.trust.tls import TlsFiles

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 60.0
SWITCH_INTERVAL_S = 0.0005  # see serve()

def database_url(cfg: ControllerConfig) -> str | None:
    """The configured database URL (``database_url``, or the first line of ``database_url_file``), or None
    for the embedded SQLite file in the data dir."""
    if cfg.database_url and cfg.database_url_file:
        raise InvalidParameter("give database_url or database_url_file, not both")
    if cfg.database_url_file is not None:
        try:
            url = cfg.database_url_file.read_text().strip()
        except OSError as exc:
            raise InvalidParameter(f"cannot read the database URL file {cfg.database_url_file}: "
                                   f"{exc.strerror}") from None
        if not url:
            raise InvalidParameter(f"the database URL file {cfg.database_url_file} is empty")
        return url
    return cfg.database_url or None


def database_for(cfg: ControllerConfig) -> Database:
    url = database_url(cfg)
    return Database(url) if url else Database.for_data_dir(cfg.data_dir)


def controller_id(cfg: ControllerConfig) -> str:
    """This controller's id on a shared database: configured, or ``<hostname>-<port>``."""
    if cfg.controller_id:
        return cfg.controller_id
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._")[:50] or "controller"
    return f"{host}-{cfg.port}"


def open_database(cfg: ControllerConfig, owner: str) -> Database:
    """The controller's database, ready and claimed for this process: SQLite (one controller) is
    migrated; PostgreSQL must already have this VBS's schema (``vbs db upgrade``), else the controller
    refuses to start, and no other live controller may have the id ``owner``."""
    db = database_for(cfg)
    try:
        db.claim("a controller", controller_id=owner)
        if db.dialect == "sqlite":
            db.migrate()
        else:
            db.check_schema()
    except BaseException:
        db.dispose()
        raise
    log.info("metadata database: %s", redact(db.url))
    return db


def purge_deleted(db: Database, retention_s: int) -> int:
    """Forget volumes deleted longer ago than the retention (EBS shows them as deleted for a while),
    with their tags and their (detached) attachments."""
    cutoff = utcnow() - timedelta(seconds=retention_s)
    with db.session() as s:
        old = list(s.scalars(select(Volume.id).where(Volume.status == VolumeState.DELETED,
                                                     Volume.deleted_at < cutoff).limit(1000)))
        if old:
            s.execute(delete(Tag).where(Tag.resource_id.in_(old)))
            s.execute(delete(Attachment).where(Attachment.volume_id.in_(old)))
            s.execute(delete(Volume).where(Volume.id.in_(old)))
    return len(old)


def access_keys(cfg: ControllerConfig) -> dict[str, str]:
    """Every key that may call the public APIs; a controller with none refuses to start."""
    keys = [credentials.AccessKey(k.get("access_key_id", ""), k.get("secret_access_key", ""))
            for k in cfg.access_keys]
    env_key = credentials.from_env()
    if env_key is not None:
        keys.append(env_key)
    path = cfg.credentials_file or cfg.data_dir / "credentials"
    if path.exists():
        keys += credentials.read(path)
    if not keys:
        raise InvalidParameter(f"no access keys: set VBS_ACCESS_KEY_ID and VBS_SECRET_ACCESS_KEY, access_keys in "
                               f"[controller], or write {path} (vbs up does)")
    return {k.access_key_id: k.secret_access_key for k in keys}


def create_app(cfg: ControllerConfig, tls: TlsFiles | None = None) -> FastAPI:
    bootstrap = access_keys(cfg)
    keyring = NodeKeyring.for_data_dir(cfg.data_dir).ensure()
    owner = controller_id(cfg)
    db = open_database(cfg, owner)
    master_key = MasterKey(cfg.master_key_file or cfg.data_dir / "master.key")
    key_store = KeyStore(db, master_key, bootstrap)
    auth = Authenticator(key_store, cfg.region, presign_max_s=cfg.presigned_url_max_s)
    # Serving HTTPS with a CA: agents must present their certificate as well as their token.
    node_certs = tls is not None and tls.serves and tls.ca is not None
    services = Services(cfg=cfg, db=db, agents=AgentDirectory(db, keyring, tls=tls), master_key=master_key)
    metrics = ControllerMetrics(db)
    engine = WorkflowEngine(db, WORKFLOWS, services, threads=cfg.workflow_threads,
                            retry_interval=cfg.retry_interval_s, give_up_after=cfg.give_up_after_s, owner=owner,
                            lease_s=cfg.operation_lease_s, on_end=metrics.operation_ended)
    # Singleton loops run on one controller at a time; another takes over once a lease lapses.
    reconcile_lease = SingletonLease(db, "reconciler", owner, max(3 * cfg.reconcile_interval_s, cfg.operation_lease_s))
    housekeeping_lease = SingletonLease(db, "housekeeping", owner, 3 * HOUSEKEEPING_INTERVAL_S)
    svc = Controller(cfg=cfg, db=db, agents=services.agents, master_key=master_key, engine=engine,
                     reconciler=Reconciler(services, grace_s=cfg.orphan_grace_s, interval_s=cfg.reconcile_interval_s,
                                           lease=reconcile_lease, on_findings=metrics.drift),
                     resolvers=Resolvers.from_config(cfg))
    svc.reconciler.follow_incoming = lambda: start_external_migrations(svc)
    svc.reconciler.finish_released = lambda attachment_id: finish_released(svc, attachment_id)
    # Every controller runs the lifecycle policies; each due run is claimed by one (docs/lifecycle-policies.md).
    lifecycle = LifecycleScheduler(svc, owner, lease_s=cfg.operation_lease_s, poll_s=cfg.lifecycle_poll_s)
    scheme = "https" if tls is not None and tls.serves else "http"
    registry = ControllerRegistry(db, owner, cfg.advertise_url or f"{scheme}://{cfg.host}:{cfg.port}")
    stop = threading.Event()

    def housekeeping() -> None:
        # A Recycle Bin "day" shortened for a test or a demo is kept to within a tenth of it (docs/recycle-bin.md).
        while not stop.wait(min(HOUSEKEEPING_INTERVAL_S, max(1.0, cfg.recycle_bin_day_s / 10))):
            try:
                if housekeeping_lease.hold():
                    purge_deleted(db, cfg.deleted_retention_s)
                    engine.purge(cfg.operation_retention_s)
                    expire_pending(svc)
                    expire_restores(svc)
                    recycle_bin.expire(svc)
            except Exception:
                log.exception("housekeeping")

    def registration() -> None:
        while not stop.wait(cfg.operation_lease_s / 3):
            try:
                registry.renew()
            except Exception:
                log.exception("controller registration")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Describing 1,000 volumes makes many short-lived objects; full collections of the long-lived
        # start-up objects were the p99 of a describe page. Freeze them and collect young ones less often.
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        registry.renew()
        log.info("controller id %s", owner)
        svc.engine.start()
        svc.reconciler.start()
        threading.Thread(target=housekeeping, name="housekeeping", daemon=True).start()
        threading.Thread(target=registration, name="registration", daemon=True).start()
        lifecycle.start()
        yield
        stop.set()
        lifecycle.stop()
        svc.reconciler.stop()
        svc.engine.stop()
        svc.agents.close()
        db.dispose()

    # No /docs or /redoc, and the schema only to an authenticated caller (install_routes): docs/security.md.
    app = FastAPI(title="VBS — Virtual Block Store", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.services = svc
    app.state.keys = key_store
    bounds = RequestBounds(body_min_rate=cfg.body_min_rate, body_grace_s=cfg.body_grace_s,
                           per_address=cfg.max_requests_per_address, per_key=cfg.max_requests_per_key,
                           per_tenant=cfg.max_requests_per_tenant, per_node=cfg.max_requests_per_node)
    install_error_handlers(app, bounds)
    app.add_middleware(PreAuth, check=edge.pre_auth(auth, keyring, insecure=cfg.insecure, node_certs=node_certs),
                       bounds=bounds)
    app.add_middleware(AfterAnswer)  # the workflows a request begins start once it is answered

    async def metrics_reader(request: Request) -> None:
        auth.check_metrics_reader(request, await request.body())

    install_metrics(app, metrics.registry, metrics_reader)
    install_routes(app, auth, insecure=cfg.insecure)
    ebs_api.install(app, auth)
    rbin_api.install(app, auth)
    dlm_api.install(app, auth)
    ec2_api.install(app, auth)
    console.install(app)
    return app


def serve(cfg: ControllerConfig) -> None:
    harden(cfg.data_dir.resolve())
    # The controller's own credentials (access keys, the node secret) are checked in create_app.
    tls = check_start("controller", cfg, has_credentials=True, what="access keys")
    app = create_app(cfg, tls)
    # A thread that gives up the interpreter lock for I/O (every SQL statement, every socket read of a
    # request) waits a whole switch interval to get it back while another thread computes (a
    # reconciliation pass over 100,000 rows): with Python's 5 ms, a create met by a pass waited
    # 150-300 ms at p99, and 80 ms with this (docs/benchmarks-history.md, "Control plane and scale curves").
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    scheme = "https" if tls is not None and tls.serves else "http"
    log.info("controller listening on %s://%s:%d", scheme, cfg.host, cfg.port)
    web.serve(app, cfg.host, cfg.port, tls, trusted_proxies=cfg.trusted_proxies)
