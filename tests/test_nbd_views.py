"""Point-in-time views by the NBD export driver against a real qemu-storage-daemon (QEMU's fleecing:
copy-before-write into a sparse scratch file, a snapshot-access node shown as a file): the view reads
the volume as it was when it was taken while hosts overwrite it, the scratch file holds only what they
overwrote, and nothing of a view is left in the daemon or on disk once it is removed, lost with its
daemon, or found after an agent restart.

Each test runs its own daemon in tmp_path on a free loopback port, stopped by PID at teardown.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import test_nbd_copy as copies
from tests import test_nbd_export as nbd
from tests.export_fixtures import MiB, free_port, wait_dead
from vbs.errors import DriverError, NotFound, RetryLater
from vbs.pools.exports import FileSource, PointInTimeViewer
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.system.mounts import is_mounted
from vbs.wire.connection import NbdConnection

pytestmark = pytest.mark.integration

make_driver = nbd.make_driver
VOL, SNAP, SNAP2 = nbd.VOL, copies.SNAP, copies.SNAP2
HOST_A, HOST_B = nbd.HOST_A, nbd.HOST_B
SIZE = 32 * MiB
write = copies.write
node_names = copies.node_names

Make = Callable[..., NbdExportDriver]


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    """A sparse volume: pattern A (0xaa) in its first 8 MiB and at 16 MiB, holes elsewhere."""
    path = tmp_path / "vol.img"
    with open(path, "wb") as f:
        f.write(b"\xaa" * (8 * MiB))
        f.seek(16 * MiB)
        f.write(b"\xaa" * MiB)
        f.truncate(SIZE)
    return path


def expected_a() -> bytes:
    return b"\xaa" * (8 * MiB) + bytes(8 * MiB) + b"\xaa" * MiB + bytes(SIZE - 17 * MiB)


def data_extents(path: Path) -> list[tuple[int, int]]:
    """The data ranges SEEK_DATA/SEEK_HOLE report (what the upload reads; holes are skipped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out, offset = [], 0
        while offset < SIZE:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, end))
            offset = end
        return out
    finally:
        os.close(fd)


def without_view(data: Any, view_id: str) -> Any:
    """The state file's JSON without the record of one view."""
    if isinstance(data, dict):
        return {k: [v for v in without_view(x, view_id) if not (isinstance(v, dict) and v.get("id") == view_id)]
                if k == "views" else without_view(x, view_id) for k, x in data.items()}
    if isinstance(data, list):
        return [without_view(x, view_id) for x in data]
    return data


