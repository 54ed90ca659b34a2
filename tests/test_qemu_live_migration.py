"""The qemu driver's side of a live migration, on two QEMUs without a guest OS (seconds, no boot).

Each host has its own driver and VM directory: the source VM runs, the destination (same VM id) waits
with ``-incoming defer``. Disks land in the source's PCI slots, the destination listens on a port it
tells, the source streams to it; a cancelled migration leaves the source running; repeated calls
change nothing; hosts with certificates accept a TLS stream only.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import private_qmp, stop_process, wait_until
from vbs.errors import IncorrectState, InvalidParameter
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.qemu.tls import X509Files
from vbs.rigs.testguest.guest import qmp_execute
from vbs.trust.pki import CertificateAuthority
from vbs.wire.connection import FileConnection
from vbs.wire.host import StartMigration

pytestmark = pytest.mark.integration

SERIALS = ("vol0123456789abcdef0", "vol0123456789abcdef1")


def start_vm(vm_dir: Path, *extra: str, machine: str = "pc") -> subprocess.Popen[bytes]:
    vm_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(["qemu-system-x86_64", "-accel", "tcg", "-machine", machine, "-m", "64", "-nodefaults",
                             "-display", "none", "-qmp", f"unix:{vm_dir / 'vm1.qmp'},server=on,wait=off",
                             "-qmp", f"unix:{private_qmp(vm_dir, 'vm1')},server=on,wait=off", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: private_qmp(vm_dir, "vm1").exists(), 10, what="QEMU's monitor")
    return proc


def _with_volumes(tmp_path: Path, procs: list[subprocess.Popen[bytes]],
                  drivers: Sequence[QemuDriver]) -> Iterator[tuple[QemuDriver, QemuDriver, Path]]:
    """Yield (h1's driver, h2's, a directory with a 64 MiB file per serial); close and stop all after."""
    volumes = tmp_path / "volumes"
    volumes.mkdir()
    for serial in SERIALS:
        with (volumes / serial).open("wb") as fh:
            fh.truncate(64 << 20)
    try:
        yield drivers[0], drivers[1], volumes
    finally:
        for driver in drivers:
            driver.close()
        for proc in procs:
            stop_process(proc)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[QemuDriver, QemuDriver, Path]]:
    """(h1's driver with the running VM, h2's with the waiting one, a directory of volume files)."""
    procs = [start_vm(tmp_path / "h1" / "vms"), start_vm(tmp_path / "h2" / "vms", "-incoming", "defer")]
    drivers = (QemuDriver(tmp_path / "h1" / "vms", qmp_timeout=5.0),
               QemuDriver(tmp_path / "h2" / "vms", qmp_timeout=5.0))
    yield from _with_volumes(tmp_path, procs, drivers)


def plug_both(source: QemuDriver, target: QemuDriver, volumes: Path, at: tuple[str, str] = ("05.0", "03.0")) -> None:
    """The disks in slots of the source that a fresh VM would not pick (as after other hot-plugs and
    unplugs), and the destination's in the slots the source reports."""
    for serial, slot in zip(SERIALS, at, strict=True):
        source.attach("vm1", serial, FileConnection(path=str(volumes / serial)), pci_slot=slot)
    slots = {d.serial: d.pci_slot for d in source.list_disks("vm1")}
    assert slots == dict(zip(SERIALS, at, strict=True))
    for serial in SERIALS:
        target.attach("vm1", serial, FileConnection(path=str(volumes / serial)), pci_slot=slots[serial])
    assert {d.serial: d.pci_slot for d in target.list_disks("vm1")} == slots


