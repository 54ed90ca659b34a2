"""Attach and detach for real through the libvirt driver: ``vbs up --hypervisor libvirt`` (NBD or
iSCSI export), a libvirtd started by the test, the test guest as transient TCG domains.

A guest writes a pattern on a hot-plugged volume, the volume moves to a second domain with its data;
libvirtd restarts while a disk is attached and the disk is found again and detached; a domain
with no OS (it never releases a disk) makes detach ``busy``; the iSCSI CHAP secret is in no argv,
no domain XML, no log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest

from tests.clouds import LibvirtCloud, bare_domain_named, detach_is_busy_until_forced
from tests.conftest import wait_until
from tests.libvirtd import URI, Libvirtd
from tests.test_ec2_api import client as ec2_client
from vbs.ids import virtio_serial

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["nbd", "iscsi"])
def cloud(request: pytest.FixtureRequest, libvirtd: Libvirtd,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LibvirtCloud]:
    tmp = tmp_path_factory.mktemp(f"libvirt-{request.param}")
    with LibvirtCloud(tmp, request.param, libvirtd, ("lv-vm1", "lv-vm2"), ["--hypervisor", "libvirt"]) as c:
        yield c


def test_a_volume_moves_between_domains_with_its_data(cloud: LibvirtCloud) -> None:
    vol_id = cloud.new_volume()
    serial = virtio_serial(vol_id)
    att = cloud.vbs.cli("attach-volume", vol_id, "--instance", cloud.instance("host-1", "lv-vm1"), "--wait")
    assert att["state"] == "attached"
    dev = cloud.vm1.wait_for_disk(serial, 30)
    written = cloud.vm1.write_pattern(dev, "through-libvirt", 8)

    assert cloud.vbs.cli("detach-volume", vol_id, "--wait")["state"] == "detached"
    cloud.vm1.wait_disk_gone(serial, 30)
    assert cloud.exports() == []

    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "lv-vm2", "--wait")
    dev2 = cloud.vm2.wait_for_disk(serial, 30)
    assert cloud.vm2.checksum(dev2, 8) == written
    # An export's disk cannot grow under libvirt: refused with the reason, nothing changed.
    r = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/modify", json={"size_gib": 2})
    assert r.status_code == 409 and "over an export, which its hypervisor cannot grow online" in r.text, r.text
    assert cloud.vbs.volume(vol_id)["size_gib"] == 1
    cloud.vbs.cli("detach-volume", vol_id, "--wait")
    cloud.vm2.wait_disk_gone(serial, 30)
    assert cloud.vbs.volume(vol_id)["status"] == "available"


def test_an_encrypted_volume_is_opened_by_libvirt_and_only_ciphertext_leaves_the_host(cloud: LibvirtCloud) -> None:
    vol_id = cloud.vbs.create_volume(size_gib=1, encrypted=True)["volume_id"]
    cloud.vbs.wait_volume(vol_id, "available")
    serial = virtio_serial(vol_id)
    try:
        cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "lv-vm1", "--wait")
        dev = cloud.vm1.wait_for_disk(serial, 30)
        assert cloud.vm1.disk_size(serial) == 1 << 30  # the payload; the LUKS header is in front of it
        written = cloud.vm1.write_pattern(dev, "libvirt-luks-plaintext", 4)
        assert cloud.vbs.cli("detach-volume", vol_id, "--wait")["state"] == "detached"
        cloud.vm1.wait_disk_gone(serial, 30)
        with open(cloud.vbs.pool / "volumes" / f"{vol_id}.raw", "rb") as f:
            assert b"libvirt-luks-plaintext" not in f.read(64 << 20)
        # Its libvirt secret went with the disk; a new attach (another domain) opens it again.
        conn = libvirt.open(URI)
        try:
            assert not any(serial in sec.XMLDesc(0) for sec in conn.listAllSecrets())
        finally:
            conn.close()
        cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "lv-vm2", "--wait")
        dev2 = cloud.vm2.wait_for_disk(serial, 30)
        assert cloud.vm2.checksum(dev2, 4) == written
    finally:
        if cloud.vbs.volume(vol_id)["attachments"]:
            cloud.vbs.cli("detach-volume", vol_id, "--force", "--wait", check=False)
        cloud.vm1.wait_disk_gone(serial, 30)
        cloud.vm2.wait_disk_gone(serial, 30)


def test_a_disk_attached_across_a_libvirtd_restart_is_found_again_and_detached(cloud: LibvirtCloud) -> None:
    vol_id = cloud.new_volume()
    serial = virtio_serial(vol_id)
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "lv-vm1", "--wait")
    dev = cloud.vm1.wait_for_disk(serial, 30)
    written = cloud.vm1.write_pattern(dev, "across-restart", 4)

    cloud.libvirtd.restart()
    disks = wait_until(lambda: _or_none(lambda: cloud.host_disks("lv-vm1")), 60, what="the host agent reconnected")
    assert [d["serial"] for d in disks] == [serial]
    assert cloud.vm1.checksum(dev, 4) == written

    assert cloud.vbs.cli("detach-volume", vol_id, "--wait")["state"] == "detached"
    cloud.vm1.wait_disk_gone(serial, 30)
    assert cloud.host_disks("lv-vm1") == []
    assert cloud.exports() == []


def _or_none(call: Any) -> Any:
    try:
        return call()
    except AssertionError:
        return None


@pytest.fixture
def bare_domain(cloud: LibvirtCloud) -> Iterator[str]:
    with bare_domain_named(cloud, "lv-bare") as name:
        yield name


def test_a_guest_that_never_releases_the_disk_makes_detach_busy(cloud: LibvirtCloud, bare_domain: str) -> None:
    detach_is_busy_until_forced(cloud, bare_domain)


def _chap_secrets(data_dir: Path) -> set[str]:
    """The CHAP secrets the storage agent granted (from its 0600 state files)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "secret" and isinstance(value, str):
                    found.add(value)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in (data_dir / "storage-state").rglob("*.json"):
        try:
            walk(json.loads(path.read_text()))
        except ValueError:
            continue
    return found


