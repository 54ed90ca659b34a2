#!/usr/bin/env python3
"""``make demo``: the paper's (docs/architecture.md §1) two use cases, end to end, on this machine.

Starts its own ``vbs up`` (a temporary data dir, a free port), boots two test guests (vm1, vm2) whose
QMP sockets are in ``<data-dir>/vms`` so host-1 finds them, and drives everything with the ``vbs``
CLI a user would type:

(a) extendable storage: two volumes are hot-plugged into vm1, written from inside the guest,
    unplugged, plugged back (one into vm2) and read back: the checksums match;
(b) snapshots: a "software environment" (a tar of a small file tree) is written to a volume and
    snapshotted; two volumes made from the snapshot go to vm1 and vm2, both see the environment,
    each stores its own results, and a third volume made from the snapshot shows it unchanged.

Exits 0 only if every check passed. Everything it starts is stopped by PID at the end (also on
Ctrl-C); the temporary directory is removed unless ``--keep``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest, build_guest, default_cache_dir, pattern_sha256
from vbs.rigs.testguest.libvirt import LibvirtGuest

VBS = [sys.executable, "-m", "vbs"]
HOST = "host-1"
PATTERN_MIB = 8  # written on each volume of use case (a)
ENV_MIB = 1  # the environment's tar fits in the first MiB; checksums and tar read that much
ENV_BYTES = ENV_MIB * 2**20
GIB = 2**30
PR_SET_PDEATHSIG = 1

BOLD, DIM, GREEN, RED, RESET = ("\033[1m", "\033[2m", "\033[32m", "\033[31m", "\033[0m") if sys.stdout.isatty() \
    else ("", "", "", "", "")


class DemoFailed(Exception):
    """A step could not go on (a command failed, a disk never came); checks that merely differ don't raise."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP: unwind like Ctrl-C so that the clean-up runs."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _own_session_and_follow_parent() -> None:
    """In ``vbs up``: its own session (a terminal Ctrl-C reaches only the demo, which stops it in
    order), and SIGTERM should the demo die without cleaning up."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def fmt_s(seconds: float) -> str:
    return f"{seconds:.2f} s"


def fill(template: str, **values: object) -> str:
    """``{name}`` placeholders only (the shell scripts have braces of their own)."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", str(value))
    return template


# -- the demo --------------------------------------------------------------------------------------


