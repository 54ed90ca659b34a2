"""The rbd backend's long-lived worker (``rbd_worker``) on the session's real Ceph: the snapshot path
through it, the same answers and errnos as the ``rbd`` tool, a worker killed or stopped mid-call
replaced (the call retried or failed as a killed tool would), and the tool as the fallback."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ceph_cluster import CephForTests
from tests.conftest import wait_until
from vbs import ids
from vbs.errors import DriverError, NotFound
from vbs.net.ports import free_port
from vbs.storage.backends.rbd import RbdBackend
from vbs.storage.backends.rbd_chains import parse_parent
from vbs.storage.backends.rbd_cli import EEXIST, ENOENT, RbdTools, ToolError
from vbs.system.processes import pid_alive

GIB = 1 << 30


pytestmark = pytest.mark.integration


def _backend(ceph: CephForTests, **kw: object) -> RbdBackend:
    # No maintenance pass during the test: every call the test counts is its own.
    return RbdBackend("default", ceph.conf_path, rbd_pool=ceph.new_pool(), maintenance_interval_s=3600,
                      **kw)  # type: ignore[arg-type]


@pytest.fixture
def backend(ceph: CephForTests) -> Iterator[RbdBackend]:
    b = _backend(ceph, timeout_s=3.0)
    yield b
    b.close()


def _worker_pid(backend: RbdBackend) -> int:
    worker = backend._cli.worker
    assert worker is not None
    pid = worker.pid
    assert pid is not None
    return pid


def test_the_snapshot_path_runs_through_one_worker_without_a_secret_on_argv_or_env(
        backend: RbdBackend, ceph: CephForTests) -> None:
    vol = ids.new_id("volume")
    backend.ensure_volume(vol, GIB)
    snaps = [ids.new_id("snapshot") for _ in range(3)]
    for snap in snaps:
        assert backend.ensure_snapshot(snap, vol).size_bytes == GIB
    assert backend.ensure_snapshot(snaps[0], vol).state == "ready"  # a repeat: EEXIST from the worker
    assert sorted(backend.inventory().snapshots) == sorted(snaps)
    backend.remove_snapshot(snaps[1])
    assert backend.snapshot_status(snaps[1]).state == "absent"
    worker = backend._cli.worker
    assert worker is not None and worker.started == 1
    pid = _worker_pid(backend)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    key = ceph.admin_key().encode()
    assert not any(key in part for part in cmdline + environ)
    assert {e.split(b"=")[0] for e in environ if e} == {b"PATH", b"LC_ALL"}
    backend.close()
    assert not pid_alive(pid)


def test_the_worker_answers_as_the_tool_does(backend: RbdBackend, ceph: CephForTests) -> None:
    """The same listing (volumes, snapshots, clones, the trash and what keeps it) and the same errnos."""
    vol, snap, clone, snap2 = ids.new_id("volume"), ids.new_id("snapshot"), ids.new_id("volume"), ids.new_id("snapshot")
    live_clone, snap3 = ids.new_id("volume"), ids.new_id("snapshot")
    backend.ensure_volume(vol, GIB)
    backend.ensure_snapshot(snap, vol)
    backend.ensure_volume(clone, 2 * GIB, snap)
    backend.ensure_snapshot(snap2, clone)
    backend.ensure_volume(live_clone, 2 * GIB, snap2)  # a clone of a snapshot of a trashed image, below
    backend.ensure_snapshot(snap3, live_clone)
    backend.remove_volume(clone)  # into the trash: its snapshot stays
    backend.remove_snapshot(snap)  # into the image's trash namespace: the trashed clone reads it
    tools = RbdTools("default", ceph.conf_path, "admin", backend.rbd_pool, 30.0, worker=False)
    via_worker, via_tool = backend._cli.listing(), tools.listing()
    assert via_worker == via_tool
    assert clone in via_worker.trash and snap2 in via_worker.snapshots
    assert via_worker.chain(live_clone)[0] == f"{clone}@{snap2}" and len(via_worker.chain(live_clone)) == 2
    # A parent trashed or not, as the tool's ``ls -l`` and ``info`` tell it.
    [row] = [r for r in json.loads(backend._cli.rbd("ls", "-l", "--format", "json", backend.rbd_pool))
             if r["image"] == live_clone and "snapshot" not in r]
    assert parse_parent(row) == parse_parent(json.loads(tools.rbd("info", "--format", "json",
                                                                  tools.spec(live_clone))))
    assert parse_parent(row) is not None and parse_parent(row)[2] is not None
    spec = backend._cli.spec(vol, snap2)
    backend._cli.rbd("snap", "create", spec)
    for cli in (backend._cli, tools):
        with pytest.raises(ToolError) as exists:
            cli.rbd("snap", "create", spec)
        assert exists.value.errno == EEXIST
        with pytest.raises(ToolError) as missing:
            cli.rbd("snap", "rm", cli.spec(vol, ids.new_id("snapshot")))
        assert missing.value.errno == ENOENT
        with pytest.raises(ToolError) as no_image:
            cli.rbd("snap", "ls", "--all", "--format", "json", cli.spec(ids.new_id("volume")))
        assert no_image.value.errno == ENOENT
    with pytest.raises(NotFound):
        backend.ensure_snapshot(ids.new_id("snapshot"), ids.new_id("volume"))
    worker = backend._cli.worker
    assert worker is not None and worker.started == 1


def _in_thread(call: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _stop(pid: int) -> None:
    """SIGSTOP the worker and wait until it is stopped: a worker that has not run since the signal
    would take the next request off its pipe before it stops (a read that finds data returns first),
    and the request would never be seen waiting there."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T", 30,
               what=f"worker {pid} stopped")