def test_the_destination_takes_the_guest_with_its_disks_in_the_same_slots(
        hosts: tuple[QemuDriver, QemuDriver, Path], tmp_path: Path) -> None:
    source, target, volumes = hosts
    assert [vm.status for vm in target.list_vms()] == ["inmigrate"]
    plug_both(source, target, volumes)
    listening = target.listen_for_migration("vm1")
    assert listening.uri is not None and listening.uri.startswith("tcp:127.0.0.1:")
    assert target.listen_for_migration("vm1").uri == listening.uri  # asked again: the same port
    source.migrate("vm1", StartMigration(uri=listening.uri))
    wait_until(lambda: source.migration_info("vm1").state == "completed", 30, what="the migration")
    again = source.migrate("vm1", StartMigration(uri=listening.uri))  # a repeated step sends nothing
    assert (again.status, again.state) == ("postmigrate", "completed")
    wait_until(lambda: target.migration_info("vm1").status == "running", 10, what="the destination running")
    assert sorted(d.serial for d in target.list_disks("vm1")) == list(SERIALS)
    # The source gives its connections up without its guest's consent (it has none any more).
    for serial in SERIALS:
        source.detach("vm1", serial, force=True, timeout=0.5)
    nodes = {n["node-name"] for n in qmp_execute(private_qmp(tmp_path / "h1" / "vms", "vm1"), "query-named-block-nodes",
                                                 {"flat": True})}
    assert not any(n.endswith("-proto") for n in nodes), nodes
    # A migrated source is not resumed by a cancel that does not ask for it.
    assert source.cancel_migration("vm1", resume=False).status == "postmigrate"


def test_on_q35_the_disks_land_in_the_root_ports_the_source_has_them_in(tmp_path: Path) -> None:
    ports = [arg for n in (1, 2, 3) for arg in ("-device", f"pcie-root-port,id=rp{n},chassis={n}")]
    procs = [start_vm(tmp_path / "h1" / "vms", *ports, machine="q35"),
             start_vm(tmp_path / "h2" / "vms", *ports, "-incoming", "defer", machine="q35")]
    drivers = (QemuDriver(tmp_path / "h1" / "vms", qmp_timeout=5.0),
               QemuDriver(tmp_path / "h2" / "vms", qmp_timeout=5.0))
    with contextmanager(_with_volumes)(tmp_path, procs, drivers) as (source, target, volumes):
        plug_both(source, target, volumes, at=("rp3/00.0", "rp2/00.0"))
        slots = {d.serial: d.pci_slot for d in source.list_disks("vm1")}
        uri = target.listen_for_migration("vm1").uri
        assert uri is not None
        source.migrate("vm1", StartMigration(uri=uri))
        wait_until(lambda: source.migration_info("vm1").state == "completed", 30, what="the migration")
        wait_until(lambda: target.migration_info("vm1").status == "running", 10, what="the destination running")
        assert {d.serial: d.pci_slot for d in target.list_disks("vm1")} == slots


def test_a_cancelled_migration_leaves_the_source_running(hosts: tuple[QemuDriver, QemuDriver, Path],
                                                          tmp_path: Path) -> None:
    source, target, volumes = hosts
    plug_both(source, target, volumes)
    # Slow enough to be cancelled while it streams: 64 MiB of RAM at 1 MiB/s.
    qmp_execute(private_qmp(tmp_path / "h1" / "vms", "vm1"), "migrate-set-parameters", {"max-bandwidth": 1 << 20})
    uri = target.listen_for_migration("vm1").uri
    assert uri is not None
    assert source.migrate("vm1", StartMigration(uri=uri)).state in ("setup", "active")
    stopped = source.cancel_migration("vm1", resume=True)
    assert (stopped.status, stopped.state) == ("running", "cancelled")
    with pytest.raises(IncorrectState):
        source.listen_for_migration("vm1")  # a running VM is no destination


