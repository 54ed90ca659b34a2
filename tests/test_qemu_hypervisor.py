"""The QEMU hypervisor driver and its host connectors, against real VMs.

A booted test guest and bare VMs with no guest OS; volumes are raw files opened by QEMU or served by
our own qemu-nbd, qemu-storage-daemon or tgtd on free loopback ports. Every check of the guest's view
goes through the guest's serial console, every check of QEMU's through the VM's test monitor (the
driver holds its main monitor with a persistent connection).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from tests.conftest import empty_file, free_port, private_qmp, start_bare_vm, stop_process, wait_until
from vbs.connectors import connector_for
from vbs.errors import DeviceBusy, DriverError, IncorrectState, InvalidParameter, NotFound
from vbs.host.hypervisors.base import HypervisorDriver
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.host.hypervisors.qemu_ids import copy_ids, disk_ids
from vbs.host.hypervisors.qemu_monitors import PROBE_TIMEOUT
from vbs.host.hypervisors.qemu_plug import FORCE_GRACE_SECONDS
from vbs.ids import virtio_serial
from vbs.qemu.qmp import QmpClient
from vbs.rigs.testguest import TestGuest, build_guest, pattern_bytes, pattern_sha256
from vbs.rigs.testguest.guest import qmp_execute
from vbs.system.argv import run
from vbs.wire.connection import FileConnection, IscsiConnection, NbdConnection
from vbs.wire.host import DiskInfo, QoS, VmInfo

MIB = 1024 * 1024
PSK_KEY = "0123456789abcdef0123456789abcdef"
CHAP_SECRET = "chap-secret-1"
SNAP = "snap-0123456789abcdef0"
SnapshotTarget = Callable[..., tuple[NbdConnection, Path]]


def vol(n: int) -> str:
    return f"vol-{n:017x}"


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qemu-hv") / "vms"  # its parent holds the VMs' test monitors
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def guest(vm_dir: Path) -> Iterator[TestGuest]:
    # Booted, not resumed: the tests find QEMU's monitor connections by the path it bound (ss), and a
    # resumed guest binds its monitor under another name first (vbs.rigs.testguest.warm).
    with TestGuest("guest1", vm_dir.parent, build_guest(), vm_dir, cold=True) as g:
        assert g.test_qmp_path == private_qmp(vm_dir, "guest1")
        g.wait_ready(120)
        yield g


@pytest.fixture(scope="module")
def q35_guest(vm_dir: Path) -> Iterator[TestGuest]:
    """A PCI Express machine: its root bus takes no hot-plugged device, its two root ports do."""
    with TestGuest("q35guest", vm_dir.parent, build_guest(), vm_dir, machine="q35", root_ports=2) as g:
        g.wait_ready(60)
        yield g


@pytest.fixture(scope="module")
def bare_vm(vm_dir: Path) -> Iterator[str]:
    """A VM with firmware only: nothing in it will ever acknowledge an unplug."""
    log = (vm_dir.parent / "bare.log").open("wb")
    proc = subprocess.Popen(  # noqa: S603 - argv list
        ["qemu-system-x86_64", "-accel", "tcg", "-machine", "pc", "-m", "64", "-nodefaults", "-display", "none",
         "-name", "bare-vm", "-qmp", f"unix:{vm_dir / 'bare.qmp'},server=on,wait=off",
         "-qmp", f"unix:{private_qmp(vm_dir, 'bare')},server=on,wait=off"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until(private_qmp(vm_dir, "bare").exists, 10, what="the bare VM's QMP sockets")
        yield "bare"
    finally:
        stop_process(proc)  # by the PID we started
        log.close()


@pytest.fixture(scope="module")
def driver(vm_dir: Path, guest: TestGuest, bare_vm: str) -> Iterator[QemuDriver]:
    drv = QemuDriver(vm_dir, qmp_timeout=10.0, secrets_dir=vm_dir.parent / "vbs-secrets")
    yield drv
    drv.close()


@pytest.fixture(autouse=True)
def leaves_shared_vms_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that plugs a disk into one of the module's VMs unplugs it; when it fails before it does,
    this does it, so the next test starts from the VM it expects. A force-detached disk of the bare VM
    stays (nothing in it acknowledges an unplug): only detached again, harmlessly."""
    shared = {"guest": "guest1", "q35_guest": "q35guest", "bare_vm": "bare"}
    used = [vm for fixture, vm in shared.items() if fixture in request.fixturenames]
    if "driver" not in request.fixturenames or not used:
        yield
        return
    driver: QemuDriver = request.getfixturevalue("driver")
    for storage in ("nbd_server", "tgt_server", "snapshot_target"):  # set up first, so torn down after this
        if storage in request.fixturenames:
            request.getfixturevalue(storage)
    guests: list[TestGuest] = [request.getfixturevalue(f) for f in ("guest", "q35_guest") if f in request.fixturenames]
    before = {vm: {d.serial for d in driver.list_disks(vm)} for vm in used}
    seen = {guest.name: set(guest.disks()) for guest in guests}
    yield
    for vm in used:
        for disk in driver.list_disks(vm):
            if disk.serial not in before[vm]:
                driver.detach(vm, disk.serial, force=vm == "bare", timeout=10.0)
    for guest in guests:
        assert {d.serial for d in driver.list_disks(guest.name)} == before[guest.name]
        wait_until(lambda g=guest: set(g.disks()) == seen[g.name], 10, what=f"{guest.name}'s disks as before")


