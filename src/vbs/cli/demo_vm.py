"""``vbs demo-vm``: a small VM on this machine to attach volumes to, for a first try of VBS.

It is the project's test guest (Debian's kernel and busybox, built once by ``vbs.rigs.testguest``) under
QEMU (TCG, no KVM needed), in the background, with its QMP socket in the data dir's ``vms/`` where
``vbs up``'s host agent finds VMs; ``--disks`` and ``--run`` look inside it over its serial console.
"""

# No ``from __future__ import annotations`` here: Typer reads every command's signature, and string
# annotations would be evaluated again on each run (twice per command), most of a --help's time.
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from vbs.cli import output
from vbs.cli.context import Context

if TYPE_CHECKING:
    from vbs.rigs.testguest.background import BackgroundGuest, GuestDisk
    from vbs.rigs.testguest.build import GuestImage

# Registered into the app by vbs.cli.main, in the order of ``vbs --help``.
commands = typer.Typer()

DEFAULT_DATA_DIR = Path("./var")  # vbs up's
GIB = 2**30
MIB = 2**20
DISK_COLUMNS: list[output.Column] = [
    output.field("Device", "device"),
    output.field("Serial", "serial"),
    ("Size", lambda d: _size(d["size_bytes"])),
    ("VolumeId", lambda d: d["volume_id"] or ""),
]


@commands.command("demo-vm")
def demo_vm(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The VM's name: vbs up's host agent reports it as this VM of host-1.")],
    data_dir: Annotated[Path, typer.Option(
        help="The data dir of the vbs up that should find it: its QMP socket goes in DIR/vms.")] = DEFAULT_DATA_DIR,
    stop: Annotated[bool, typer.Option("--stop", help="Stop it (the QEMU PID in DIR/demo-vms/NAME.pid).")] = False,
    disks: Annotated[bool, typer.Option("--disks", help=(
        "The virtio disks the guest sees now: device, serial (a volume's id without its dash), size."))] = False,
    run: Annotated[str | None, typer.Option(help=(
        "A shell command to run in the guest (busybox sh, as root): its output is printed and its exit status "
        "is this command's."))] = None,
    machine: Annotated[str, typer.Option(help="QEMU machine type: pc | q35.")] = "pc",
    memory: Annotated[int, typer.Option(help="The guest's memory in MiB.")] = 256,
    root_ports: Annotated[int | None, typer.Option(help=(
        "q35: empty PCIe root ports, one per disk it can take (default: 8 on q35, none on pc)."))] = None,
    boot_timeout: Annotated[float, typer.Option(help="Seconds to wait for the guest to boot.")] = 180.0,
    incoming: Annotated[bool, typer.Option("--incoming", help=(
        "Boot nothing: wait as the destination of a live migration of the VM of this name on another host "
        "(QEMU -incoming defer; give the same --machine, --memory and --root-ports); vbs migrate-instance "
        "moves the guest in."))] = False,
) -> None:
    """Boot a small VM (the project's test guest under QEMU, in the background) that vbs up's host agent
    finds, to attach volumes to; --disks shows what it sees, --stop stops it."""
    from vbs.errors import InvalidParameter
    from vbs.rigs.testguest.background import BackgroundGuest

    c: Context = ctx.obj
    if sum((stop, disks, run is not None)) > 1:
        raise typer.BadParameter("give one of --stop, --disks and --run")
    guest = BackgroundGuest(name, data_dir)
    hint = "" if data_dir == DEFAULT_DATA_DIR else f" --data-dir {data_dir}"
    if stop:
        pid = guest.stop()
        print(f"{name} stopped (QEMU PID {pid})" if pid is not None else f"{name} was not running")
        return
    if disks:
        rows = [_disk_row(d) for d in guest.disks()]
        output.emit(rows, c.fmt, DISK_COLUMNS)
        return
    if run is not None:
        status, text = guest.run(run)
        sys.stdout.write(text)
        raise typer.Exit(status)
    if machine not in ("pc", "q35"):
        raise InvalidParameter("--machine must be pc or q35")
    if not 64 <= memory <= 65536:
        raise InvalidParameter("--memory is 64-65536 MiB")
    ports = root_ports if root_ports is not None else (8 if machine == "q35" else 0)
    if incoming:
        pid = guest.start(_image(), machine=machine, memory_mib=memory, root_ports=ports, incoming=True)
        output.emit({"name": name, "pid": pid, "qmp_socket": str(guest.qmp_path), "incoming": True,
                     "stop": f"vbs demo-vm {name}{hint} --stop"}, c.fmt)
        return
    pid, booted = _boot(guest, machine, memory, ports, boot_timeout)
    qmp = guest.qmp_path.relative_to(Path.cwd()) if guest.qmp_path.is_relative_to(Path.cwd()) else guest.qmp_path
    if output.is_machine(c.fmt):
        output.emit({"name": name, "pid": pid, "qmp_socket": str(guest.qmp_path),
                     "console_socket": str(guest.console_path), "boot_seconds": round(booted, 1),
                     "stop": f"vbs demo-vm {name}{hint} --stop"}, c.fmt)
        return
    print(f"{name} is up: QEMU PID {pid} (TCG, {memory} MiB, {machine}), booted in {booted:.1f} s; QMP socket {qmp}, "
          "where vbs up's host agent finds it (vbs describe-instances)")
    print(f"  vbs demo-vm {name}{hint} --disks        the disks the guest sees")
    print(f"  vbs demo-vm {name}{hint} --run 'CMD'    a shell command in the guest")
    print(f"  vbs demo-vm {name}{hint} --stop         stop it (QEMU PID {pid})")


def _image() -> "GuestImage":
    """The test guest's kernel and initramfs (built the first time, from Debian's packages)."""
    from vbs.rigs.testguest import build_guest, default_cache_dir

    cache = default_cache_dir()
    if not any(cache.glob("linux-image-*")):
        print(f"vbs demo-vm: building the test guest from Debian's linux-image-amd64 and busybox-static, once "
              f"(cached in {cache}) ...", file=sys.stderr, flush=True)
    return build_guest()


def _boot(guest: "BackgroundGuest", machine: str, memory: int, ports: int, timeout: float) -> tuple[int, float]:
    """Find (or build, the first time) the test guest's kernel and initramfs, start QEMU, wait for the
    guest; QEMU's PID and the seconds the boot took."""
    pid = guest.start(_image(), machine=machine, memory_mib=memory, root_ports=ports)
    try:
        booted = guest.wait_ready(timeout)
    except BaseException:
        guest.stop()
        raise
    return pid, booted


def _disk_row(disk: "GuestDisk") -> dict[str, Any]:
    return {"device": disk.device, "serial": disk.serial, "size_bytes": disk.size_bytes, "volume_id": disk.volume_id}


def _size(size: int) -> str:
    if size % GIB == 0:
        return f"{size // GIB} GiB"
    return f"{size / MIB:.0f} MiB" if size % MIB == 0 else f"{size} bytes"
