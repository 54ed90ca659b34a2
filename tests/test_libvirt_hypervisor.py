"""The libvirt hypervisor driver against a real libvirtd (started by the test) and real guests.

The test guest boots as a transient libvirt domain under TCG; a volume file is served by qemu-nbd
on a unix socket. What a test checks is the domain's own state (its live XML, through a connection
of the test's own) and what the guest sees.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import libvirt
import libvirt_qemu
import pytest

from tests.conftest import free_port, stop_process, wait_until
from tests.libvirtd import URI, Libvirtd
from vbs.errors import DeviceBusy, IncorrectState, NotFound
from vbs.host.hypervisors.libvirt import LibvirtDriver
from vbs.host.hypervisors.libvirt_iothreads import VBS_IOTHREAD_BASE, vbs_threads
from vbs.host.hypervisors.libvirt_xml import disk_alias
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.rigs.testguest import build_guest
from vbs.rigs.testguest.libvirt import LibvirtGuest, domain_xml
from vbs.trust.pki import CertificateAuthority
from vbs.wire.connection import NbdConnection
from vbs.wire.host import DiskInfo, QoS

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


def vol(n: int) -> str:
    return f"vol{n:017x}"


@pytest.fixture(scope="module")
def driver(libvirtd: Libvirtd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LibvirtDriver]:
    drv = LibvirtDriver(URI, state_dir=tmp_path_factory.mktemp("host-state"))
    yield drv
    drv.close()


@pytest.fixture(scope="module")
def guest(driver: LibvirtDriver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LibvirtGuest]:
    driver.list_vms()  # connected before the domain starts: it is found through its lifecycle event
    g = LibvirtGuest("lv-guest1", tmp_path_factory.mktemp("guest1"), build_guest()).start()
    try:
        g.wait_ready(120)
        yield g
    finally:
        g.stop()


@pytest.fixture
def nbd(tmp_path: Path) -> Iterator[NbdConnection]:
    """qemu-nbd serving a fresh 16 MiB file on a unix socket."""
    image = tmp_path / "volume.raw"
    with image.open("wb") as f:
        f.truncate(16 * MIB)
    sock = tmp_path / "nbd.sock"
    log = (tmp_path / "qemu-nbd.log").open("wb")
    proc = subprocess.Popen(["qemu-nbd", "--format=raw", "--export-name=vol", f"--socket={sock}", "--persistent",
                             "--shared=4", "--cache=none", str(image)], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        wait_until(sock.exists, 10, what="qemu-nbd's socket")
        yield NbdConnection(socket=str(sock), export="vol")
    finally:
        stop_process(proc)


def live_disks(dom: libvirt.virDomain, serial: str, flags: int = 0) -> list[ET.Element]:
    """The domain's disks that carry the user alias of ``serial``."""
    root = ET.fromstring(dom.XMLDesc(flags))
    return [d for d in root.iterfind("devices/disk") if d.find(f"alias[@name='{disk_alias(serial)}']") is not None]


def disk_thread(dom: libvirt.virDomain, serial: str, flags: int = 0) -> int | None:
    """The id of the I/O thread the disk ``serial`` runs in (None: QEMU's main loop)."""
    (disk,) = live_disks(dom, serial, flags)
    driver = disk.find("driver")
    value = driver.get("iothread") if driver is not None else None
    return None if value is None else int(value)


def qemu_threads(dom: libvirt.virDomain) -> set[str]:
    """The ids of the iothread objects the domain's QEMU has."""
    answer = json.loads(libvirt_qemu.qemuMonitorCommand(dom, json.dumps({"execute": "query-iothreads"}), 0))
    return {t["id"] for t in answer["return"]}


