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


# A TCP connection opened before a cut: a line sent during the cut arrives only after the mend (TCP
# retransmits it), on the same connection; prints what the server echoed and whether it came in time.
ECHO_ACROSS_A_CUT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print("connected", flush=True)
sys.stdin.readline()  # the cut is made
s.sendall(b"during\\n")
s.settimeout(2)
try:
    s.recv(64)
    print("answered during the cut", flush=True)
except TimeoutError:
    print("no answer during the cut", flush=True)
sys.stdin.readline()  # the cut is mended
s.settimeout(60)
print("after the mend:", s.recv(64).decode().strip(), flush=True)
"""
ECHO_SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    c, _ = srv.accept()
    c.sendall(c.recv(64))
    c.close()
"""


def test_two_machines_cut_from_each_other_alone_and_mended(tmp_path: Path) -> None:
    """``cut`` drops the packets between two machines only (silently: an open connection stalls, it is not
    reset) and ``mend`` lets them through again; the stalled connection then carries on."""
    with NetnsCluster(f"vbsrig{os.getpid() % 100000}") as cluster:
        a, b, c = cluster.add("a", 10), cluster.add("b", 11), cluster.add("c", 12)
        cluster.start(b, [sys.executable, "-c", ECHO_SERVER, b.address, "8000"], log=tmp_path / "b.log", env=ENV)
        wait_listening(cluster, b, 8000, 60)
        client = subprocess.Popen(a.argv([sys.executable, "-c", ECHO_ACROSS_A_CUT, b.address, "8000"]),  # noqa: S603
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
        try:
            assert client.stdout is not None and client.stdin is not None
            assert client.stdout.readline().strip() == "connected"
            cluster.cut(a, b)
            assert connect(cluster, a, b.address, 8000) == "TimeoutError"
            assert connect(cluster, c, b.address, 8000) == "open"  # the rest of the bridge flows
            client.stdin.write("\n")
            client.stdin.flush()
            assert client.stdout.readline().strip() == "no answer during the cut"
            cluster.mend(a, b)
            client.stdin.write("\n")
            client.stdin.flush()
            assert client.stdout.readline().strip() == "after the mend: during"
            assert client.wait(60) == 0
            assert connect(cluster, a, b.address, 8000) == "open"
        finally:
            if client.poll() is None:
                client.kill()
                client.wait(10)
