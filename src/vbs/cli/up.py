"""``vbs up``: the embedded default — controller, storage agent and host agent as supervised children —
and, with ``--controllers N --storage-nodes M``, a small cluster on one machine.

Same code paths as a multi-node install (each agent reached over HTTP(S) with its own node token and,
with ``--tls``, its own certificate; every agent given every controller's URL); the children run in
their own sessions so that Ctrl-C reaches only this supervisor, which stops them in order (host
agent, storage agents, controllers) and waits for them. ``<data-dir>/up.json`` lists the services
that run (role, name, PID, URL); it is rewritten whenever one is restarted and removed at the end.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from vbs.cli.up_banner import VM_DIR, banner, hypervisor_of
from vbs.cli.up_storage import (
    RbdChoice,
    SnapshotStoreChoice,
    choose_archive_store,
    choose_snapshot_store,
    embedded_ceph,
)
from vbs.errors import InvalidParameter, VbsError
from vbs.net.ports import PortPicker
from vbs.net.web import ApiClient
from vbs.rigs.ceph import CLUSTER_DIR as CEPH_DIR
from vbs.rigs.ceph import EmbeddedCeph
from vbs.rigs.postgres import CLUSTER_DIR, EmbeddedPostgres
from vbs.system.files import write_private
from vbs.system.processes import stop_children
from vbs.trust import credentials
from vbs.trust.fail_closed import harden
from vbs.trust.node_credentials import NodeKeyring
from vbs.trust.pki import CertificateAuthority

STOP_TIMEOUT_S = 15.0
PR_SET_PDEATHSIG = 1
RESTART_BACKOFF_S = 1.0
# Starts an agent gets on new ports after it exited during start-up (see on_new_ports in up()).
AGENT_START_RETRIES = 2


STORAGE_NODE = "storage-1"
HOST_NODE = "host-1"
MAX_CONTROLLERS = 8
MAX_STORAGE_NODES = 16
SERVICES_FILE = "up.json"
# What a child keeps of this process's environment: no secrets (tokens and keys reach the children
# as 0600 files), just what a Python program and the VBS settings need.
KEPT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "VBS_TEST_HOOKS",
            "VBS_CONFIG")
KEPT_ENV_PREFIXES = ("VBS_CONTROLLER_", "VBS_STORAGE_AGENT_", "VBS_HOST_AGENT_")
# May hold a password: the controller gets the URL as a 0600 file instead (database_url_file).
DATABASE_URL_ENV = "VBS_CONTROLLER_DATABASE_URL"
DATABASE_URL_FILE = "database-url"


def child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ) if environ is None else environ
    return {k: v for k, v in env.items()
            if (k in KEPT_ENV or k.startswith(KEPT_ENV_PREFIXES)) and k != DATABASE_URL_ENV}


def embedded_postgres(data_dir: Path, avoid: Iterable[int] = ()) -> EmbeddedPostgres:
    """``vbs up --postgres``: the data dir's own PostgreSQL cluster, started, with database ``vbs`` at
    this VBS's schema (what ``vbs db upgrade`` does)."""
    from vbs.controller.db import Database

    cluster = EmbeddedPostgres(data_dir, port=PortPicker(taken=avoid)())  # not a controller's, bound later
    cluster.start()
    try:
        db = Database(cluster.create_database("vbs"))
        try:
            db.migrate()
        finally:
            db.dispose()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _check_metadata_home(data_dir: Path, database_url: str | None, postgres: bool) -> None:
    """A data dir keeps its metadata in one place: starting it on the other would show an empty install
    over a pool full of volumes."""
    if not postgres and database_url is None and (data_dir / CLUSTER_DIR).is_dir():
        raise RuntimeError(f"{data_dir} keeps its metadata in its own PostgreSQL cluster: start it with "
                           "vbs up --postgres")
    if postgres and (data_dir / "vbs.db").exists():
        raise RuntimeError(f"{data_dir} keeps its metadata in SQLite (vbs.db): start it without --postgres")


def _check_volume_home(data_dir: Path, rbd: RbdChoice | None) -> None:
    """Volumes made in the data dir's own Ceph stay reachable only through it."""
    if (rbd is None or rbd.conf is not None) and (data_dir / CEPH_DIR / "ceph.conf").exists():
        raise RuntimeError(f"{data_dir} keeps its volumes in its own Ceph cluster: start it with --backend rbd "
                           "(and no --ceph-conf)")


