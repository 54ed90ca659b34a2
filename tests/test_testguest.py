"""The test guest: built from Debian's packages, booted under QEMU (TCG), it reports hot-plugged disks.

One guest is booted cold for the module (the boot itself is under test); disks are hot-plugged with plain
QMP commands on the guest's test monitor (not the VBS driver) so that this proves the guest itself. The
last tests start guests warm, as the rest of the suite does: a saved boot resumed (warm.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from vbs.ids import virtio_serial
from vbs.qemu.qmp import QmpClient, QmpCommandError
from vbs.rigs.testguest import GuestImage, TestGuest, build_guest, pattern_bytes, pattern_sha256, warm
from vbs.rigs.testguest.build import MODULES
from vbs.rigs.testguest.guest import KERNEL_CMDLINE

VOL = "vol-0123456789abcdef0"
SERIAL = virtio_serial(VOL)


@pytest.fixture(scope="module")
def image() -> GuestImage:
    return build_guest()


@pytest.fixture(scope="module")
def guest(image: GuestImage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestGuest]:
    work = tmp_path_factory.mktemp("guest")
    with TestGuest("tg1", work, image, work / "vms", cold=True) as g:
        g.wait_ready(120)
        yield g
    assert not g.alive()


def test_build_is_cached_and_holds_kernel_modules_and_busybox(image: GuestImage) -> None:
    # Cached: the same files, not written again (speed belongs to bench/, not to a test).
    stamps = {p: p.stat().st_mtime_ns for p in (image.kernel, image.initrd)}
    again = build_guest()
    assert again == image
    assert {p: p.stat().st_mtime_ns for p in (again.kernel, again.initrd)} == stamps
    initrd = image.initrd.read_bytes()
    assert initrd.startswith(b"070701")
    for module in MODULES:
        assert f"lib/modules/{module}.ko\0".encode() in initrd
    assert b"bin/busybox\0" in initrd and b"init\0" in initrd
    # The xz payload of vmlinuz is unpacked: an ELF kernel boots faster under TCG.
    assert image.kernel.name == "vmlinux" and image.kernel.read_bytes()[:4] == b"\x7fELF"


def test_guest_boots_and_runs_commands_with_exit_status(guest: TestGuest) -> None:
    assert guest.boot_seconds is not None and guest.boot_seconds > 0
    assert guest.run("echo hello; echo oops >&2; exit 3") == (3, "hello\noops\n")
    assert guest.run("printf 'no newline'") == (0, "no newline")
    assert guest.run("true") == (0, "")
    # A command that outlives its timeout is killed in the guest (its shell: the exit status says so, a
    # finished sleep answers 0), and the console stays usable.
    rc, _ = guest.run("sleep 31", timeout=1)
    assert rc != 0
    rc, out = guest.run("ls /sys/module")
    assert rc == 0 and "virtio_blk" in out.split()
    assert "VBS-READY" in guest.console_log.read_text()


def test_a_long_command_runs_in_the_background_while_others_run(guest: TestGuest) -> None:
    # The background command waits for a file that only a later command makes: it can end only if the
    # other commands ran while it was running (events, not timings).
    guest.run("rm -f /tmp/go")
    writer = guest.run_background("while [ ! -e /tmp/go ]; do sleep 0.2; done; echo waited", timeout=120)
    assert guest.run("echo beside") == (0, "beside\n")
    assert not writer.done()
    assert guest.run("touch /tmp/go") == (0, "")
    assert writer.result(timeout=120) == (0, "waited\n")


def test_the_guest_has_a_test_monitor_beside_the_one_the_host_agent_holds(guest: TestGuest) -> None:
    assert guest.test_qmp_path != guest.qmp_path and guest.test_qmp_path.parent == guest.workdir
    with QmpClient(guest.qmp_path, name="host-agent") as agent:  # holds the main monitor, as the driver does
        assert agent.execute("query-name") == {"name": "tg1"}
        assert guest.qmp("query-status")["running"] is True
        assert guest.qmp("query-name") == {"name": "tg1"}


def test_hot_plugged_disk_is_seen_with_its_serial_written_and_unplugged(guest: TestGuest, tmp_path: Path) -> None:
    volume = tmp_path / "vol.raw"
    with volume.open("wb") as f:
        f.truncate(8 * 1024 * 1024)
    guest.qmp("blockdev-add", {"driver": "file", "node-name": "t-proto", "filename": str(volume)})
    guest.qmp("blockdev-add", {"driver": "raw", "node-name": "t-raw", "file": "t-proto"})
    guest.qmp("device_add", {"driver": "virtio-blk-pci", "id": "t-dev", "drive": "t-raw", "serial": SERIAL})

    dev = guest.wait_for_disk(SERIAL, timeout=10)
    assert dev.startswith("vd")
    assert guest.disks()[SERIAL] == dev
    assert guest.disk_size(SERIAL) == 8 * 1024 * 1024
    rc, out = guest.run(f"cat /sys/block/{dev}/serial")
    assert (rc, out) == (0, SERIAL)

    checksum = guest.write_pattern(dev, "seed-1", 2)
    assert checksum == pattern_sha256("seed-1", 2)
    assert guest.checksum(dev, 2) == checksum

    guest.qmp("device_del", {"id": "t-dev"})
    guest.wait_disk_gone(SERIAL, timeout=10)
    assert SERIAL not in guest.disks()
    # The guest drops the disk before it acknowledges the eject; QEMU frees the node after that.
    wait_until(
        lambda: all(c["name"] != "t-dev" for c in guest.qmp("qom-list", {"path": "/machine/peripheral"})),
        10,
        what="QEMU to delete the device",
    )
    # …and lets go of the node a moment later still (seen on a loaded machine: "Node t-raw is in use").
    wait_until(lambda: _blockdev_del(guest, "t-raw"), 10, what="QEMU to release t-raw")
    guest.qmp("blockdev-del", {"node-name": "t-proto"})
    # What the guest wrote reached the file.
    assert volume.read_bytes()[: 2 * 1024 * 1024] == pattern_bytes("seed-1", 2)


def _blockdev_del(guest: TestGuest, node: str) -> bool:
    try:
        guest.qmp("blockdev-del", {"node-name": node})
    except QmpCommandError as exc:
        if "is in use" in str(exc):
            return False
        raise
    return True


def test_warm_guests_resume_one_saved_boot_each_with_its_own_console_and_disks(
        image: GuestImage, tmp_path: Path) -> None:
    state = warm.saved_state(image, warm.Shape("pc", 256, 0, KERNEL_CMDLINE))
    assert state.stat().st_mode & 0o777 == 0o600 and state.parent.stat().st_mode & 0o777 == 0o700
    saved = state.stat().st_mtime_ns
    volume = tmp_path / "vol.raw"
    volume.write_bytes(b"\0" * (4 * 1024 * 1024))
    with TestGuest("w1", tmp_path / "w1", image, tmp_path / "vms") as one, \
            TestGuest("w2", tmp_path / "w2", image, tmp_path / "vms") as two:
        for g in (one, two):
            g.wait_ready(10)  # resumed in start(): ready at once
            assert g.qmp("query-name") == {"name": g.name} and g.qmp("query-status")["running"] is True
            assert "VBS-READY" not in g.console_log.read_text()  # no boot: the saved one goes on
            # Its clock is the host's, not the saved guest's.
            rc, out = g.run("date +%s")
            assert rc == 0 and abs(int(out) - time.time()) < 300, out
        one.run("echo one > /tmp/who")
        assert two.run("cat /tmp/who 2>/dev/null || echo none") == (0, "none\n")
        one.qmp("blockdev-add", {"driver": "file", "node-name": "w-proto", "filename": str(volume)})
        one.qmp("blockdev-add", {"driver": "raw", "node-name": "w-raw", "file": "w-proto"})
        one.qmp("device_add", {"driver": "virtio-blk-pci", "id": "w-dev", "drive": "w-raw", "serial": SERIAL})
        dev = one.wait_for_disk(SERIAL, timeout=30)
        assert one.write_pattern(dev, "warm", 1) == pattern_sha256("warm", 1)
        assert SERIAL not in two.disks()
    assert volume.read_bytes()[:1024 * 1024] == pattern_bytes("warm", 1)
    assert state.stat().st_mtime_ns == saved, "the saved boot is reused, not saved again"


def test_a_state_qemu_cannot_load_is_replaced_by_a_boot(image: GuestImage, tmp_path: Path) -> None:
    shape = warm.Shape("pc", 192, 0, KERNEL_CMDLINE)  # a shape of its own: other tests' state is not touched
    state = warm.saved_state(image, shape)
    state.write_bytes(state.read_bytes()[:4096])  # cut short
    with TestGuest("w3", tmp_path / "w3", image, tmp_path / "vms", memory_mib=192) as g:
        g.wait_ready(180)
        assert "VBS-READY" in g.console_log.read_text()  # booted
        assert g.run("echo ok") == (0, "ok\n")
    assert not state.exists()  # dropped: the next guest of this shape saves a fresh one
    assert warm.saved_state(image, shape).stat().st_size > 1024 * 1024