class QmpSpy:
    """What is asked of QEMU's monitors during a test (``QmpClient`` patched): per socket, each command,
    each wait for an event and each connect, with the time limit it was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str, float]] = []  # (socket path, what, seconds allowed)
        self._lock = threading.Lock()
        execute, wait_event, connect = QmpClient.execute, QmpClient.wait_event, QmpClient.connect

        def spied_execute(client: QmpClient, command: str, arguments: Any = None, *, timeout: float | None = None
                          ) -> Any:
            self._record(client, command, timeout)
            return execute(client, command, arguments, timeout=timeout)

        def spied_wait_event(client: QmpClient, name: str, match: Any = None, *, since: int = 0,
                             timeout: float | None = None) -> dict[str, Any]:
            self._record(client, f"event {name}", timeout)
            return wait_event(client, name, match, since=since, timeout=timeout)

        def spied_connect(client: QmpClient, timeout: float | None = None) -> None:
            self._record(client, "connect", timeout if timeout is not None else client.connect_timeout)
            connect(client, timeout)

        monkeypatch.setattr(QmpClient, "execute", spied_execute)
        monkeypatch.setattr(QmpClient, "wait_event", spied_wait_event)
        monkeypatch.setattr(QmpClient, "connect", spied_connect)

    def _record(self, client: QmpClient, what: str, timeout: float | None) -> None:
        with self._lock:
            self.calls.append((client.socket_path, what, client.timeout if timeout is None else timeout))

    def on(self, socket: Path) -> list[tuple[str, float]]:
        """(what, seconds allowed) of every call on ``socket``, in order."""
        with self._lock:
            return [(what, limit) for path, what, limit in self.calls if path == str(socket)]

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()


@pytest.fixture
def qmp_spy(monkeypatch: pytest.MonkeyPatch) -> QmpSpy:
    return QmpSpy(monkeypatch)


@pytest.fixture
def own_vms(tmp_path: Path) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    """Bare VMs in a directory of this test's own (``tmp_path / "vms"``), stopped by PID at the end."""
    vms = tmp_path / "vms"
    vms.mkdir()
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> subprocess.Popen[bytes]:
        proc = start_bare_vm(vms, name, tmp_path / f"{name}.log")
        procs.append(proc)
        wait_until(lambda: private_qmp(vms, name).exists() and (vms / f"{name}.qmp").exists(), 10,
                   what=f"VM {name}'s sockets")
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # in case a test stopped it
        stop_process(proc)


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    return empty_file(tmp_path / "volume.raw", 16 * MIB)


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
def snapshot_target(tmp_path: Path) -> Iterator[SnapshotTarget]:
    """An empty 16 MiB snapshot file exported by qemu-storage-daemon, as a storage node makes one for a
    copy: its connection and its path.

    By default its writes are throttled to 2 MiB/s, so a point-in-time copy into it runs for seconds
    while the guest writes; with ``failing`` every data write fails (EIO).
    """
    procs: list[subprocess.Popen[bytes]] = []

    def start(failing: bool = False) -> tuple[NbdConnection, Path]:
        target = empty_file(tmp_path / f"snap{len(procs)}.raw", 16 * MIB)
        port = free_port()
        file = {"driver": "file", "filename": str(target)}
        if failing:
            objects: list[str] = []
            top = {"driver": "raw", "node-name": "t",  # raw raises write_aio for each write it passes down
                   "file": {"driver": "blkdebug", "image": file, "inject-error": [{"event": "write_aio", "errno": 5}]}}
        else:
            objects = ["--object", json.dumps({"qom-type": "throttle-group", "id": "tg",
                                               "limits": {"bps-write": 2 * MIB}})]
            top = {"driver": "throttle", "node-name": "t", "throttle-group": "tg", "file": file}
        argv = ["qemu-storage-daemon", *objects, "--blockdev", json.dumps(top),
                "--nbd-server", f"addr.type=inet,addr.host=127.0.0.1,addr.port={port}",
                "--export", "type=nbd,id=e,node-name=t,name=snap,writable=on"]  # fmt: skip
        log = (tmp_path / "qsd.log").open("ab")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))  # noqa: S603
        log.close()
        wait_until(lambda: _listening(port), 10, what="qemu-storage-daemon to listen")
        return NbdConnection(host="127.0.0.1", port=port, export="snap"), target

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
        tgtadm("--mode", "account", "--op", "new", "--user", "vbsuser", "--password", CHAP_SECRET)
        tgtadm("--mode", "account", "--op", "bind", "--tid", "1", "--user", "vbsuser")
        yield IscsiConnection(
            host="127.0.0.1", port=port, iqn=iqn, lun=1, chap_user="vbsuser", chap_secret=SecretStr(CHAP_SECRET)
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


# -- helpers ----------------------------------------------------------------------------------------


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def vbs_nodes(monitor: Path) -> set[str]:
    nodes = qmp_execute(monitor, "query-named-block-nodes", {"flat": True})
    return {n["node-name"] for n in nodes if n["node-name"].startswith("vbs-")}


def node(monitor: Path, name: str) -> dict[str, Any]:
    return next(n for n in qmp_execute(monitor, "query-named-block-nodes", {"flat": True}) if n["node-name"] == name)


def vbs_objects(monitor: Path) -> set[str]:
    return {o["name"] for o in qmp_execute(monitor, "qom-list", {"path": "/objects"}) if o["name"].startswith("vbs-")}


def jobs(monitor: Path) -> list[dict[str, Any]]:
    return qmp_execute(monitor, "query-jobs")  # type: ignore[no-any-return]


def monitor_connections(sock: Path) -> set[str]:
    """The connections QEMU accepted on a monitor socket and still holds (their socket inodes)."""
    out = run(["ss", "-xH", "state", "connected", "src", str(sock)], timeout=10).stdout
    return {line.split()[line.split().index(str(sock)) + 1] for line in out.splitlines() if str(sock) in line}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def wait_copy(driver: QemuDriver, vm: str, serial: str, target: NbdConnection | FileConnection,
              timeout: float = 60) -> Any:
    status = wait_until(lambda: (s := driver.ensure_copy(vm, serial, SNAP, target)).state != "copying" and s,
                        timeout, 0.2, what="the copy to end")
    return status


# -- discovery and the monitor connection -------------------------------------------------------------


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
    assert VmInfo(vm_id="guest1", name="guest1", running=True, status="running") in vms
    assert VmInfo(vm_id="bare", name="bare-vm", running=True, status="running") in vms
    assert {vm.vm_id for vm in vms} == {"guest1", "bare"}


def test_unknown_and_malformed_vm_ids_are_refused(driver: QemuDriver, volume: Path) -> None:
    conn = FileConnection(path=str(volume))
    with pytest.raises(NotFound) as raised:
        driver.attach("no-such-vm", virtio_serial(vol(1)), conn)
    assert raised.value.code == "InvalidInstanceID.NotFound"
    for bad in ("../guest1", "", "a b", "x" * 65):
        with pytest.raises(InvalidParameter):
            driver.attach(bad, virtio_serial(vol(1)), conn)
    with pytest.raises(InvalidParameter):
        driver.attach("guest1", "vol-with-dash", conn)


def test_one_persistent_connection_serves_every_call(driver: QemuDriver, guest: TestGuest, volume: Path,
                                                     vm_dir: Path) -> None:
    driver.list_vms()
    held = monitor_connections(vm_dir / "guest1.qmp")
    assert len(held) == 1
    serial = virtio_serial(vol(0x05))
    (_, took) = timed(lambda: [driver.list_disks("guest1") for _ in range(50)])
    driver.attach("guest1", serial, FileConnection(path=str(volume)))
    guest.wait_for_disk(serial)
    driver.list_vms()
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert monitor_connections(vm_dir / "guest1.qmp") == held
    print(f"50 list_disks on one connection: {took:.3f}s")


def test_a_vm_restarted_under_the_driver_is_reconnected(own_vms: Callable[[str], subprocess.Popen[bytes]],
                                                        tmp_path: Path, volume: Path) -> None:
    driver = QemuDriver(tmp_path / "vms", qmp_timeout=5.0)
    try:
        proc = own_vms("vm1")
        serial = virtio_serial(vol(0x06))
        driver.attach("vm1", serial, FileConnection(path=str(volume)))
        first = monitor_connections(tmp_path / "vms" / "vm1.qmp")
        stop_process(proc)
        own_vms("vm1")  # a new QEMU on the same socket, before the driver calls again
        assert driver.list_disks("vm1") == []
        second = monitor_connections(tmp_path / "vms" / "vm1.qmp")
        assert len(second) == 1 and second != first
        assert [vm.vm_id for vm in driver.list_vms()] == ["vm1"]
    finally:
        driver.close()


def test_a_vm_that_is_gone_holds_no_disk(own_vms: Callable[[str], subprocess.Popen[bytes]], tmp_path: Path,
                                         volume: Path) -> None:
    """Attach, detach, stop the VM, attach again: the attach fails, and its undo (a detach) succeeds."""
    driver = QemuDriver(tmp_path / "vms", qmp_timeout=5.0)
    try:
        proc = own_vms("vm1")
        serial = virtio_serial(vol(0x07))
        conn = FileConnection(path=str(volume))
        driver.attach("vm1", serial, conn)
        driver.detach("vm1", serial, force=True, timeout=0.5)  # nothing in a bare VM lets go
        stop_process(proc)

        for call in (lambda: driver.attach("vm1", serial, conn),
                     lambda: driver.resize("vm1", serial, conn, 32 * MIB),
                     lambda: driver.ensure_copy("vm1", serial, SNAP, conn),
                     lambda: driver.list_disks("vm1")):  # fmt: skip
            with pytest.raises(NotFound) as raised:
                call()
            assert raised.value.code == "InvalidInstanceID.NotFound"
        driver.detach("vm1", serial)
        driver.detach("vm1", serial, force=True)
        driver.remove_copy("vm1", serial, SNAP)
        driver.detach("never-was", serial)  # no socket at all
        assert driver.list_vms() == []
    finally:
        driver.close()


def test_a_vm_that_does_not_answer_is_a_driver_error_not_gone(
    own_vms: Callable[[str], subprocess.Popen[bytes]], tmp_path: Path, volume: Path, qmp_spy: QmpSpy
) -> None:
    driver = QemuDriver(tmp_path / "vms", qmp_timeout=2.0)
    try:
        proc = own_vms("vm1")
        assert driver.list_vms() == [VmInfo(vm_id="vm1", name="vm1", running=True, status="running")]
        serial = virtio_serial(vol(0x08))
        os.kill(proc.pid, signal.SIGSTOP)  # the process and its socket are there; nothing answers
        try:
            qmp_spy.clear()
            vms = driver.list_vms()
            assert vms == [VmInfo(vm_id="vm1", name="vm1", running=False)]
            # The probe waited for the monitor no longer than its own limit, not the driver's QMP timeout.
            probe = qmp_spy.on(tmp_path / "vms" / "vm1.qmp")
            assert probe and {limit for _, limit in probe} == {min(driver.qmp_timeout, PROBE_TIMEOUT)}, probe
            for call in (lambda: driver.attach("vm1", serial, FileConnection(path=str(volume))),
                         lambda: driver.detach("vm1", serial),
                         lambda: driver.remove_copy("vm1", serial, SNAP)):  # fmt: skip
                with pytest.raises(DriverError) as raised:
                    call()
                assert not isinstance(raised.value, NotFound)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        wait_until(lambda: driver.list_vms() == [VmInfo(vm_id="vm1", name="vm1", running=True, status="running")], 20,
                   what="the VM to answer again")
        driver.attach("vm1", serial, FileConnection(path=str(volume)))
        assert [d.serial for d in driver.list_disks("vm1")] == [serial]
    finally:
        driver.close()


def test_a_vm_whose_monitor_another_client_holds_is_listed_as_not_running(
    driver: QemuDriver, guest: TestGuest, vm_dir: Path, volume: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver.list_vms()  # this driver holds both monitors now: a second agent on the same VMs must queue
    other = QemuDriver(vm_dir, qmp_timeout=2.0)
    probes: list[tuple[str, str]] = []
    probe = other.monitors._probe

    def recorded_probe(vm_id: str) -> VmInfo | None:
        probes.append(("start", vm_id))
        try:
            return probe(vm_id)
        finally:
            probes.append(("end", vm_id))

    monkeypatch.setattr(other.monitors, "_probe", recorded_probe)
    try:
        vms = other.list_vms()
        assert VmInfo(vm_id="guest1", name="guest1", running=False) in vms
        assert VmInfo(vm_id="bare", name="bare", running=False) in vms
        # Both probed at once: each waits out its limit, and the second started before the first ended.
        assert sorted(probes[:2]) == [("start", "bare"), ("start", "guest1")], probes
        with pytest.raises(DriverError) as raised:
            other.attach("guest1", virtio_serial(vol(0x09)), FileConnection(path=str(volume)))
        assert not isinstance(raised.value, NotFound)
    finally:
        other.close()
    assert VmInfo(vm_id="guest1", name="guest1", running=True, status="running") in driver.list_vms()


# -- attach and detach ------------------------------------------------------------------------------


def test_file_volume_is_hot_plugged_written_and_unplugged(
    driver: QemuDriver, guest: TestGuest, volume: Path, vm_dir: Path
) -> None:
    hv: HypervisorDriver = driver  # the host agent sees only the contract
    serial = virtio_serial(vol(0x10))
    disk, attach_s = timed(lambda: hv.attach("guest1", serial, FileConnection(path=str(volume))))
    assert disk == DiskInfo(serial=serial, read_only=False, size_bytes=16 * MIB, pci_slot=disk.pci_slot)
    dev = guest.wait_for_disk(serial, timeout=10)
    assert guest.disk_size(serial) == 16 * MIB
    assert hv.list_disks("guest1") == [disk]

    assert guest.write_pattern(dev, "file-vol", 4) == pattern_sha256("file-vol", 4)

    _, detach_s = timed(lambda: hv.detach("guest1", serial))
    guest.wait_disk_gone(serial, timeout=10)
    assert hv.list_disks("guest1") == []
    assert vbs_nodes(guest.test_qmp_path) == set()
    assert volume.read_bytes()[: 4 * MIB] == pattern_bytes("file-vol", 4)
    print(f"file attach {attach_s:.3f}s, detach (guest released) {detach_s:.3f}s")


def test_a_q35_machine_takes_disks_in_its_empty_root_ports_and_refuses_one_more(
    driver: QemuDriver, q35_guest: TestGuest, tmp_path: Path
) -> None:
    vm, guest = "q35guest", q35_guest
    files = {n: empty_file(tmp_path / f"v{n}.raw", 8 * MIB) for n in (1, 2, 3)}
    serials = {n: virtio_serial(vol(0x70 + n)) for n in files}

    def attach(n: int, slot: str | None = None) -> DiskInfo:
        return driver.attach(vm, serials[n], FileConnection(path=str(files[n])), pci_slot=slot)

    one, two = attach(1), attach(2)
    assert (one.pci_slot, two.pci_slot) == ("rp1/00.0", "rp2/00.0")
    for n in (1, 2):
        dev = guest.wait_for_disk(serials[n])
        assert guest.write_pattern(dev, f"q35-{n}", 2) == pattern_sha256(f"q35-{n}", 2)
    assert sorted(driver.list_disks(vm), key=lambda d: d.serial) == sorted([one, two], key=lambda d: d.serial)

    # Both ports taken and the root bus takes nothing: refused with the reason, nothing left behind.
    before = vbs_nodes(guest.test_qmp_path), vbs_objects(guest.test_qmp_path)
    with pytest.raises(IncorrectState, match="no free slot for another disk.*pcie-root-port"):
        attach(3)
    assert (vbs_nodes(guest.test_qmp_path), vbs_objects(guest.test_qmp_path)) == before
    assert set(guest.disks()) == {serials[1], serials[2]}

    # A detach frees its port for the next disk; a given slot (a migration's) is taken as it is.
    driver.detach(vm, serials[1])
    guest.wait_disk_gone(serials[1])
    assert attach(3).pci_slot == "rp1/00.0"
    dev = guest.wait_for_disk(serials[3])
    assert guest.write_pattern(dev, "q35-3", 1) == pattern_sha256("q35-3", 1)
    driver.detach(vm, serials[2])
    guest.wait_disk_gone(serials[2])
    assert attach(1, "rp2/00.0").pci_slot == "rp2/00.0"
    assert guest.checksum(guest.wait_for_disk(serials[1]), 2) == pattern_sha256("q35-1", 2)
    for n in (1, 3):
        driver.detach(vm, serials[n])
        guest.wait_disk_gone(serials[n])
    assert vbs_nodes(guest.test_qmp_path) == set()
    assert files[2].read_bytes()[: 2 * MIB] == pattern_bytes("q35-2", 2)


def test_attach_and_detach_are_idempotent(driver: QemuDriver, guest: TestGuest, volume: Path) -> None:
    serial = virtio_serial(vol(0x11))
    conn = FileConnection(path=str(volume))
    first = driver.attach("guest1", serial, conn)
    assert driver.attach("guest1", serial, conn) == first
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
    _, attach_s = timed(lambda: driver.attach("guest1", serial, conn))
    # What QEMU reports of the node is what the connector recognises (resize relies on it).
    assert connector_for(conn).qemu_node_opens(node(guest.test_qmp_path, disk_ids(serial).proto), conn)
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "over-nbd", 3) == pattern_sha256("over-nbd", 3)
    _, detach_s = timed(lambda: driver.detach("guest1", serial))
    guest.wait_disk_gone(serial)
    assert volume.read_bytes()[: 3 * MIB] == pattern_bytes("over-nbd", 3)
    print(f"nbd attach {attach_s:.3f}s, detach {detach_s:.3f}s")


def test_iscsi_volume_with_chap_is_read_and_written_through_tgt(
    driver: QemuDriver, guest: TestGuest, tgt_server: IscsiConnection, volume: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    serial = virtio_serial(vol(0x22))
    _, attach_s = timed(lambda: driver.attach("guest1", serial, tgt_server))
    # The CHAP secret lives in a QEMU secret object, created over QMP only.
    assert disk_ids(serial).secret in vbs_objects(guest.test_qmp_path)
    assert connector_for(tgt_server).qemu_node_opens(node(guest.test_qmp_path, disk_ids(serial).proto), tgt_server)
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "over-iscsi", 2) == pattern_sha256("over-iscsi", 2)
    _, detach_s = timed(lambda: driver.detach("guest1", serial))
    guest.wait_disk_gone(serial)
    assert vbs_objects(guest.test_qmp_path) == set()
    assert volume.read_bytes()[: 2 * MIB] == pattern_bytes("over-iscsi", 2)
    assert CHAP_SECRET not in caplog.text
    print(f"iscsi attach {attach_s:.3f}s, detach {detach_s:.3f}s")


def test_iscsi_with_a_wrong_chap_secret_fails_cleanly(
    driver: QemuDriver, guest: TestGuest, tgt_server: IscsiConnection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = tgt_server.model_copy(update={"chap_secret": SecretStr("not-the-secret")})
    serial = virtio_serial(vol(0x23))
    with pytest.raises(DriverError) as raised:
        driver.attach("guest1", serial, wrong)
    assert "not-the-secret" not in str(raised.value) and "not-the-secret" not in caplog.text
    assert vbs_nodes(guest.test_qmp_path) == set()
    assert vbs_objects(guest.test_qmp_path) == set()


def test_nbd_with_tls_psk_leaves_no_key_on_disk(
    driver: QemuDriver, guest: TestGuest, nbd_server: Callable[..., NbdConnection], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    conn = nbd_server(psk_identity="host1")
    serial = virtio_serial(vol(0x21))
    driver.attach("guest1", serial, conn)
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "tls", 1) == pattern_sha256("tls", 1)
    assert disk_ids(serial).tls in vbs_objects(guest.test_qmp_path)
    assert connector_for(conn).qemu_node_opens(node(guest.test_qmp_path, disk_ids(serial).proto), conn)
    assert list(driver.secrets_dir.rglob("*")) == []
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_objects(guest.test_qmp_path) == set()
    assert PSK_KEY not in caplog.text


def test_a_failed_attach_leaves_no_node_or_object(driver: QemuDriver, guest: TestGuest) -> None:
    nobody = NbdConnection(
        host="127.0.0.1", port=free_port(), export="vol", tls_psk_identity="host1", tls_psk_key=SecretStr(PSK_KEY)
    )
    serial = virtio_serial(vol(0x30))
    with pytest.raises(DriverError, match="QMP blockdev-add"):
        driver.attach("guest1", serial, nobody, qos=QoS(iops=100))
    assert vbs_nodes(guest.test_qmp_path) == set()
    assert vbs_objects(guest.test_qmp_path) == set()
    assert driver.list_disks("guest1") == []
    assert serial not in guest.disks()


def test_qos_puts_a_throttle_group_under_the_disk(driver: QemuDriver, guest: TestGuest, volume: Path) -> None:
    serial = virtio_serial(vol(0x40))
    ids = disk_ids(serial)
    driver.attach("guest1", serial, FileConnection(path=str(volume)), qos=QoS(iops=20, mbps=5))
    qdev = f"/machine/peripheral/{ids.device}/virtio-backend"
    block = {b["qdev"]: b for b in guest.qmp("query-block")}
    assert block[qdev]["inserted"]["node-name"] == ids.throttle
    # The device's top node is a throttle filter, in a throttle group of the disk's own with its limits.
    assert node(guest.test_qmp_path, ids.throttle)["drv"] == "throttle"
    groups = {o["name"]: o["type"] for o in guest.qmp("qom-list", {"path": "/objects"})}
    assert groups[ids.throttle_group] == "child<throttle-group>"
    limits = guest.qmp("qom-get", {"path": f"/objects/{ids.throttle_group}", "property": "limits"})
    assert limits["iops-total"] == 20 and limits["bps-total"] == 5 * MIB
    dev = guest.wait_for_disk(serial)
    # The guest's writes go to that device, through the throttle node on top of it.
    guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=4k count=40 oflag=direct")
    stats = {s["qdev"]: s["stats"] for s in guest.qmp("query-blockstats") if "qdev" in s}
    assert stats[qdev]["wr_operations"] >= 40
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_objects(guest.test_qmp_path) == set()


def test_qos_changes_live_without_a_detach(driver: QemuDriver, guest: TestGuest, volume: Path, vm_dir: Path,
                                           qmp_spy: QmpSpy) -> None:
    """ModifyVolume where the storage node does not limit the volume: the disk's own throttle group."""
    serial = virtio_serial(vol(0x41))
    ids = disk_ids(serial)
    driver.attach("guest1", serial, FileConnection(path=str(volume)), qos=QoS(iops=20))
    dev = guest.wait_for_disk(serial)
    write = f"dd if=/dev/zero of=/dev/{dev} bs=4k count=40 oflag=direct"
    guest.check(write)
    limits = guest.qmp("qom-get", {"path": f"/objects/{ids.throttle_group}", "property": "limits"})
    assert limits["iops-total"] == 20
    nodes = vbs_nodes(guest.test_qmp_path)
    qmp_spy.clear()
    assert driver.set_qos("guest1", serial, QoS(iops=4000)).serial == serial
    # New limits on the same group, set live: nothing unplugged, no node removed or added.
    commands = [what for what, _ in qmp_spy.on(vm_dir / "guest1.qmp")]
    assert "qom-set" in commands and not {"device_del", "blockdev-del", "blockdev-add"} & set(commands), commands
    limits = guest.qmp("qom-get", {"path": f"/objects/{ids.throttle_group}", "property": "limits"})
    assert (limits["iops-total"], limits["iops-size"]) == (4000, 256 * 1024)
    assert vbs_nodes(guest.test_qmp_path) == nodes
    guest.check(write)
    assert guest.disks()[serial] == dev
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    # A disk attached without limits has no throttle to change: said, not ignored.
    plain = virtio_serial(vol(0x42))
    driver.attach("guest1", plain, FileConnection(path=str(volume)))
    with pytest.raises(IncorrectState):
        driver.set_qos("guest1", plain, QoS(iops=100))
    driver.detach("guest1", plain)
    guest.wait_disk_gone(plain)


def test_read_only_attach_is_read_only_in_the_guest(driver: QemuDriver, guest: TestGuest, volume: Path) -> None:
    volume.write_bytes(pattern_bytes("ro", 1) + bytes(15 * MIB))
    serial = virtio_serial(vol(0x50))
    disk = driver.attach("guest1", serial, FileConnection(path=str(volume)), read_only=True)
    assert disk.read_only and driver.list_disks("guest1")[0].read_only
    dev = guest.wait_for_disk(serial)
    assert guest.check(f"cat /sys/block/{dev}/ro").strip() == "1"
    assert guest.checksum(dev, 1) == pattern_sha256("ro", 1)
    rc, _ = guest.run(f"dd if=/dev/zero of=/dev/{dev} bs=4k count=1 oflag=direct")
    assert rc != 0
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert volume.read_bytes()[:MIB] == pattern_bytes("ro", 1)


def test_leftovers_of_a_crashed_attach_are_cleaned(driver: QemuDriver, guest: TestGuest, volume: Path) -> None:
    serial = virtio_serial(vol(0x60))
    ids = disk_ids(serial)

    def half_attach() -> None:  # what an agent killed between blockdev-add and device_add leaves
        guest.qmp("blockdev-add", {"driver": "file", "node-name": ids.proto, "filename": str(volume)})
        guest.qmp("blockdev-add", {"driver": "raw", "node-name": ids.raw, "file": ids.proto})

    half_attach()
    driver.detach("guest1", serial)
    assert vbs_nodes(guest.test_qmp_path) == set()

    half_attach()
    driver.attach("guest1", serial, FileConnection(path=str(volume)))
    guest.wait_for_disk(serial)
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(guest.test_qmp_path) == set()


def test_a_guest_that_never_releases_the_disk_is_busy_and_force_cuts_its_io(
    driver: QemuDriver, bare_vm: str, nbd_server: Callable[..., NbdConnection], vm_dir: Path, qmp_spy: QmpSpy
) -> None:
    monitor = private_qmp(vm_dir, bare_vm)
    serial = virtio_serial(vol(0x70))
    ids = disk_ids(serial)
    driver.attach(bare_vm, serial, nbd_server())

    def unplug_waits() -> list[float]:
        return [limit for what, limit in qmp_spy.on(vm_dir / f"{bare_vm}.qmp") if what == "event DEVICE_DELETED"]

    started = time.monotonic()
    qmp_spy.clear()
    with pytest.raises(DeviceBusy, match="did not release"):
        driver.detach(bare_vm, serial, timeout=1.0)
    assert unplug_waits() == [1.0]  # waited for the guest as long as asked, once
    assert {ids.proto, ids.raw} <= vbs_nodes(monitor)  # still in use: nothing was pulled from under it

    qmp_spy.clear()
    _, force_s = timed(lambda: driver.detach(bare_vm, serial, force=True, timeout=5.0))
    assert unplug_waits() == [min(5.0, FORCE_GRACE_SECONDS)]  # force gives the guest only its grace
    # The device stays until a guest acknowledges; the NBD session is gone and I/O fails.
    nodes = vbs_nodes(monitor)
    assert ids.proto not in nodes and ids.dead in nodes
    assert [d.serial for d in driver.list_disks(bare_vm)] == [serial]
    with pytest.raises(IncorrectState, match="force-detached"):
        driver.attach(bare_vm, serial, FileConnection(path="/dev/null"))
    driver.detach(bare_vm, serial, force=True, timeout=1.0)  # repeating it is harmless
    print(f"busy detach raised after {time.monotonic() - started:.2f}s total; force {force_s:.3f}s")


def test_listing_does_not_wait_for_a_vm_the_driver_is_busy_with(driver: QemuDriver, bare_vm: str, volume: Path,
                                                                vm_dir: Path, qmp_spy: QmpSpy) -> None:
    serial = virtio_serial(vol(0x71))
    driver.attach(bare_vm, serial, FileConnection(path=str(volume)))
    assert VmInfo(vm_id="bare", name="bare-vm", running=True, status="running") in driver.list_vms()
    errors: list[BaseException] = []
    events: list[str] = []
    bare_monitor = vm_dir / f"{bare_vm}.qmp"

    def slow_detach() -> None:  # holds the bare VM for 4 s, waiting for a guest that never answers
        try:
            driver.detach(bare_vm, serial, timeout=4.0)
        except DeviceBusy as exc:
            errors.append(exc)
        finally:
            events.append("detach ended")

    qmp_spy.clear()
    worker = threading.Thread(target=slow_detach)
    worker.start()
    wait_until(lambda: ("event DEVICE_DELETED", 4.0) in qmp_spy.on(bare_monitor), 10,
               what="the detach waiting for the guest")
    asked = len(qmp_spy.on(bare_monitor))
    vms = driver.list_vms()
    events.append("listed")
    asked_meanwhile = qmp_spy.on(bare_monitor)[asked:]
    worker.join()
    # The listing came back while the detach still held the VM, and did not ask that VM anything.
    assert events == ["listed", "detach ended"]
    assert asked_meanwhile == []
    assert VmInfo(vm_id="bare", name="bare-vm", running=True, status="running") in vms  # as last seen
    assert len(errors) == 1
    driver.detach(bare_vm, serial, force=True, timeout=0.5)


# -- online resize ----------------------------------------------------------------------------------


def test_a_grown_file_volume_with_qos_is_resized_in_place(driver: QemuDriver, guest: TestGuest, volume: Path) -> None:
    """The top node is the throttle node; a file node sees its file grow, so no swap is needed."""
    serial = virtio_serial(vol(0x81))
    ids = disk_ids(serial)
    conn = FileConnection(path=str(volume))
    driver.attach("guest1", serial, conn, qos=QoS(iops=10_000))
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "qos", 2) == pattern_sha256("qos", 2)
    with volume.open("r+b") as f:
        f.truncate(32 * MIB)
    disk = driver.resize("guest1", serial, conn, 32 * MIB)
    assert disk == DiskInfo(serial=serial, read_only=False, size_bytes=32 * MIB, pci_slot=disk.pci_slot)
    wait_until(lambda: int(guest.check(f"cat /sys/block/{dev}/size")) * 512 == 32 * MIB, 10, 0.05, what="32 MiB")
    assert vbs_nodes(guest.test_qmp_path) == {ids.throttle, ids.raw, ids.proto}
    assert guest.checksum(dev, 2) == pattern_sha256("qos", 2)
    guest.check(f"dd if=/dev/zero of=/dev/{dev} bs=1M seek=31 count=1 oflag=direct")
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(guest.test_qmp_path) == set() and vbs_objects(guest.test_qmp_path) == set()


def test_a_grown_nbd_volume_moves_to_its_refreshed_export(
    driver: QemuDriver, guest: TestGuest, volume: Path, nbd_server: Callable[..., NbdConnection]
) -> None:
    """An NBD node keeps its export's size: the disk moves to a second node on the refreshed export."""
    serial = virtio_serial(vol(0x83))
    ids = disk_ids(serial)
    old = nbd_server()
    driver.attach("guest1", serial, old)
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "grow", 2) == pattern_sha256("grow", 2)
    with volume.open("r+b") as f:
        f.truncate(32 * MIB)
    new = nbd_server()  # what the storage node's refresh answers: an export that has the new size
    disk, took = timed(lambda: driver.resize("guest1", serial, new, 32 * MIB))
    assert disk == DiskInfo(serial=serial, read_only=False, size_bytes=32 * MIB, pci_slot=disk.pci_slot)
    wait_until(lambda: int(guest.check(f"cat /sys/block/{dev}/size")) * 512 == 32 * MIB, 10, 0.05, what="32 MiB")
    assert vbs_nodes(guest.test_qmp_path) == {ids.raw, ids.proto2}
    assert connector_for(new).qemu_node_opens(node(guest.test_qmp_path, ids.proto2), new)
    assert driver.resize("guest1", serial, new, 32 * MIB) == disk  # already so: nothing to do
    assert vbs_nodes(guest.test_qmp_path) == {ids.raw, ids.proto2}
    assert guest.checksum(dev, 2) == pattern_sha256("grow", 2)
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(guest.test_qmp_path) == set()
    print(f"nbd resize {took:.3f}s")


