"""``vbs up`` as a small cluster on one machine: several storage agents, several controllers on
PostgreSQL, ``<data-dir>/up.json``, and the CLI and the agents failing over when a controller dies.

Real processes throughout (``vbs up`` and its children, a QEMU guest, PostgreSQL 15); every process
is stopped by its PID. The two-controller test needs operation leases: until they land, a second
controller on one PostgreSQL database is refused at start (``DatabaseInUse``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import VBS, Vbs, VbsUp, free_port, wait_until
from tests.postgres_cluster import PostgresForTests
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest
from vbs.system.processes import cmdline, pid_alive

pytestmark = pytest.mark.integration

GIB = 1 << 30


def services(data_dir: Path) -> list[dict[str, Any]]:
    """What up.json lists (and that it is the owner's alone)."""
    path = data_dir / "up.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return json.loads(path.read_text())["services"]  # type: ignore[no-any-return]


def service(data_dir: Path, name: str) -> dict[str, Any]:
    return next(s for s in services(data_dir) if s["name"] == name)


def runs_as(pid: int, role: str) -> bool:
    """``pid`` is alive and is the vbs service of that role (its subcommand; not a recycled PID)."""
    return pid_alive(pid) and cmdline(pid)[1:4] == ["-m", "vbs", role]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def last_switch(log: Path, agent: str) -> str | None:
    """The URL ``agent`` last said it switched to (None: it never did)."""
    # The reason may nest parentheses: "failed (unreachable (RemoteProtocolError)): switching to URL".
    switches = re.findall(rf"{re.escape(agent)}: \S+ failed \([^\n]*?\): switching to (\S+)", log.read_text())
    return switches[-1] if switches else None


def switched_to(log: Path, agent: str, url: str) -> bool:
    return last_switch(log, agent) == url


def cli(vbs: Vbs, endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``vbs -o json ARGS`` against ``endpoint`` (one URL or several, as VBS_ENDPOINT)."""
    env = {**os.environ, "VBS_ENDPOINT": endpoint, "VBS_ACCESS_KEY_ID": vbs.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": vbs.key.secret_access_key}
    return subprocess.run([*VBS, "-o", "json", *args], env=env, capture_output=True, text=True, timeout=120)


def ok(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout) if proc.stdout.strip() else None


# -- one controller, three storage nodes (SQLite) -----------------------------------------------------------


def test_three_storage_nodes_each_with_its_own_pool_serve_one_guest(tmp_path: Path) -> None:
    # Each pool may promise 1.5 GiB (capacity x this ratio): one 1-GiB volume fills a node, so three
    # volumes land on three different nodes.
    fs = os.statvfs(tmp_path)
    ratio = 1.5 * GIB / (fs.f_blocks * fs.f_frsize)
    up = VbsUp(tmp_path / "var", tmp_path / "up.log", extra=["--storage-nodes", "3", "--overcommit-ratio", repr(ratio)])
    vbs = up.start()
    vm = TestGuest("vm1", tmp_path / "guests", build_guest(), up.data_dir / "vms")
    try:
        listed = services(up.data_dir)
        assert [(s["role"], s["name"]) for s in listed] == [
            ("controller", "controller-1"), ("storage-agent", "storage-1"), ("storage-agent", "storage-2"),
            ("storage-agent", "storage-3"), ("host-agent", "host-1")]
        assert listed[0]["url"] == vbs.endpoint
        for s in listed:
            assert runs_as(s["pid"], s["role"]), s
            assert healthy(s["url"]), s
        assert "storage nodes storage-1, storage-2, storage-3" in up.log_path.read_text()

        nodes = ok(cli(vbs, vbs.endpoint, "describe-storage-nodes"))["storage_nodes"]
        assert [(n["name"], n["state"]) for n in nodes] == [("storage-1", "up"), ("storage-2", "up"),
                                                             ("storage-3", "up")]
        assert {n["url"] for n in nodes} == {s["url"] for s in listed if s["role"] == "storage-agent"}

        volumes = [vbs.cli("create-volume", "--size", "1", "--wait") for _ in range(3)]
        assert sorted(v["storage_node"] for v in volumes) == ["storage-1", "storage-2", "storage-3"]
        pools = {"storage-1": up.data_dir / "pool", "storage-2": up.data_dir / "pools" / "storage-2",
                 "storage-3": up.data_dir / "pools" / "storage-3"}
        for v in volumes:
            assert (pools[v["storage_node"]] / "volumes" / f"{v['volume_id']}.raw").is_file(), v
        full = vbs.cli("create-volume", "--size", "1", check=False)
        assert full.returncode == 1 and "InsufficientVolumeCapacity" in full.stderr

        vm.start()
        vm.wait_ready(120)
        vbs.instance("vm1")  # reported by the host agent: attach to it by name
        for v, device in zip(volumes, ("vdb", "vdc", "vdd"), strict=True):
            att = vbs.cli("attach-volume", v["volume_id"], "--host", "host-1", "--vm", "vm1", "--device", device,
                          "--wait")
            assert att["state"] == "attached", att
            dev = vm.wait_for_disk(virtio_serial(v["volume_id"]), 20)
            written = vm.write_pattern(dev, v["storage_node"], 1)
            assert vm.checksum(dev, 1) == written
        for v in volumes:
            assert vbs.cli("detach-volume", v["volume_id"], "--wait")["state"] == "detached"
            vm.wait_disk_gone(virtio_serial(v["volume_id"]), 20)

        # The supervisor restarts a storage agent it lost, and up.json follows.
        lost = service(up.data_dir, "storage-2")
        os.kill(lost["pid"], signal.SIGKILL)
        wait_until(lambda: (s := service(up.data_dir, "storage-2"))["pid"] != lost["pid"]
                   and runs_as(s["pid"], "storage-agent") and healthy(s["url"]), 60, what="storage-2 restarted")
        assert service(up.data_dir, "storage-2")["url"] == lost["url"]
    finally:
        vm.stop()
        up.stop()
    assert not (up.data_dir / "up.json").exists(), "up.json lists running services only"


# -- several controllers ---------------------------------------------------------------------------------------


def test_two_controllers_on_sqlite_are_refused_before_anything_starts(tmp_path: Path) -> None:
    data_dir = tmp_path / "var"
    proc = subprocess.run([*VBS, "up", "--controllers", "2", "--data-dir", str(data_dir), "--port", str(free_port())],
                          env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert "--controllers 2 needs PostgreSQL (--postgres, --database-url or --database-url-file)" in proc.stderr
    assert "SQLite serves exactly one controller" in proc.stderr
    assert not data_dir.exists(), "nothing was made, let alone started"
    mentions = [int(p) for p in os.listdir("/proc") if p.isdigit() and str(data_dir) in " ".join(cmdline(int(p)))]
    assert mentions == []


def test_two_controllers_on_postgresql_keep_serving_when_one_is_killed(tmp_path: Path,
                                                                      postgres: PostgresForTests) -> None:
    # Heartbeats every half second: the agents surely call the killed controller before it is back.
    fast = {"VBS_STORAGE_AGENT_HEARTBEAT_INTERVAL_S": "0.5", "VBS_HOST_AGENT_HEARTBEAT_INTERVAL_S": "0.5"}
    up = VbsUp(tmp_path / "var", tmp_path / "up.log", env=fast, ports=2, extra=[
        "--controllers", "2", "--storage-nodes", "2", "--database-url", postgres.upgraded_database()])
    vbs = up.start()
    assert up.proc is not None
    try:
        first, second = (s for s in services(up.data_dir) if s["role"] == "controller")
        url1, url2 = first["url"], second["url"]
        assert (first["name"], second["name"]) == ("controller-1", "controller-2")
        assert (url1, url2) == (vbs.endpoint, f"http://127.0.0.1:{up.port + 1}")
        assert healthy(url1) and healthy(url2)
        assert f"endpoints {url1},{url2}" in up.log_path.read_text()
        both = f"{url1},{url2}"

        made = ok(cli(vbs, both, "create-volume", "--size", "1", "--wait"))
        assert made["status"] == "available"
        assert ok(cli(vbs, url2, "describe-volumes", made["volume_id"]))["volumes"][0]["status"] == "available"

        # The supervisor would restart controller-1 after a second: hold it still while the test looks.
        os.kill(up.proc.pid, signal.SIGSTOP)
        try:
            killed_at = datetime.now(UTC)
            os.kill(first["pid"], signal.SIGKILL)
            wait_until(lambda: not pid_alive(first["pid"]), 10, what="controller-1 gone")

            described = cli(vbs, both, "describe-volumes", made["volume_id"])
            assert ok(described)["volumes"][0]["volume_id"] == made["volume_id"]
            assert f"{url1} failed (connection refused): switching to {url2}" in described.stderr
            # A create without a client token moves on too: it never reached controller-1.
            again = ok(cli(vbs, both, "create-volume", "--size", "1", "--wait"))
            assert again["status"] == "available"
            assert ok(cli(vbs, both, "delete-volume", made["volume_id"], "--wait"))["status"] == "deleted"

            for agent in ("storage agent storage-1", "storage agent storage-2", "host agent host-1"):
                # Refused, or reset/timed out when a heartbeat was in flight as controller-1 died. An
                # agent whose heartbeat once took too long on a loaded machine moved on before the kill
                # and says nothing new: either way its last switch is to controller-2.
                said = [line for line in up.log_path.read_text().splitlines() if f"{agent}:" in line]
                wait_until(partial(switched_to, up.log_path, agent, url2), 30,
                           what=f"{agent} on controller-2; it said before: {said}")
            auth = {"authorization": f"Bearer {vbs.key.bearer}"}

            def beating_since_the_kill() -> bool:
                seen = [*httpx.get(f"{url2}/v1/storage-nodes", headers=auth, timeout=5).json()["storage_nodes"],
                        *httpx.get(f"{url2}/v1/hosts", headers=auth, timeout=5).json()["hosts"]]
                since = killed_at + timedelta(seconds=1)
                return len(seen) == 3 and all(
                    n["state"] == "up" and datetime.fromisoformat(n["last_heartbeat"]) > since for n in seen)

            wait_until(beating_since_the_kill, 30, what="heartbeats reaching controller-2")
            nodes = ok(cli(vbs, url2, "describe-storage-nodes"))["storage_nodes"]
            assert [(n["name"], n["state"]) for n in nodes] == [("storage-1", "up"), ("storage-2", "up")]
        finally:
            os.kill(up.proc.pid, signal.SIGCONT)

        wait_until(lambda: (s := service(up.data_dir, "controller-1"))["pid"] != first["pid"]
                   and runs_as(s["pid"], "controller") and healthy(url1), 60, what="controller-1 restarted")
        assert ok(cli(vbs, url1, "describe-volumes", again["volume_id"]))["volumes"][0]["status"] == "available"
    finally:
        up.stop()