def test_a_disk_is_seen_by_the_guest_and_a_repeated_attach_adds_nothing(
        driver: LibvirtDriver, guest: LibvirtGuest, nbd: NbdConnection) -> None:
    serial = vol(1)
    disk = driver.attach(guest.name, serial, nbd)
    assert (disk.serial, disk.size_bytes, disk.read_only, disk.connected) == (serial, 16 * MIB, False, True)
    dev = guest.wait_for_disk(serial, 30)
    written = guest.write_pattern(dev, "libvirt", 4)

    assert driver.attach(guest.name, serial, nbd) == disk
    assert len(live_disks(guest.domain(), serial)) == 1
    assert driver.list_disks(guest.name) == [disk]
    # It runs in an I/O thread of its own (on by default), which a repeated attach does not add again.
    assert vbs_threads(guest.domain()) == {disk_thread(guest.domain(), serial)} == {VBS_IOTHREAD_BASE + 1}
    assert f"iothread{VBS_IOTHREAD_BASE + 1}" in qemu_threads(guest.domain())

    driver.detach(guest.name, serial, timeout=30)
    guest.wait_disk_gone(serial, 30)
    assert live_disks(guest.domain(), serial) == []
    assert driver.list_disks(guest.name) == []
    assert vbs_threads(guest.domain()) == set(), "the thread goes with its disk"
    driver.detach(guest.name, serial)  # absent: success

    # The data is on the volume: a new attach reads it back.
    driver.attach(guest.name, serial, nbd)
    assert guest.checksum(guest.wait_for_disk(serial, 30), 4) == written
    driver.detach(guest.name, serial, timeout=30)
    guest.wait_disk_gone(serial, 30)


def test_each_disk_has_a_thread_of_its_own_a_leftover_is_taken_and_the_domains_own_are_left_alone(
        driver: LibvirtDriver, guest: LibvirtGuest, nbd: NbdConnection, tmp_path: Path) -> None:
    dom, live = guest.domain(), libvirt.VIR_DOMAIN_AFFECT_LIVE
    first, second = vol(21), vol(22)
    leftover = VBS_IOTHREAD_BASE + 1
    dom.addIOThread(1, live)  # the domain's own thread, below VBS's range
    dom.addIOThread(leftover, live)  # as an attach that crashed between its two calls leaves one
    off = LibvirtDriver(URI, state_dir=tmp_path, iothreads=False)
    try:
        driver.attach(guest.name, first, nbd)
        driver.attach(guest.name, second, nbd, read_only=True)
        assert (disk_thread(dom, first), disk_thread(dom, second)) == (leftover, leftover + 1)
        assert vbs_threads(dom) == {leftover, leftover + 1}
        written = guest.write_pattern(guest.wait_for_disk(first, 30), "threads", 2)
        assert guest.checksum(guest.wait_for_disk(second, 30), 2) == written  # the same export, read only

        driver.detach(guest.name, first, timeout=30)
        guest.wait_disk_gone(first, 30)
        assert vbs_threads(dom) == {leftover + 1}
        # With the option off a disk stays in the main loop.
        wait_until(lambda: any(vm.vm_id == guest.name for vm in off.list_vms()), 30, what="the guest")
        off.attach(guest.name, first, nbd, read_only=True)
        assert disk_thread(dom, first) is None and vbs_threads(dom) == {leftover + 1}
        assert guest.checksum(guest.wait_for_disk(first, 30), 2) == written
        for serial in (first, second):
            driver.detach(guest.name, serial, timeout=30)
            guest.wait_disk_gone(serial, 30)
        assert vbs_threads(dom) == set()
        assert 1 in {tid for tid, _cpus in dom.ioThreadInfo(live)}, "the domain's own thread is left alone"
    finally:
        off.close()
        for serial in (first, second):
            if live_disks(dom, serial):
                driver.detach(guest.name, serial, timeout=30)
                guest.wait_disk_gone(serial, 30)
        for tid, _cpus in dom.ioThreadInfo(live):
            dom.delIOThread(tid, live)


