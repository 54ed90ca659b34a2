"""``vbs up`` as a child process and the REST calls the control-plane benchmarks make through it: what
bench/control_plane.py and its modes (cluster_mode, completion_mode, rbd_control) and bench/scale.py
share. It imports no bench script but bench/common.py, so the modes need not import control_plane.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import log  # noqa: E402

from vbs.net.ports import free_port  # noqa: E402

POLL_S = 0.05

VBS = [sys.executable, "-m", "vbs"]


# -- vbs up as a child process ---------------------------------------------------------------------


# The benchmark fills one pool with far more (thin, mostly empty) volumes than a tenant's default quota
# or the default overcommit allow: raise them, as docs/configuration.md says operators and benchmarks may.
BENCH_LIMITS = ["--quota-volumes", "10000000", "--quota-gib", str(1 << 40), "--quota-snapshots", "10000000",
                "--overcommit-ratio", "1000"]


class VbsUp:
    """``vbs up`` on a free port; stopped by its PID (SIGINT, then SIGKILL after a grace period)."""

    def __init__(self, data_dir: Path, log_path: Path, extra: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.extra = extra or []
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # XDG_CONFIG_HOME: vbs up records its endpoint's key there; keep that inside our tree.
        env = {**os.environ, "XDG_CONFIG_HOME": str(self.data_dir.parent / "xdg")}
        with self.log_path.open("ab") as out:
            # Own session: a Ctrl-C of the benchmark reaches only us, and we stop vbs up in order.
            self.proc = subprocess.Popen(  # noqa: S603 - argv list
                [*VBS, "up", "--data-dir", str(self.data_dir), "--port", str(self.port), *BENCH_LIMITS, *self.extra],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.data_dir.parent, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vbs up exited ({self.proc.returncode}):\n{self.log_tail()}")
            if b"VBS is up" in self.log_path.read_bytes() or self._node_up():
                return
            time.sleep(0.2)
        raise RuntimeError(f"vbs up did not come up in 120 s:\n{self.log_tail()}")

    def headers(self) -> dict[str, str]:
        """The bearer token of the install's ``default`` key, if it has one (``<data-dir>/credentials``)."""
        path = self.data_dir / "credentials"
        if not path.exists():
            return {}
        parser = configparser.RawConfigParser()
        parser.read_string(path.read_text())
        sec = parser["default"]
        return {"authorization": f"Bearer {sec['aws_access_key_id'].strip()}:{sec['aws_secret_access_key'].strip()}"}

    def _node_up(self) -> bool:
        try:
            nodes = httpx.get(f"{self.endpoint}/v1/storage-nodes", timeout=2,
                              headers=self.headers()).json()["storage_nodes"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return any(n["state"] == "up" for n in nodes)

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            log(f"vbs up (pid {self.proc.pid}) did not stop in 40 s: killing it")
            self.proc.kill()
            self.proc.wait()


class Api:
    """The REST calls the benchmark makes: one httpx client, shared by the benchmark's threads (a client
    each would load the CA bundle again in every new thread, and the concurrent runs start new ones)."""

    def __init__(self, endpoint: str, headers: dict[str, str] | None = None) -> None:
        self.endpoint = endpoint
        self.headers = headers or {}
        self.http = httpx.Client(base_url=self.endpoint, timeout=120, headers=self.headers,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    def close(self) -> None:
        self.http.close()

    def _json(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            raise RuntimeError(f"{resp.request.method} {resp.request.url.path}: HTTP {resp.status_code} {resp.text}")
        return resp.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._json(self.http.post(path, json=body))

    def get(self, path: str, **params: Any) -> Any:
        return self._json(self.http.get(path, params=params))

    def delete(self, path: str) -> Any:
        return self._json(self.http.delete(path))

    def clone_method(self) -> str:
        nodes = self.get("/v1/storage-nodes")["storage_nodes"]
        return ",".join(p["clone_method"] for n in nodes for p in n["pools"]) or "?"

    def count_volumes(self, status: str | None = None) -> int:
        n, token = 0, None
        while True:
            params: dict[str, Any] = {"max_results": 1000}
            if status:
                params["filter"] = f"status={status}"
            if token:
                params["next_token"] = token
            page = self.get("/v1/volumes", **params)
            n += len(page["volumes"])
            token = page.get("next_token")
            if not token:
                return n

    def wait_status(self, path: str, target: str, timeout: float) -> tuple[float, dict[str, Any]]:
        """Poll ``path`` (first at once, then every 50 ms) until its status is ``target``."""
        deadline = time.monotonic() + timeout
        while True:
            body = self.get(path)
            now = time.monotonic()
            if body["status"] == target:
                return now, body
            if body["status"] == "error":
                raise RuntimeError(f"{path} went to error: {body.get('status_reason')}")
            if now > deadline:
                raise RuntimeError(f"{path} not {target} after {timeout:g}s (last {body['status']})")
            time.sleep(POLL_S)

    def wait_none_creating(self, timeout: float) -> float:
        """Poll every 50 ms until no volume is 'creating'; the time that was first seen."""
        deadline = time.monotonic() + timeout
        while True:
            page = self.get("/v1/volumes", filter="status=creating", max_results=1000)
            now = time.monotonic()
            if not page["volumes"]:
                return now
            if now > deadline:
                raise RuntimeError(f"volumes still creating after {timeout:g}s")
            time.sleep(POLL_S)


def concurrent_creates(apis: list[Api], n: int, threads: int) -> list[float]:
    """``n`` creates of 1 GiB from ``threads`` clients, the i-th through ``apis[i % len]``: their API
    latencies (ms)."""
    lat: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t = time.perf_counter()
        apis[i % len(apis)].post("/v1/volumes", {"size_gib": 1})
        ms = (time.perf_counter() - t) * 1000
        with lock:
            lat.append(ms)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    return lat


def server_ms(db: Path, resource_id: str) -> float | None:
    """How long the create operation of ``resource_id`` ran, from the controller's DB (read-only).

    From the commit of the POST's transaction to the operation's last update (its success), so
    without the client's 50 ms polling granularity.
    """
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        try:
            row = con.execute("SELECT created_at, updated_at FROM operations WHERE resource_id = ? "
                              "AND kind LIKE 'create-%' ORDER BY created_at LIMIT 1", (resource_id,)).fetchone()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    if not row:
        return None
    start, end = (datetime.fromisoformat(str(v)) for v in row)
    return (end - start).total_seconds() * 1000
