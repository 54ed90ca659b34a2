"""The TLS tunnel's reloads: stunnel re-reads its host list on SIGHUP, and the agent waits until it has.

stunnel listens before it installs its signal handlers. A SIGHUP sent in that window (an export made
right after the storage agent started its tunnel) ended stunnel where SIGHUP had its default
disposition, or was lost where the agent ignored SIGHUP (as under ``nohup``): the host just added
was refused ("Rejected by CERT"). Real stunnel on loopback; every process is stopped by its PID.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from vbs.errors import DriverError
from vbs.net.ports import free_port
from vbs.net.stunnel import Tunnel, server_config
from vbs.qemu.tls import X509Files
from vbs.system.processes import pid_alive
from vbs.trust.pki import CertificateAuthority

pytestmark = pytest.mark.integration

ROUNDS = 10


@pytest.fixture
def node_files(tmp_path: Path) -> X509Files:
    ca = CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")
    node = ca.issue_in(tmp_path / "node", "storage-1", ["127.0.0.1"])
    return X509Files(node.cert, node.key, node.ca)


@pytest.fixture
def tunnel(tmp_path: Path) -> Iterator[Tunnel]:
    t = Tunnel(tmp_path / "tunnel" / "stunnel.conf")
    yield t
    t.stop()


def _reads_of_the_config(t: Tunnel) -> int:
    return t.conf.with_suffix(".log").read_text().count("Configuration successful")


@pytest.mark.parametrize("sighup", ["default", "ignored"])
def test_a_reload_right_after_the_start_takes_effect_and_keeps_the_tunnel(
        tunnel: Tunnel, node_files: X509Files, sighup: str) -> None:
    listen = ("127.0.0.1", free_port())
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN if sighup == "ignored" else signal.SIG_DFL)
    try:
        for _ in range(ROUNDS):
            reads = _reads_of_the_config(tunnel) if tunnel.conf.with_suffix(".log").exists() else 0
            tunnel.ensure(server_config(listen, 1, node_files, ["hv-a"]), listen)
            pid = tunnel.pid
            assert pid is not None
            tunnel.ensure(server_config(listen, 1, node_files, ["hv-a", "hv-b"]), listen)  # at once
            assert tunnel.pid == pid and pid_alive(pid), "the reload ended stunnel"
            assert _reads_of_the_config(tunnel) == reads + 2, "the reload was lost"
            tunnel.stop()
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_config_stunnel_refuses_is_an_error_and_the_old_one_serves_on(
        tunnel: Tunnel, node_files: X509Files) -> None:
    listen = ("127.0.0.1", free_port())
    good = server_config(listen, 1, node_files, ["hv-a"])
    tunnel.ensure(good, listen)
    pid = tunnel.pid
    with pytest.raises(DriverError, match="refused its new config"):
        tunnel.ensure(good + "no-such-option = 1\n", listen)
    assert tunnel.pid == pid and pid is not None and pid_alive(pid)
    tunnel.ensure(server_config(listen, 1, node_files, ["hv-b"]), listen)  # and it reloads again
    assert tunnel.pid == pid and _reads_of_the_config(tunnel) == 2
