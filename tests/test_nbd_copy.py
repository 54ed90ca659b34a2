"""Point-in-time copies by the NBD export driver against a real qemu-storage-daemon: the target is the
volume at the instant the copy started, also while hosts write to it; a copy whose daemon died is an
error, never restarted; cancelling; what waits for a copy (a refresh, a chain it would not see).

Copies run with a low ``copy_speed`` so that writes land while the job runs; each test runs its own
daemon in tmp_path on a free loopback port and stops it by PID at teardown.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import test_nbd_export as nbd
from tests.export_fixtures import MiB, free_port, wait_dead
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, NotFound, RetryLater
from vbs.pools.exports import FileSource
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.wire.connection import HostIdentity, NbdConnection
from vbs.wire.storage import ItemStatus

pytestmark = pytest.mark.integration

make_driver = nbd.make_driver  # fixtures shared with the export tests
VOL = nbd.VOL
SNAP = "snap-0123456789abcdef0"
SNAP2 = "snap-0fedcba9876543210"
HOST_A, HOST_B = nbd.HOST_A, nbd.HOST_B
SIZE = 32 * MiB
SLOW = 2 * MiB  # bytes/s: the job alone would take 16 s, far longer than any step of these tests

Make = Callable[..., NbdExportDriver]


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    """A volume full of pattern A (0xaa)."""
    path = tmp_path / "vol.img"
    path.write_bytes(b"\xaa" * SIZE)
    return path


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """An empty sparse file of the volume's size, as the caller makes it."""
    path = tmp_path / "snap.img"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    return path


def write(c: NbdConnection, pattern: int, offset: int, length: int) -> None:
    rc, out = nbd.qemu_io(c, f"write -P {pattern:#x} {offset} {length}")
    assert rc == 0, out


def wait_copy(drv: NbdExportDriver, copy_id: str, volume: Path, target: Path, timeout: float = 60) -> ItemStatus:
    """Poll ``ensure_copy`` until the copy is no longer running."""
    deadline = time.monotonic() + timeout
    while (st := drv.ensure_copy(copy_id, VOL, FileSource(volume), target)).state == "copying":
        assert time.monotonic() < deadline, f"copy {copy_id} still running: {st}"
        time.sleep(0.1)
    return st


def jobs(drv: NbdExportDriver) -> list[str]:
    return [j["id"] for j in nbd.qmp(drv, "query-jobs")]


def node_names(drv: NbdExportDriver) -> set[str]:
    return {n["node-name"] for n in nbd.qmp(drv, "query-named-block-nodes", {"flat": True})}