def node_token_file(data_dir: Path, kind: str, name: str) -> Path:
    """The node token of one of the embedded agents, written 0600 where only it is read from."""
    path = data_dir / "agents" / f"{kind}-{name}.token"
    path.parent.mkdir(exist_ok=True, mode=0o700)
    keyring = NodeKeyring.for_data_dir(data_dir).ensure()
    token = keyring.token(kind, name)
    if not path.exists() or path.read_text().strip() != token:
        write_private(path, token)
    return path


def tls_flags(data_dir: Path, name: str, host: str) -> list[str]:
    """Make (once) the install's CA and ``name``'s certificate; the flags that serve with them."""
    ca = CertificateAuthority.in_data_dir(data_dir)
    files = ca.issue_in(data_dir / "tls", name, sorted({host, "127.0.0.1", "localhost"}))
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


def _detach_but_follow_parent() -> None:
    """In the child: own session (Ctrl-C goes to the supervisor only), and SIGTERM if it dies."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class Shape:
    """How many controllers and storage agents ``vbs up`` runs (and one host agent)."""

    controllers: int = 1
    storage_nodes: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.controllers <= MAX_CONTROLLERS:
            raise InvalidParameter(f"--controllers is 1-{MAX_CONTROLLERS}, not {self.controllers}")
        if not 1 <= self.storage_nodes <= MAX_STORAGE_NODES:
            raise InvalidParameter(f"--storage-nodes is 1-{MAX_STORAGE_NODES}, not {self.storage_nodes}")

    @property
    def storage_names(self) -> list[str]:
        return [f"storage-{k}" for k in range(1, self.storage_nodes + 1)]


@dataclass(frozen=True)
class StorageNodeDirs:
    pool: Path
    state: Path
    nbd: Path


def storage_node_dirs(data_dir: Path, name: str) -> StorageNodeDirs:
    """Where storage node ``name`` keeps its pool, its export daemon's state and its NBD socket. The
    first keeps the paths of a one-node install, so a data dir that grows to several nodes keeps its
    volumes; each other one has its own beside or under them."""
    if name == STORAGE_NODE:
        return StorageNodeDirs(data_dir / "pool", data_dir / "storage-state", data_dir / "nbd")
    return StorageNodeDirs(data_dir / "pools" / name, data_dir / "storage-state" / name, data_dir / "nbd" / name)


@dataclass
class Child:
    role: str  # controller | storage-agent | host-agent
    name: str
    url: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = field(default=0)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_detach_but_follow_parent)  # noqa: S603

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def stop_together(children: list[Child]) -> None:
    """Stop ``children`` together (SIGKILL to any still running after ``STOP_TIMEOUT_S``)."""
    stop_children([c.proc for c in children if c.proc is not None], timeout=STOP_TIMEOUT_S)


@dataclass
class _Plan:
    """The command lines of the services of one ``vbs up``: secrets reach them as 0600 files only."""

    data_dir: Path
    host: str
    scheme: str
    tls: bool
    log_json: bool
    env: dict[str, str]
    # The agents' ports, none of them a controller's: those are planned and bound only later.
    ports: PortPicker
    host_agent_flags: tuple[str, ...] = ()  # its hypervisor driver and that driver's settings
    storage_flags: tuple[str, ...] = ()  # the storage agents' backend when it is not file or rbd, their store

    @property
    def _exe(self) -> list[str]:
        return [sys.executable, "-m", "vbs"]

    @property
    def _flags(self) -> list[str]:
        return ["--log-json"] if self.log_json else []

    def _tls(self, name: str) -> list[str]:
        return tls_flags(self.data_dir, name, self.host) if self.tls else []

    def controller(self, k: int, port: int, db_flags: list[str], extra_env: dict[str, str]) -> Child:
        # The first one's certificate keeps the name a one-controller install gave it.
        cert = "controller" if k == 1 else f"controller-{k}"
        return Child("controller", f"controller-{k}", f"{self.scheme}://{self.host}:{port}",
                     [*self._exe, "controller", "--host", self.host, "--port", str(port),
                      "--data-dir", str(self.data_dir), *db_flags, *self._tls(cert), *self._flags],
                     {**self.env, **extra_env})

    def storage_agent(self, name: str, controllers: list[str], export: str, clone_method: str | None,
                      rbd: RbdChoice | None = None) -> Child:
        port = self.ports()
        dirs = storage_node_dirs(self.data_dir, name)
        argv = [*self._exe, "storage-agent", "--host", self.host, "--port", str(port),
                *_controller_flags(controllers), "--node-name", name,
                "--agent-token-file", str(node_token_file(self.data_dir, "storage", name)), *self._tls(name),
                "--pool-path", str(dirs.pool), "--state-dir", str(dirs.state),
                "--export", export, "--nbd-port", str(self.ports()), "--iscsi-port", str(self.ports()),
                # NBD to the host agent on this same machine: a unix socket in a 0700 directory.
                "--nbd-socket-dir", str(dirs.nbd),
                "--iscsi-control", str(port % 32768), *self._flags]
        if clone_method:
            argv += ["--clone-method", clone_method]
        if rbd is not None:
            argv += rbd.agent_flags()
        argv += self.storage_flags
        return Child("storage-agent", name, f"{self.scheme}://{self.host}:{port}", argv, self.env)

    def host_agent(self, controllers: list[str]) -> Child:
        port = self.ports()
        return Child("host-agent", HOST_NODE, f"{self.scheme}://{self.host}:{port}",
                     [*self._exe, "host-agent", "--host", self.host, "--port", str(port),
                      *_controller_flags(controllers), "--vm-dir", str(self.data_dir / VM_DIR),
                      "--state-dir", str(self.data_dir / "host-state"),
                      "--node-name", HOST_NODE,
                      "--agent-token-file", str(node_token_file(self.data_dir, "host", HOST_NODE)),
                      *self._tls(HOST_NODE), "--address", self.host, *self.host_agent_flags, *self._flags],
                     self.env)


def _controller_flags(urls: list[str]) -> list[str]:
    return [flag for url in urls for flag in ("--controller-url", url)]


def _wait_until(check: Callable[[], bool], timeout: float, what: str, children: list[Child],
                restart: Callable[[Child], bool] = lambda child: False) -> None:
    """Wait for ``check``; a child that exits meanwhile fails the start-up unless ``restart`` started it again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children:
            if not c.alive() and not restart(c):
                raise RuntimeError(f"{c.name} exited during start-up (code {c.proc.returncode if c.proc else '?'})")
        try:
            if check():
                return
        except (httpx.HTTPError, VbsError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def is_postgresql(database_url: str | None) -> bool:
    """Whether ``database_url`` names a PostgreSQL database (None is SQLite in the data dir)."""
    return database_url is not None and database_url.split(":", 1)[0].split("+", 1)[0] == "postgresql"


def _check_shape(shape: Shape, *, postgres: bool, database_url: str | None) -> None:
    if shape.controllers > 1 and not (postgres or is_postgresql(database_url)):
        raise RuntimeError(f"--controllers {shape.controllers} needs PostgreSQL (--postgres, --database-url or "
                           "--database-url-file): SQLite serves exactly one controller")


def _check_ports_free(host: str, ports: list[int]) -> None:
    """The controllers' ports are the operator's choice (``--port`` and the ones after it): say which one
    is taken before anything starts, instead of a controller that dies at start-up."""
    for port in ports:
        if not 1 <= port <= 65535:
            raise RuntimeError(f"controller port {port} is not in 1-65535: give a lower --port")
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise RuntimeError(f"port {port} on {host} is in use ({exc.strerror}): give another --port") from None


def run_embedded(data_dir: Path, host: str, port: int, *, shape: Shape | None = None, clone_method: str | None = None,
                 export: str = "nbd", log_json: bool = False, tls: bool = False,
                 controller_env: dict[str, str] | None = None, database_url: str | None = None,
                 postgres: bool = False, rbd: RbdChoice | None = None,
                 host_agent_flags: tuple[str, ...] = (), storage_flags: tuple[str, ...] = (),
                 snapshot_store: dict[str, Any] | None = None, archive_store: dict[str, Any] | None = None) -> int:
    """Run the services until SIGINT/SIGTERM: ``shape`` says how many controllers (on ports ``port``,
    ``port`` + 1, …) and storage agents, plus one host agent. The metadata DB: SQLite in the data dir
    (the controller upgrades it as it starts; one controller only), ``database_url`` (PostgreSQL,
    upgraded by ``vbs db upgrade`` beforehand), or with ``postgres`` a cluster of the data dir's own
    that this process starts, upgrades, and stops last. Volumes: files in the data dir, or with
    ``rbd`` Ceph RBD images (every storage agent serves the same Ceph pool): of the given cluster, or
    of the data dir's own single-node one, started before the services and stopped after them.
    Snapshots go to ``snapshot_store`` (``config.parse_snapshot_store``'s table; default: a ``dir`` store
    in ``<data-dir>/snapshots``), the same store for every storage agent; archived ones to ``archive_store``
    (the same table; default: none, they stay in the snapshot store).
    Everything that would refuse is checked before anything starts."""
    shape = shape or Shape()
    database_url = database_url or os.environ.get(DATABASE_URL_ENV) or None
    try:
        _check_shape(shape, postgres=postgres, database_url=database_url)
        controller_ports = [port + k for k in range(shape.controllers)]
        _check_ports_free(host, controller_ports)
        data_dir = data_dir.resolve()
        # Every folder the banner names exists when it is printed: VMs are started with their QMP
        # sockets in DIR/vms before any of them is found.
        pools = [storage_node_dirs(data_dir, name).pool for name in shape.storage_names]
        harden(data_dir, data_dir / VM_DIR, *pools)
        # The volumes' data is in the pools' directories, or in the embedded Ceph's (an existing cluster's is
        # elsewhere): a dir store beside it protects against less.
        data_homes = pools if rbd is None else [data_dir / CEPH_DIR] if rbd.conf is None else []
        store = choose_snapshot_store(data_dir, snapshot_store, data_homes)
        archive_flags = choose_archive_store(data_dir, archive_store, store)
        _check_metadata_home(data_dir, database_url, postgres)
        _check_volume_home(data_dir, rbd)
        cluster = embedded_postgres(data_dir, avoid=controller_ports) if postgres else None
    except (RuntimeError, VbsError) as exc:
        print(f"vbs up: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1
    ceph: EmbeddedCeph | None = None
    try:
        if cluster is not None:
            database_url = cluster.url("vbs")
        if rbd is not None and rbd.conf is None:
            ceph = embedded_ceph(data_dir, rbd.pool)
            rbd = RbdChoice(conf=ceph.conf_path, user="admin", pool=rbd.pool)
        return _run_services(data_dir, host, controller_ports, shape, clone_method=clone_method, export=export,
                             log_json=log_json, tls=tls, controller_env=controller_env, database_url=database_url,
                             rbd=rbd, ceph=ceph, host_agent_flags=host_agent_flags,
                             storage_flags=(*storage_flags, *store.flags, *archive_flags), store=store)
    except (RuntimeError, VbsError) as exc:
        print(f"vbs up: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1
    finally:
        if ceph is not None:
            ceph.stop()  # OSDs first, the mon last
        if cluster is not None:
            cluster.stop()


def write_services(path: Path, children: list[Child], ceph: EmbeddedCeph | None = None) -> None:
    """``up.json``: every service started so far, its role, name, PID and URL (0600, replaced whole),
    and the data dir's own Ceph daemons with its ``ceph.conf``."""
    services: list[dict[str, Any]] = [{"role": c.role, "name": c.name, "pid": c.proc.pid, "url": c.url}
                                      for c in children if c.proc is not None]
    found: dict[str, Any] = {"services": services}
    if ceph is not None:
        services += [{"role": "ceph", "name": name, "pid": pid, "url": None} for name, pid in ceph.pids.items()]
        found["ceph_conf"] = str(ceph.conf_path)
    write_private(path, json.dumps(found, indent=2) + "\n")


def _run_services(data_dir: Path, host: str, controller_ports: list[int], shape: Shape, *,
                  clone_method: str | None, export: str, log_json: bool, tls: bool,
                  controller_env: dict[str, str] | None, database_url: str | None,
                  rbd: RbdChoice | None = None, ceph: EmbeddedCeph | None = None,
                  host_agent_flags: tuple[str, ...] = (), storage_flags: tuple[str, ...] = (),
                  store: SnapshotStoreChoice | None = None) -> int:
    scheme = "https" if tls else "http"
    key = credentials.ensure_file(data_dir / "credentials")
    plan = _Plan(data_dir, host, scheme, tls=tls, log_json=log_json, env=child_env(),
                 host_agent_flags=host_agent_flags, storage_flags=storage_flags,
                 ports=PortPicker(host, taken=controller_ports))
    db_flags: list[str] = []
    if database_url is not None:
        url_file = data_dir / DATABASE_URL_FILE
        write_private(url_file, database_url + "\n")
        db_flags = ["--database-url-file", str(url_file)]
    controllers = [plan.controller(k, controller_port, db_flags, controller_env or {})
                   for k, controller_port in enumerate(controller_ports, start=1)]
    endpoints = [c.url for c in controllers]
    for endpoint in endpoints:
        credentials.register_endpoint(endpoint, key)
    storage_agents = [plan.storage_agent(name, endpoints, export, clone_method, rbd) for name in shape.storage_names]
    host_agent = plan.host_agent(endpoints)
    children = [*controllers, *storage_agents, host_agent]
    # After the plan: with --tls, it made the CA. One context for every client of this process: given
    # True instead, httpx would load the system's CA bundle again for each health check (50 ms of CPU each).
    verify = ssl.create_default_context(cafile=str(data_dir / "ca.pem")) if tls else ssl.create_default_context()
    services_file = data_dir / SERVICES_FILE
    api = ApiClient(endpoints, key.bearer, timeout=2, verify=verify, label="vbs up")

    stopping = False

    def _on_signal(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        # All at once: an agent's heartbeat retries until its controller listens (vbs.net.heartbeat), so the
        # agents' start-up (imports, pools, export daemons) overlaps the controllers' (imports, migrations).
        for child in children:
            child.start()
        write_services(services_file, children, ceph)
        def on_new_ports(child: Child) -> bool:
            """An agent that exited during start-up gets new ports and another start, twice at most: a port
            picked free can be taken by another process before the agent binds it ("address already in
            use"; the agents' ports are vbs up's choice, the controllers' the operator's)."""
            if child.role == "controller" or child.restarts >= AGENT_START_RETRIES:
                return False
            again = (plan.host_agent(endpoints) if child.role == "host-agent" else
                     plan.storage_agent(child.name, endpoints, export, clone_method, rbd))
            child.argv, child.url, child.restarts = again.argv, again.url, child.restarts + 1
            print(f"{child.name} exited during start-up (code {child.proc.returncode if child.proc else '?'}); "
                  f"starting it again on {child.url}", file=sys.stderr, flush=True)
            child.start()
            write_services(services_file, children, ceph)
            return True

        for controller in controllers:
            _wait_until(partial(_healthy, controller.url, verify), 60, f"the controller {controller.url}", children,
                        on_new_ports)
        _wait_until(lambda: _agents_up(api, storage_agents, host_agent), 60, "the agents", children, on_new_ports)
        print(banner(data_dir, endpoints, storage_agents, services_file, tls=tls, rbd=rbd, store=store,
                      demo_vm=hypervisor_of(host_agent_flags) == "qemu"), flush=True)
        while not stopping:
            time.sleep(0.2)
            for child in children:
                if not child.alive() and not stopping:
                    child.restarts += 1
                    print(f"{child.name} exited (code {child.proc.returncode if child.proc else '?'}); "
                          f"restarting", file=sys.stderr, flush=True)
                    time.sleep(RESTART_BACKOFF_S)
                    child.start()
                    write_services(services_file, children, ceph)
        return 0
    except RuntimeError as exc:
        print(f"vbs up: {exc}", file=sys.stderr)
        return 1
    finally:
        # The agents together (each may take a moment to end its exports' daemons), then the controllers.
        stop_together([c for c in children if c.role != "controller"])
        api.close()
        stop_together(controllers)
        _close_local_paths(data_dir / "host-state")
        services_file.unlink(missing_ok=True)
        for endpoint in endpoints:  # a stopped install's key no longer piles up in the user's file
            credentials.unregister_endpoint(endpoint, key)


def _close_local_paths(host_state: Path) -> None:
    """The embedded install owns its host's local paths (the command driver's FUSE daemons), which
    outlive a host agent on purpose: with the install stopped, they are stopped and unmounted too."""
    from vbs.connectors.local_path import STATE_SUBDIR, LocalPaths

    root = host_state / STATE_SUBDIR
    if not root.is_dir():
        return
    paths = LocalPaths(root, secrets_dir=host_state / "secrets")
    paths.close_all()
    paths.release()


def _healthy(url: str, verify: ssl.SSLContext) -> bool:
    return httpx.get(f"{url}/health", timeout=1, verify=verify).status_code == 200


def _agents_up(api: ApiClient, storage_agents: list[Child], host_agent: Child) -> bool:
    """Whether every agent's newest heartbeat (from this start: its port) says it is up."""
    nodes = {n["name"]: n for n in api.call("GET", "/v1/storage-nodes?max_results=1000")["storage_nodes"]}
    hosts = {h["name"]: h for h in api.call("GET", "/v1/hosts?max_results=1000")["hosts"]}

    def up(found: dict[str, Any], child: Child) -> bool:
        node = found.get(child.name)
        return node is not None and node["state"] == "up" and node["url"] == child.url

    return all(up(nodes, a) for a in storage_agents) and up(hosts, host_agent)