class Demo:
    def __init__(self, workspace: Path, export: str, hypervisor: str = "qemu") -> None:
        self.workspace = workspace
        self.data_dir = workspace
        self.export = export
        self.hypervisor = hypervisor
        self.libvirtd: Any = None  # a libvirtd this demo started (None: QEMU's own, or one already running)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.up_log = workspace / "vbs-up.log"
        # vbs up and the CLI keep per-endpoint client settings under XDG_CONFIG_HOME: keep the demo's
        # (a new endpoint each run) in its own directory, not in the user's home.
        self.env = {**os.environ, "VBS_ENDPOINT": self.endpoint, "XDG_CONFIG_HOME": str(workspace / "config")}
        self.guest_dir = workspace / "guests"
        self.up: subprocess.Popen[bytes] | None = None
        self.guests: dict[str, TestGuest] = {}
        self._console_pos: dict[str, int] = {}
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.timings: dict[str, list[float]] = {}
        self.volumes: list[str] = []
        self.snapshots: list[str] = []
        self.last_elapsed = 0.0

    # -- printing ----------------------------------------------------------------------------------

    @staticmethod
    def section(title: str) -> None:
        print(f"\n{BOLD}== {title}{RESET}", flush=True)

    @staticmethod
    def say(text: str) -> None:
        print(f"\n{text}", flush=True)

    @staticmethod
    def outcome(text: str) -> None:
        print(f"    -> {text}", flush=True)

    def check(self, ok: bool, text: str) -> bool:
        if ok:
            self.passed.append(text)
            print(f"{GREEN}OK{RESET}    {text}", flush=True)
        else:
            self.failed.append(text)
            print(f"{RED}FAIL{RESET}  {text}", flush=True)
        return ok

    def time(self, what: str, seconds: float) -> None:
        self.timings.setdefault(what, []).append(seconds)

    def console(self, vm: str, wanted: tuple[str, ...] = ("VBS-DISK",)) -> None:
        """Print the guest's own console lines (disk events) that came since the last call."""
        path = self.guests[vm].console_log
        try:
            with path.open("rb") as f:
                f.seek(self._console_pos.get(vm, 0))
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only
        self._console_pos[vm] = self._console_pos.get(vm, 0) + end
        for raw in data[:end].decode(errors="replace").splitlines():
            if raw.startswith(wanted):
                print(f"    {DIM}[{vm} console]{RESET} {raw}", flush=True)

    # -- the user interface: the vbs CLI ------------------------------------------------------------

    def vbs(self, *args: str, quiet: bool = False, timing: str | None = None) -> Any:
        """Run ``vbs -o json ARGS`` as a user would, print it, return its JSON."""
        if not quiet:
            print(f"{BOLD}$ vbs {shlex.join(args)}{RESET}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run([*VBS, "-o", "json", *args], env=self.env, capture_output=True, text=True,  # noqa: S603
                              timeout=300)
        elapsed = time.monotonic() - t0
        if timing:
            self.time(timing, elapsed)
        if proc.returncode != 0:
            for line in (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-10:]:
                print(f"    {line}")
            raise DemoFailed(f"vbs {' '.join(args)} exited {proc.returncode}")
        self.last_elapsed = elapsed
        return json.loads(proc.stdout) if proc.stdout.strip() else None

    def in_guest(self, vm: str, script: str, shown: str | None = None, timeout: float = 120) -> str:
        """Run a shell script in the guest over its console, print it and what the guest answered."""
        for i, line in enumerate((shown or script).strip().splitlines()):
            print(f"{BOLD}{vm}# {RESET}{line}" if i == 0 else f"{BOLD}{vm}> {RESET}{line}", flush=True)
        t0 = time.monotonic()
        rc, out = self.guests[vm].run(script, timeout)
        elapsed = time.monotonic() - t0
        self.time("guest commands", elapsed)
        for line in out.rstrip("\n").splitlines():
            print(f"    {DIM}[{vm}]{RESET} {line}", flush=True)
        print(f"    {DIM}({vm}: exit {rc}, {fmt_s(elapsed)}){RESET}", flush=True)
        if rc != 0:
            raise DemoFailed(f"the command in {vm} exited {rc}")
        return out

    def guest_checksum(self, vm: str, dev: str, mib: int) -> str:
        out = self.in_guest(vm, f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/{dev} bs=1M count={mib} 2>/dev/null "
                                "| sha256sum")
        return out.split()[0]

    # -- building blocks of the story ---------------------------------------------------------------

    def create_volume(self, *args: str) -> str:
        vol = self.vbs("create-volume", *args, "--wait", timing="create-volume --wait")
        self.volumes.append(vol["volume_id"])
        src = f" from {vol['snapshot_id']}" if vol.get("snapshot_id") else ""
        self.outcome(f"{vol['volume_id']}: {vol['size_gib']} GiB, {vol['status']}{src} "
                     f"(on {vol['storage_node']}/{vol['pool']}, {fmt_s(self.last_elapsed)})")
        if vol["status"] != "available":
            raise DemoFailed(f"{vol['volume_id']} is {vol['status']}")
        return str(vol["volume_id"])

    def attach(self, vol: str, vm: str, device: str = "vdb") -> str:
        """Attach ``vol`` to ``vm`` on host-1; return the disk's name in the guest."""
        serial = virtio_serial(vol)
        t0 = time.monotonic()
        att = self.vbs("attach-volume", vol, "--host", HOST, "--vm", vm, "--device", device, "--wait",
                       timing="attach-volume --wait")
        cli_s = time.monotonic() - t0
        if att["state"] != "attached":
            raise DemoFailed(f"attach of {vol} ended {att['state']}")
        dev = self.guests[vm].wait_for_disk(serial, 60)
        seen_s = time.monotonic() - t0
        self.time("attach: guest sees the disk", seen_s)
        size = self.guests[vm].disk_size(serial)
        self.outcome(f"{att['state']} to {att['host']}/{att['vm_id']} ({att['instance_id']}) as {att['device']} "
                     f"in {fmt_s(cli_s)}; the guest saw /dev/{dev} ({size / GIB:g} GiB) {fmt_s(seen_s)} after the "
                     "command started")
        self.console(vm)
        return dev

    def detach(self, vol: str, vm: str) -> None:
        serial = virtio_serial(vol)
        t0 = time.monotonic()
        att = self.vbs("detach-volume", vol, "--wait", timing="detach-volume --wait")
        cli_s = time.monotonic() - t0
        if att["state"] != "detached":
            raise DemoFailed(f"detach of {vol} ended {att['state']}")
        self.guests[vm].wait_disk_gone(serial, 60)
        gone_s = time.monotonic() - t0
        self.outcome(f"detached in {fmt_s(cli_s)}; gone from {vm} {fmt_s(gone_s)} after the command started")
        self.console(vm)

    def volume(self, vol: str) -> dict[str, Any]:
        return self.vbs("describe-volumes", vol, quiet=True)["volumes"][0]  # type: ignore[no-any-return]

    # -- set-up and tear-down -----------------------------------------------------------------------

    def start(self) -> None:
        self.section("Set-up")
        cache = default_cache_dir()
        print(f"test guest image: {cache} (built on the first run, from Debian's kernel and busybox)", flush=True)
        t0 = time.monotonic()
        image = build_guest()
        self.time("guest image", time.monotonic() - t0)

        if self.hypervisor == "libvirt":
            self.libvirtd = start_libvirtd(self.workspace / "libvirtd")
        print(f"$ vbs up --data-dir {self.data_dir} --port {self.port} --export {self.export} "
              f"--hypervisor {self.hypervisor}   {DIM}(in the background; log: {self.up_log}){RESET}", flush=True)
        with self.up_log.open("ab") as log:
            self.up = subprocess.Popen(  # noqa: S603 - argv list
                [*VBS, "up", "--data-dir", str(self.data_dir), "--port", str(self.port), "--export", self.export,
                 "--hypervisor", self.hypervisor],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                preexec_fn=_own_session_and_follow_parent)  # noqa: PLW1509 - no threads yet
        deadline = time.monotonic() + 90
        while b"VBS is up" not in self.up_log.read_bytes():
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise DemoFailed(f"vbs up did not start (exit code {self.up.poll()}; its log follows)")
            time.sleep(0.2)
        self.outcome(f"VBS is up at {self.endpoint} (pid {self.up.pid})")

        vms_dir = self.data_dir / "vms"
        for name in ("vm1", "vm2"):
            if self.hypervisor == "libvirt":
                guest: TestGuest = LibvirtGuest(name, self.guest_dir, image)
                print(f"booting test guest {name} as a transient libvirt domain (QEMU, TCG)", flush=True)
            else:
                guest = TestGuest(name, self.guest_dir, image, vms_dir)
                print(f"booting test guest {name} under QEMU (TCG), QMP socket {guest.qmp_path}", flush=True)
            self.guests[name] = guest
            guest.start()
        for name, guest in self.guests.items():
            boot = guest.wait_ready(180)
            self.time("guest boot", boot)
            self.outcome(f"{name} booted in {fmt_s(boot)}" + (f" (pid {guest.pid})" if guest.pid else ""))

        nodes = self.vbs("describe-storage-nodes")["storage_nodes"]
        for n in nodes:
            pools = ", ".join(f"{p['name']} ({p['clone_method']}, {p['free_bytes'] / GIB:.0f} GiB free)"
                              for p in n["pools"])
            self.outcome(f"storage node {n['name']}: {n['state']}, pools: {pools}")

        print(f"{BOLD}$ vbs describe-instances{RESET}   {DIM}(until host-1 reports both guests){RESET}", flush=True)
        deadline = time.monotonic() + 60
        while True:
            instances = self.vbs("describe-instances", quiet=True)["instances"]
            found = {i["vm_id"]: i for i in instances if i["host"] == HOST and i["state"] == "running"}
            if {"vm1", "vm2"} <= found.keys():
                break
            if time.monotonic() > deadline:
                raise DemoFailed(f"host-1 did not report vm1 and vm2 (it reports {sorted(found)})")
            time.sleep(0.5)
        for vm in ("vm1", "vm2"):
            i = found[vm]
            self.outcome(f"{i['instance_id']}  host {i['host']}  vm {i['vm_id']}  {i['state']}")

    def stop(self) -> list[str]:
        """Stop the guests, then vbs up, by PID; return what is still running from the workspace."""
        for guest in self.guests.values():
            try:
                guest.stop()
            except Exception as exc:  # noqa: BLE001 - keep cleaning
                print(f"stopping {guest.name}: {exc}", file=sys.stderr)
        if self.up is not None and self.up.poll() is None:
            self.up.send_signal(signal.SIGINT)  # its clean stop: host agent, storage agent, controller
            try:
                self.up.wait(60)
            except subprocess.TimeoutExpired:
                self.up.kill()
                self.up.wait()
        reap_export_daemons(self.data_dir / "storage-state")
        if self.libvirtd is not None:
            self.libvirtd.teardown()
            self.libvirtd = None
        return leftovers(self.workspace)

    # -- use case (a) -------------------------------------------------------------------------------

    def extendable_storage(self) -> None:
        self.section("Use case (a): extendable storage — volumes outlive their attachment")
        self.say("vm1 needs more space: create two volumes and hot-plug both into the running VM.")
        vol1 = self.create_volume("--size", "1", "--comment", "demo: data disk 1", "--tag", "demo=extendable")
        vol2 = self.create_volume("--size", "2", "--comment", "demo: data disk 2", "--tag", "demo=extendable")
        self.say("(--device is the name VBS records, as in EBS; the guest names its disks itself, and the disk's "
                 "serial is the volume id without its dash.)")
        dev1 = self.attach(vol1, "vm1", "vdb")
        dev2 = self.attach(vol2, "vm1", "vdc")
        self.check(self.guests["vm1"].disk_size(virtio_serial(vol1)) == GIB
                   and self.guests["vm1"].disk_size(virtio_serial(vol2)) == 2 * GIB,
                   f"vm1 sees both volumes at their sizes (/dev/{dev1} 1 GiB, /dev/{dev2} 2 GiB)")
        vols = {v["volume_id"]: v for v in self.vbs("describe-volumes", "--filter", "tag:demo=extendable")["volumes"]}
        for vol in (vol1, vol2):
            v = vols[vol]
            a = v["attachments"][0] if v["attachments"] else {}
            self.outcome(f"{vol}: {v['status']}, attached to {a.get('host')}/{a.get('vm_id')} as {a.get('device')}")
        self.check(all(vols[v]["status"] == "in-use" for v in (vol1, vol2)), "both volumes are in-use")

        self.say("Inside vm1, write a different pattern on each disk and checksum what is on the device.")
        written: dict[str, str] = {}
        for vol, dev, seed in ((vol1, dev1, "data-disk-1"), (vol2, dev2, "data-disk-2")):
            self.in_guest("vm1", f"yes {seed} | head -c {PATTERN_MIB * 2**20} | dd of=/dev/{dev} bs=1M conv=fsync "
                                 "2>/dev/null")
            written[vol] = self.guest_checksum("vm1", dev, PATTERN_MIB)
            self.check(written[vol] == pattern_sha256(seed, PATTERN_MIB),
                       f"vm1's checksum of /dev/{dev} is that of the pattern computed on the host")

        self.say("Unplug both volumes: the guest loses the disks, the volumes (and the data) stay.")
        for vol in (vol1, vol2):
            self.detach(vol, "vm1")
        statuses = {vol: self.volume(vol)["status"] for vol in (vol1, vol2)}
        self.check(all(s == "available" for s in statuses.values()) and not self.guests["vm1"].disks(),
                   "both volumes are available again and vm1 has no data disk left")

        self.say("Plug them back: the first into vm1 again, the second into vm2. The data is still there.")
        for vol, vm, name in ((vol1, "vm1", "data disk 1"), (vol2, "vm2", "data disk 2")):
            dev = self.attach(vol, vm, "vdb")
            got = self.guest_checksum(vm, dev, PATTERN_MIB)
            self.check(got == written[vol], f"{name} read back in {vm}: sha256 {got[:16]}… matches what vm1 wrote")
        for vol, vm in ((vol1, "vm1"), (vol2, "vm2")):
            self.detach(vol, vm)

    # -- use case (b) -------------------------------------------------------------------------------

    ENV_SCRIPT = """\
set -e
rm -rf /env && mkdir -p /env/bin /env/etc /env/share
echo 'toolkit 1.0 (demo environment)' > /env/etc/version
seq 1 20000 > /env/share/dataset.txt
cat > /env/bin/analyze <<'EOF'
#!/bin/sh
# analyze STEP: the sum of every STEP-th value of the data set
awk -v s="$1" 'NR % s == 0 { t += $1 } END { print t }' "$(dirname "$0")/../share/dataset.txt"
EOF
chmod +x /env/bin/analyze
tar -cf - -C /env . | dd of=/dev/{dev} bs=64k conv=fsync 2>/dev/null
echo 3 > /proc/sys/vm/drop_caches; head -c {bytes} /dev/{dev} | tar -tvf -"""

    RUN_SCRIPT = """\
set -e
rm -rf /work && mkdir /work && head -c {bytes} /dev/{dev} | tar -xf - -C /work
cat /work/etc/version
mkdir -p /work/results && /work/bin/analyze {step} > /work/results/{vm}.txt
echo "{vm}: analyze {step} = $(cat /work/results/{vm}.txt)"
tar -cf - -C /work . | dd of=/dev/{dev} bs=64k conv=fsync 2>/dev/null
echo 3 > /proc/sys/vm/drop_caches; head -c {bytes} /dev/{dev} | tar -tf - | grep results/"""

    def snapshots_share_an_environment(self) -> None:
        self.section("Use case (b): snapshots — one software environment, many independent copies")
        self.say("Prepare a software environment on a volume in vm1: a small tree (a tool, a data set) packed "
                 "with tar straight onto the disk.")
        base = self.create_volume("--size", "1", "--comment", "demo: golden environment", "--tag", "demo=snapshots")
        dev = self.attach(base, "vm1", "vdb")
        self.in_guest("vm1", fill(self.ENV_SCRIPT, dev=dev, bytes=ENV_BYTES))
        golden = self.guest_checksum("vm1", dev, ENV_MIB)
        self.detach(base, "vm1")

        self.say("Snapshot it, then make two volumes from the snapshot, one per VM.")
        snap = self.vbs("create-snapshot", base, "--comment", "demo: toolkit 1.0", "--wait",
                        timing="create-snapshot --wait")
        snap_id = str(snap["snapshot_id"])
        self.snapshots.append(snap_id)
        self.outcome(f"{snap_id} of {snap['volume_id']}: {snap['status']} ({snap['progress']}%, "
                     f"{fmt_s(self.last_elapsed)})")
        if snap["status"] != "completed":
            raise DemoFailed(f"{snap_id} is {snap['status']}")
        copies = {vm: self.create_volume("--snapshot", snap_id, "--comment", f"demo: workspace of {vm}",
                                         "--tag", "demo=snapshots") for vm in ("vm1", "vm2")}

        self.say("Each VM gets its copy, checks it has the environment, runs the tool and stores its results on "
                 "its own volume.")
        devs: dict[str, str] = {}
        for vm, vol in copies.items():
            devs[vm] = self.attach(vol, vm, "vdb")
            got = self.guest_checksum(vm, devs[vm], ENV_MIB)
            self.check(got == golden, f"{vm} sees the environment of {snap_id} (sha256 {got[:16]}… as written)")
        after: dict[str, str] = {}
        for vm, step in (("vm1", 3), ("vm2", 7)):
            out = self.in_guest(vm, fill(self.RUN_SCRIPT, dev=devs[vm], step=step, vm=vm, bytes=ENV_BYTES))
            files = [line for line in out.splitlines() if "results/" in line and not line.endswith("/")]
            self.check(files == [f"./results/{vm}.txt"],
                       f"{vm}'s volume now holds its results (results/{vm}.txt) and only those")
            after[vm] = self.guest_checksum(vm, devs[vm], ENV_MIB)
        self.check(len({golden, after["vm1"], after["vm2"]}) == 3,
                   "the two copies now differ from each other and from the environment "
                   f"(vm1 {after['vm1'][:12]}…, vm2 {after['vm2'][:12]}…)")

        self.say("vm1 looks at its copy again: vm2's writes did not reach it.")
        listing = self.in_guest("vm1", f"echo 3 > /proc/sys/vm/drop_caches; head -c {ENV_BYTES} /dev/{devs['vm1']} "
                                     "| tar -tf - | grep results/")
        self.check("vm2" not in listing and self.guest_checksum("vm1", devs["vm1"], ENV_MIB) == after["vm1"],
                   "vm1's volume is as vm1 left it")
        for vm, vol in copies.items():
            self.detach(vol, vm)

        self.say("The snapshot itself is unchanged: a third volume made from it shows the pristine environment.")
        third = self.create_volume("--snapshot", snap_id, "--comment", "demo: fresh copy", "--tag", "demo=snapshots")
        dev3 = self.attach(third, "vm2", "vdb")
        got = self.guest_checksum("vm2", dev3, ENV_MIB)
        listing = self.in_guest("vm2", f"head -c {ENV_BYTES} /dev/{dev3} | tar -tf - | grep -c results/ || true")
        self.check(got == golden and listing.strip() == "0",
                   f"a fresh volume from {snap_id} has the original environment (sha256 {got[:16]}…) and no results")
        self.detach(third, "vm2")

    # -- the end ------------------------------------------------------------------------------------

    def delete_everything(self) -> None:
        self.section("Clean-up through the API")
        for vol in self.volumes:
            v = self.vbs("delete-volume", vol, "--wait", timing="delete-volume --wait")
            self.outcome(f"{vol}: {v['status']}")
        for snap in self.snapshots:
            sn = self.vbs("delete-snapshot", snap)
            self.outcome(f"{snap}: {sn['status']}")
        left = [v["volume_id"] for v in self.vbs("describe-volumes")["volumes"]
                if v["volume_id"] in self.volumes and v["status"] != "deleted"]
        self.check(not left, f"{len(self.volumes)} volumes and {len(self.snapshots)} snapshot deleted")


