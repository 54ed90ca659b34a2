"""RBD through libvirt (attach, online growth, detach), for real: a real Ceph, a real libvirtd, the
host agent's ``libvirt`` driver and a TCG domain of the test guest. The volume reaches libvirt as
``<source protocol='rbd'>`` with the monitors as hosts and the attachment's own cephx user, whose
key is only in an ephemeral, private libvirt secret of usage ``ceph``; the guest's writes are in the
image; detach removes the secret and the cephx user."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator
from pathlib import Path

import libvirt
import pytest

from tests.ceph_cluster import CephForTests
from tests.conftest import Services, wait_until
from tests.libvirtd import URI, Libvirtd
from tests.rbd_cloud import rbd_export_sha256
from tests.test_online_resize import guest_size
from vbs.ids import virtio_serial
from vbs.rigs.testguest import build_guest
from vbs.rigs.testguest.libvirt import LibvirtGuest

pytestmark = pytest.mark.integration


@pytest.fixture
def cloud(ceph: CephForTests, libvirtd: Libvirtd, tmp_path: Path) -> Iterator[tuple[Services, LibvirtGuest, str]]:
    pool = ceph.new_pool()
    svc = Services(tmp_path)
    config = tmp_path / "host.toml"
    config.write_text('[host_agent]\nhypervisor = "libvirt"\n')
    guest: LibvirtGuest | None = None
    try:
        svc.start_controller()
        svc.start_agent("--backend", "rbd", "--export", "nbd", "--ceph-conf", str(ceph.conf_path),
                        "--ceph-user", "admin", "--rbd-pool", pool)
        svc.start_host_agent("host-1", config)
        guest = LibvirtGuest("lvr-vm1", tmp_path / "guests", build_guest())
        guest.start()
        guest.wait_ready(120)
        wait_until(lambda: any(i["vm_id"] == "lvr-vm1" and i["state"] == "running"
                               for i in svc.vbs.http.get("/v1/instances").json()["instances"]), 60, what="domain")
        yield svc, guest, pool
    finally:
        if guest is not None:
            guest.stop()
        svc.stop()


def test_a_guest_under_libvirt_opens_an_rbd_volume_natively(cloud: tuple[Services, LibvirtGuest, str],
                                                            ceph: CephForTests) -> None:
    svc, guest, pool = cloud
    vol = svc.vbs.create_volume(size_gib=1)["volume_id"]
    svc.vbs.wait_volume(vol, "available", timeout=120)
    serial = virtio_serial(vol)
    att = svc.vbs.cli("attach-volume", vol, "--host", "host-1", "--vm", "lvr-vm1", "--wait")
    assert att["state"] == "attached"
    dev = guest.wait_for_disk(serial, 60)

    xml = guest.domain().XMLDesc(0)
    disk = xml[xml.rindex("<disk", 0, xml.index(serial)):xml.index("</disk>", xml.index(serial))]
    assert "protocol='rbd'" in disk and f"name='{pool}/{vol}'" in disk, disk
    assert "<secret type='ceph'" in disk, disk
    user = disk.split("<auth username='")[1].split("'")[0]
    assert user.startswith("vbs.host-1.") and ceph_user_exists_named(ceph, user)

    conn = libvirt.open(URI)
    try:
        [secret] = conn.listAllSecrets()
        assert secret.usageType() == libvirt.VIR_SECRET_USAGE_TYPE_CEPH
        with pytest.raises(libvirt.libvirtError):
            secret.value()  # private: libvirt does not give it back
        key = ceph_key(ceph, user)
        assert key not in xml and base64.b64decode(key) not in xml.encode()

        written = guest.write_pattern(dev, "rbd-through-libvirt", 8)
        assert rbd_export_sha256(ceph.conf_path, f"{pool}/{vol}", 8) == written, "the writes are in the image"

        # Online growth: the image grows, libvirt's blockResize tells the guest.
        svc.vbs.cli("modify-volume", vol, "--size", "2", "--wait")
        wait_until(lambda: guest_size(guest, dev) == 2 << 30, 60, what="the guest sees 2 GiB")
        assert guest.checksum(dev, 8) == written

        assert svc.vbs.cli("detach-volume", vol, "--wait")["state"] == "detached"
        guest.wait_disk_gone(serial, 60)
        assert conn.listAllSecrets() == []
        wait_until(lambda: not ceph_user_exists_named(ceph, user), 60, what="the cephx user removed")
    finally:
        conn.close()


def ceph_key(ceph: CephForTests, user: str) -> str:
    return subprocess.run(["ceph", "--conf", str(ceph.conf_path), "auth", "print-key", f"client.{user}"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def ceph_user_exists_named(ceph: CephForTests, user: str) -> bool:
    return subprocess.run(["ceph", "--conf", str(ceph.conf_path), "auth", "get", f"client.{user}"],
                          capture_output=True, text=True, timeout=60).returncode == 0