def test_detach_removes_both_generations_of_an_interrupted_resize(
    driver: QemuDriver, guest: TestGuest, volume: Path
) -> None:
    serial = virtio_serial(vol(0x82))
    ids = disk_ids(serial)
    driver.attach("guest1", serial, FileConnection(path=str(volume)))
    guest.wait_for_disk(serial)
    # What an agent killed in the middle of a resize leaves: the second generation's node and secret.
    guest.qmp("object-add", {"qom-type": "secret", "id": ids.secret2, "data": "x"})
    guest.qmp("blockdev-add", {"driver": "null-co", "node-name": ids.proto2, "size": 16 * MIB})
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(guest.test_qmp_path) == set() and vbs_objects(guest.test_qmp_path) == set()


# -- point-in-time copies ---------------------------------------------------------------------------


def test_a_copy_holds_the_disk_as_it_was_when_it_started_while_the_guest_writes(
    driver: QemuDriver, guest: TestGuest, volume: Path, snapshot_target: SnapshotTarget
) -> None:
    serial = virtio_serial(vol(0x90))
    driver.attach("guest1", serial, FileConnection(path=str(volume)))
    dev = guest.wait_for_disk(serial)
    assert guest.write_pattern(dev, "before", 8) == pattern_sha256("before", 8)
    target, snapshot = snapshot_target()

    first, start_s = timed(lambda: driver.ensure_copy("guest1", serial, SNAP, target))
    assert first.state == "copying" and 0 <= first.progress < 100
    # The guest overwrites what is being copied: QEMU copies each old block out before the write.
    _, write_s = timed(lambda: guest.write_pattern(dev, "after", 8))
    status, wait_s = timed(lambda: wait_copy(driver, "guest1", serial, target))
    assert (status.state, status.progress, status.size_bytes) == ("ready", 100, 16 * MIB)

    assert snapshot.read_bytes() == pattern_bytes("before", 8) + bytes(8 * MIB)
    assert volume.read_bytes()[: 8 * MIB] == pattern_bytes("after", 8)
    cids = copy_ids(serial, SNAP)
    # The target is closed once the copy is complete; the finished job stays as its record.
    assert vbs_nodes(guest.test_qmp_path) == {disk_ids(serial).raw, disk_ids(serial).proto}
    assert [(j["id"], j["status"]) for j in jobs(guest.test_qmp_path)] == [(cids.job, "concluded")]
    assert driver.ensure_copy("guest1", serial, SNAP, target).state == "ready"  # not a second copy

    driver.remove_copy("guest1", serial, SNAP)
    driver.remove_copy("guest1", serial, SNAP)
    assert jobs(guest.test_qmp_path) == []
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
    assert vbs_nodes(guest.test_qmp_path) == set() and vbs_objects(guest.test_qmp_path) == set()
    print(f"copy started in {start_s:.3f}s; the guest wrote 8 MiB during it in {write_s:.2f}s; "
          f"the copy was ready {wait_s:.2f}s later")


