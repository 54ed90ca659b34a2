"""The QEMU driver's I/O threads (``[host_agent.options.qemu] iothreads``, on by default; qemu_disk_bus): each
virtio-blk disk in an ``iothread`` of its own, VBS's virtio-scsi controller in one for its disks.

In a real TCG guest over NBD (qemu-nbd on a unix socket), every operation that moves a disk's block
nodes runs with the nodes in the disk's thread: live QoS, online resize onto a refreshed export (a
``blockdev-reopen`` onto a node made in the main loop), a point-in-time copy (a backup job into a
target made in the main loop), detach and attach again; a forced detach's cut of the I/O path on a
VM that never releases the disk; and no thread is left behind."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import detached_after, empty_file, private_qmp, start_bare_vm, stop_process, wait_until
from vbs.config import HostAgentConfig
from vbs.errors import IncorrectState, InvalidParameter
from vbs.host.hypervisors.base import checked_iothreads
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.host.hypervisors.qemu_disk_bus import SCSI_CONTROLLER, SCSI_IOTHREAD
from vbs.host.hypervisors.qemu_ids import disk_ids
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest, pattern_bytes, pattern_sha256
from vbs.rigs.testguest.guest import qmp_execute
from vbs.wire.connection import FileConnection, NbdConnection
from vbs.wire.host import QoS

MIB = 1024 * 1024
VM = "ioguest"
BARE = "iobare"
SNAP = "snap-0123456789abcdef1"


def vol(n: int) -> str:
    return f"vol-{n:017x}"


@pytest.fixture(scope="module")
def vm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qemu-io") / "vms"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def guest(vm_dir: Path) -> Iterator[TestGuest]:
    with TestGuest(VM, vm_dir.parent, build_guest(), vm_dir, machine="q35", root_ports=2) as g:
        g.wait_ready(120)
        yield g


@pytest.fixture(scope="module")
def bare_vm(vm_dir: Path) -> Iterator[str]:
    """A VM with firmware only: nothing in it acknowledges an unplug."""
    proc = start_bare_vm(vm_dir, BARE, vm_dir.parent / "bare.log")
    try:
        wait_until(private_qmp(vm_dir, BARE).exists, 10, what="the bare VM's QMP sockets")
        yield BARE
    finally:
        stop_process(proc)  # by the PID we started


@pytest.fixture(scope="module")
def driver(vm_dir: Path, guest: TestGuest, bare_vm: str) -> Iterator[QemuDriver]:
    drv = QemuDriver(vm_dir, qmp_timeout=10.0, secrets_dir=vm_dir.parent / "vbs-secrets", iothreads=True)
    yield drv
    drv.close()


@pytest.fixture(autouse=True)
def leaves_the_guest_without_our_disks(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails before it detaches leaves the module's guest as the next test expects."""
    yield from detached_after(request, VM)


