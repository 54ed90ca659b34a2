"""Full disks, for real: a storage pool on a small ext4 filesystem that a guest fills through a thin
volume, and the metadata database on a tiny filesystem that fills up (docs/operations.md "A full pool",
"A full metadata disk").

Each ``vbs up`` here has its pool (``var/pool``) on a 192 MiB ext4 loop filesystem, and a test guest (QEMU,
TCG) writes numbered 1 MiB blocks to a 1 GiB volume that cannot all fit. What the guest sees depends on
the export:
- NBD (the default): the export daemon answers ENOSPC, and the guest's QEMU stops the VM on that write
  (``werror=enospc``, virtio-blk's default), so no write fails in the guest; the host agent retries it
  every few seconds, and once space is freed the VM runs on by itself and every block lands.
- iSCSI (tgtd): tgtd answers a medium error, which QEMU reports to the guest as EIO: the write fails in
  the guest (``I/O error, dev vdX``), the blocks acknowledged before it stay, and the guest's writes
  succeed again once space is freed.
The NBD install also keeps its SQLite database on a 32 MiB filesystem, which the last test fills.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Vbs, VbsUp, node_token, wait_until
from tests.loopfs import loop_filesystem
from tests.numbered_blocks import NumberedBlocks
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest

pytestmark = pytest.mark.integration

MIB = 1 << 20
POOL_MIB = 192
DB_MIB = 32
FREE_BEFORE_WRITES_MIB = 24  # room left in the pool when the guest starts writing
HELD_CREATE = {"kind": "create-volume", "step": "storage-create"}
BLOCKS = NumberedBlocks(writes=48, slots=48, stride=1, block=MIB)  # twice what fits


@dataclass
class FullDisks:
    vbs: Vbs
    up: VbsUp
    guest: TestGuest
    pool: Path  # the pool's filesystem (var/pool)
    db_dir: Path | None  # the database's filesystem, if it has one of its own


@contextmanager
def _install(tmp: Path, *extra: str, db_mib: int | None = None) -> Iterator[FullDisks]:
    """``vbs up EXTRA`` whose pool is a small ext4 filesystem (and its database another, with ``db_mib``),
    and its booted guest vm1."""
    with ExitStack() as stack:
        pool = stack.enter_context(loop_filesystem(tmp, "ext4", POOL_MIB))
        db_dir = stack.enter_context(loop_filesystem(tmp, "ext4", db_mib)) if db_mib else None
        (tmp / "var").mkdir(mode=0o700)
        (tmp / "var" / "pool").symlink_to(pool)
        db = ["--database-url", f"sqlite:///{db_dir}/vbs.db"] if db_dir else []
        up = VbsUp(tmp / "var", tmp / "up.log", extra=[*db, "--overcommit-ratio", "1000", *extra],
                   env={"VBS_TEST_HOOKS": "1"})
        guest = TestGuest("vm1", tmp / "guests", build_guest(), tmp / "var" / "vms")
        stack.callback(up.stop)
        stack.callback(guest.stop)  # before vbs up stops: its host agent holds the guest's monitor
        guest.start()
        vbs = up.start()
        guest.wait_ready(120)
        yield FullDisks(vbs, up, guest, pool, db_dir)


@pytest.fixture(scope="module")
def disks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullDisks]:
    with _install(tmp_path_factory.mktemp("full-disks"), db_mib=DB_MIB) as found:
        yield found


@pytest.fixture
def iscsi_disks(tmp_path: Path) -> Iterator[FullDisks]:
    """Its one test runs first, and its install stops before the module's other one starts."""
    with _install(tmp_path, "--export", "iscsi") as found:
        yield found


def _writer(dev: str, start: int = 0) -> str:
    """A guest shell loop writing blocks ``start``.. of BLOCKS in order, each durable before the next; it
    says where it stopped if a write fails."""
    return (f"i={start}; while [ $i -lt {BLOCKS.writes} ]; do "
            "printf 'VBS-BLOCK-%08d\\n' $i > /run/blk; "
            f"dd if=/run/blk of=/dev/{dev} bs={BLOCKS.block} seek=$i conv=sync,notrunc,fsync oflag=direct "
            "2>/dev/null || { echo failed at $i; exit 1; }; i=$((i+1)); done; echo wrote $i")


