"""The QEMU hypervisor driver against real VMs: a booted test guest and a bare VM with no guest OS.

Volumes are raw files opened by QEMU or served by our own qemu-nbd on a free loopback port; every
check of the guest's view goes through the guest's serial console, every check of QEMU's through QMP.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from tests.conftest import free_port, stop_process, wait_until
from vbs.argv import run
from vbs.connection import FileConnection, IscsiConnection, NbdConnection
from vbs.errors import DriverError, IncorrectState, InvalidParameter, NotFound
from vbs.host.hypervisors.base import AttachedDisk, DeviceBusy, HypervisorDriver, QoS, VmInfo
from vbs.host.hypervisors.qemu import PROBE_TIMEOUT, QemuDriver, disk_ids
from vbs.ids import virtio_serial
from vbs.testguest import GuestImage, TestGuest, build_guest, pattern_bytes, pattern_sha256
from vbs.testguest.guest import qmp_execute

MIB = 1024 * 1024
PSK_KEY = "0123456789abcdef0123456789abcdef"


def vol(n: int) -> str:
    return f"vol-{n:017x}"


@pytest.fixture(scope="module")
def vm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vms")


@pytest.fixture(scope="module")
def guest(vm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestGuest]:
    image: GuestImage = build_guest()
    with TestGuest("guest1", tmp_path_factory.mktemp("guest1"), image, vm_dir) as g:
        g.wait_ready(60)
        yield g


@pytest.fixture(scope="module")
def bare_vm(vm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A VM with firmware only: nothing in it will ever acknowledge an unplug."""
    log = (tmp_path_factory.mktemp("bare") / "qemu.log").open("wb")
    sock = vm_dir / "bare.qmp"
    proc = subprocess.Popen(  # noqa: S603 - argv list
        ["qemu-system-x86_64", "-accel", "tcg", "-machine", "pc", "-m", "64", "-nodefaults",
         "-display", "none", "-name", "bare-vm", "-qmp", f"unix:{sock},server=on,wait=off"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until(sock.exists, 10, what="the bare VM's QMP socket")
        yield "bare"
    finally:
        stop_process(proc)  # by the PID we started
        log.close()


@pytest.fixture(scope="module")
def driver(vm_dir: Path, guest: TestGuest, bare_vm: str) -> QemuDriver:
    return QemuDriver(vm_dir, qmp_timeout=10.0, secrets_dir=vm_dir.parent / "vbs-secrets")


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    path = tmp_path / "volume.raw"
    with path.open("wb") as f:
        f.truncate(16 * MIB)
    return path


@pytest.fixture
def nbd_server(tmp_path: Path, volume: Path) -> Iterator[Callable[..., NbdConnection]]:
    """Start qemu-nbd on a free loopback port serving ``volume`` (optionally TLS-PSK only)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(psk_identity: str | None = None) -> NbdConnection:
        port = free_port()
        argv = ["qemu-nbd", "--format=raw", "--export-name=vol", "--bind=127.0.0.1", f"--port={port}",
                "--persistent", "--shared=4", "--cache=none"]  # fmt: skip
        if psk_identity:
            keys = tmp_path / "server-keys"
            keys.mkdir()
            (keys / "keys.psk").write_text(f"{psk_identity}:{PSK_KEY}\n")
            argv += ["--object", f"tls-creds-psk,id=tls0,endpoint=server,dir={keys}", "--tls-creds=tls0"]
        log = (tmp_path / "qemu-nbd.log").open("wb")
        procs.append(subprocess.Popen([*argv, str(volume)], stdout=log, stderr=subprocess.STDOUT))  # noqa: S603
        log.close()
        wait_until(lambda: _listening(port), 10, what="qemu-nbd to listen")
        return NbdConnection(
            host="127.0.0.1",
            port=port,
            export="vol",
            tls_psk_identity=psk_identity,
            tls_psk_key=PSK_KEY if psk_identity else None,
        )

    yield start
    for proc in procs:
        stop_process(proc)


@pytest.fixture
def tgt_server(tmp_path: Path, volume: Path) -> Iterator[IscsiConnection]:
    """tgtd on a free loopback port exporting ``volume`` as LUN 1, with CHAP."""
    port = free_port()
    # tgtd's control socket number (a small int): pick one no other tgtd on this machine uses.
    control = str(next(n for n in range(1000 + port % 5000, 9000) if not Path(f"/var/run/tgtd/socket.{n}").exists()))
    iqn = "iqn.2024-01.org.vbs:test-volume"
    log = (tmp_path / "tgtd.log").open("wb")
    proc = subprocess.Popen(  # noqa: S603 - argv list
        ["tgtd", "-f", "-C", control, "--iscsi", f"portal=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT
    )
    log.close()

    def tgtadm(*args: str) -> None:
        run(["tgtadm", "-C", control, "--lld", "iscsi", *args], timeout=30)

    try:
        wait_until(lambda: _listening(port), 10, what="tgtd to listen")
        tgtadm("--mode", "target", "--op", "new", "--tid", "1", "-T", iqn)
        tgtadm("--mode", "logicalunit", "--op", "new", "--tid", "1", "--lun", "1", "-b", str(volume))
        tgtadm("--mode", "target", "--op", "bind", "--tid", "1", "--initiator-address", "127.0.0.1")
        tgtadm("--mode", "account", "--op", "new", "--user", "vbsuser", "--password", "chap-secret-1")
        tgtadm("--mode", "account", "--op", "bind", "--tid", "1", "--user", "vbsuser")
        yield IscsiConnection(
            host="127.0.0.1", port=port, iqn=iqn, lun=1, chap_user="vbsuser", chap_secret="chap-secret-1"
        )
    finally:
        # tgtd ignores SIGTERM: take it offline and delete it through its control socket.
        run(["tgtadm", "-C", control, "--op", "update", "--mode", "sys", "--name", "State", "-v", "offline"],
            timeout=30, check=False)  # fmt: skip
        run(["tgtadm", "-C", control, "--lld", "iscsi", "--mode", "target", "--op", "delete", "--force",
             "--tid", "1"], timeout=30, check=False)  # fmt: skip
        run(["tgtadm", "-C", control, "--op", "delete", "--mode", "system"], timeout=30, check=False)
        stop_process(proc, timeout=10)  # by PID, if the control socket did not stop it
        for leftover in (f"/var/run/tgtd/socket.{control}", f"/var/run/tgtd/socket.{control}.lock"):
            Path(leftover).unlink(missing_ok=True)  # tgtd leaves them behind


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def vbs_nodes(vm_sock: Path) -> set[str]:
    nodes = qmp_execute(vm_sock, "query-named-block-nodes", {"flat": True})
    return {n["node-name"] for n in nodes if n["node-name"].startswith("vbs-")}


def vbs_objects(vm_sock: Path) -> set[str]:
    return {o["name"] for o in qmp_execute(vm_sock, "qom-list", {"path": "/objects"}) if o["name"].startswith("vbs-")}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def test_vms_are_discovered_by_their_sockets_and_stale_ones_skipped(driver: QemuDriver, vm_dir: Path) -> None:
    stale = vm_dir / "gone.qmp"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a socket file nobody listens on any more, as a killed QEMU leaves it
    (vm_dir / "notes.txt.qmp").write_text("not a socket")
    try:
        vms = driver.list_vms()
    finally:
        stale.unlink()
        (vm_dir / "notes.txt.qmp").unlink()
    assert VmInfo(vm_id="guest1", name="guest1", running=True) in vms
    assert VmInfo(vm_id="bare", name="bare-vm", running=True) in vms
    assert {vm.vm_id for vm in vms} == {"guest1", "bare"}


def test_unknown_and_malformed_vm_ids_are_refused(driver: QemuDriver, volume: Path) -> None:
    conn = FileConnection(path=str(volume))
    with pytest.raises(NotFound):
        driver.attach("no-such-vm", conn, virtio_serial(vol(1)))
    for bad in ("../guest1", "", "a b", "x" * 65):
        with pytest.raises(InvalidParameter):
            driver.attach(bad, conn, virtio_serial(vol(1)))
    with pytest.raises(InvalidParameter):
        driver.attach("guest1", conn, "vol-with-dash")


def test_file_volume_is_hot_plugged_written_and_unplugged(
    driver: QemuDriver, guest: TestGuest, volume: Path, vm_dir: Path
) -> None:
    hv: HypervisorDriver = driver  # the host agent sees only the contract
    serial = virtio_serial(vol(0x10))
    disk, attach_s = timed(lambda: hv.attach("guest1", FileConnection(path=str(volume)), serial))
    ids = disk_ids(serial)
    assert disk == AttachedDisk(serial=serial, device_id=ids.device, node_name=ids.raw, read_only=False)
    dev = guest.wait_for_disk(serial, timeout=10)
    assert guest.disk_size(serial) == 16 * MIB
    assert hv.list_disks("guest1") == [disk]

    assert guest.write_pattern(dev, "file-vol", 4) == pattern_sha256("file-vol", 4)

    _, detach_s = timed(lambda: hv.detach("guest1", serial))
    guest.wait_disk_gone(serial, timeout=10)
    assert hv.list_disks("guest1") == []
    assert vbs_nodes(vm_dir / "guest1.qmp") == set()
    assert volume.read_bytes()[: 4 * MIB] == pattern_bytes("file-vol", 4)
    print(f"file attach {attach_s:.3f}s, detach (guest released) {detach_s:.3f}s")


def test_attach_and_detach_are_idempotent(driver: QemuDriver, guest: TestGuest, volume: Path) -> None:
    serial = virtio_serial(vol(0x11))
    conn = FileConnection(path=str(volume))
    first = driver.attach("guest1", conn, serial)
    assert driver.attach("guest1", conn, serial) == first
    guest.wait_for_disk(serial)
    assert [d.serial for d in driver.list_disks("guest1")] == [serial]

    driver.detach("guest1", serial)
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    driver.detach("guest1", virtio_serial(vol(0x12)))  # never attached: nothing to do


def test_nbd_volume_is_read_and_written_through_qemu_nbd(
    driver: QemuDriver, guest: TestGuest, nbd_server: Callable[..., NbdConnection], volume: Path
) -> None:
    conn = nbd_server()
    serial = virtio_serial(vol(0x20))
    _, attach_s = timed(lambda: driver.attach("guest1", conn, serial))
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "over-nbd", 3) == pattern_sha256("over-nbd", 3)
    _, detach_s = timed(lambda: driver.detach("guest1", serial))
    guest.wait_disk_gone(serial)
    assert volume.read_bytes()[: 3 * MIB] == pattern_bytes("over-nbd", 3)
    print(f"nbd attach {attach_s:.3f}s, detach {detach_s:.3f}s")


def test_iscsi_volume_with_chap_is_read_and_written_through_tgt(
    driver: QemuDriver, guest: TestGuest, tgt_server: IscsiConnection, volume: Path, vm_dir: Path
) -> None:
    serial = virtio_serial(vol(0x22))
    _, attach_s = timed(lambda: driver.attach("guest1", tgt_server, serial))
    # The CHAP secret lives in a QEMU secret object, created over QMP only.
    assert disk_ids(serial).secret in vbs_objects(vm_dir / "guest1.qmp")
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "over-iscsi", 2) == pattern_sha256("over-iscsi", 2)
    _, detach_s = timed(lambda: driver.detach("guest1", serial))
    guest.wait_disk_gone(serial)
    assert vbs_objects(vm_dir / "guest1.qmp") == set()
    assert volume.read_bytes()[: 2 * MIB] == pattern_bytes("over-iscsi", 2)
    print(f"iscsi attach {attach_s:.3f}s, detach {detach_s:.3f}s")


def test_iscsi_with_a_wrong_chap_secret_fails_cleanly(
    driver: QemuDriver, guest: TestGuest, tgt_server: IscsiConnection, vm_dir: Path
) -> None:
    wrong = tgt_server.model_copy(update={"chap_secret": SecretStr("not-the-secret")})
    serial = virtio_serial(vol(0x23))
    with pytest.raises(DriverError):
        driver.attach("guest1", wrong, serial)
    assert vbs_nodes(vm_dir / "guest1.qmp") == set()
    assert vbs_objects(vm_dir / "guest1.qmp") == set()


def test_nbd_with_tls_psk_leaves_no_key_on_disk(
    driver: QemuDriver, guest: TestGuest, nbd_server: Callable[..., NbdConnection], vm_dir: Path
) -> None:
    conn = nbd_server(psk_identity="host1")
    serial = virtio_serial(vol(0x21))
    driver.attach("guest1", conn, serial)
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "tls", 1) == pattern_sha256("tls", 1)
    assert disk_ids(serial).tls in vbs_objects(vm_dir / "guest1.qmp")
    assert list(driver.secrets_dir.rglob("*")) == []
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_objects(vm_dir / "guest1.qmp") == set()


def test_a_failed_attach_leaves_no_node_or_object(driver: QemuDriver, guest: TestGuest, vm_dir: Path) -> None:
    nobody = NbdConnection(
        host="127.0.0.1", port=free_port(), export="vol", tls_psk_identity="host1", tls_psk_key=PSK_KEY
    )
    serial = virtio_serial(vol(0x30))
    with pytest.raises(DriverError, match="QMP blockdev-add"):
        driver.attach("guest1", nobody, serial, qos=QoS(iops=100))
    sock = vm_dir / "guest1.qmp"
    assert vbs_nodes(sock) == set()
    assert vbs_objects(sock) == set()
    assert driver.list_disks("guest1") == []
    assert serial not in guest.disks()


def test_qos_puts_a_throttle_group_under_the_disk(
    driver: QemuDriver, guest: TestGuest, volume: Path, vm_dir: Path
) -> None:
    serial = virtio_serial(vol(0x40))
    ids = disk_ids(serial)
    disk = driver.attach("guest1", FileConnection(path=str(volume)), serial, qos=QoS(iops=20, mbps=5))
    assert disk.node_name == ids.throttle
    limits = qmp_execute(
        vm_dir / "guest1.qmp", "qom-get", {"path": f"/objects/{ids.throttle_group}", "property": "limits"}
    )
    assert limits["iops-total"] == 20 and limits["bps-total"] == 5 * MIB
    dev = guest.wait_for_disk(serial)
    # 40 synchronous 4 KiB writes at 20 IOPS take about 2 s (less a small initial burst).
    _, took = timed(lambda: guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=4k count=40 oflag=direct"))
    assert took > 1.2
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_objects(vm_dir / "guest1.qmp") == set()


def test_read_only_attach_is_read_only_in_the_guest(driver: QemuDriver, guest: TestGuest, volume: Path) -> None:
    volume.write_bytes(pattern_bytes("ro", 1) + bytes(15 * MIB))
    serial = virtio_serial(vol(0x50))
    disk = driver.attach("guest1", FileConnection(path=str(volume)), serial, read_only=True)
    assert disk.read_only and driver.list_disks("guest1")[0].read_only
    dev = guest.wait_for_disk(serial)
    assert guest.check(f"cat /sys/block/{dev}/ro").strip() == "1"
    assert guest.checksum(dev, 1) == pattern_sha256("ro", 1)
    rc, _ = guest.run(f"dd if=/dev/zero of=/dev/{dev} bs=4k count=1 oflag=direct")
    assert rc != 0
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert volume.read_bytes()[:MIB] == pattern_bytes("ro", 1)


def test_leftovers_of_a_crashed_attach_are_cleaned(
    driver: QemuDriver, guest: TestGuest, volume: Path, vm_dir: Path
) -> None:
    serial = virtio_serial(vol(0x60))
    ids = disk_ids(serial)
    sock = vm_dir / "guest1.qmp"

    def half_attach() -> None:  # what an agent killed between blockdev-add and device_add leaves
        qmp_execute(sock, "blockdev-add", {"driver": "file", "node-name": ids.proto, "filename": str(volume)})
        qmp_execute(sock, "blockdev-add", {"driver": "raw", "node-name": ids.raw, "file": ids.proto})

    half_attach()
    driver.detach("guest1", serial)
    assert vbs_nodes(sock) == set()

    half_attach()
    driver.attach("guest1", FileConnection(path=str(volume)), serial)
    guest.wait_for_disk(serial)
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(sock) == set()


def test_a_guest_that_never_releases_the_disk_is_busy_and_force_cuts_its_io(
    driver: QemuDriver, bare_vm: str, nbd_server: Callable[..., NbdConnection], vm_dir: Path
) -> None:
    sock = vm_dir / f"{bare_vm}.qmp"
    serial = virtio_serial(vol(0x70))
    ids = disk_ids(serial)
    driver.attach(bare_vm, nbd_server(), serial)

    started = time.monotonic()
    with pytest.raises(DeviceBusy, match="did not release"):
        driver.detach(bare_vm, serial, timeout=1.0)
    assert time.monotonic() - started < 4
    assert {ids.proto, ids.raw} <= vbs_nodes(sock)  # still in use: nothing was pulled from under it

    _, force_s = timed(lambda: driver.detach(bare_vm, serial, force=True, timeout=5.0))
    assert force_s < 4
    # The device stays until a guest acknowledges; the NBD session is gone and I/O fails.
    nodes = vbs_nodes(sock)
    assert ids.proto not in nodes and ids.dead in nodes
    assert [d.serial for d in driver.list_disks(bare_vm)] == [serial]
    with pytest.raises(IncorrectState, match="force-detached"):
        driver.attach(bare_vm, FileConnection(path="/dev/null"), serial)
    driver.detach(bare_vm, serial, force=True, timeout=1.0)  # repeating it is harmless
    print(f"busy detach raised after {time.monotonic() - started:.2f}s total; force {force_s:.3f}s")


def test_listing_does_not_wait_for_a_vm_the_driver_is_busy_with(driver: QemuDriver, bare_vm: str, volume: Path) -> None:
    serial = virtio_serial(vol(0x71))
    driver.attach(bare_vm, FileConnection(path=str(volume)), serial)
    assert VmInfo(vm_id="bare", name="bare-vm", running=True) in driver.list_vms()
    errors: list[BaseException] = []

    def slow_detach() -> None:  # holds the bare VM's monitor for 4 s, waiting for a guest that never answers
        try:
            driver.detach(bare_vm, serial, timeout=4.0)
        except DeviceBusy as exc:
            errors.append(exc)

    worker = threading.Thread(target=slow_detach)
    worker.start()
    time.sleep(0.3)
    vms, took = timed(driver.list_vms)
    worker.join()
    assert took < 2.0  # waiting for the detach would take over 3.5 s
    assert VmInfo(vm_id="bare", name="bare-vm", running=True) in vms  # as last seen
    assert len(errors) == 1
    driver.detach(bare_vm, serial, force=True, timeout=0.5)


def test_a_vm_whose_monitor_another_client_holds_is_listed_as_not_running(
    driver: QemuDriver, guest: TestGuest, vm_dir: Path
) -> None:
    with socket.socket(socket.AF_UNIX) as holder:
        holder.connect(str(vm_dir / "guest1.qmp"))  # QEMU serves this client; the driver must queue
        vms, took = timed(driver.list_vms)
    assert VmInfo(vm_id="guest1", name="guest1", running=False) in vms
    assert took < PROBE_TIMEOUT + 2
    assert VmInfo(vm_id="guest1", name="guest1", running=True) in driver.list_vms()


def test_disk_ids_have_two_generations_of_connection_ids() -> None:
    ids = disk_ids(virtio_serial(vol(0x80)))
    first, second = ids.generations
    assert (first.proto, first.secret, first.tls) == (ids.proto, ids.secret, ids.tls)  # what attach uses
    assert len({first.proto, second.proto, first.secret, second.secret, first.tls, second.tls}) == 6
    assert max(len(n) for n in ids.nodes_top_down) <= 31  # QEMU's limit on node names
    assert {first.proto, second.proto} <= set(ids.nodes_top_down)
    assert set(first.objects + second.objects) <= set(ids.objects)


def test_a_grown_file_volume_with_qos_is_resized_in_place(
    driver: QemuDriver, guest: TestGuest, volume: Path, vm_dir: Path
) -> None:
    """The top node is the throttle node; a file node sees its file grow, so no swap is needed."""
    serial = virtio_serial(vol(0x81))
    ids = disk_ids(serial)
    conn = FileConnection(path=str(volume))
    driver.attach("guest1", conn, serial, qos=QoS(iops=10_000))
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "qos", 2) == pattern_sha256("qos", 2)
    with volume.open("r+b") as f:
        f.truncate(32 * MIB)
    disk = driver.resize("guest1", serial, conn, 32 * MIB)
    assert disk.node_name == ids.throttle
    wait_until(lambda: int(guest.check(f"cat /sys/block/{dev}/size")) * 512 == 32 * MIB, 10, 0.05, what="32 MiB")
    assert vbs_nodes(vm_dir / "guest1.qmp") == {ids.throttle, ids.raw, ids.proto}
    assert guest.checksum(dev, 2) == pattern_sha256("qos", 2)
    guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=1M seek=31 count=1 oflag=direct")
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(vm_dir / "guest1.qmp") == set() and vbs_objects(vm_dir / "guest1.qmp") == set()


def test_detach_removes_both_generations_of_an_interrupted_resize(
    driver: QemuDriver, guest: TestGuest, volume: Path, vm_dir: Path
) -> None:
    serial = virtio_serial(vol(0x82))
    ids = disk_ids(serial)
    sock = vm_dir / "guest1.qmp"
    driver.attach("guest1", FileConnection(path=str(volume)), serial)
    guest.wait_for_disk(serial)
    # What an agent killed in the middle of a resize leaves: the second generation's node and secret.
    qmp_execute(sock, "object-add", {"qom-type": "secret", "id": ids.secret2, "data": "x"})
    qmp_execute(sock, "blockdev-add", {"driver": "null-co", "node-name": ids.proto2, "size": 16 * MIB})
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(sock) == set() and vbs_objects(sock) == set()
