"""One machine's VBS install run as its systemd units run it: the three services of an installed venv
(tests/installed.py) started by the ``ExecStart`` lines of deploy/systemd/*.service, with mutual TLS from the
install's CA as on several machines, on free loopback ports, its metadata on a real PostgreSQL; each process
stopped by its PID. tests/test_install.py runs one release; tests/test_rolling_upgrade.py swaps the services
of one install between two (``Install.of``).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import reap_daemons, stop_process, wait_until
from tests.installed import Installed, clean_env, exec_start
from vbs.net.ports import free_port
from vbs.system.files import write_private

# The install's nodes and their kinds.
NODES = {"storage-1": "storage", "host-1": "host"}


@dataclass
class Install:
    """The installed vbs, its config, and its three services as their units start them."""

    installed: Installed
    dir: Path
    config: Path
    port: int
    ports: dict[str, int]
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]]

    def of(self, installed: Installed) -> Install:
        """The same install (its files, its running services) driven with another venv's vbs: a release
        upgraded to, or rolled back to."""
        return dataclasses.replace(self, installed=installed)

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.dir / "controller" / "ca.pem"

    def tls_as(self, stem: Path) -> ssl.SSLContext:
        """A client's TLS context with the certificate ``stem``.pem and its key ``stem``-key.pem."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(f"{stem}.pem", f"{stem}-key.pem")
        return context

    def vbs(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.installed.vbs), *args], capture_output=True, text=True, timeout=300,
                              env=self.env, cwd=self.dir)
        assert not check or proc.returncode == 0, f"vbs {' '.join(args)}: {proc.stderr}"
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.vbs("-o", "json", *args).stdout)

    def start(self, role: str) -> None:
        """The service as its unit starts it: the unit's ExecStart, with the venv's vbs and this config."""
        assert role not in self.procs or self.procs[role].poll() is not None, f"{role} runs already"
        argv = exec_start(role, self.installed.vbs, self.config)
        log = (self.dir / f"{role}.log").open("ab")
        self.procs[role] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd="/")

    def stop(self, role: str) -> None:
        """Stop the service as systemd would (SIGTERM to its PID)."""
        stop_process(self.procs.pop(role), signal.SIGTERM, timeout=60)

    def stop_all(self) -> None:
        for role in ("host-agent", "storage-agent", "controller"):
            if role in self.procs:
                self.stop(role)
        reap_daemons(self.dir / "storage")

    def log(self, role: str) -> str:
        return (self.dir / f"{role}.log").read_text(errors="replace")

    def node(self, collection: str, name: str) -> dict[str, Any] | None:
        command = {"storage_nodes": "describe-storage-nodes", "hosts": "describe-hosts"}[collection]
        return next((n for n in self.json(command)[collection] if n["name"] == name), None)

    def up(self, collection: str, name: str) -> bool:
        """Whether the node is up, as the CLI shows it; a service that died fails at once with its log."""
        for role, proc in self.procs.items():
            assert proc.poll() is None, f"{role} exited {proc.returncode}:\n{self.log(role)[-3000:]}"
        said = self.vbs("-o", "json", "describe-storage-nodes" if collection == "storage_nodes" else "describe-hosts",
                        check=False)
        if said.returncode != 0:  # the controller is still starting
            return False
        return any(n["name"] == name and n["state"] == "up" for n in json.loads(said.stdout)[collection])

    def wait_up(self) -> None:
        """Until both nodes are up, as the CLI shows them."""
        wait_until(lambda: self.up("storage_nodes", "storage-1"), 180, 0.5, what="storage-1 up")
        wait_until(lambda: self.up("hosts", "host-1"), 180, 0.5, what="host-1 up")

    def issue_credentials(self) -> None:
        """What docs/install.md has the first controller's machine make besides its first key: the CA and every
        service's certificate, the nodes' tokens."""
        d = f"{self.dir}/controller"
        self.vbs("issue-cert", "controller", "--host", "127.0.0.1", "--data-dir", d)
        for node, kind in NODES.items():
            self.vbs("issue-cert", node, "--host", "127.0.0.1", "--data-dir", d, "--out-dir", f"{self.dir}/tls")
            token = self.vbs("node-token", node, "--kind", kind, "--data-dir", d).stdout
            write_private(self.dir / f"{node}.token", token)


def new_install(installed: Installed, d: Path, database_url: str) -> Install:
    """An install of ``installed`` in ``d`` (nothing made nor started yet): its config, its pool's directory
    and its database's URL file, and the CLI's environment."""
    ports = {"controller": free_port(), "storage": free_port(), "host": free_port(), "nbd": free_port()}
    config = d / "vbs.toml"
    config.write_text(config_text(d, ports))
    (d / "pools" / "default").mkdir(parents=True)
    (d / "controller").mkdir(mode=0o700)
    write_private(d / "controller" / "database-url", database_url + "\n")
    env = clean_env(installed.root / "home", VBS_ENDPOINT=f"https://127.0.0.1:{ports['controller']}",
                    VBS_CA_BUNDLE=str(d / "controller" / "ca.pem"),
                    VBS_CREDENTIALS_FILE=str(d / "controller" / "credentials"))
    return Install(installed, d, config, ports["controller"], ports, env, {})


def config_text(d: Path, ports: dict[str, int]) -> str:
    """One machine's vbs.toml with all three roles, as docs/install.md writes each role's (TLS everywhere)."""
    controller = f"https://127.0.0.1:{ports['controller']}"
    return f'''
[controller]
host = "127.0.0.1"
port = {ports["controller"]}
data_dir = "{d}/controller"
database_url_file = "{d}/controller/database-url"
tls_cert = "{d}/controller/tls/controller.pem"
tls_key = "{d}/controller/tls/controller-key.pem"
tls_ca = "{d}/controller/ca.pem"

[storage_agent]
host = "127.0.0.1"
port = {ports["storage"]}
node_name = "storage-1"
controller_url = "{controller}"
agent_token_file = "{d}/storage-1.token"
pool_path = "{d}/pools/default"
state_dir = "{d}/storage"
export_host = "127.0.0.1"
nbd_port = {ports["nbd"]}
tls_cert = "{d}/tls/storage-1.pem"
tls_key = "{d}/tls/storage-1-key.pem"
tls_ca = "{d}/controller/ca.pem"

[host_agent]
host = "127.0.0.1"
port = {ports["host"]}
node_name = "host-1"
controller_url = "{controller}"
agent_token_file = "{d}/host-1.token"
address = "127.0.0.1"
state_dir = "{d}/host"
vm_dir = "{d}/host/vms"
tls_cert = "{d}/tls/host-1.pem"
tls_key = "{d}/tls/host-1-key.pem"
tls_ca = "{d}/controller/ca.pem"
'''