def test_limits_are_iotune_and_change_live(driver: LibvirtDriver, guest: LibvirtGuest, nbd: NbdConnection) -> None:
    serial = vol(5)
    # 40 writes at 10 IOPS take 4 s: far above what they take unlimited, even on a loaded machine
    # (at 20 IOPS, 2 s against 0.9 s unlimited once made the ratio fail).
    driver.attach(guest.name, serial, nbd, qos=QoS(iops=10))
    dev = guest.wait_for_disk(serial, 30)
    tune = live_disks(guest.domain(), serial)[0].find("iotune")
    assert tune is not None and tune.findtext("total_iops_sec") == "10" and tune.findtext("size_iops_sec") == "262144"
    write = f"dd if=/dev/zero of=/dev/{dev} bs=4k count=40 oflag=direct"
    started = time.monotonic()
    guest.check(write)
    slow = time.monotonic() - started
    assert driver.set_qos(guest.name, serial, QoS(iops=4000)).serial == serial
    tune = live_disks(guest.domain(), serial)[0].find("iotune")
    assert tune is not None and tune.findtext("total_iops_sec") == "4000"
    started = time.monotonic()
    guest.check(write)
    assert slow > 2.5 * (time.monotonic() - started)
    assert guest.disks()[serial] == dev  # the same disk: never detached
    driver.detach(guest.name, serial, timeout=30)
    guest.wait_disk_gone(serial, 30)


def test_an_attached_disk_outlives_a_libvirtd_restart_and_is_found_again(
        libvirtd: Libvirtd, driver: LibvirtDriver, guest: LibvirtGuest, nbd: NbdConnection) -> None:
    serial = vol(2)
    disk = driver.attach(guest.name, serial, nbd)
    dev = guest.wait_for_disk(serial, 30)
    written = guest.write_pattern(dev, "before-restart", 2)

    libvirtd.restart()
    # The driver reconnects by itself; the disk is found by its alias in libvirt's state (once the
    # restarted libvirtd has reconnected to the running QEMU, which a loaded machine slows).
    listed: list[list[DiskInfo]] = []

    def found_again() -> bool:
        listed[:] = [driver.list_disks(guest.name)]
        return listed[0] == [disk]

    try:
        wait_until(found_again, 60, what="the disk found again")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: expected [{disk}], last listed {listed}") from None
    assert driver.attach(guest.name, serial, nbd) == disk
    assert len(live_disks(guest.domain(), serial)) == 1, "a repeated attach made no second device"
    assert guest.checksum(dev, 2) == written

    driver.detach(guest.name, serial, timeout=30)
    guest.wait_disk_gone(serial, 30)
    assert live_disks(guest.domain(), serial) == []


def test_domains_that_start_and_stop_later_are_seen_through_lifecycle_events(
        driver: LibvirtDriver, tmp_path: Path) -> None:
    driver.list_vms()
    conn = driver.session.connection()
    listed = conn.listAllDomains

    def no_listing(*args: object) -> object:
        raise AssertionError("the driver listed all domains: it should follow events")

    conn.listAllDomains = no_listing  # only events may tell the driver now
    own = libvirt.open(URI)
    try:
        dom = own.createXML(domain_xml("lv-events", None, None, 64), 0)
        found = wait_until(lambda: next((vm for vm in driver.list_vms() if vm.vm_id == "lv-events"), None), 30,
                           what="the new domain listed")
        assert found.running and found.uuid == dom.UUIDString()
        dom.destroy()
        wait_until(lambda: all(vm.vm_id != "lv-events" for vm in driver.list_vms()), 30,
                   what="the destroyed domain gone")
    finally:
        conn.listAllDomains = listed
        own.close()
    with pytest.raises(NotFound):
        driver.attach("lv-events", vol(3), NbdConnection(socket="/run/none/nbd.sock", export="v"))


@pytest.fixture
def bare(libvirtd: Libvirtd) -> Iterator[libvirt.virDomain]:
    """A persistent domain with no OS: it takes hot-plugged disks and never acknowledges an unplug."""
    conn = libvirt.open(URI)
    dom = conn.defineXML(domain_xml("lv-bare", None, None, 64))
    dom.create()
    try:
        yield dom
    finally:
        try:
            conn.lookupByName("lv-bare").destroy()
        except libvirt.libvirtError:
            pass
        conn.lookupByName("lv-bare").undefine()
        conn.close()


