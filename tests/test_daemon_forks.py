"""The daemon supervisor with a program that forks into the background itself (nbdkit): the daemon is
the child its pidfile names, also when the child writes it before the process started here exits;
stopping it stops the child, by PID. A small Python program stands in for the daemon."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.export_fixtures import wait_dead
from vbs.errors import DriverError
from vbs.system.daemons import Daemon, DaemonSpec, argv0_is
from vbs.system.processes import pid_alive

pytestmark = pytest.mark.integration

# Forks; the child starts a session, writes the pidfile and sleeps; the parent lingers a moment after
# the pidfile exists (so a supervisor that took the pidfile's appearance for readiness would track the
# parent), then exits with the given status.
FORKER = """
import os, sys, time
pidfile, linger, status = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
if os.fork() == 0:
    os.setsid()
    with open(pidfile + ".tmp", "w") as f:
        f.write(f"{os.getpid()}\\n")
    os.rename(pidfile + ".tmp", pidfile)
    time.sleep(300)
    sys.exit(0)
while not os.path.exists(pidfile):
    time.sleep(0.01)
time.sleep(linger)
sys.exit(status)
"""


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Daemon]]:
    daemons: list[Daemon] = []
    yield daemons
    for d in daemons:
        d.stop(grace=0.0)


def spec(tmp_path: Path, linger: float, status: int = 0) -> DaemonSpec:
    pid_path = tmp_path / "forker.pid"
    program = Path(sys.executable).name
    return DaemonSpec(name="forker", argv=(sys.executable, "-c", FORKER, str(pid_path), str(linger), str(status)),
                      pid_path=pid_path, log_path=tmp_path / "forker.log", writes_pidfile=True, forks=True,
                      owns=lambda pid: argv0_is(pid, program, mentions=str(pid_path)), start_timeout=10.0)


def test_the_daemon_is_the_child_its_pidfile_names_and_stop_ends_it(tmp_path: Path, started: list[Daemon]) -> None:
    daemon = Daemon(spec(tmp_path, linger=0.5))
    started.append(daemon)
    daemon.spawn(lambda _deadline: None)
    child = int((tmp_path / "forker.pid").read_text())
    assert daemon.pid == child and daemon.running()
    adopter = Daemon(daemon.spec)  # a restarted agent finds the same child
    assert adopter.adopt() and adopter.pid == child
    daemon.stop(grace=0.0)
    wait_dead(child)
    assert not pid_alive(child) or not daemon.spec.owns(child)
    assert not (tmp_path / "forker.pid").exists()


def test_a_launcher_that_fails_is_a_daemon_that_did_not_start(tmp_path: Path, started: list[Daemon]) -> None:
    daemon = Daemon(spec(tmp_path, linger=0.0, status=1))
    started.append(daemon)
    with pytest.raises(DriverError, match="did not start"):
        daemon.spawn(lambda _deadline: None)
    assert daemon.pid is None
