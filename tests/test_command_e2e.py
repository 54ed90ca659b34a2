"""Attach and detach for real through the ``command`` hypervisor driver and the shipped ``virsh-path``
profile: ``vbs up --hypervisor command --hypervisor-profile virsh-path`` (NBD or iSCSI with CHAP), a libvirtd
started by the test, the test guest as transient TCG domains.

The profile gives libvirt a local path made by the host's connector (a qemu-storage-daemon serving
the export through FUSE): the guest sees the serial, writes a pattern, the volume moves to a second
domain with its data; a domain with no OS never releases the disk and detach is ``busy`` until
forced; a command that fails leaves its output in the operation's error; the iSCSI CHAP secret is
in no argv and no domain XML.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import libvirt
import pytest

from tests.clouds import LibvirtCloud, bare_domain_named, detach_is_busy_until_forced
from tests.libvirtd import URI, Libvirtd
from tests.test_resolvers import lab_profile
from vbs.ids import virtio_serial

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["nbd", "iscsi"])
def cloud(request: pytest.FixtureRequest, libvirtd: Libvirtd,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LibvirtCloud]:
    tmp = tmp_path_factory.mktemp(f"command-{request.param}")
    resolver = lab_profile(tmp, {"lab-1": "host-1 cmd-vm1", "lab-2": "host-1 cmd-vm2"})
    resolvers = json.dumps({"nova": "libvirt-metadata", "lab": f"command:{resolver}"})
    with LibvirtCloud(tmp, request.param, libvirtd, ("cmd-vm1", "cmd-vm2"),
                      ["--hypervisor", "command", "--hypervisor-profile", "virsh-path"],
                      {"VBS_CONTROLLER_RESOLVERS": resolvers}) as c:
        yield c


def test_a_volume_moves_between_domains_with_its_data_through_local_paths(cloud: LibvirtCloud) -> None:
    vol_id = cloud.new_volume()
    serial = virtio_serial(vol_id)
    att = cloud.vbs.cli("attach-volume", vol_id, "--instance", cloud.instance("host-1", "cmd-vm1"), "--wait")
    assert att["state"] == "attached"
    dev = cloud.vm1.wait_for_disk(serial, 30)
    written = cloud.vm1.write_pattern(dev, "through-virsh", 8)
    # libvirt was given a local path, not a network disk.
    xml = cloud.vm1.domain().XMLDesc(0)
    assert f"local-paths/{serial}/disk" in xml and "protocol=" not in xml.split(serial)[0].rsplit("<disk", 1)[1]
    assert [d["serial"] for d in cloud.host_disks("cmd-vm1")] == [serial]

    assert cloud.vbs.cli("detach-volume", vol_id, "--wait")["state"] == "detached"
    cloud.vm1.wait_disk_gone(serial, 30)
    assert cloud.exports() == []
    assert not _local_paths(cloud), "the host's local path goes with the detach"

    # The second domain by the lab's own id, mapped by the command resolver's script.
    att = cloud.vbs.cli("attach-volume", vol_id, "--instance", "lab:lab-2", "--wait")
    assert att["vm_id"] == "cmd-vm2"
    dev2 = cloud.vm2.wait_for_disk(serial, 30)
    assert cloud.vm2.checksum(dev2, 8) == written
    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm2.wait_disk_gone(serial, 30)
    assert cloud.vbs.volume(vol_id)["status"] == "available"

    # Through the REST API: hostile ids are refused before the script runs, an unknown one is 404.
    ran = cloud.vbs.data_dir.parent / "ran"  # lab_profile's script logs each id it is run with
    # (A newline is a control character: the request schema's floor refuses it before any resolver.)
    for ref, status, code in [*((f"lab:{h}", 400, "InvalidInstanceID.Malformed")
                                for h in ["lab-1 x", "lab-1;id", "$(reboot)", "`id`", "../etc", "'a'"]),
                              ("lab:lab-1\nx", 400, "InvalidParameterValue"),
                              ("lab:lab-9", 404, "InvalidInstanceID.NotFound")]:
        r = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"instance_id": ref})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert cloud.vbs.volume(vol_id)["attachments"] == []
    assert ran.read_text() == "lab-2\nlab-9\n", "only well-formed ids reached the script"


def _local_paths(cloud: LibvirtCloud) -> list[Path]:
    return [p for p in (cloud.vbs.data_dir).rglob("local-paths/*/disk")]


@pytest.fixture
def bare_domain(cloud: LibvirtCloud) -> Iterator[str]:
    with bare_domain_named(cloud, "cmd-bare") as name:
        yield name


def test_a_guest_that_never_releases_the_disk_makes_detach_busy(cloud: LibvirtCloud, bare_domain: str) -> None:
    detach_is_busy_until_forced(cloud, bare_domain)


def test_a_failing_command_leaves_its_output_in_the_operation(cloud: LibvirtCloud) -> None:
    vol_id = cloud.new_volume()
    # vdb..vdy are the driver's; a disk the guest already has at the target the driver picks makes
    # virsh attach-disk fail with libvirt's own words.
    conn = libvirt.open(URI)
    try:
        dom = conn.lookupByName("cmd-vm1")
        blocker = cloud.vbs.data_dir / "blocker.img"
        blocker.write_bytes(b"\0" * (1 << 20))
        dom.attachDeviceFlags(f"<disk type='file' device='disk'><driver name='qemu' type='raw'/>"
                              f"<source file='{blocker}'/><target dev='vdb' bus='virtio'/></disk>",
                              libvirt.VIR_DOMAIN_AFFECT_LIVE)
        r = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"host": "host-1", "vm_id": "cmd-vm1"})
        assert r.status_code == 200, r.text
        cloud.vbs.wait_volume(vol_id, "available", timeout=60)
        op = cloud.vbs.http.get(f"/v1/operations/{r.json()['operation_id']}").json()
        assert op["status"] == "rolled-back", op
        failed = [s for s in op["steps"] if s.get("error")]
        assert [s["name"] for s in failed] == ["host-attach"], op
        assert failed[0]["state"] == "undone"
        for error in (failed[0]["error"], op["error"]):
            assert "profile virsh-path: attach (virsh) exited with 1" in error, op
            assert "target 'vdb' duplicated" in error, "libvirt's own words are kept"
        assert cloud.vbs.volume(vol_id)["status"] == "available"
        assert not _local_paths(cloud)
        dom.detachDeviceFlags(f"<disk type='file' device='disk'><source file='{blocker}'/>"
                              f"<target dev='vdb' bus='virtio'/></disk>", libvirt.VIR_DOMAIN_AFFECT_LIVE)
    finally:
        conn.close()


@pytest.fixture(scope="module")
def virsh_cloud(libvirtd: Libvirtd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LibvirtCloud]:
    """vbs up with the `virsh` profile: libvirt opens the NBD export itself (`vbs up` serves NBD on a unix
    socket on this machine, plaintext), given to `virsh attach-disk --source-protocol nbd`."""
    with LibvirtCloud(tmp_path_factory.mktemp("command-virsh"), "nbd", libvirtd,
                      ("cmdn-vm1", "cmdn-vm1"), ["--hypervisor", "command", "--hypervisor-profile", "virsh"]) as c:
        yield c


def test_the_virsh_profile_gives_libvirt_an_nbd_network_disk(virsh_cloud: LibvirtCloud) -> None:
    cloud = virsh_cloud
    vol_id = cloud.new_volume()
    serial = virtio_serial(vol_id)
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "cmdn-vm1", "--wait")
    dev = cloud.vm1.wait_for_disk(serial, 30)
    xml = cloud.vm1.domain().XMLDesc(0)
    disk = xml[xml.rindex("<disk", 0, xml.index(serial)):xml.index("</disk>", xml.index(serial))]
    assert "protocol='nbd'" in disk and "transport='unix'" in disk, disk
    written = cloud.vm1.write_pattern(dev, "virsh-nbd", 4)
    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm1.wait_disk_gone(serial, 30)
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "cmdn-vm1", "--wait")
    dev = cloud.vm1.wait_for_disk(serial, 30)
    assert cloud.vm1.checksum(dev, 4) == written
    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm1.wait_disk_gone(serial, 30)
    assert cloud.exports() == []