def test_copy_is_the_volume_at_its_start_while_hosts_write(make_driver: Make, volume: Path, target: Path) -> None:
    drv = make_driver(copy_speed=SLOW)
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(a, NbdConnection)

    st = drv.ensure_copy(SNAP, VOL, FileSource(volume), target)
    assert st.state == "copying" and st.size_bytes == SIZE and st.progress < 100
    write(a, 0xBB, SIZE // 2, SIZE // 2)  # pattern B over the half the job reaches last
    st = drv.ensure_copy(SNAP, VOL, FileSource(volume), target)
    assert st.state == "copying", st  # so B landed while the job ran
    # A host that attaches now joins the chain above the copy's filter: its writes are seen too.
    b = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    assert isinstance(b, NbdConnection) and len(nbd.file_nodes(drv, volume)) == 1
    write(b, 0xBB, 0, SIZE // 2)

    st = wait_copy(drv, SNAP, volume, target)
    assert st == ItemStatus(state="ready", size_bytes=SIZE, progress=100)
    assert target.read_bytes() == b"\xaa" * SIZE  # the instant the copy started
    assert volume.read_bytes() == b"\xbb" * SIZE  # every write reached the volume
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target) == st  # idempotent
    # The job, its target node and its filter are gone; the exports serve on.
    assert jobs(drv) == [] and nbd.file_nodes(drv, target) == []
    write(a, 0xCC, 0, 4096)
    rc, out = nbd.qemu_io(b, "read -P 0xcc 0 4k")
    assert rc == 0, out
    assert target.read_bytes()[:4096] == b"\xaa" * 4096

    drv.remove_copy(SNAP)
    drv.remove_copy(SNAP)  # idempotent
    drv.remove_export(VOL, HOST_A.name)
    drv.remove_export(VOL, HOST_B.name)
    assert node_names(drv) == set() and VOL not in drv.state_path.read_text()


def test_copy_of_a_volume_no_host_uses(make_driver: Make, volume: Path, target: Path) -> None:
    """The copy opens the volume itself and closes it when it is done."""
    drv = make_driver()
    assert wait_copy(drv, SNAP, volume, target).state == "ready"
    assert target.read_bytes() == volume.read_bytes()
    assert node_names(drv) == set()  # nothing held open: no export, no job
    assert not drv.is_exported(VOL) and drv.list_exports() == []


def test_copy_after_the_daemon_was_killed_is_an_error(make_driver: Make, volume: Path, target: Path) -> None:
    drv = make_driver(copy_speed=SLOW)
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "copying"
    pid = drv.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)

    st = drv.ensure_copy(SNAP, VOL, FileSource(volume), target)  # the daemon comes back without the job
    assert st.state == "error" and st.error is not None and "point in time is lost" in st.error
    assert drv.pid not in (None, pid) and jobs(drv) == []
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target) == st  # never restarted
    assert drv.ensure_export(VOL, FileSource(volume), HOST_A) == a  # the export came back
    rc, out = nbd.qemu_io(a, "read -P 0xaa 0 4k")  # type: ignore[arg-type]
    assert rc == 0, out
    drv.remove_copy(SNAP)
    assert nbd.file_nodes(drv, target) == []


def test_check_after_a_daemon_death_drops_the_chain_of_a_lost_copy(make_driver: Make, volume: Path,
                                                                  target: Path) -> None:
    drv = make_driver(copy_speed=SLOW)
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "copying"
    pid = drv.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    drv.check()
    assert node_names(drv) == set()  # the chain only the job held is not re-opened
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "error"


def test_remove_copy_cancels_it_midway(make_driver: Make, volume: Path, target: Path) -> None:
    drv = make_driver(copy_speed=SLOW)
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "copying"
    assert jobs(drv) != [] and nbd.file_nodes(drv, volume) != []
    drv.remove_copy(SNAP)
    assert jobs(drv) == [] and node_names(drv) == set()  # job, target, filter and chain gone
    drv.remove_copy(SNAP)
    assert SNAP not in drv.state_path.read_text()


def test_a_restarted_agent_finds_a_running_copy(make_driver: Make, volume: Path, target: Path) -> None:
    port = free_port()
    first = make_driver(port=port, copy_speed=SLOW)
    a = first.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(a, NbdConnection)
    assert first.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "copying"
    pid = first.pid
    first.close()
    second = make_driver(port=port, copy_speed=SLOW)
    second.start()
    assert second.pid == pid  # adopted, with the job running in it
    assert second.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "copying"
    write(a, 0xBB, 0, SIZE)  # every block copied before it is overwritten: the job is done at once
    assert wait_copy(second, SNAP, volume, target).state == "ready"
    assert target.read_bytes() == b"\xaa" * SIZE and volume.read_bytes() == b"\xbb" * SIZE


def test_refresh_and_new_chains_wait_for_a_copy(make_driver: Make, volume: Path, target: Path) -> None:
    drv = make_driver(copy_speed=SLOW)
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "copying"
    os.truncate(volume, 2 * SIZE)
    with pytest.raises(RetryLater):  # a new chain would escape the copy's filter
        drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    with pytest.raises(RetryLater):  # so would a new host's export on a chain of the new size
        drv.ensure_export(VOL, FileSource(volume), HOST_B)
    assert drv.ensure_export(VOL, FileSource(volume), HOST_A) == a  # a host that has one keeps it

    drv.remove_copy(SNAP)
    a2 = drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    assert isinstance(a2, NbdConnection) and nbd.nbd_sizes(drv.port)[a2.export] == 2 * SIZE