def test_detach_during_a_copy_cancels_the_copy(
    driver: QemuDriver, guest: TestGuest, volume: Path, snapshot_target: SnapshotTarget,
    caplog: pytest.LogCaptureFixture,
) -> None:
    serial = virtio_serial(vol(0x91))
    driver.attach("guest1", serial, FileConnection(path=str(volume)))
    dev = guest.wait_for_disk(serial)
    guest.write_pattern(dev, "data", 12)
    target, _ = snapshot_target()
    assert driver.ensure_copy("guest1", serial, SNAP, target).state == "copying"
    with pytest.raises(IncorrectState, match="copy"):
        driver.resize("guest1", serial, FileConnection(path=str(volume)), 32 * MIB)

    _, detach_s = timed(lambda: driver.detach("guest1", serial))
    guest.wait_disk_gone(serial)
    assert "cancelled by its detach" in caplog.text
    assert jobs(guest.test_qmp_path) == []
    assert vbs_nodes(guest.test_qmp_path) == set() and vbs_objects(guest.test_qmp_path) == set()
    with pytest.raises(NotFound):
        driver.ensure_copy("guest1", serial, SNAP, target)
    driver.remove_copy("guest1", serial, SNAP)
    print(f"detach with a copy running took {detach_s:.2f}s")