def test_a_view_is_the_volume_at_its_instant_while_hosts_write(make_driver: Make, volume: Path,
                                                               tmp_path: Path) -> None:
    drv = make_driver()
    assert isinstance(drv, PointInTimeViewer)
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(a, NbdConnection)
    scratch = tmp_path / "scratch"
    st = drv.ensure_view(SNAP, VOL, FileSource(volume), scratch)
    assert st.state == "ready" and st.size_bytes == SIZE
    view = drv.view_path(SNAP)
    assert view.parent == drv.state_dir / "views" and view.stat().st_mode & 0o777 == 0o400
    assert (drv.state_dir / "views").stat().st_mode & 0o777 == 0o700 and scratch.stat().st_mode & 0o777 == 0o600

    write(a, 0xBB, 0, 4 * MiB)  # over data the view must keep
    write(a, 0xBB, 24 * MiB, MiB)  # into a hole
    # A host that attaches now joins the same chain, above the filter: its writes are seen too.
    b = drv.ensure_export(VOL, FileSource(volume), HOST_B)
    assert isinstance(b, NbdConnection) and len(nbd.file_nodes(drv, volume)) == 1
    write(b, 0xCC, 16 * MiB, MiB)

    assert view.read_bytes() == expected_a(), "the view is the volume at its instant"
    assert drv.ensure_view(SNAP, VOL, FileSource(volume), scratch) == st  # idempotent
    with open(volume, "rb") as f:
        now = f.read()
    assert now[:4 * MiB] == b"\xbb" * (4 * MiB) and now[16 * MiB:17 * MiB] == b"\xcc" * MiB
    assert now[24 * MiB:25 * MiB] == b"\xbb" * MiB, "every write reached the volume"
    # The scratch file holds only what was overwritten: 6 MiB of a 32 MiB volume (QEMU copies whole clusters).
    assert scratch.stat().st_blocks * 512 <= 7 * MiB
    # The view's holes are the volume's holes at its instant (the range written into a hole since reads
    # as data of zeros: its old zeros went to the scratch file).
    extents = data_extents(view)
    assert extents[0] == (0, 8 * MiB) and (8 * MiB, 16 * MiB) not in extents
    assert all(not (s < 12 * MiB < e) for s, e in extents), "the hole at 12 MiB is a hole in the view"

    with pytest.raises(RetryLater):  # a new chain (a resize) would escape the view's filter
        os.truncate(volume, 2 * SIZE)
        drv.refresh_export(VOL, FileSource(volume), HOST_A.name)
    os.truncate(volume, SIZE)

    drv.remove_view(SNAP)
    drv.remove_view(SNAP)  # idempotent
    assert not scratch.exists() and not view.exists() and not is_mounted(view)
    assert not any(n.startswith(("vbsv", "vbsw", "vbsl", "vbsx")) for n in node_names(drv))
    with pytest.raises(NotFound):
        drv.view_path(SNAP)
    write(a, 0xDD, 0, 4096)  # the exports serve on, on the raw node again
    rc, out = nbd.qemu_io(b, "read -P 0xdd 0 4k")
    assert rc == 0, out
    drv.remove_export(VOL, HOST_A.name)
    drv.remove_export(VOL, HOST_B.name)
    assert node_names(drv) == set() and VOL not in drv.state_path.read_text()


def test_a_view_of_a_volume_no_host_uses(make_driver: Make, volume: Path, tmp_path: Path) -> None:
    """The view opens the volume itself, for as long as it is held."""
    drv = make_driver()
    scratch = tmp_path / "scratch"
    assert drv.ensure_view(SNAP, VOL, FileSource(volume), scratch).state == "ready"
    assert drv.view_path(SNAP).read_bytes() == expected_a()
    assert scratch.stat().st_blocks == 0, "nobody wrote: the scratch file stays empty"
    assert not drv.is_exported(VOL) and drv.list_exports() == []
    drv.remove_view(SNAP)
    assert node_names(drv) == set() and not scratch.exists()
    assert VOL not in drv.state_path.read_text()


def test_a_view_lost_with_its_daemon_is_an_error_and_leaves_nothing(make_driver: Make, volume: Path,
                                                                    tmp_path: Path) -> None:
    drv = make_driver()
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    scratch = tmp_path / "scratch"
    assert drv.ensure_view(SNAP, VOL, FileSource(volume), scratch).state == "ready"
    view = drv.view_path(SNAP)
    pid = drv.pid
    assert pid is not None and is_mounted(view)
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)

    drv.check()  # the watcher's restart: the export comes back, the view's leftovers go
    assert drv.pid not in (None, pid)
    assert not is_mounted(view) and not view.exists() and not scratch.exists()
    st = drv.ensure_view(SNAP, VOL, FileSource(volume), scratch)
    assert st.state == "error" and st.error is not None and "point in time is lost" in st.error
    assert not scratch.exists(), "never re-made"
    with pytest.raises(DriverError, match="point in time is lost"):
        drv.view_path(SNAP)
    assert drv.ensure_export(VOL, FileSource(volume), HOST_A) == a
    rc, out = nbd.qemu_io(a, "read -P 0xaa 0 4k")  # type: ignore[arg-type]
    assert rc == 0, out
    drv.remove_view(SNAP)
    assert SNAP not in drv.state_path.read_text()
    assert not any(n.startswith(("vbsv", "vbsw", "vbsl", "vbsx")) for n in node_names(drv))