def test_a_guest_that_never_releases_the_disk_makes_detach_busy_and_persist_edits_the_config(
        libvirtd: Libvirtd, driver: LibvirtDriver, bare: libvirt.virDomain, nbd: NbdConnection,
        tmp_path: Path) -> None:
    drv = LibvirtDriver(URI, persist=True, state_dir=tmp_path)
    serial, live_only = vol(4), vol(6)
    try:
        wait_until(lambda: any(vm.vm_id == "lv-bare" for vm in drv.list_vms()), 30, what="the bare domain")
        drv.attach("lv-bare", serial, nbd)
        assert len(live_disks(bare, serial)) == 1
        assert len(live_disks(bare, serial, libvirt.VIR_DOMAIN_XML_INACTIVE)) == 1, "--persist: in the config"
        # Its I/O thread too, in both: the configuration names no thread it lacks.
        config = libvirt.VIR_DOMAIN_AFFECT_CONFIG
        thread = disk_thread(bare, serial)
        assert thread == disk_thread(bare, serial, libvirt.VIR_DOMAIN_XML_INACTIVE) == VBS_IOTHREAD_BASE + 1
        assert vbs_threads(bare) == vbs_threads(bare, config) == {thread}
        # A disk attached by an agent without --libvirt-persist gets into the config on a repeated attach.
        driver.attach("lv-bare", live_only, nbd)
        assert live_disks(bare, live_only, libvirt.VIR_DOMAIN_XML_INACTIVE) == []
        drv.attach("lv-bare", live_only, nbd)
        assert len(live_disks(bare, live_only)) == 1
        assert len(live_disks(bare, live_only, libvirt.VIR_DOMAIN_XML_INACTIVE)) == 1
        live_only_thread = disk_thread(bare, live_only)
        assert disk_thread(bare, live_only, libvirt.VIR_DOMAIN_XML_INACTIVE) == live_only_thread
        assert vbs_threads(bare, config) == {thread, live_only_thread}
        drv.detach("lv-bare", live_only, force=True)
        assert live_disks(bare, live_only, libvirt.VIR_DOMAIN_XML_INACTIVE) == []
        assert vbs_threads(bare, config) == {thread}, "the configuration's thread goes with its disk"

        started = time.monotonic()
        with pytest.raises(DeviceBusy):
            drv.detach("lv-bare", serial, timeout=3)
        assert time.monotonic() - started >= 3  # it waited for the guest, and the guest never answered
        assert [d.serial for d in drv.list_disks("lv-bare")] == [serial, live_only]  # the guest holds both

        drv.detach("lv-bare", serial, force=True)
        assert live_disks(bare, serial, libvirt.VIR_DOMAIN_XML_INACTIVE) == [], "gone from the config"
        # The devices the guest holds keep their threads; the configuration has none left.
        assert (vbs_threads(bare), vbs_threads(bare, config)) == ({thread, live_only_thread}, set())
        # The device stays until the guest lets go, but its NBD connection is closed.
        assert [(d.serial, d.connected) for d in drv.list_disks("lv-bare")] == [(serial, False), (live_only, False)]
        nodes = json.loads(libvirt_qemu.qemuMonitorCommand(
            bare, json.dumps({"execute": "query-named-block-nodes", "arguments": {"flat": True}}), 0))["return"]
        assert [n["drv"] for n in nodes if n["drv"] == "nbd"] == []
        drv.detach("lv-bare", serial, force=True)  # again: nothing left to cut, success
        with pytest.raises(IncorrectState, match="force-detached"):
            drv.attach("lv-bare", serial, nbd)
    finally:
        drv.close()