def test_a_copy_whose_target_fails_answers_qemus_reason_until_removed(
    driver: QemuDriver, guest: TestGuest, volume: Path, snapshot_target: SnapshotTarget
) -> None:
    serial = virtio_serial(vol(0x94))
    driver.attach("guest1", serial, FileConnection(path=str(volume)))
    dev = guest.wait_for_disk(serial)
    guest.write_pattern(dev, "data", 4)
    target, _ = snapshot_target(failing=True)
    status = wait_copy(driver, "guest1", serial, target)
    assert status.state == "error" and "Input/output error" in (status.error or "")
    assert driver.ensure_copy("guest1", serial, SNAP, target) == status  # its instant is lost: no retry
    assert vbs_nodes(guest.test_qmp_path) == {disk_ids(serial).raw, disk_ids(serial).proto}  # target closed
    driver.remove_copy("guest1", serial, SNAP)
    assert jobs(guest.test_qmp_path) == []

    # A target node without its job (a call stopped between the two): the copy's instant is unknown.
    guest.qmp("blockdev-add", {"driver": "null-co", "node-name": copy_ids(serial, SNAP).target.proto,
                               "size": 16 * MIB})
    assert driver.ensure_copy("guest1", serial, SNAP, target).state == "error"
    driver.remove_copy("guest1", serial, SNAP)
    assert vbs_nodes(guest.test_qmp_path) == {disk_ids(serial).raw, disk_ids(serial).proto}
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)