def reap_export_daemons(state_dir: Path) -> None:
    """Safety net: export daemons whose pidfile is in our state dir, if still running after vbs up stopped.

    Only a process whose command line names this state directory is signalled (no PID-reuse accidents).
    """
    if not state_dir.exists():
        return
    for pidfile in state_dir.rglob("*.pid"):
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if str(state_dir).encode() in cmdline:
            print(f"stopping a leftover export daemon, pid {pid}", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)


def leftovers(workspace: Path) -> list[str]:
    """Processes (other than this one and its parents) whose command line names the workspace."""
    mine = set()
    pid = os.getpid()
    while pid > 1:
        mine.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    needle = str(workspace).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            text = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {text[:200]}")
    return found


def summary(demo: Demo, total: float, error: str | None) -> None:
    demo.section("Summary")
    rows = [
        ("attach-volume --wait", "attach-volume --wait"),
        ("  guest sees the disk", "attach: guest sees the disk"),
        ("detach-volume --wait", "detach-volume --wait"),
        ("create-volume --wait", "create-volume --wait"),
        ("create-snapshot --wait", "create-snapshot --wait"),
        ("guest boot (TCG)", "guest boot"),
    ]
    for label, key in rows:
        values = demo.timings.get(key)
        if not values:
            continue
        if len(values) == 1:
            print(f"  {label:<24} {fmt_s(values[0])}")
        else:
            print(f"  {label:<24} {len(values)}x: median {fmt_s(statistics.median(values))}, "
                  f"{min(values):.2f}–{max(values):.2f} s")
    print("  (CLI times are wall clock for the whole `vbs` process, Python start-up included)")
    print(f"  checks: {len(demo.passed)} passed, {len(demo.failed)} failed; total {total:.0f} s")
    for text in demo.failed:
        print(f"  {RED}FAIL{RESET}  {text}")
    if error:
        print(f"  {RED}stopped early{RESET}: {error.splitlines()[0][:300]}")


