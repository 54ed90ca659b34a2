"""RBD volumes end to end, real parts only: a single-node Ceph, the controller, a storage agent
``--backend rbd --export nbd``, a host agent and a guest that writes and reads through its disks.

The controller, the host agent and QEMU are the same as for file volumes: the storage agent's
qemu-storage-daemon opens the image and serves it over NBD. Every process is stopped by PID.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ceph_cluster import CephForTests
from tests.conftest import wait_until
from tests.rbd_cloud import RbdCloud, running_rbd_cloud
from vbs.rigs.testguest import pattern_sha256

pytestmark = pytest.mark.integration

MIB = 1 << 20
SPAN_MIB = 8


@pytest.fixture
def cloud(ceph: CephForTests, tmp_path: Path) -> Iterator[RbdCloud]:
    """Volumes served through the storage agent's export (tests/test_rbd_native.py: opened natively)."""
    with running_rbd_cloud(ceph, ceph.new_pool(), tmp_path, native=False) as c:
        yield c


def test_a_pattern_written_in_a_guest_is_read_back_from_a_clone_of_its_snapshot(cloud: RbdCloud) -> None:
    vbs, guest = cloud.vbs, cloud.guest
    parent = cloud.new_volume(size_gib=1)
    dev = cloud.attach(parent, "vdb")
    assert cloud.exported_over_nbd(parent)  # this host's QEMU lists no rbd: the export serves it
    guest.check(f"yes rbd-parent | head -c {SPAN_MIB * MIB} | dd of=/dev/{dev} bs=1M conv=fsync 2>/dev/null",
                timeout=180)
    snap = cloud.snapshot(parent)  # while attached: an RBD snapshot is taken at one instant
    # Written after the snapshot: the clone must not see it.
    guest.check(f"yes later | head -c {MIB} | dd of=/dev/{dev} bs=1M conv=fsync 2>/dev/null", timeout=60)

    clone = cloud.new_volume(snapshot_id=snap)
    assert clone in cloud.rbd("ls", cloud.pool)
    clone_dev = cloud.attach(clone, "vdc")
    assert guest.checksum(clone_dev, SPAN_MIB) == pattern_sha256("rbd-parent", SPAN_MIB)
    cloud.detach(clone)
    cloud.detach(parent)

    # The parent goes while its snapshot and the clone remain: the clone keeps its data.
    assert vbs.http.delete(f"/v1/volumes/{parent}").status_code == 200
    wait_until(lambda: vbs.http.get(f"/v1/volumes/{parent}").status_code == 404
               or vbs.volume(parent)["status"] == "deleted", 60, what=f"{parent} deleted")
    clone_dev = cloud.attach(clone, "vdb")
    assert guest.checksum(clone_dev, SPAN_MIB) == pattern_sha256("rbd-parent", SPAN_MIB)
    guest.check(f"yes clone | head -c {MIB} | dd of=/dev/{clone_dev} bs=1M conv=fsync 2>/dev/null", timeout=60)
    cloud.assert_consistent()  # images, snapshots, the export and the guest's disk as the DB says
    cloud.detach(clone)
    cloud.assert_consistent()

    # Ceph and the DB agree: the clone is the one volume, the snapshot lives on the parent in the RBD trash.
    live_volumes = {v["volume_id"] for v in vbs.all_volumes() if v["status"] != "deleted"}
    live_snaps = {s["snapshot_id"] for s in vbs.http.get("/v1/snapshots").json()["snapshots"]
                  if s["status"] != "deleted"}
    images = set(cloud.rbd("ls", cloud.pool))
    assert live_volumes == {clone} == images
    [trashed] = cloud.rbd("trash", "ls", cloud.pool)
    assert trashed["name"] == parent
    rbd_snaps = {s["name"] for s in cloud.rbd("snap", "ls", "--pool", cloud.pool, "--image-id", trashed["id"])}
    assert not cloud.rbd("snap", "ls", f"{cloud.pool}/{clone}")
    assert rbd_snaps == live_snaps == {snap}


def test_the_cephx_key_is_not_on_the_export_daemons_argv_nor_in_the_agents_log(cloud: RbdCloud) -> None:
    vol = cloud.new_volume(size_gib=1)
    dev = cloud.attach(vol, "vdb")
    cloud.guest.check(f"dd if=/dev/{dev} of=/dev/null bs=1M count=1 2>/dev/null")
    key = cloud.ceph.admin_key()
    pidfiles = list((cloud.svc.data_dir / "storage-state").rglob("qsd.pid"))
    assert len(pidfiles) == 1
    pid = int(pidfiles[0].read_text())
    assert b"qemu-storage-daemon" in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    agent_log = (cloud.svc.tmp / "agent.log").read_bytes()
    assert b"backend rbd" in agent_log  # the log is the agent's, and it got this far
    assert key.encode() not in agent_log
    for f in (cloud.svc.data_dir / "storage-state").rglob("*"):
        if f.is_file():
            assert key.encode() not in f.read_bytes(), f
    cloud.detach(vol)

