"""The QEMU driver's mirror of an attached disk onto another connection (a volume moving to another
storage node), against a real VM with no guest OS: data equal after the switch, the disk on its new
node, the old one closed; a cancelled mirror leaves the disk where it was."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import private_qmp, start_bare_vm, stop_process, wait_until
from vbs.errors import IncorrectState
from vbs.host.hypervisors.qemu import QemuDriver
from vbs.host.hypervisors.qemu_ids import disk_ids
from vbs.rigs.testguest.guest import qmp_execute
from vbs.wire.connection import FileConnection
from vbs.wire.host import QoS

MIB = 1024 * 1024
SERIAL = "vol0123456789abcdef0"


@pytest.fixture
def vm(tmp_path: Path) -> Iterator[tuple[QemuDriver, Path]]:
    vms = tmp_path / "vms"
    vms.mkdir()
    proc = start_bare_vm(vms, "vm1", tmp_path / "vm1.log")
    wait_until(lambda: private_qmp(vms, "vm1").exists() and (vms / "vm1.qmp").exists(), 10, what="VM sockets")
    driver = QemuDriver(vms, secrets_dir=tmp_path / "secrets")
    try:
        yield driver, private_qmp(vms, "vm1")
    finally:
        driver.close()
        stop_process(proc)


def volume_file(path: Path, data: bytes | None = None) -> FileConnection:
    with path.open("wb") as f:
        f.truncate(8 * MIB)
        if data is not None:
            f.write(data)
    return FileConnection(path=str(path))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def proto_file(monitor: Path) -> str:
    nodes = {n["node-name"]: n for n in qmp_execute(monitor, "query-named-block-nodes", {"flat": True})}
    protos = [n for name, n in nodes.items() if name.startswith(f"vbs-{SERIAL}-proto")]
    assert len(protos) == 1, f"one protocol node, not {[n['node-name'] for n in protos]}"
    return str(protos[0]["file"])


def test_a_mirrored_disk_switches_onto_its_target_with_the_same_data(vm: tuple[QemuDriver, Path],
                                                                     tmp_path: Path) -> None:
    driver, monitor = vm
    source = volume_file(tmp_path / "old.raw", os.urandom(3 * MIB))
    target = volume_file(tmp_path / "new.raw")
    driver.attach("vm1", SERIAL, source)
    deadline = time.monotonic() + 30
    while (status := driver.ensure_mirror("vm1", SERIAL, target, pivot=False)).state != "ready":
        assert status.state == "copying" and time.monotonic() < deadline, status
        time.sleep(0.1)
    done = driver.ensure_mirror("vm1", SERIAL, target, pivot=True)
    assert done.state == "ready"
    assert proto_file(monitor) == target.path
    assert digest(tmp_path / "new.raw") == digest(tmp_path / "old.raw")
    # Repeated after the switch (a controller that restarted): still ready, nothing started again.
    assert driver.ensure_mirror("vm1", SERIAL, target, pivot=True).state == "ready"
    assert qmp_execute(monitor, "query-jobs") == []
    # A forced detach cuts the new connection as any (a bare VM never releases the device itself).
    driver.detach("vm1", SERIAL, force=True, timeout=1)
    names = {n["node-name"] for n in qmp_execute(monitor, "query-named-block-nodes", {"flat": True})}
    assert not any(n.startswith(f"vbs-{SERIAL}-proto") for n in names), names


def test_a_cancelled_mirror_leaves_the_disk_on_its_old_node(vm: tuple[QemuDriver, Path], tmp_path: Path) -> None:
    driver, monitor = vm
    source = volume_file(tmp_path / "old.raw", os.urandom(MIB))
    target = volume_file(tmp_path / "new.raw")
    driver.attach("vm1", SERIAL, source)
    driver.ensure_mirror("vm1", SERIAL, target, pivot=False)
    driver.remove_mirror("vm1", SERIAL)
    assert proto_file(monitor) == source.path
    assert qmp_execute(monitor, "query-jobs") == []
    driver.remove_mirror("vm1", SERIAL)  # nothing there: success
    with pytest.raises(IncorrectState, match="no mirror to complete"):
        driver.ensure_mirror("vm1", SERIAL, target, pivot=True)  # never a switch onto a copy not in step
    ids = disk_ids(SERIAL)
    assert ids.mirror_job.endswith("-mirror") and len(ids.mirror_job) <= 31


def test_a_disk_moves_twice_and_under_a_qos_throttle_then_grows_on_its_newest_node(
        vm: tuple[QemuDriver, Path], tmp_path: Path) -> None:
    """The format node alternates between its two names at each move (QEMU replaces the whole chain
    under the device, or under the throttle), and what works on a disk works after: a move back, an
    online resize."""
    driver, monitor = vm
    first = volume_file(tmp_path / "a.raw", os.urandom(2 * MIB))
    driver.attach("vm1", SERIAL, first, qos=QoS(iops=100_000))
    for name in ("b.raw", "c.raw"):
        target = volume_file(tmp_path / name)
        deadline = time.monotonic() + 30
        while driver.ensure_mirror("vm1", SERIAL, target, pivot=False).state != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert driver.ensure_mirror("vm1", SERIAL, target, pivot=True).state == "ready"
        assert proto_file(monitor) == target.path
        assert digest(tmp_path / name) == digest(tmp_path / "a.raw")
    nodes = {n["node-name"]: n for n in qmp_execute(monitor, "query-named-block-nodes", {"flat": True})}
    formats = [n for n in nodes if n in (f"vbs-{SERIAL}-raw", f"vbs-{SERIAL}-raw2")]
    assert formats == [f"vbs-{SERIAL}-raw"] or formats == [f"vbs-{SERIAL}-raw2"], formats
    assert f"vbs-{SERIAL}-thr" in nodes, "the QoS throttle stays on top"
    grown = tmp_path / "c.raw"
    with grown.open("r+b") as f:
        f.truncate(16 * MIB)
    disk = driver.resize("vm1", SERIAL, FileConnection(path=str(grown)), 16 * MIB)
    assert disk.size_bytes == 16 * MIB
    assert [d.serial for d in driver.list_disks("vm1")] == [SERIAL]