def test_a_copy_into_a_target_of_the_wrong_size_fails_and_leaves_nothing(
    driver: QemuDriver, guest: TestGuest, volume: Path, tmp_path: Path
) -> None:
    serial = virtio_serial(vol(0x92))
    driver.attach("guest1", serial, FileConnection(path=str(volume)))
    guest.wait_for_disk(serial)
    small = empty_file(tmp_path / "small.raw", 8 * MIB)
    with pytest.raises(DriverError, match="different sizes"):
        driver.ensure_copy("guest1", serial, SNAP, FileConnection(path=str(small)))
    assert jobs(guest.test_qmp_path) == []
    assert vbs_nodes(guest.test_qmp_path) == {disk_ids(serial).raw, disk_ids(serial).proto}

    # A copy into a local file works the same way; a copy of a disk that is not attached does not.
    right = empty_file(tmp_path / "right.raw", 16 * MIB)
    assert wait_copy(driver, "guest1", serial, FileConnection(path=str(right))).state == "ready"
    driver.remove_copy("guest1", serial, SNAP)
    with pytest.raises(NotFound) as raised:
        driver.ensure_copy("guest1", virtio_serial(vol(0x93)), SNAP, FileConnection(path=str(right)))
    assert raised.value.code == "InvalidAttachment.NotFound"
    driver.detach("guest1", serial)
    guest.wait_disk_gone(serial)