def _full_pool_under_a_writer(disks: FullDisks) -> tuple[str, str, str]:
    """A filler volume that leaves FREE_BEFORE_WRITES_MIB in the pool, and a 1 GiB volume attached to vm1:
    (filler, volume, the guest's name for its disk)."""
    vbs = disks.vbs
    filler = _new_volume(vbs)
    _fill_file(disks.pool / "volumes" / f"{filler}.raw", FREE_BEFORE_WRITES_MIB * MIB)
    vol = _new_volume(vbs)  # 1 GiB, thin: far more than the pool has free
    attached = vbs.http.post(f"/v1/volumes/{vol}/attach", json={"instance_id": vbs.instance("vm1"), "device": "vdb"})
    assert attached.status_code == 200, attached.text
    vbs.wait_volume(vol, "in-use")
    return filler, vol, disks.guest.wait_for_disk(virtio_serial(vol), 30)


def _pool(vbs: Vbs) -> dict[str, Any]:
    nodes = vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]
    return dict(nodes[0]["pools"][0])


def _metric(vbs: Vbs, name: str) -> float:
    for family in text_string_to_metric_families(vbs.http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"no {name} in /metrics")


def _new_volume(vbs: Vbs, gib: int = 1) -> str:
    vol = str(vbs.create_volume(size_gib=gib)["volume_id"])
    vbs.wait_volume(vol, "available")
    return vol


def _fill_file(path: Path, leave_bytes: int) -> None:
    """Allocate ``path`` (a volume's file) until its filesystem has ``leave_bytes`` free."""
    st = os.statvfs(path.parent)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - leave_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def _paused_for_space(guest: TestGuest) -> bool:
    return bool(guest.qmp("query-status")["status"] == "io-error")


def test_an_iscsi_guest_filling_its_pool_gets_an_io_error_and_keeps_every_acknowledged_block(
        iscsi_disks: FullDisks) -> None:
    vbs, guest = iscsi_disks.vbs, iscsi_disks.guest
    filler, vol, dev = _full_pool_under_a_writer(iscsi_disks)
    rc, out = guest.run(_writer(dev), timeout=600)
    assert rc == 1 and out.startswith("failed at "), out
    failed_at = int(out.split()[-1])
    assert FREE_BEFORE_WRITES_MIB // 2 < failed_at < BLOCKS.writes
    assert guest.qmp("query-status")["status"] == "running"  # not paused: the guest got the error
    assert "I/O error" in guest.check("dmesg")
    wait_until(lambda: _pool(vbs)["full"], 30, what="the pool reported full")
    created = vbs.http.post("/v1/volumes", json={"size_gib": 1})
    assert (created.status_code, created.json()["error"]["code"]) == (503, "InsufficientVolumeCapacity")

    assert vbs.http.delete(f"/v1/volumes/{filler}").status_code == 200
    # Every block acknowledged before the error is there; the guest's writes go on once space is freed
    # (the delete runs after its answer: the guest writes again once the filler's file is gone).
    assert BLOCKS.blocks_in(iscsi_disks.pool / "volumes" / f"{vol}.raw") >= set(range(failed_at))
    wait_until(lambda: not (iscsi_disks.pool / "volumes" / f"{filler}.raw").exists(), 120, interval=0.5,
               what="the filler's file removed")
    assert guest.check(_writer(dev, failed_at), timeout=600).strip() == f"wrote {BLOCKS.writes}"
    assert BLOCKS.blocks_in(iscsi_disks.pool / "volumes" / f"{vol}.raw") == set(range(BLOCKS.writes))


