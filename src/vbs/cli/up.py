"""``vbs up``: the embedded default — controller, storage agent and host agent as supervised children.

Same code paths as a multi-node install (the agent is reached over HTTP with a shared token); the
children run in their own sessions so that Ctrl-C reaches only this supervisor, which stops them
in order (agent first, then controller) and waits for them.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vbs import credentials

STOP_TIMEOUT_S = 15.0
PR_SET_PDEATHSIG = 1
RESTART_BACKOFF_S = 1.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def agent_token(data_dir: Path) -> str:
    """The controller-agent shared secret of this install, made once and kept private (mode 0600)."""
    path = data_dir / "agent-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


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
                 export: str = "nbd", log_json: bool = False) -> int:
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (data_dir / "pool").mkdir(exist_ok=True)
    endpoint = f"http://{host}:{port}"
    key = credentials.ensure_file(data_dir / "credentials")
    credentials.register_endpoint(endpoint, key)
    env = {**os.environ, "VBS_AGENT_TOKEN": agent_token(data_dir)}
    exe = [sys.executable, "-m", "vbs"]
    flags = ["--log-json"] if log_json else []
    agent_port = free_port(host)
    controller = Child("controller", [*exe, "controller", "--host", host, "--port", str(port),
                                      "--data-dir", str(data_dir), *flags], env)
    agent_argv = [*exe, "storage-agent", "--host", host, "--port", str(agent_port), "--controller-url", endpoint,
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
                                      "--address", host, *flags], env)
    children = [controller, agent, host_agent]

    stopping = False

    def _on_signal(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        controller.start()
        _wait_until(lambda: httpx.get(f"{endpoint}/health", timeout=1).status_code == 200, 60, "the controller",
                    [controller])
        agent.start()
        host_agent.start()

        auth = {"authorization": f"Bearer {key.bearer}"}

        def agents_up() -> bool:
            nodes = httpx.get(f"{endpoint}/v1/storage-nodes", headers=auth, timeout=2).json()["storage_nodes"]
            hosts = httpx.get(f"{endpoint}/v1/hosts", headers=auth, timeout=2).json()["hosts"]
            return any(n["state"] == "up" and n["url"].endswith(f":{agent_port}") for n in nodes) and any(
                h["state"] == "up" and h["url"].endswith(f":{host_port}") for h in hosts)

        _wait_until(agents_up, 60, "the agents", children)
        print(f"VBS is up: endpoint {endpoint}, data in {data_dir}, VMs found in {data_dir / 'vms'}, "
              f"credentials in {data_dir / 'credentials'} (Ctrl-C stops)", flush=True)
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
