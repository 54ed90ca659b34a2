"""The namespace cluster rig (src/vbs/rigs/netns.py): machines reach each other's addresses over the
bridge and nothing else, a link taken down cuts one off and back up rejoins it, processes are stopped by
their PIDs, and every namespace is gone after the cluster, also after a failure inside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vbs.errors import DriverError
from vbs.rigs.netns import Machine, NetnsCluster, existing_namespaces, wait_listening

pytestmark = pytest.mark.integration

ENV = {"PATH": "/usr/sbin:/usr/bin:/bin"}
CONNECT = ("import socket,sys\n"
           "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print('open')\n"
           "except OSError as e:\n print(type(e).__name__)")


def connect(cluster: NetnsCluster, source: Machine, host: str, port: int) -> str:
    return cluster.run(source, [sys.executable, "-c", CONNECT, host, str(port)], env=ENV).stdout.strip()


def test_machines_reach_each_other_only_over_the_bridge(tmp_path: Path) -> None:
    prefix = f"vbsrig{os.getpid() % 100000}"
    with NetnsCluster(prefix) as cluster:
        a, b = cluster.add("a", 10), cluster.add("b", 11)
        assert (a.address, b.address) == ("10.77.0.10", "10.77.0.11")
        server = cluster.start(b, [sys.executable, "-m", "http.server", "--bind", b.address, "8000"],
                               log=tmp_path / "server.log", env=ENV)
        wait_listening(cluster, b, 8000, 60)
        assert server.pid in cluster.pids(b.netns)
        assert connect(cluster, a, b.address, 8000) == "open"
        # Loopback is each machine's own: b's server is not a's 127.0.0.1 (nor b's, as it binds b.address).
        assert connect(cluster, a, "127.0.0.1", 8000) == "ConnectionRefusedError"
        cluster.link_down(b)
        assert connect(cluster, a, b.address, 8000) in ("TimeoutError", "OSError")
        cluster.link_up(b)
        wait_listening(cluster, b, 8000, 60)
        assert connect(cluster, a, b.address, 8000) == "open"
        cluster.remove_address(b)
        assert connect(cluster, a, b.address, 8000) in ("TimeoutError", "OSError")
        cluster.restore_address(b)
        assert sorted(existing_namespaces(prefix)) == [a.netns, b.netns, cluster.switch]
    assert server.poll() is not None
    assert existing_namespaces(prefix) == []


def test_everything_goes_also_after_a_failure_and_a_stray_process_is_named(tmp_path: Path) -> None:
    prefix = f"vbsrig{os.getpid() % 100000}"
    with pytest.raises(ValueError), NetnsCluster(prefix) as cluster:
        cluster.add("a", 10)
        raise ValueError("a test failed half-way")
    assert existing_namespaces(prefix) == []
    # A process the cluster did not start (a daemon that forked away from its starter) is named at teardown.
    strays: list[int] = []
    try:
        with pytest.raises(DriverError, match="processes were left"), NetnsCluster(prefix) as cluster:
            a = cluster.add("a", 10)
            subprocess.run(a.argv(["setsid", "-f", "sleep", "600"]), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=ENV, timeout=60, check=True)
            strays += cluster.pids(a.netns)
            assert len(strays) == 1
    finally:
        for pid in strays:
            os.kill(pid, signal.SIGKILL)
    assert existing_namespaces(prefix) == []
