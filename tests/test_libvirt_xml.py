"""The libvirt disk XML each host connector produces, and what the libvirt driver refuses before it
calls libvirt. libvirt's own ``test:///default`` driver (in-process, no daemon) stands in for a
hypervisor where a driver object is needed; tests/test_libvirt_hypervisor.py runs the real one."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from vbs.connectors import connector_for
from vbs.connectors.base import LibvirtAuth, LibvirtSource
from vbs.errors import IncorrectState, InvalidParameter
from vbs.host.hypervisors.libvirt import LibvirtDriver
from vbs.host.hypervisors.libvirt_xml import disk_alias, disk_xml, secret_uuid
from vbs.wire.connection import FileConnection, IscsiConnection, NbdConnection
from vbs.wire.host import QoS

pytestmark = pytest.mark.unit

SERIAL = "vol0123456789abcdef0"
CHAP_SECRET = "chap-secret-never-in-xml"
SECRET_UUID = "6a1a2b84-93c5-4d2e-8d6f-0c1d2e3f4a5b"


def parsed(xml: str) -> ET.Element:
    return ET.fromstring(xml)


def test_nbd_over_a_unix_socket() -> None:
    conn = NbdConnection(socket="/var/lib/vbs/nbd/nbd.sock", export="vol-0123456789abcdef0")
    disk = parsed(disk_xml(SERIAL, "vdb", connector_for(conn).libvirt_source(conn)))
    assert disk.attrib == {"type": "network", "device": "disk"}
    source = disk.find("source")
    assert source is not None and source.attrib == {"protocol": "nbd", "name": "vol-0123456789abcdef0"}
    assert [h.attrib for h in source.findall("host")] == [{"transport": "unix", "socket": "/var/lib/vbs/nbd/nbd.sock"}]
    assert disk.findtext("serial") == SERIAL
    alias = disk.find("alias")
    assert alias is not None and alias.get("name") == "ua-" + SERIAL == disk_alias(SERIAL)
    target = disk.find("target")
    assert target is not None and target.attrib == {"dev": "vdb", "bus": "virtio"}
    assert disk.find("readonly") is None and disk.find("iotune") is None
    driver = disk.find("driver")
    assert driver is not None and driver.attrib == {"name": "qemu", "type": "raw", "discard": "unmap"}  # main loop


def test_a_disk_given_an_io_thread_names_it_in_its_driver() -> None:
    conn = NbdConnection(socket="/var/lib/vbs/nbd/nbd.sock", export="vol-0123456789abcdef0")
    disk = parsed(disk_xml(SERIAL, "vdb", connector_for(conn).libvirt_source(conn), iothread=0x56420003))
    driver = disk.find("driver")
    assert driver is not None and driver.get("iothread") == str(0x56420003)


def test_nbd_over_tcp_with_qos_and_read_only() -> None:
    conn = NbdConnection(host="10.0.0.7", port=10809, export="vol-0123456789abcdef0")
    disk = parsed(disk_xml(SERIAL, "vdc", connector_for(conn).libvirt_source(conn), read_only=True,
                           qos=QoS(iops=500, mbps=40)))
    source = disk.find("source")
    assert source is not None and source.get("tls") is None
    assert [h.attrib for h in source.findall("host")] == [{"name": "10.0.0.7", "port": "10809"}]
    assert disk.find("readonly") is not None
    assert disk.findtext("iotune/total_iops_sec") == "500"
    assert disk.findtext("iotune/total_bytes_sec") == str(40 * 1024 * 1024)


def test_iscsi_with_chap_names_a_secret_object_and_never_holds_the_secret() -> None:
    conn = IscsiConnection(host="10.0.0.8", port=3260, iqn="iqn.2024-01.org.vbs:vol-0123456789abcdef0", lun=1,
                           chap_user="vbs-host1", chap_secret=SecretStr(CHAP_SECRET),
                           initiator_name="iqn.2024-01.org.vbs:host1")
    source = connector_for(conn).libvirt_source(conn)
    assert source.auth is not None and source.auth.usage == "iscsi"
    assert CHAP_SECRET not in repr(source)
    xml = disk_xml(SERIAL, "vdb", source, secret=SECRET_UUID)
    assert CHAP_SECRET not in xml
    src = parsed(xml).find("source")
    assert src is not None and src.attrib == {"protocol": "iscsi",
                                              "name": "iqn.2024-01.org.vbs:vol-0123456789abcdef0/1"}
    assert [h.attrib for h in src.findall("host")] == [{"name": "10.0.0.8", "port": "3260"}]
    initiator = src.find("initiator/iqn")
    assert initiator is not None and initiator.get("name") == "iqn.2024-01.org.vbs:host1"
    auth = src.find("auth")
    assert auth is not None and auth.attrib == {"username": "vbs-host1"}
    secret = auth.find("secret")
    assert secret is not None and secret.attrib == {"type": "iscsi", "uuid": SECRET_UUID}
    with pytest.raises(InvalidParameter):
        disk_xml(SERIAL, "vdb", source)  # credentials without a secret object to name


def test_iscsi_without_chap_or_initiator_has_neither() -> None:
    conn = IscsiConnection(host="::1", port=3260, iqn="iqn.2024-01.org.vbs:vol-0123456789abcdef0", lun=0)
    src = parsed(disk_xml(SERIAL, "vdb", connector_for(conn).libvirt_source(conn))).find("source")
    assert src is not None and src.get("name", "").endswith("/0")
    assert src.find("auth") is None and src.find("initiator") is None
    assert [h.attrib for h in src.findall("host")] == [{"name": "::1", "port": "3260"}]


def test_values_are_escaped_by_the_xml_builder_not_formatted_in() -> None:
    hostile = "x'/><disk type='file'><source file='/etc/shadow'/>&\""
    source = LibvirtSource(protocol="nbd", name=hostile, hosts=({"name": hostile, "port": "1"},),
                           auth=LibvirtAuth(username=hostile, secret=SecretStr("s"), usage="iscsi"))
    disk = parsed(disk_xml(SERIAL, "vdb", source, secret=SECRET_UUID))
    assert len(disk.findall(".//source")) == 1 and disk.find(".//source").get("name") == hostile  # type: ignore[union-attr]
    assert disk.find(".//host").get("name") == hostile  # type: ignore[union-attr]
    assert disk.find(".//auth").get("username") == hostile  # type: ignore[union-attr]


def test_bad_serials_are_refused() -> None:
    for bad in ("vol-0123456789abcdef0", "vol0123456789abcdef0'", "", "../x"):
        with pytest.raises(InvalidParameter):
            disk_alias(bad)


def test_secret_uuids_are_stable_per_domain_and_disk() -> None:
    assert secret_uuid("vm1", SERIAL) == secret_uuid("vm1", SERIAL)
    assert secret_uuid("vm1", SERIAL) != secret_uuid("vm2", SERIAL)


def test_protocols_libvirt_cannot_open_are_refused_by_their_connector() -> None:
    psk = NbdConnection(host="10.0.0.7", port=10809, export="v", tls="psk", tls_psk_identity="h",
                        tls_psk_key=SecretStr("00ff"))
    with pytest.raises(IncorrectState, match="TLS-PSK"):
        connector_for(psk).libvirt_source(psk)
    file = FileConnection(path="/tmp/x.raw")
    with pytest.raises(IncorrectState, match="cannot open file"):
        connector_for(file).libvirt_source(file)


@pytest.fixture
def test_driver(tmp_path: Path) -> Iterator[LibvirtDriver]:
    drv = LibvirtDriver("test:///default", state_dir=tmp_path)
    yield drv
    drv.close()


def test_nbd_over_x509_is_refused_saying_why(test_driver: LibvirtDriver) -> None:
    x509 = NbdConnection(host="10.0.0.7", port=10809, export="v", tls="x509")
    with pytest.raises(IncorrectState, match="nbd_tls_x509_cert_dir"):
        test_driver.attach("test", SERIAL, x509)


def test_domains_are_listed_by_name_with_their_uuid(test_driver: LibvirtDriver) -> None:
    vms = test_driver.list_vms()
    assert [(vm.vm_id, vm.running) for vm in vms] == [("test", True)]
    assert vms[0].uuid is not None and len(vms[0].uuid) == 36


def test_what_the_driver_cannot_do_it_declares_and_refuses(test_driver: LibvirtDriver) -> None:
    caps = test_driver.capabilities
    assert sorted(caps.protocols) == ["iscsi", "nbd", "rbd"]
    # It grows RBD disks online (blockResize) and no other: an export's disk keeps its size.
    assert caps.online_resize and caps.online_resize_protocols == ["rbd"]
    assert not caps.point_in_time_copy and caps.qos
    conn = NbdConnection(socket="/run/x/nbd.sock", export="v")
    with pytest.raises(IncorrectState):
        test_driver.resize("test", SERIAL, conn, 1 << 30)
    with pytest.raises(IncorrectState):
        test_driver.ensure_copy("test", SERIAL, "snap-0123456789abcdef0", conn)
    with pytest.raises(InvalidParameter):
        test_driver.attach("bad name;", SERIAL, conn)


def test_the_libvirt_uri_is_checked_and_unknown_driver_options_refused(tmp_path: Path) -> None:
    from vbs import config as cfgmod

    for bad in ("qemu:///system; rm -rf /", "qemu:///system\nx", "$(id)://x/", "qemu:// /system"):
        with pytest.raises(InvalidParameter):
            cfgmod.load(cfgmod.HostAgentConfig, "host_agent", overrides={"libvirt_uri": bad}, environ={})
    cfg = cfgmod.load(cfgmod.HostAgentConfig, "host_agent", environ={},
                      overrides={"hypervisor": "libvirt", "libvirt_uri": "test:///default", "state_dir": tmp_path})
    drv = LibvirtDriver.from_config(cfg)
    try:
        assert (drv.uri, drv.persist, drv.iothreads) == ("test:///default", False, True)
    finally:
        drv.close()
    off = LibvirtDriver.from_config(cfg.model_copy(update={"options": {"libvirt": {"iothreads": False}}}))
    try:
        assert off.iothreads is False
    finally:
        off.close()
    for value in ("yes", 1, 0, ""):
        with pytest.raises(InvalidParameter, match="iothreads of the libvirt driver: true or false"):
            LibvirtDriver.from_config(cfg.model_copy(update={"options": {"libvirt": {"iothreads": value}}}))
    with pytest.raises(InvalidParameter, match="unknown options"):
        LibvirtDriver.from_config(cfg.model_copy(update={"options": {"libvirt": {"nbd_tls": True}}}))
    with pytest.raises(InvalidParameter, match="tls_cert"):  # a TLS dir needs this host's certificate
        LibvirtDriver.from_config(cfg.model_copy(update={"libvirt_nbd_tls_dir": tmp_path / "nbd-tls"}))
