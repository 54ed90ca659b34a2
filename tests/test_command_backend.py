"""The ``command`` backend with the shipped ``qemu-img`` profile, for real: qcow2 volumes, standalone
snapshots, thin clones over them, growth, idempotent repeats, an interrupted command's leftover,
a snapshot that clones still read kept hidden until the last clone goes, hostile values refused."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.fakes import MemoryExports
from vbs import ids
from vbs.errors import InvalidParameter, NotFound, PointInTimeUnavailable
from vbs.pools.exports import FileSource
from vbs.profiles import load_profile
from vbs.storage.backends.command import BACKEND_PROFILES, CommandBackend
from vbs.wire.connection import HostIdentity

pytestmark = pytest.mark.unit

MiB = 1 << 20


@pytest.fixture
def pool(tmp_path: Path) -> CommandBackend:
    return CommandBackend("default", tmp_path, load_profile(BACKEND_PROFILES, "qemu-img", []),
                          exports=MemoryExports())  # type: ignore[arg-type]


def info(path: Path) -> dict[str, object]:
    out = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(path)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def write(path: Path, offset: int, data: bytes) -> None:
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x{data[0]:02x} {offset} {len(data)}", str(path)],
                   check=True, capture_output=True, timeout=60)


def read_pattern(path: Path, offset: int, length: int, byte: int) -> bool:
    r = subprocess.run(["qemu-io", "-f", "qcow2", "-r", "-c", f"read -P 0x{byte:02x} {offset} {length}", str(path)],
                       capture_output=True, text=True, timeout=60)
    return r.returncode == 0 and "Pattern verification failed" not in r.stdout


def test_volumes_snapshots_and_thin_clones(pool: CommandBackend, tmp_path: Path) -> None:
    vol = ids.new_id("volume")
    st = pool.ensure_volume(vol, 64 * MiB)
    assert (st.state, st.size_bytes) == ("ready", 64 * MiB)
    path = tmp_path / "volumes" / f"{vol}.qcow2"
    assert info(path)["format"] == "qcow2"
    assert pool.ensure_volume(vol, 64 * MiB).state == "ready"  # a repeat answers what is there
    write(path, 0, b"\x5a" * 65536)

    snap = ids.new_id("snapshot")
    assert pool.ensure_snapshot(snap, vol).state == "ready"
    spath = tmp_path / "snapshots" / f"{snap}.qcow2"
    assert "backing-filename" not in info(spath), "a snapshot is standalone"
    write(path, 0, b"\x11" * 65536)  # the volume changes; the snapshot does not
    assert read_pattern(spath, 0, 65536, 0x5a)

    clone = ids.new_id("volume")
    assert pool.ensure_volume(clone, 128 * MiB, snap).size_bytes == 128 * MiB
    cpath = tmp_path / "volumes" / f"{clone}.qcow2"
    assert info(cpath)["backing-filename"] == str(spath)
    assert read_pattern(cpath, 0, 65536, 0x5a)
    assert pool.inventory().volumes == sorted([vol, clone]) and pool.inventory().snapshots == [snap]

    # The snapshot is removed while the clone reads through it: hidden, still on disk.
    pool.remove_snapshot(snap)
    assert pool.inventory().snapshots == [] and pool.snapshot_status(snap).state == "absent"
    assert spath.exists() and read_pattern(cpath, 0, 65536, 0x5a)
    with pytest.raises(NotFound):
        pool.ensure_volume(ids.new_id("volume"), 64 * MiB, snap)
    pool.remove_volume(clone)  # its last clone: the snapshot goes with it
    assert not spath.exists() and not cpath.exists()

    assert pool.resize_volume(vol, 96 * MiB).size_bytes == 96 * MiB
    with pytest.raises(InvalidParameter, match="can only grow"):
        pool.resize_volume(vol, 32 * MiB)
    pool.remove_volume(vol)
    pool.remove_volume(vol)  # absent is success
    assert pool.inventory().volumes == []


def test_an_interrupted_command_leaves_a_partial_that_the_next_ensure_replaces(pool: CommandBackend,
                                                                               tmp_path: Path) -> None:
    vol = ids.new_id("volume")
    partial = tmp_path / "volumes" / f"{vol}.qcow2.partial"
    partial.write_bytes(b"half an image")  # what a crash in qemu-img create left
    assert pool.volume_status(vol).state == "absent" and pool.inventory().volumes == []
    assert pool.ensure_volume(vol, 16 * MiB).state == "ready"
    assert not partial.exists()


def test_a_snapshot_of_an_exported_volume_is_the_hypervisors_to_take(pool: CommandBackend) -> None:
    vol = ids.new_id("volume")
    pool.ensure_volume(vol, 16 * MiB)
    assert isinstance(pool.exports, MemoryExports)
    pool.exports.ensure_export(vol, pool._source(pool._path("volume", vol), vol), HostIdentity(name="h", address="::1"))
    with pytest.raises(PointInTimeUnavailable):
        pool.ensure_snapshot(ids.new_id("snapshot"), vol)


def test_ids_and_sizes_are_checked_before_any_command(pool: CommandBackend, tmp_path: Path) -> None:
    for bad in ("vol-../../etc", "vol-0123 ; reboot", "$(id)", "vol-0123456789abcdef"):
        with pytest.raises(InvalidParameter):
            pool.ensure_volume(bad, 16 * MiB)
    for size in (0, -512, 513, True, 65 << 40):
        with pytest.raises(InvalidParameter):
            pool.ensure_volume(ids.new_id("volume"), size)  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path / "volumes")) == []


def test_sources_are_qcow2_with_their_virtual_size(pool: CommandBackend) -> None:
    vol = ids.new_id("volume")
    pool.ensure_volume(vol, 16 * MiB)
    source = pool._source(pool._path("volume", vol), vol)
    assert source == FileSource(source.path, "qcow2", 16 * MiB) and source.size_bytes == 16 * MiB


def test_tgt_refuses_a_qcow2_source_with_the_reason(pool: CommandBackend, tmp_path: Path) -> None:
    from vbs.storage.exports.iscsi import IscsiExportDriver

    vol = ids.new_id("volume")
    pool.ensure_volume(vol, 16 * MiB)
    iscsi = IscsiExportDriver(tmp_path / "tgt", port=3260, control_port=1)  # never started: refused before
    with pytest.raises(InvalidParameter, match="serves raw files, not qcow2"):
        iscsi.ensure_export(vol, pool._source(pool._path("volume", vol), vol), HostIdentity(name="h", address="::1"))