def _texts_that_must_not_hold_secrets(cloud: LibvirtCloud, dom: libvirt.virDomain) -> dict[str, bytes]:
    texts = {"domain XML": dom.XMLDesc(libvirt.VIR_DOMAIN_XML_SECURE).encode(),
             "inactive domain XML": dom.XMLDesc(libvirt.VIR_DOMAIN_XML_SECURE | libvirt.VIR_DOMAIN_XML_INACTIVE)
             .encode()}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                texts[f"argv of {pid}"] = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
    logs = [cloud.up.log_path, cloud.libvirtd.log, *Path("/var/log/libvirt").rglob("*"),
            *Path("/run/libvirt/qemu").rglob("*.xml"), *(cloud.vbs.data_dir / "logs").rglob("*")]
    for path in logs:
        if path.is_file():
            texts[str(path)] = path.read_bytes()
    return texts


def test_credentials_go_through_libvirt_secret_objects_only(cloud: LibvirtCloud) -> None:
    vol_id = cloud.new_volume()
    cloud.vbs.cli("attach-volume", vol_id, "--host", "host-1", "--vm", "lv-vm1", "--wait")
    cloud.vm1.wait_for_disk(virtio_serial(vol_id), 30)
    conn = libvirt.open(URI)
    try:
        secrets = conn.listAllSecrets()
        chap = _chap_secrets(cloud.vbs.data_dir)
        if cloud.export == "iscsi":
            assert chap, "the iSCSI export grants CHAP"
            assert [s.usageType() for s in secrets] == [libvirt.VIR_SECRET_USAGE_TYPE_ISCSI]
            with pytest.raises(libvirt.libvirtError):
                secrets[0].value()  # private: libvirt does not give it back
            disk_xml = cloud.vm1.domain().XMLDesc(0)
            assert f"uuid=\"{secrets[0].UUIDString()}\"" in disk_xml.replace("'", '"')
        else:
            assert secrets == [] and chap == set(), "NBD over a unix socket has no credentials"
        for where, text in _texts_that_must_not_hold_secrets(cloud, cloud.vm1.domain()).items():
            for secret in chap:
                assert secret.encode() not in text, f"a CHAP secret is in {where}"
    finally:
        cloud.vbs.cli("detach-volume", vol_id, "--wait")
        cloud.vm1.wait_disk_gone(virtio_serial(vol_id), 30)
        assert conn.listAllSecrets() == [], "the secret object goes with the disk"
        conn.close()