def _wait_sent(pid: int) -> None:
    """Until the stopped worker's stdin pipe holds the request (the agent wrote it): the pipe,
    opened again through /proc, tells how many bytes wait in it."""
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            waiting = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
            if int.from_bytes(waiting, sys.byteorder) > 0:
                return
            time.sleep(0.02)
    finally:
        os.close(fd)
    raise AssertionError("the request never reached the worker")


def test_a_worker_killed_mid_read_is_replaced_and_the_read_asked_again(backend: RbdBackend) -> None:
    vol, snap = ids.new_id("volume"), ids.new_id("snapshot")
    backend.ensure_volume(vol, GIB)
    backend.ensure_snapshot(snap, vol)
    pid = _worker_pid(backend)
    _stop(pid)
    t, out = _in_thread(lambda: backend.snapshot_status(snap))
    _wait_sent(pid)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert out and not isinstance(out[0], Exception), out
    assert getattr(out[0], "state", None) == "ready"
    assert not pid_alive(pid)
    assert _worker_pid(backend) != pid
    worker = backend._cli.worker
    assert worker is not None and worker.started == 2


def test_a_worker_killed_mid_write_fails_the_call_and_the_next_one_runs_on_a_new_worker(
        backend: RbdBackend) -> None:
    vol, snap = ids.new_id("volume"), ids.new_id("snapshot")
    backend.ensure_volume(vol, GIB)
    backend.ensure_snapshot(ids.new_id("snapshot"), vol)
    pid = _worker_pid(backend)
    _stop(pid)
    t, out = _in_thread(lambda: backend.ensure_snapshot(snap, vol))
    _wait_sent(pid)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert out and isinstance(out[0], DriverError) and "rbd worker ended" in out[0].message, out
    assert not pid_alive(pid)
    assert backend.ensure_snapshot(snap, vol).state == "ready"  # the controller's retry of the step
    assert _worker_pid(backend) != pid


def test_a_stopped_worker_fails_the_call_after_its_timeout_and_is_replaced(backend: RbdBackend) -> None:
    vol, snap = ids.new_id("volume"), ids.new_id("snapshot")
    backend.ensure_volume(vol, GIB)
    backend.ensure_snapshot(ids.new_id("snapshot"), vol)
    pid = _worker_pid(backend)
    _stop(pid)
    with pytest.raises(DriverError, match="did not answer within 3s"):
        backend.ensure_snapshot(snap, vol)
    assert not pid_alive(pid)  # killed by its PID and reaped
    assert backend.ensure_snapshot(snap, vol).state == "ready"
    assert _worker_pid(backend) != pid


def test_without_the_bindings_the_tool_serves_every_call_and_says_so_once(
        ceph: CephForTests, caplog: pytest.LogCaptureFixture) -> None:
    # The agent's venv Python has no python3-rados: the worker exits at its import.
    backend = _backend(ceph, worker_python=Path(sys.executable))
    try:
        with caplog.at_level(logging.WARNING, logger="vbs.storage.backends.rbd_worker"):
            vol = ids.new_id("volume")
            backend.ensure_volume(vol, GIB)
            snaps = [ids.new_id("snapshot") for _ in range(2)]
            for snap in snaps:
                assert backend.ensure_snapshot(snap, vol).state == "ready"
            backend.remove_snapshot(snaps[0])
            assert backend.inventory().snapshots == [snaps[1]]
        worker = backend._cli.worker
        assert worker is not None and worker.disabled and worker.started == 1 and worker.pid is None
        said = [r for r in caplog.records if "no python3-rados" in r.getMessage()]
        assert len(said) == 1
    finally:
        backend.close()


def test_a_worker_that_cannot_connect_fails_the_call_and_the_tool_serves_the_next_ones(
        ceph: CephForTests, tmp_path: Path) -> None:
    """A conf whose monitor does not answer (a closed port): the worker says why it did not connect,
    the call fails with it, and the calls after it go to the tool (which fails the same way) until
    the worker is tried again."""
    conf = tmp_path / "ceph.conf"
    text = ceph.conf_path.read_text()
    lines = [f"mon host = [v2:127.0.0.1:{free_port()}]" if line.strip().startswith("mon host") else line
             for line in text.splitlines()]
    assert lines != text.splitlines(), "the conf names its monitors in 'mon host'"
    conf.write_text("\n".join(lines) + "\n")
    tools = RbdTools("default", conf, "admin", ceph.new_pool(), 2.0)
    try:
        with pytest.raises(DriverError, match="rbd worker could not connect"):
            tools.rbd("ls", "-l", "--format", "json", tools.rbd_pool)
        with pytest.raises(DriverError) as by_tool:
            tools.rbd("ls", "-l", "--format", "json", tools.rbd_pool)
        assert "rbd worker" not in by_tool.value.message
        worker = tools.worker
        assert worker is not None and worker.started == 1 and worker.pid is None and not worker.disabled
    finally:
        tools.close()