def test_a_copy_waits_for_hosts_still_on_an_older_chain(make_driver: Make, volume: Path, target: Path) -> None:
    drv = make_driver()
    drv.ensure_export(VOL, FileSource(volume), HOST_A)
    os.truncate(volume, 2 * SIZE)
    os.truncate(target, 2 * SIZE)
    drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    with pytest.raises(RetryLater):  # A may still write through chain 0, which the copy would not see
        drv.ensure_copy(SNAP, VOL, FileSource(volume), target)
    drv.retire_exports(VOL, HOST_A.name)
    assert wait_copy(drv, SNAP, volume, target).state == "ready"


def test_two_copies_of_one_volume_at_once(make_driver: Make, volume: Path, target: Path, tmp_path: Path) -> None:
    drv = make_driver(copy_speed=SLOW)
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(a, NbdConnection)
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "copying"
    write(a, 0xBB, 0, SIZE // 2)
    second = tmp_path / "snap2.img"
    with open(second, "wb") as f:
        f.truncate(SIZE)
    assert drv.ensure_copy(SNAP2, VOL, FileSource(volume), second).state == "copying"
    b = drv.ensure_export(VOL, FileSource(volume), HOST_B)  # on top of both filters
    assert isinstance(b, NbdConnection)
    write(b, 0xCC, 0, SIZE)
    assert wait_copy(drv, SNAP, volume, target).state == "ready"
    assert wait_copy(drv, SNAP2, volume, second).state == "ready"
    assert target.read_bytes() == b"\xaa" * SIZE
    assert second.read_bytes() == b"\xbb" * (SIZE // 2) + b"\xaa" * (SIZE // 2)
    assert volume.read_bytes() == b"\xcc" * SIZE


def test_bad_copy_requests_are_refused(make_driver: Make, volume: Path, target: Path, tmp_path: Path) -> None:
    drv = make_driver(copy_speed=SLOW)
    with pytest.raises(InvalidParameter):
        drv.ensure_copy("vol-0123456789abcdef0", VOL, FileSource(volume), target)  # a copy is a snapshot
    with pytest.raises(InvalidParameter):
        drv.ensure_copy(SNAP, VOL, FileSource(volume), Path("relative.img"))
    with pytest.raises(NotFound):
        drv.ensure_copy(SNAP, VOL, FileSource(volume), tmp_path / "missing.img")
    small = tmp_path / "small.img"
    small.write_bytes(b"\0" * MiB)
    with pytest.raises(InvalidParameter, match="bytes"):
        drv.ensure_copy(SNAP, VOL, FileSource(volume), small)
    assert drv.list_exports() == [] and not drv.state_path.exists()  # nothing was recorded
    assert drv.ensure_copy(SNAP, VOL, FileSource(volume), target).state == "copying"
    with pytest.raises(IdempotentParameterMismatch):
        drv.ensure_copy(SNAP, VOL, FileSource(volume), small)
    host = HostIdentity(name="hv-z", address="127.0.0.9")
    drv.ensure_export(VOL, FileSource(volume), host)
    drv.remove_copy(SNAP)
    drv.remove_export(VOL, host.name)
    assert node_names(drv) == set()


def test_a_copy_is_flushed_to_the_disk_before_it_is_ready(make_driver: Make, volume: Path, target: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon writes the target through the page cache: the driver fsyncs it before it says ready,
    and a flush that fails is an error of that call, asked again by the next one (never a ready copy
    whose data may still be only in memory)."""
    from vbs.storage.exports.nbd import copies as nbd_copies

    flushed: list[str] = []
    failing = [True]

    def fsync_path(path: str) -> None:
        if failing[0]:
            failing[0] = False
            raise OSError(5, "Input/output error")
        flushed.append(path)

    monkeypatch.setattr(nbd_copies, "fsync_path", fsync_path)
    drv = make_driver()
    deadline = time.monotonic() + 60
    while True:
        try:
            st = drv.ensure_copy(SNAP, VOL, FileSource(volume), target)
        except DriverError as exc:
            assert "cannot flush" in exc.message and not flushed
            continue
        if st.state != "copying":
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.1)
    assert st.state == "ready" and flushed == [str(target)] and not failing[0]
    assert target.read_bytes() == volume.read_bytes()
