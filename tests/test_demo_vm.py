"""``vbs demo-vm``: the test guest in the background, as a user starts, asks and stops it (the README's
Quick start drives it against a real ``vbs up``: tests/test_readme.py). Here: what happens around it —
its files, a second start, a command's exit status, a stale pidfile, a stop that finds nothing."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import VBS
from vbs.cli.demo_vm import _size
from vbs.rigs.testguest import build_guest
from vbs.rigs.testguest.background import BackgroundGuest, GuestDisk
from vbs.rigs.testguest.guest import qemu_argv


def vbs(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBS_") or k == "VBS_CACHE_DIR"}
    return subprocess.run([*VBS, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.unit
def test_the_guest_line_and_what_the_guest_reports_read_as_said(tmp_path: Path) -> None:
    image = type("Image", (), {"kernel": Path("/k"), "initrd": Path("/i")})()
    argv = qemu_argv("vm1", image, tmp_path / "vms" / "vm1.qmp", machine="q35", root_ports=2,
                     serial="unix:/c,server=on,wait=off")
    assert argv[:3] == ["qemu-system-x86_64", "-accel", "tcg"]
    assert f"unix:{tmp_path}/vms/vm1.qmp,server=on,wait=off" in argv
    assert argv.count("-device") == 2 and "pcie-root-port,id=rp2,chassis=2" in argv
    assert GuestDisk("vda", "vol0123456789abcdef0", 1).volume_id == "vol-0123456789abcdef0"
    assert GuestDisk("vda", "-", 1).volume_id is None
    assert [_size(20 * 2**30), _size(3 * 2**20), _size(1000)] == ["20 GiB", "3 MiB", "1000 bytes"]
    # A pidfile whose process is not this VM's QEMU is no VM: nothing would be signalled.
    guest = BackgroundGuest("vm1", tmp_path / "var")
    guest.pid_path.parent.mkdir(parents=True)
    guest.pid_path.write_text(f"{os.getpid()}\n")
    assert guest.pid() is None
    assert guest.stop() is None and not guest.pid_path.exists()


@pytest.mark.integration
def test_a_demo_vm_starts_once_answers_and_stops_by_its_pid(tmp_path: Path) -> None:
    build_guest()  # the image outside the command's boot time (a first build downloads two packages)
    data = tmp_path / "elsewhere"
    started = vbs(tmp_path, "-o", "json", "demo-vm", "vm7", "--data-dir", str(data))
    guest = BackgroundGuest("vm7", data)
    try:
        assert started.returncode == 0, started.stderr
        said = json.loads(started.stdout)
        assert said["pid"] == guest.pid() and said["qmp_socket"] == str(data / "vms" / "vm7.qmp")
        assert said["stop"] == f"vbs demo-vm vm7 --data-dir {data} --stop"
        assert (data / "vms" / "vm7.qmp").is_socket() and (data / "demo-vms" / "vm7.console").is_socket()
        assert oct((data / "demo-vms").stat().st_mode & 0o777) == oct(0o700)
        again = vbs(tmp_path, "demo-vm", "vm7", "--data-dir", str(data))
        assert again.returncode == 1 and f"runs already (QEMU PID {said['pid']})" in again.stderr
        # A command's output and exit status come back; a guest without disks lists none.
        ran = vbs(tmp_path, "demo-vm", "vm7", "--data-dir", str(data), "--run", "echo hello; exit 3")
        assert (ran.returncode, ran.stdout) == (3, "hello\n")
        disks = vbs(tmp_path, "-o", "json", "demo-vm", "vm7", "--data-dir", str(data), "--disks")
        assert disks.returncode == 0 and json.loads(disks.stdout) == [], disks.stderr
        stopped = vbs(tmp_path, "demo-vm", "vm7", "--data-dir", str(data), "--stop")
        assert stopped.stdout == f"vm7 stopped (QEMU PID {said['pid']})\n", stopped.stderr
        assert guest.pid() is None
        assert not (data / "vms" / "vm7.qmp").exists() and not guest.pid_path.exists()
        assert vbs(tmp_path, "demo-vm", "vm7", "--data-dir", str(data), "--stop").stdout == "vm7 was not running\n"
        gone = vbs(tmp_path, "demo-vm", "vm7", "--data-dir", str(data), "--disks")
        assert gone.returncode == 1 and "vm7 is not running" in gone.stderr
    finally:
        guest.stop()
