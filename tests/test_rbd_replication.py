"""The copies of an RBD volume are real: a guest's writes go on while an OSD holding them is SIGKILLed,
and the cluster puts the second copy back when the OSD returns.

A test Ceph of its own (three OSDs on sparse files, the low ``osd memory target`` of every test Ceph)
and a pool of size 2, min_size 1; the cloud of ``tests/rbd_cloud.py`` on it (a guest whose disk is the
volume, served over NBD by the storage agent's qemu-storage-daemon through librbd).

The guest writes a pattern one MiB at a time. As soon as the first object of the image exists, the
OSD that is primary for the *last* object of the span (so writes to it are still to come) is killed
by its PID. The guest's writes complete; the pattern reads back intact in the guest and through
``rbd export`` while that OSD is down. The OSD is started again and every PG comes back
active+clean. Then the *other* OSD that held the last object is killed: what is read now of that
object can only come from the copy the restarted OSD got back by recovery.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ceph_cluster import CephForTests
from tests.conftest import wait_until
from tests.rbd_cloud import RbdCloud, running_rbd_cloud
from vbs.errors import InvalidParameter
from vbs.rigs.testguest import pattern_sha256

pytestmark = pytest.mark.integration

MIB = 1 << 20
OBJECT_MIB = 4  # RBD's default object size
SPAN_MIB = 32  # 8 objects
# 15 characters and a newline: 16 divides a MiB, so each MiB of the pattern is the same and the guest
# can write it one MiB at a time (at its own pace, long enough for an OSD to die in the middle).
SEED = "copies-are-real"
RECOVERY_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def ceph3() -> Iterator[CephForTests]:
    cluster = CephForTests(osds=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _json(cloud: RbdCloud, *args: str) -> Any:
    return json.loads(cloud.ceph.cluster.ceph(*args, "--format", "json"))


def _object(cloud: RbdCloud, volume_id: str, index: int) -> str:
    prefix = cloud.rbd("info", f"{cloud.pool}/{volume_id}")["block_name_prefix"]
    return f"{prefix}.{index:016x}"


def _placement(cloud: RbdCloud, obj: str) -> dict[str, Any]:
    """Where Ceph puts ``obj`` now: its ``up`` and ``acting`` OSD sets and the acting primary."""
    out: dict[str, Any] = _json(cloud, "osd", "map", cloud.pool, obj)
    return out


def _objects_written(cloud: RbdCloud, prefix: str) -> int:
    out = subprocess.run(["rados", "--conf", str(cloud.ceph.conf_path), "-p", cloud.pool, "ls"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return sum(1 for line in out.split() if line.startswith(prefix + "."))


def _up_osd_ids(cloud: RbdCloud) -> set[int]:
    """The OSDs the monitor's map has up now."""
    return {int(o["osd"]) for o in _json(cloud, "osd", "dump")["osds"] if int(o["up"])}


def test_writes_go_on_while_an_osd_is_killed_and_recovery_restores_the_second_copy(
        ceph3: CephForTests, tmp_path: Path) -> None:
    cluster = ceph3.cluster
    for bad in (lambda: cluster.kill_osd(7), lambda: cluster.start_osd(0),  # no osd.7; osd.0 runs
                lambda: cluster.create_pool("bad", 2, min_size=3), lambda: cluster.create_pool("bad", 4)):
        with pytest.raises(InvalidParameter):
            bad()
    assert len(cluster.osd_ids()) == 3 and all(f"osd.{i}" in cluster.pids for i in cluster.osd_ids())
    pool = ceph3.new_pool(size=2, min_size=1)
    with running_rbd_cloud(ceph3, pool, tmp_path) as cloud:
        assert _json(cloud, "osd", "pool", "get", pool, "size")["size"] == 2
        assert _json(cloud, "osd", "pool", "get", pool, "min_size")["min_size"] == 1
        vol = cloud.new_volume(size_gib=1)
        dev = cloud.attach(vol, "vdb")
        last = _object(cloud, vol, SPAN_MIB // OBJECT_MIB - 1)
        before = _placement(cloud, last)
        assert len(set(before["acting"])) == 2, before  # two copies, on two OSDs
        victim = int(before["acting_primary"])
        survivor = next(int(o) for o in before["acting"] if int(o) != victim)
        prefix = last.rsplit(".", 1)[0]

        writer = cloud.guest.run_background(
            f"yes {SEED} | head -c {MIB} > /tmp/mib && i=0; while [ $i -lt {SPAN_MIB} ]; do "
            f"dd if=/tmp/mib of=/dev/{dev} bs=1M seek=$i count=1 oflag=direct conv=notrunc 2>/dev/null || exit 1; "
            f"i=$((i+1)); sleep 0.2; done; sync", timeout=900)
        wait_until(lambda: _objects_written(cloud, prefix) >= 1, 120, interval=0.05, what="the first object written")
        assert not writer.done(), "the guest finished writing before the OSD could be killed"
        killed_pid = cluster.kill_osd(victim)
        assert not Path(f"/proc/{killed_pid}").exists()

        rc, out = writer.result(timeout=900)
        assert rc == 0, out  # every write completed with one copy's OSD dead
        assert _up_osd_ids(cloud) == set(cluster.osd_ids()) - {victim}
        during = _placement(cloud, last)
        assert victim not in during["acting"], during  # the last object was written to one copy only
        want = pattern_sha256(SEED, SPAN_MIB)
        assert cloud.guest.checksum(dev, SPAN_MIB) == want
        assert cloud.export_sha256(vol, SPAN_MIB) == want

        cluster.start_osd(victim)
        started = time.monotonic()
        cluster.wait_clean(timeout=RECOVERY_TIMEOUT_S)
        print(f"osd.{victim} back: all PGs active+clean after {time.monotonic() - started:.1f} s")
        assert _placement(cloud, last)["acting"] == before["acting"]

        # The copy the victim got back is real: with the OSD that kept the data down, it is the only one.
        cluster.kill_osd(survivor)
        # Which two are up, not how many: a fresh clone's make test once read "acting [0]" right after the
        # count reached two, without knowing which two. Wait for exactly the others.
        others = set(cluster.osd_ids()) - {survivor}
        wait_until(lambda: _up_osd_ids(cloud) == others, 120, what=f"osd.{survivor} down and the others up")
        assert _placement(cloud, last)["acting"] == [victim]
        assert cloud.export_sha256(vol, SPAN_MIB) == want
        assert cloud.guest.checksum(dev, SPAN_MIB) == want
        cluster.start_osd(survivor)
        cluster.wait_clean(timeout=RECOVERY_TIMEOUT_S)

        cloud.detach(vol)
        cloud.assert_consistent()
