"""A snapshot of an attached volume is point-in-time on a copy pool (ext4), over NBD and over iSCSI.

A real guest writes numbered 4 KiB blocks at scattered offsets, each one on disk (O_DIRECT + fsync)
before the next starts, while the snapshot is taken. A point-in-time copy holds exactly blocks
0..k for some k: none written after its instant, none written before it missing. A copy that
reads the file while it changes (what VBS did on copy pools before) breaks that.

Over NBD the export daemon, through which every write passes, takes the copy (a QEMU backup job
with copy-before-write). Over iSCSI tgtd writes to the file directly, so the storage node cannot;
the guest's own QEMU takes it into a snapshot target the storage node exports to its host.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.conftest import Vbs, VbsUp, wait_until
from tests.numbered_blocks import NumberedBlocks
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest

pytestmark = pytest.mark.integration

MIB = 1 << 20
BLOCK = 4096
SLOTS = 1 << 15  # 128 MiB of 4 KiB slots at the start of the volume
STRIDE = 7919  # a prime: block i goes to slot i * STRIDE % SLOTS, a different slot for every i
WRITES = 600
PREFILL_MIB = 512  # data the copy must move while the guest writes
BLOCKS = NumberedBlocks(writes=WRITES, slots=SLOTS, stride=STRIDE, block=BLOCK)
writer_script = BLOCKS.writer_script
blocks_in = BLOCKS.blocks_in





@pytest.fixture(scope="module", params=["nbd", "iscsi"])
def cloud(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Vbs, TestGuest]]:
    tmp = tmp_path_factory.mktemp(f"pit-{request.param}")
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--export", request.param, "--clone-method", "copy"])
    vbs = up.start()
    guest = TestGuest("vm1", tmp / "guests", build_guest(), tmp / "var" / "vms")
    try:
        guest.start()
        guest.wait_ready(120)
        wait_until(lambda: vbs.http.get("/v1/instances").json()["instances"], 30, what="the guest as an instance")
        yield vbs, guest
    finally:
        guest.stop()
        up.stop()


def test_a_snapshot_of_a_volume_a_guest_writes_holds_exactly_a_prefix_of_its_writes(
        cloud: tuple[Vbs, TestGuest]) -> None:
    vbs, guest = cloud
    vol = vbs.cli("create-volume", "--size", "1", "--wait")["volume_id"]
    volume_file = vbs.pool / "volumes" / f"{vol}.raw"
    with open(volume_file, "r+b") as f:  # data the snapshot has to copy while the guest writes
        f.seek(SLOTS * BLOCK)
        for _ in range(PREFILL_MIB):
            f.write(os.urandom(MIB))
    vbs.cli("attach-volume", vol, "--host", "host-1", "--vm", "vm1", "--wait")
    dev = guest.wait_for_disk(virtio_serial(vol), 20)

    writing = guest.run_background(writer_script(dev), timeout=600)
    wait_until(lambda: len(blocks_in(volume_file)) >= 40, 120, interval=0.2, what="the guest's first writes")
    snap = vbs.cli("create-snapshot", vol, "--wait")
    rc, out = writing.result(600)
    assert rc == 0 and f"wrote {WRITES}" in out, out

    assert snap["status"] == "completed", snap
    snapshot_file = vbs.snapshot_data(snap["snapshot_id"])  # restored from the store on a copy pool
    in_snapshot = blocks_in(snapshot_file)
    newest = max(in_snapshot)
    missing = sorted(set(range(newest + 1)) - in_snapshot)
    assert not missing, f"the snapshot holds block {newest} but lacks {len(missing)} written before it: {missing[:10]}"
    assert 40 <= newest < WRITES - 1, f"the snapshot was taken while the guest wrote (newest block {newest})"
    assert blocks_in(volume_file) == set(range(WRITES)), "the volume itself has every write"
    # The rest of the snapshot is the volume as it was: the prefilled data came along.
    with open(volume_file, "rb") as v, open(snapshot_file, "rb") as s:
        v.seek(SLOTS * BLOCK)
        s.seek(SLOTS * BLOCK)
        assert v.read(PREFILL_MIB * MIB) == s.read(PREFILL_MIB * MIB)

    vbs.cli("detach-volume", vol, "--wait")