@pytest.fixture
def nbd_server(tmp_path: Path) -> Iterator[Callable[[Path], NbdConnection]]:
    """qemu-nbd serving a file on a unix socket of its own, as a storage node's export under ``vbs up``."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(file: Path) -> NbdConnection:
        sock = tmp_path / f"nbd{len(procs)}.sock"
        log = (tmp_path / "qemu-nbd.log").open("ab")
        procs.append(subprocess.Popen(  # noqa: S603 - argv list
            ["qemu-nbd", "--format=raw", "--export-name=vol", f"--socket={sock}", "--persistent", "--shared=4",
             "--cache=none", str(file)], stdout=log, stderr=subprocess.STDOUT))
        log.close()
        wait_until(sock.exists, 10, what="qemu-nbd to listen")
        return NbdConnection(socket=str(sock), export="vol")

    yield start
    for proc in procs:
        stop_process(proc)


def qom(vm_dir: Path, vm: str, path: str, prop: str) -> Any:
    return qmp_execute(private_qmp(vm_dir, vm), "qom-get", {"path": path, "property": prop})


def vbs_objects(vm_dir: Path, vm: str) -> set[str]:
    return {o["name"] for o in qmp_execute(private_qmp(vm_dir, vm), "qom-list", {"path": "/objects"})
            if o["name"].startswith("vbs-")}


def vbs_nodes(vm_dir: Path, vm: str) -> set[str]:
    return {n["node-name"] for n in qmp_execute(private_qmp(vm_dir, vm), "query-named-block-nodes", {"flat": True})
            if n["node-name"].startswith("vbs-")}


def test_a_disk_in_its_own_thread_is_written_throttled_resized_copied_detached_and_attached_again(
        driver: QemuDriver, guest: TestGuest, vm_dir: Path, nbd_server: Callable[[Path], NbdConnection],
        tmp_path: Path) -> None:
    serial = virtio_serial(vol(0x10A))
    ids = disk_ids(serial)
    volume = empty_file(tmp_path / "volume.raw", 16 * MIB)
    driver.attach(VM, serial, nbd_server(volume), qos=QoS(iops=5000))
    dev = guest.wait_for_disk(serial)
    # The device runs in the disk's own thread.
    assert qom(vm_dir, VM, f"/machine/peripheral/{ids.device}", "iothread") == f"/objects/{ids.iothread}"
    assert qom(vm_dir, VM, f"/objects/{ids.iothread}", "type") == "iothread"
    assert guest.write_pattern(dev, "in-its-thread", 4) == pattern_sha256("in-its-thread", 4)
    assert volume.read_bytes()[: 4 * MIB] == pattern_bytes("in-its-thread", 4)

    # QoS changed live: the throttle group of a node in the thread takes the new limits.
    driver.set_qos(VM, serial, QoS(iops=2000, mbps=50))
    limits = qom(vm_dir, VM, f"/objects/{ids.throttle_group}", "limits")
    assert (limits["iops-total"], limits["bps-total"]) == (2000, 50 * MIB)

    # Online resize: the raw node in the thread is reopened onto a node made on the refreshed export.
    with volume.open("r+b") as f:
        f.truncate(32 * MIB)
    assert driver.resize(VM, serial, nbd_server(volume), 32 * MIB).size_bytes == 32 * MIB
    wait_until(lambda: int(guest.check(f"cat /sys/block/{dev}/size")) * 512 == 32 * MIB, 30, 0.1,
               what="the guest to see 32 MiB")
    assert vbs_nodes(vm_dir, VM) == {ids.throttle, ids.raw, ids.proto2}

    # A point-in-time copy: the backup job runs in the disk's thread with a target made in the main loop.
    snapshot = empty_file(tmp_path / "snapshot.raw", 32 * MIB)
    wait_until(lambda: driver.ensure_copy(VM, serial, SNAP, FileConnection(path=str(snapshot))).state == "ready",
               60, 0.2, what="the copy to be ready")
    assert snapshot.read_bytes()[: 4 * MIB] == pattern_bytes("in-its-thread", 4)
    driver.remove_copy(VM, serial, SNAP)

    # Detach: the device, its nodes and its thread go.
    driver.detach(VM, serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(vm_dir, VM) == set() and vbs_objects(vm_dir, VM) == set()

    driver.attach(VM, serial, nbd_server(volume))
    dev = guest.wait_for_disk(serial)
    assert guest.checksum(dev, 4) == pattern_sha256("in-its-thread", 4)
    driver.detach(VM, serial)
    guest.wait_disk_gone(serial)
    assert vbs_objects(vm_dir, VM) == set()


def test_a_crashed_attachs_thread_is_taken_over_and_a_failed_attach_leaves_none(
        driver: QemuDriver, guest: TestGuest, vm_dir: Path, tmp_path: Path) -> None:
    serial = virtio_serial(vol(0x10B))
    ids = disk_ids(serial)
    # What an agent killed between the thread and the device leaves.
    guest.qmp("object-add", {"qom-type": "iothread", "id": ids.iothread})
    driver.attach(VM, serial, FileConnection(path=str(empty_file(tmp_path / "a.raw", 16 * MIB))))
    guest.wait_for_disk(serial)
    assert qom(vm_dir, VM, f"/machine/peripheral/{ids.device}", "iothread") == f"/objects/{ids.iothread}"
    driver.detach(VM, serial)
    guest.wait_disk_gone(serial)
    # An attach that fails after its thread was made (the guest's slots are full) takes it back.
    q35_ports = [virtio_serial(vol(0x10C + n)) for n in range(2)]
    for n, other in enumerate(q35_ports):
        driver.attach(VM, other, FileConnection(path=str(empty_file(tmp_path / f"p{n}.raw", 16 * MIB))))
    with pytest.raises(IncorrectState, match="no free slot for another disk"):
        driver.attach(VM, serial, FileConnection(path=str(empty_file(tmp_path / "b.raw", 16 * MIB))))
    assert ids.iothread not in vbs_objects(vm_dir, VM)
    for other in q35_ports:
        driver.detach(VM, other)
        guest.wait_disk_gone(other)
    assert vbs_objects(vm_dir, VM) == set()


def test_a_forced_detach_cuts_the_io_of_a_disk_in_its_thread(driver: QemuDriver, bare_vm: str, vm_dir: Path,
                                                             tmp_path: Path) -> None:
    serial = virtio_serial(vol(0x10E))
    ids = disk_ids(serial)
    driver.attach(bare_vm, serial, FileConnection(path=str(empty_file(tmp_path / "f.raw", 16 * MIB))))
    assert qom(vm_dir, bare_vm, f"/machine/peripheral/{ids.device}", "iothread") == f"/objects/{ids.iothread}"
    driver.detach(bare_vm, serial, force=True, timeout=1.0)
    # The device stays (nothing releases it) with its thread; the storage under it is gone.
    assert ids.proto not in vbs_nodes(vm_dir, bare_vm) and ids.dead in vbs_nodes(vm_dir, bare_vm)
    assert ids.iothread in vbs_objects(vm_dir, bare_vm)


def test_the_scsi_controller_runs_its_disks_in_one_thread(vm_dir: Path, bare_vm: str, driver: QemuDriver,
                                                          tmp_path: Path) -> None:
    # QEMU serves one client per monitor: the module's driver lets go of the bare VM's meanwhile.
    driver.close()
    scsi = QemuDriver(vm_dir, qmp_timeout=10.0, secrets_dir=vm_dir.parent / "vbs-secrets", disk_bus="virtio-scsi",
                      iothreads=True)
    try:
        serials = [virtio_serial(vol(0x110 + n)) for n in range(2)]
        for n, serial in enumerate(serials):
            scsi.attach(bare_vm, serial, FileConnection(path=str(empty_file(tmp_path / f"s{n}.raw", 16 * MIB))))
        assert qom(vm_dir, bare_vm, f"/machine/peripheral/{SCSI_CONTROLLER}", "iothread") == f"/objects/{SCSI_IOTHREAD}"
        # No thread of a disk's own: both run in the controller's.
        assert not {disk_ids(s).iothread for s in serials} & vbs_objects(vm_dir, bare_vm)
        assert set(serials) <= {d.serial for d in scsi.list_disks(bare_vm)}
    finally:
        scsi.close()


@pytest.mark.unit
@pytest.mark.parametrize("value", ["yes", 1, 0, "", ["true"]])
def test_iothreads_takes_a_boolean_only(value: object, tmp_path: Path) -> None:
    with pytest.raises(InvalidParameter, match="iothreads of the qemu driver"):
        checked_iothreads(value, "qemu")
    with pytest.raises(InvalidParameter, match="iothreads of the qemu driver"):
        QemuDriver.from_config(HostAgentConfig(vm_dir=tmp_path, options={"qemu": {"iothreads": value}}))


@pytest.mark.unit
def test_iothreads_are_on_unless_turned_off(tmp_path: Path) -> None:
    assert QemuDriver(tmp_path).iothreads is True
    assert QemuDriver.from_config(HostAgentConfig(vm_dir=tmp_path)).iothreads is True
    off = HostAgentConfig(vm_dir=tmp_path, options={"qemu": {"iothreads": False}})
    assert QemuDriver.from_config(off).iothreads is False