@pytest.fixture
def nbd_x509(tmp_path: Path) -> Iterator[tuple[NbdConnection, X509Files]]:
    """qemu-nbd on a loopback port, X.509 only (it checks the client's certificate too): its
    connection, and a host certificate from the same CA."""
    ca = CertificateAuthority(tmp_path / "ca.pem", tmp_path / "ca-key.pem")
    server = ca.issue("storage-1", ["127.0.0.1"], tmp_path / "server.pem", tmp_path / "server-key.pem")
    host = ca.issue("host-1", ["127.0.0.1"], tmp_path / "host.pem", tmp_path / "host-key.pem")
    creds = qemu_x509_dir(X509Files(server.cert, server.key, server.ca), tmp_path / "server-x509", "server")
    image = tmp_path / "volume.raw"
    with image.open("wb") as f:
        f.truncate(16 * MIB)
    port = free_port()
    log = (tmp_path / "qemu-nbd.log").open("wb")
    proc = subprocess.Popen(["qemu-nbd", "--format=raw", "--export-name=vol", "--bind=127.0.0.1", f"--port={port}",
                             "--persistent", "--shared=4", "--object",
                             f"tls-creds-x509,id=tls0,endpoint=server,dir={creds},verify-peer=on", "--tls-creds=tls0",
                             str(image)], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        wait_until(lambda: _listening(port), 10, what="qemu-nbd to listen")
        yield NbdConnection(host="127.0.0.1", port=port, export="vol", tls="x509"), \
            X509Files(host.cert, host.key, host.ca)
    finally:
        stop_process(proc)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_nbd_over_x509_with_the_hosts_certificate_where_qemu_conf_says(
        libvirtd: Libvirtd, guest: LibvirtGuest, nbd_x509: tuple[NbdConnection, X509Files], tmp_path: Path) -> None:
    conn, host = nbd_x509
    without = LibvirtDriver(URI, state_dir=tmp_path / "plain")
    try:
        with pytest.raises(IncorrectState, match="libvirt_nbd_tls_dir"):
            without.attach(guest.name, vol(5), conn)
    finally:
        without.close()
    drv = LibvirtDriver(URI, state_dir=tmp_path / "tls", x509=host, nbd_tls_dir=libvirtd.nbd_tls_dir)
    serial = vol(5)
    try:
        assert sorted(p.name for p in libvirtd.nbd_tls_dir.iterdir()) == ["ca-cert.pem", "client-cert.pem",
                                                                          "client-key.pem"]
        disk = drv.attach(guest.name, serial, conn)
        assert disk.size_bytes == 16 * MIB
        source = live_disks(guest.domain(), serial)[0].find("source")
        assert source is not None and source.get("tls") == "yes"
        dev = guest.wait_for_disk(serial, 30)
        written = guest.write_pattern(dev, "over-x509", 2)
        assert guest.checksum(dev, 2) == written
        drv.detach(guest.name, serial, timeout=30)
        guest.wait_disk_gone(serial, 30)
    finally:
        drv.close()


def test_on_q35_disks_go_into_spare_root_ports_and_one_more_is_refused_with_the_reason(
        driver: LibvirtDriver, nbd: NbdConnection, tmp_path: Path) -> None:
    """A q35 domain hot-plugs PCI devices only into empty PCIe root ports: libvirt picks one for each
    disk; with none left the attach is refused (409, the reason and the remedy) and leaves nothing."""
    g = LibvirtGuest("lv-q35", tmp_path / "q35", build_guest(), machine="q35", root_ports=2).start()
    try:
        g.wait_ready(120)
        driver.attach(g.name, vol(11), nbd)
        written = g.write_pattern(g.wait_for_disk(vol(11), 30), "q35", 2)
        driver.attach(g.name, vol(12), nbd, read_only=True)
        g.wait_for_disk(vol(12), 30)
        with pytest.raises(IncorrectState, match="no free slot for another disk.*pcie-root-port") as err:
            driver.attach(g.name, vol(13), nbd, read_only=True)
        assert err.value.status == 409
        assert live_disks(g.domain(), vol(13)) == []
        # The refused disk's I/O thread was made first, and is gone with it.
        assert vbs_threads(g.domain()) == {disk_thread(g.domain(), vol(11)), disk_thread(g.domain(), vol(12))}
        assert sorted(d.serial for d in driver.list_disks(g.name)) == [vol(11), vol(12)]

        # A port freed by a detach takes the next disk; it reads what the first one wrote.
        driver.detach(g.name, vol(12), timeout=30)
        g.wait_disk_gone(vol(12), 30)
        driver.detach(g.name, vol(11), timeout=30)
        g.wait_disk_gone(vol(11), 30)
        driver.attach(g.name, vol(13), nbd, read_only=True)
        assert g.checksum(g.wait_for_disk(vol(13), 30), 2) == written
        driver.detach(g.name, vol(13), timeout=30)
        g.wait_disk_gone(vol(13), 30)
    finally:
        g.stop()