def test_a_restarted_agent_keeps_a_live_view_and_sweeps_stale_ones(make_driver: Make, volume: Path,
                                                                   tmp_path: Path) -> None:
    port = free_port()
    first = make_driver(port=port)
    a = first.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(a, NbdConnection)
    assert first.ensure_view(SNAP, VOL, FileSource(volume), tmp_path / "scratch").state == "ready"
    assert first.ensure_view(SNAP2, VOL, FileSource(volume), tmp_path / "scratch2").state == "ready"
    stale_view = first.view_path(SNAP2)
    pid = first.pid
    first.close()
    # The second view's record is lost (as with a state file restored from before it was taken).
    state = json.loads(first.state_path.read_text())
    first.state_path.write_text(json.dumps(without_view(state, SNAP2)))

    second = make_driver(port=port)
    second.start()
    assert second.pid == pid  # adopted, with the live view in it
    write(a, 0xBB, 0, 8 * MiB)
    assert second.view_path(SNAP).read_bytes() == expected_a(), "the view survives an agent restart"
    assert not is_mounted(stale_view) and not stale_view.exists(), "a view no record names is swept"
    names = node_names(second)
    assert sum(n.startswith("vbsw") for n in names) == 1
    second.remove_view(SNAP)
    assert not any(n.startswith(("vbsv", "vbsw", "vbsl", "vbsx")) for n in node_names(second))


def test_views_stack_and_go_in_any_order(make_driver: Make, volume: Path, tmp_path: Path) -> None:
    """A second snapshot while the first one's upload runs: each view keeps its own instant, and the
    older one can end first."""
    drv = make_driver()
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(a, NbdConnection)
    assert drv.ensure_view(SNAP, VOL, FileSource(volume), tmp_path / "scratch").state == "ready"
    write(a, 0xBB, 0, MiB)
    assert drv.ensure_view(SNAP2, VOL, FileSource(volume), tmp_path / "scratch2").state == "ready"
    write(a, 0xCC, 0, 2 * MiB)
    second = expected_a()
    second = b"\xbb" * MiB + second[MiB:]
    assert drv.view_path(SNAP).read_bytes() == expected_a()
    assert drv.view_path(SNAP2).read_bytes() == second
    drv.remove_view(SNAP)  # the lower one first
    write(a, 0xDD, 0, 4 * MiB)
    assert drv.view_path(SNAP2).read_bytes() == second, "the newer view keeps its instant"
    drv.remove_view(SNAP2)
    assert not any(n.startswith(("vbsv", "vbsw", "vbsl", "vbsx")) for n in node_names(drv))
    rc, out = nbd.qemu_io(a, "read -P 0xdd 0 4M")
    assert rc == 0, out


def test_a_view_read_in_whole_clusters_is_exact_where_hosts_overwrote_every_other_one(
        make_driver: Make, volume: Path, tmp_path: Path) -> None:
    """What the upload relies on (``file_streams.VIEW_READ_UNIT``): aligned 64 KiB reads of the view, with
    read-ahead off, give the instant even where clusters a host overwrote alternate with untouched ones,
    and where a host zeroed the volume with unmap (its file then has a hole there, the view has data)."""
    drv = make_driver()
    a = drv.ensure_export(VOL, FileSource(volume), HOST_A)
    assert isinstance(a, NbdConnection)
    assert drv.ensure_view(SNAP, VOL, FileSource(volume), tmp_path / "scratch").state == "ready"
    for k in range(0, 8 * MiB, 128 << 10):
        write(a, 0xBB, k, 4096)
    rc, out = nbd.qemu_io(a, f"write -z -u {16 * MiB} {MiB}")
    assert rc == 0, out
    fd = os.open(drv.view_path(SNAP), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        got = b"".join(os.pread(fd, 64 << 10, k) for k in range(0, SIZE, 64 << 10))
    finally:
        os.close(fd)
    assert got == expected_a()
    assert all(not s <= 16 * MiB < e for s, e in data_extents(volume)), "the volume file has a hole there now"
    drv.remove_view(SNAP)