def print_log_tails(demo: Demo) -> None:
    paths = [demo.up_log] + [g.console_log for g in demo.guests.values()]
    for path in paths:
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()[-15:]
            print(f"\n--- last lines of {path}", file=sys.stderr)
            for line in lines:
                print(f"    {line}", file=sys.stderr)


def start_libvirtd(workdir: Path) -> Any:
    """A libvirtd for the demo: None if one answers already (it is used), else one started the way the
    tests start theirs (system paths made and removed again, stopped by its PID: tests/libvirtd.py)."""
    import libvirt

    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    try:
        libvirt.open("qemu:///system").close()
        print("using the libvirtd that runs already (qemu:///system)", flush=True)
        return None
    except libvirt.libvirtError:
        pass
    repo = Path(__file__).resolve().parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from tests.libvirtd import Libvirtd

    print(f"starting a libvirtd for the demo (its log: {workdir}/libvirtd.log)", flush=True)
    return Libvirtd(workdir).setup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, help="use this directory (kept; not one another vbs up uses) "
                        "instead of a temporary one")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, pool, DB)")
    parser.add_argument("--export", choices=("nbd", "iscsi"), default="nbd", help="how volumes reach the host")
    parser.add_argument("--hypervisor", choices=("qemu", "libvirt"), default="qemu",
                        help="the guests as QEMU processes (QMP) or as libvirt domains (a libvirtd already "
                             "running is used, else the demo starts one for its run)")
    args = parser.parse_args()

    def _raise(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGHUP, _raise)

    if args.data_dir:
        workspace = args.data_dir.resolve()
        workspace.mkdir(parents=True, exist_ok=True)
        temporary = False
    else:
        workspace = Path(tempfile.mkdtemp(prefix="vbs-demo-"))
        temporary = True
    if os.geteuid() != 0:
        print("note: not root; the export daemons and QEMU may need it", file=sys.stderr)

    demo = Demo(workspace, args.export, args.hypervisor)
    t0 = time.monotonic()
    error: str | None = None
    interrupted = False
    print(f"{BOLD}VBS demo{RESET}: every `$ vbs …` line below is run as `vbs -o json …` with "
          f"VBS_ENDPOINT={demo.endpoint}\n(and XDG_CONFIG_HOME={workspace}/config, where vbs up leaves the "
          "endpoint's access key);\nits outcome is summarised from the JSON. `vmN#` lines run in the guest "
          "(busybox sh over its serial console).")
    try:
        demo.start()
        demo.extendable_storage()
        demo.snapshots_share_an_environment()
        demo.delete_everything()
    except (KeyboardInterrupt, Interrupted) as exc:
        error, interrupted = f"interrupted ({str(exc) or 'Ctrl-C'})", True
    except DemoFailed as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - report, then clean up
        error = f"{type(exc).__name__}: {exc}"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if error:
            print(f"\n{RED}error{RESET}: {error}", file=sys.stderr)
            if not interrupted:
                print_log_tails(demo)
        print("\nstopping the guests and vbs up …", flush=True)
        left = demo.stop()
        demo.check(not left, "no process left behind" + (": " + "; ".join(left) if left else ""))
        if temporary and not args.keep:
            shutil.rmtree(workspace, ignore_errors=True)
            print(f"removed {workspace}")
        else:
            print(f"kept {workspace} (vbs-up.log, guests/*.console.log, pool, DB)")
    summary(demo, time.monotonic() - t0, error)
    ok = error is None and not demo.failed
    print(f"\n{GREEN + 'demo passed' if ok else RED + 'demo FAILED'}{RESET}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