@pytest.fixture
def tls_hosts(tmp_path: Path) -> Iterator[tuple[QemuDriver, QemuDriver, Path]]:
    """``hosts`` with each driver holding its host's certificate from one CA (as `vbs up --tls` issues them)."""
    ca = CertificateAuthority(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca-key.pem")
    procs = [start_vm(tmp_path / "h1" / "vms"), start_vm(tmp_path / "h2" / "vms", "-incoming", "defer")]
    drivers = []
    for name in ("h1", "h2"):
        files = ca.issue(name, ["127.0.0.1"], tmp_path / name / "cert.pem", tmp_path / name / "key.pem")
        drivers.append(QemuDriver(tmp_path / name / "vms", qmp_timeout=5.0, secrets_dir=tmp_path / name / "secrets",
                                  x509=X509Files(files.cert, files.key, files.ca)))
    yield from _with_volumes(tmp_path, procs, drivers)


def test_hosts_with_certificates_migrate_over_tls_only(tls_hosts: tuple[QemuDriver, QemuDriver, Path],
                                                       tmp_path: Path) -> None:
    source, target, volumes = tls_hosts
    plug_both(source, target, volumes)
    uri = target.listen_for_migration("vm1").uri
    assert uri is not None
    # A peer without a certificate is refused: the destination keeps waiting for the real source.
    source_monitor = private_qmp(tmp_path / "h1" / "vms", "vm1")
    qmp_execute(source_monitor, "migrate", {"uri": uri})
    wait_until(lambda: qmp_execute(source_monitor, "query-migrate").get("status") == "failed", 30,
               what="the plain-text stream failing")
    assert target.migration_info("vm1").status == "inmigrate"
    assert qmp_execute(source_monitor, "query-status")["status"] == "running"
    # The host's own credentials: the guest moves.
    source.migrate("vm1", StartMigration(uri=uri))
    wait_until(lambda: target.migration_info("vm1").status == "running", 30, what="the TLS migration")
    assert source.migration_info("vm1").status == "postmigrate"


def test_the_operator_sets_the_streams_cap_and_a_bad_one_is_refused(
        hosts: tuple[QemuDriver, QemuDriver, Path], tmp_path: Path) -> None:
    """QEMU caps a migration at 128 MiB/s unless told otherwise; ``migration_mibps`` tells it."""
    _, target, _ = hosts
    source = QemuDriver(tmp_path / "h1" / "vms", qmp_timeout=5.0, migration_mibps=2048)
    try:
        source.migrate("vm1", StartMigration(uri=target.listen_for_migration("vm1").uri or ""))
        params = qmp_execute(private_qmp(tmp_path / "h1" / "vms", "vm1"), "query-migrate-parameters")
        assert params["max-bandwidth"] == 2048 << 20
        wait_until(lambda: source.migration_info("vm1").state == "completed", 30, what="the migration")
    finally:
        source.close()
    for bad in (0, -1, True, "fast", (1 << 20) + 1):
        with pytest.raises(InvalidParameter, match="migration_mibps"):
            QemuDriver(tmp_path / "h1" / "vms", migration_mibps=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("source_threads", "target_threads"), [(True, True), (True, False), (False, True)])
def test_disks_in_io_threads_migrate_whichever_side_has_them(source_threads: bool, target_threads: bool,
                                                              tmp_path: Path) -> None:
    """An I/O thread is not part of a disk's migration state (``[host_agent.options.qemu] iothreads``):
    hosts that differ in the option migrate both ways, each VM's disks in threads as its host says."""
    procs = [start_vm(tmp_path / "h1" / "vms"), start_vm(tmp_path / "h2" / "vms", "-incoming", "defer")]
    drivers = (QemuDriver(tmp_path / "h1" / "vms", qmp_timeout=5.0, iothreads=source_threads),
               QemuDriver(tmp_path / "h2" / "vms", qmp_timeout=5.0, iothreads=target_threads))
    with contextmanager(_with_volumes)(tmp_path, procs, drivers) as (source, target, volumes):
        plug_both(source, target, volumes)
        for host, threads in (("h1", source_threads), ("h2", target_threads)):
            device = qmp_execute(private_qmp(tmp_path / host / "vms", "vm1"), "qom-get",
                                 {"path": f"/machine/peripheral/vbs-{SERIALS[0]}-dev", "property": "iothread"})
            assert device == (f"/objects/vbs-{SERIALS[0]}-io" if threads else "")
        uri = target.listen_for_migration("vm1").uri
        assert uri is not None
        source.migrate("vm1", StartMigration(uri=uri))
        wait_until(lambda: source.migration_info("vm1").state == "completed", 30, what="the migration")
        wait_until(lambda: target.migration_info("vm1").status == "running", 10, what="the destination running")
        assert sorted(d.serial for d in target.list_disks("vm1")) == list(SERIALS)