def test_a_guest_filling_its_pool_waits_paused_creates_are_refused_and_it_runs_on_once_space_is_freed(
        disks: FullDisks) -> None:
    vbs, guest = disks.vbs, disks.guest
    filler, vol, dev = _full_pool_under_a_writer(disks)
    writer = guest.run_background(_writer(dev), timeout=600)
    try:
        # The write that finds no space stops the VM: nothing fails in the guest, its write waits.
        wait_until(lambda: _paused_for_space(guest) or writer.done(), 300, what="the guest paused on a full pool")
        assert not writer.done(), writer.result()
        pool = wait_until(lambda: (p := _pool(vbs))["full"] and p, 30, what="the pool reported full")
        assert pool["free_bytes"] < MIB
        assert _metric(vbs, "vbs_pool_full") == 1
        assert _metric(vbs, "vbs_pool_free_bytes") < MIB

        # Creates and snapshots on the full pool are refused before anything is made.
        volumes_before = {v["volume_id"] for v in vbs.all_volumes()}
        files_before = sorted(os.listdir(disks.pool / "volumes")) + sorted(os.listdir(disks.pool / "snapshots"))
        created = vbs.http.post("/v1/volumes", json={"size_gib": 1})
        assert created.status_code == 503, created.text
        assert created.json()["error"]["code"] == "InsufficientVolumeCapacity"
        assert "is full" in created.json()["error"]["message"]
        snapped = vbs.http.post("/v1/snapshots", json={"volume_id": vol})
        assert snapped.status_code == 503, snapped.text
        assert snapped.json()["error"]["code"] == "InsufficientVolumeCapacity"
        assert {v["volume_id"] for v in vbs.all_volumes()} == volumes_before
        assert vbs.http.get("/v1/snapshots").json()["snapshots"] == []
        assert sorted(os.listdir(disks.pool / "volumes")) + sorted(os.listdir(disks.pool / "snapshots")) \
            == files_before

        # Space freed: the host agent resumes the VM, the waiting write and all after it land.
        assert vbs.http.delete(f"/v1/volumes/{filler}").status_code == 200
        rc, out = writer.result(timeout=600)
        assert (rc, out.strip()) == (0, f"wrote {BLOCKS.writes}")
        assert guest.qmp("query-status")["status"] == "running"
        errors = guest.check("dmesg | grep -ci 'I/O error' || true").strip()
        assert errors == "0", "the guest saw I/O errors"
    finally:
        if _paused_for_space(guest):
            guest.qmp("cont")
        writer.exception(timeout=600)
    assert BLOCKS.blocks_in(disks.pool / "volumes" / f"{vol}.raw") == set(range(BLOCKS.writes))
    wait_until(lambda: not _pool(vbs)["full"], 30, what="the pool reported with room")
    assert _metric(vbs, "vbs_pool_full") == 0
    _new_volume(vbs)


def _fill_filesystem(path: Path) -> None:
    """Write ``path`` until its filesystem has no byte left."""
    chunk = b"\xa5" * MIB
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (MIB, 4096, 1):
            while True:
                try:
                    os.write(fd, chunk[:size])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_full_metadata_disk_answers_503_loses_no_committed_operation_and_recovers(disks: FullDisks) -> None:
    vbs, up = disks.vbs, disks.up
    controller = up.child_pid("controller")
    done = [_new_volume(vbs) for _ in range(2)]
    # One create acknowledged, its workflow held before its storage call: it must record its end on a full disk.
    internal = {"authorization": f"Bearer {node_token(vbs.data_dir, 'storage', 'storage-1')}"}
    assert vbs.http.post("/internal/v1/test/hold-step", json=HELD_CREATE, headers=internal).status_code == 200
    in_flight = str(vbs.create_volume(size_gib=1)["volume_id"])
    wait_until(lambda: vbs.http.post("/internal/v1/test/held-step", json=HELD_CREATE, headers=internal).json()["held"],
               30, what="the create's storage step is held")
    assert disks.db_dir is not None
    filler = disks.db_dir / "filler"
    try:
        _fill_filesystem(filler)
        refused = vbs.http.post("/v1/volumes", json={"size_gib": 1})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "DatabaseFull"
        assert vbs.http.delete(f"/v1/volumes/{done[0]}").status_code == 503
        assert vbs.http.post("/internal/v1/test/release-step", json=HELD_CREATE, headers=internal).status_code == 200
        # Reads go on, and show what was committed: the volumes, the held create still creating.
        assert vbs.volume(done[0])["status"] == "available"
        assert vbs.volume(in_flight)["status"] == "creating"
    finally:
        filler.unlink(missing_ok=True)
        vbs.http.post("/internal/v1/test/release-step", json=HELD_CREATE, headers=internal)
    # Space freed: writes are taken again, and the create that could not record its end finishes.
    made = wait_until(lambda: (r := vbs.http.post("/v1/volumes", json={"size_gib": 1})).status_code == 200 and r,
                      60, what="a create after space was freed")
    for vol in [*done, in_flight, made.json()["volume_id"]]:
        vbs.wait_volume(vol, "available", timeout=120)
    assert up.child_pid("controller") == controller