NOVA_NS = "http://openstack.org/xmlns/libvirt/nova/1.1"
NOVA_METADATA = ("<instance><package version='27.1.0'/><name>web-0</name><flavor name='m1.small'/>"
                 "<owner><user uuid='u1'>demo</user><project uuid='p1'>demo</project></owner></instance>")


def test_a_nova_instance_is_attached_to_by_its_cloud_id(cloud: LibvirtCloud) -> None:
    """A domain carrying Nova's <metadata> (as Nova's libvirt driver writes it) is the Nova instance
    of its UUID: `--instance nova:<uuid>` attaches to it through the REST API, the CLI and EC2."""
    dom = cloud.vm2.domain()
    nova_id = dom.UUIDString()
    dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, NOVA_METADATA, "nova", NOVA_NS,
                    libvirt.VIR_DOMAIN_AFFECT_LIVE)
    try:
        def reported() -> Any:
            insts = cloud.vbs.http.get("/v1/instances").json()["instances"]
            found = [i for i in insts if i["vm_id"] == "lv-vm2" and i["cloud_ids"] == {"nova": nova_id}]
            return found or None

        [inst] = wait_until(reported, 30, what="the host agent reported the domain's Nova id")
        vol_id = cloud.new_volume()
        serial = virtio_serial(vol_id)
        r = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"instance_id": f"nova:{nova_id}"})
        assert r.status_code == 200, r.text
        assert r.json()["instance_id"] == inst["instance_id"] and r.json()["vm_id"] == "lv-vm2"
        dev = cloud.vm2.wait_for_disk(serial, 30)
        assert cloud.vm2.write_pattern(dev, "by-nova-id", 1)
        cloud.vbs.cli("detach-volume", vol_id, "--wait")
        cloud.vm2.wait_disk_gone(serial, 30)

        att = cloud.vbs.cli("attach-volume", vol_id, "--instance", f"nova:{nova_id}", "--wait")
        assert att["state"] == "attached" and att["vm_id"] == "lv-vm2"
        cloud.vm2.wait_for_disk(serial, 30)
        cloud.vbs.cli("detach-volume", vol_id, "--wait")
        cloud.vm2.wait_disk_gone(serial, 30)

        # Unknown and malformed ids: 4xx with the reason, nothing attached.
        for ref, status, code in [("nova:00000000-0000-4000-8000-000000000000", 404, "InvalidInstanceID.NotFound"),
                                  ("nova:$(reboot)", 400, "InvalidInstanceID.Malformed"),
                                  ("nova:../etc", 400, "InvalidInstanceID.Malformed"),
                                  ("aws:i-0123", 400, "InvalidInstanceID.Malformed")]:
            r = cloud.vbs.http.post(f"/v1/volumes/{vol_id}/attach", json={"instance_id": ref})
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
        assert cloud.vbs.volume(vol_id)["attachments"] == []

        # EC2: DescribeInstances shows the cloud id; AttachVolume takes it.
        ec2 = _ec2(cloud)
        [res] = ec2.describe_instances(InstanceIds=[inst["instance_id"]])["Reservations"]
        tags = {t["Key"]: t["Value"] for t in res["Instances"][0]["Tags"]}
        assert tags["vbs:cloud-id:nova"] == nova_id
        found = ec2.describe_instances(Filters=[{"Name": "tag:vbs:cloud-id:nova", "Values": [nova_id]}])
        assert [i["InstanceId"] for r in found["Reservations"] for i in r["Instances"]] == [inst["instance_id"]]
        ec2.attach_volume(VolumeId=vol_id, InstanceId=f"nova:{nova_id}", Device="/dev/vdb")
        cloud.vm2.wait_for_disk(serial, 60)
        cloud.vbs.cli("detach-volume", vol_id, "--wait")
        cloud.vm2.wait_disk_gone(serial, 30)
    finally:
        dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, None, None, NOVA_NS, libvirt.VIR_DOMAIN_AFFECT_LIVE)


def _ec2(cloud: LibvirtCloud) -> Any:
    key = cloud.vbs.key
    return ec2_client(cloud.vbs.endpoint, key.access_key_id, key.secret_access_key)
