"""``vbs up``: the embedded default — controller, storage agent and host agent as supervised children.

Same code paths as a multi-node install (each agent reached over HTTP(S) with its own node token); the
children run in their own sessions so that Ctrl-C reaches only this supervisor, which stops them
in order (agent first, then controller) and waits for them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vbs import credentials
from vbs.errors import VbsError
from vbs.fail_closed import harden
from vbs.files import write_private
from vbs.node_credentials import NodeKeyring
from vbs.pki import CertificateAuthority
from vbs.postgres import CLUSTER_DIR, EmbeddedPostgres

STOP_TIMEOUT_S = 15.0
PR_SET_PDEATHSIG = 1
RESTART_BACKOFF_S = 1.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


STORAGE_NODE = "storage-1"
HOST_NODE = "host-1"
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


def embedded_postgres(data_dir: Path) -> EmbeddedPostgres:
    """``vbs up --postgres``: the data dir's own PostgreSQL cluster, started, with database ``vbs`` at
    this VBS's schema (what ``vbs db upgrade`` does)."""
    from vbs.controller.db import Database

    cluster = EmbeddedPostgres(data_dir, port=free_port())
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


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = field(default=0)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_detach_but_follow_parent)  # noqa: S603

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _wait_until(check: object, timeout: float, what: str, children: list[Child]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children:
            if not c.alive():
                raise RuntimeError(f"{c.name} exited during start-up (code {c.proc.returncode if c.proc else '?'})")
        try:
            if check():  # type: ignore[operator]
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def run_embedded(data_dir: Path, host: str, port: int, *, clone_method: str | None = None,
                 export: str = "nbd", log_json: bool = False, tls: bool = False,
                 controller_env: dict[str, str] | None = None, database_url: str | None = None,
                 postgres: bool = False) -> int:
    """Run the three services until SIGINT/SIGTERM. The metadata DB: SQLite in the data dir (the
    controller upgrades it as it starts), ``database_url`` (PostgreSQL, upgraded by ``vbs db
    upgrade`` beforehand), or with ``postgres`` a cluster of the data dir's own that this process
    starts, upgrades, and stops last."""
    data_dir = data_dir.resolve()
    harden(data_dir, data_dir / "pool")
    database_url = database_url or os.environ.get(DATABASE_URL_ENV) or None
    try:
        _check_metadata_home(data_dir, database_url, postgres)
        cluster = embedded_postgres(data_dir) if postgres else None
    except (RuntimeError, VbsError) as exc:
        print(f"vbs up: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1
    try:
        if cluster is not None:
            database_url = cluster.url("vbs")
        return _run_services(data_dir, host, port, clone_method=clone_method, export=export, log_json=log_json,
                             tls=tls, controller_env=controller_env, database_url=database_url)
    finally:
        if cluster is not None:
            cluster.stop()


def _run_services(data_dir: Path, host: str, port: int, *, clone_method: str | None, export: str, log_json: bool,
                  tls: bool, controller_env: dict[str, str] | None, database_url: str | None) -> int:
    scheme = "https" if tls else "http"
    endpoint = f"{scheme}://{host}:{port}"
    key = credentials.ensure_file(data_dir / "credentials")
    credentials.register_endpoint(endpoint, key)
    env = child_env()
    verify: ssl.SSLContext | bool = True
    tls_of: dict[str, list[str]] = {"controller": [], STORAGE_NODE: [], HOST_NODE: []}
    if tls:
        tls_of = {name: tls_flags(data_dir, name, host) for name in tls_of}
        verify = ssl.create_default_context(cafile=str(data_dir / "ca.pem"))
    exe = [sys.executable, "-m", "vbs"]
    flags = ["--log-json"] if log_json else []
    agent_port = free_port(host)
    db_flags: list[str] = []
    if database_url is not None:
        url_file = data_dir / DATABASE_URL_FILE
        write_private(url_file, database_url + "\n")
        db_flags = ["--database-url-file", str(url_file)]
    controller = Child("controller", [*exe, "controller", "--host", host, "--port", str(port),
                                      "--data-dir", str(data_dir), *db_flags, *tls_of["controller"], *flags],
                       {**env, **(controller_env or {})})
    agent_argv = [*exe, "storage-agent", "--host", host, "--port", str(agent_port), "--controller-url", endpoint,
                  "--node-name", STORAGE_NODE,
                  "--agent-token-file", str(node_token_file(data_dir, "storage", STORAGE_NODE)),
                  *tls_of[STORAGE_NODE],
                  "--pool-path", str(data_dir / "pool"), "--state-dir", str(data_dir / "storage-state"),
                  "--export", export, "--nbd-port", str(free_port(host)), "--iscsi-port", str(free_port(host)),
                  # NBD to the host agent on this same machine: a unix socket in a 0700 directory.
                  "--nbd-socket-dir", str(data_dir / "nbd"),
                  "--iscsi-control", str(agent_port % 32768), *flags]
    if clone_method:
        agent_argv += ["--clone-method", clone_method]
    agent = Child("storage-agent", agent_argv, env)
    host_port = free_port(host)
    host_agent = Child("host-agent", [*exe, "host-agent", "--host", host, "--port", str(host_port),
                                      "--controller-url", endpoint, "--vm-dir", str(data_dir / "vms"),
                                      "--node-name", HOST_NODE,
                                      "--agent-token-file", str(node_token_file(data_dir, "host", HOST_NODE)),
                                      *tls_of[HOST_NODE], "--address", host, *flags], env)
    children = [controller, agent, host_agent]

    stopping = False

    def _on_signal(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        controller.start()
        _wait_until(lambda: httpx.get(f"{endpoint}/health", timeout=1, verify=verify).status_code == 200, 60,
                    "the controller", [controller])
        agent.start()
        host_agent.start()

        auth = {"authorization": f"Bearer {key.bearer}"}

        def agents_up() -> bool:
            nodes = httpx.get(f"{endpoint}/v1/storage-nodes", headers=auth, timeout=2, verify=verify
                              ).json()["storage_nodes"]
            hosts = httpx.get(f"{endpoint}/v1/hosts", headers=auth, timeout=2, verify=verify).json()["hosts"]
            return any(n["state"] == "up" and n["url"].endswith(f":{agent_port}") for n in nodes) and any(
                h["state"] == "up" and h["url"].endswith(f":{host_port}") for h in hosts)

        _wait_until(agents_up, 60, "the agents", children)
        print(f"VBS is up: endpoint {endpoint}, data in {data_dir}, VMs found in {data_dir / 'vms'}, "
              f"credentials in {data_dir / 'credentials'}"
              + (f", CA certificate {data_dir / 'ca.pem'}" if tls else "") + " (Ctrl-C stops)", flush=True)
        while not stopping:
            time.sleep(0.2)
            for child in children:
                if not child.alive() and not stopping:
                    child.restarts += 1
                    print(f"{child.name} exited (code {child.proc.returncode if child.proc else '?'}); "
                          f"restarting", file=sys.stderr, flush=True)
                    time.sleep(RESTART_BACKOFF_S)
                    child.start()
        return 0
    except RuntimeError as exc:
        print(f"vbs up: {exc}", file=sys.stderr)
        return 1
    finally:
        for child in reversed(children):
            child.stop()
