#!/usr/bin/env python3
"""Attach / detach latency of VBS into a running guest: prints figures (it is not a test).

For each export protocol (``vbs up --export nbd``, then ``--export iscsi``) it starts ``vbs up`` on
a free loopback port in a temporary directory, boots the test guest (QEMU, TCG) with its monitor in
the host agent's VM directory, creates one volume and runs one warm-up and then ``--cycles``
attach / detach cycles:

* attach: from ``POST /v1/volumes/{id}/attach`` to the guest reporting the disk (its serial) on its
  console (``TestGuest.wait_for_disk``);
* detach: from ``POST /v1/volumes/{id}/detach`` to the guest reporting the disk gone
  (``TestGuest.wait_disk_gone``).

Where the time goes comes from the controller's own step records (``operations`` and
``operation_steps`` in its SQLite database, read after the run): when each workflow step finished,
against the wall clock of the API call. The guest scans ``/sys/block`` every 20 ms, so "the guest
sees the disk" includes up to 20 ms of polling. Each protocol runs with the guest as a ``pc``
(i440fx) machine, the baseline, and as a ``q35`` machine with four spare PCIe root ports, where
the host agent plugs each disk into an empty root port (``--machines``). Compared with
OpenStack's published Rally averages (4.0 s per attach, 3.7 s per detach).

While the guest takes the disk, the client waits for the operation to end as a client of the API
would, alternating cycle by cycle: ``poll-50ms`` (GET the operation every 50 ms, the baseline) or
``long-poll`` (``GET /v1/operations/{id}?wait=30``, answered when it ends); the report gives both
the client's figure and the guest's under each, with their ratio.

Every process is stopped by its PID in a ``finally`` (the guest by ``TestGuest.stop``, ``vbs up``
by SIGINT, which stops its children and export daemons); only 127.0.0.1 is used.

    .venv/bin/python bench/attach.py              # 20 cycles per protocol (about 3 minutes)
    .venv/bin/python bench/attach.py --quick      # 5 cycles per protocol
    .venv/bin/python bench/attach.py --hypervisor libvirt   # the guest as a libvirt domain (a libvirtd
                                                  # started as the tests start theirs: tests/libvirtd.py)
    .venv/bin/python bench/attach.py --hypervisor qemu,libvirt,command --exports nbd
        # QMP, the libvirt driver and the command driver's virsh-path profile (a FUSE local path per
        # volume) in one run: the first is the baseline of the others' ratios
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
# The vbs processes this script starts run the same tree as the script itself.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])

from bench.common import log, markdown_table, os_name, pct  # noqa: E402
from tests.conftest import Vbs, VbsUp, wait_until  # noqa: E402
from tests.libvirtd import Libvirtd  # noqa: E402

from vbs.ids import virtio_serial  # noqa: E402
from vbs.rigs.testguest import TestGuest, build_guest  # noqa: E402
from vbs.rigs.testguest.libvirt import LibvirtGuest  # noqa: E402
from vbs.storage.exports.nodelay import force_nodelay  # noqa: E402

HOST, VM = "host-1", "vm1"
TARGET_P50_S = 1.0
RALLY_ATTACH_S = 4.0  # OpenStack Rally, published averages (Cinder + Nova, KVM)
RALLY_DETACH_S = 3.7
POLL_S = 0.01
CLIENT_POLL_S = 0.05  # the baseline client's polling interval
LONG_POLL_S = 30
WAITS = ("poll-50ms", "long-poll")
ATTACH_STEPS = ("storage-export", "host-attach", "mark-attached")
DETACH_STEPS = ("host-detach", "storage-unexport", "mark-detached")
Q35_ROOT_PORTS = 4


@dataclass
class Cycle:
    """One attach or detach, times in seconds from the API call."""

    kind: str  # attach | detach
    wall_start: float  # time.time() at the call
    api: float  # the POST answered
    guest: float  # the guest saw the disk come / go
    settled: float  # the API reports the attachment attached / the volume available
    steps: dict[str, float] = field(default_factory=dict)  # step name -> finished at (from the DB)
    created: float | None = None  # the operation row was written (from the DB)
    waited: str = "poll-50ms"  # how the client waited for the operation's end (WAITS)
    client_done: float | None = None  # the client held the operation's end (succeeded)


class OperationWatch:
    """A client waiting in a thread for an operation to end, the ``waited`` way; when it saw the end."""

    def __init__(self, vbs: Vbs, operation_id: str, waited: str, t0: float) -> None:
        self.seen: float | None = None
        self.status = ""
        self._thread = threading.Thread(target=self._run, args=(vbs, operation_id, waited, t0), daemon=True)
        self._thread.start()

    def _run(self, vbs: Vbs, operation_id: str, waited: str, t0: float) -> None:
        params = {"wait": LONG_POLL_S} if waited == "long-poll" else {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            op = vbs.http.get(f"/v1/operations/{operation_id}", params=params, timeout=LONG_POLL_S + 30).json()
            if op["status"] not in ("running", "rolling-back"):
                self.seen, self.status = time.perf_counter() - t0, op["status"]
                return
            if waited != "long-poll":
                time.sleep(CLIENT_POLL_S)

    def result(self) -> float:
        self._thread.join(150)
        if self.seen is None or self.status != "succeeded":
            raise RuntimeError(f"operation ended {self.status or 'never'}")
        return self.seen


def machine() -> dict[str, str]:
    info = {"cpus": str(os.cpu_count()), "kernel": platform.release(), "python": platform.python_version(),
            "guest": f"QEMU TCG, -machine pc or q35 (+{Q35_ROOT_PORTS} pcie-root-ports), 256 MiB, "
                     "virtio-blk hot-plug"}
    if (name := os_name()) is not None:
        info["os"] = name
    return info


# -- the controller's step records -----------------------------------------------------------------


def _ts(value: Any) -> float:
    dt = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def add_step_times(db: Path, volume_id: str, cycles: list[Cycle]) -> None:
    """Match each cycle with its operation (same kind, created just after the call) and read when
    each of its steps finished. Read-only, after the run: the measurement is not disturbed."""
    if not db.exists():
        return
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        ops = con.execute("SELECT id, kind, created_at FROM operations WHERE resource_id = ? "
                          "AND kind IN ('attach-volume', 'detach-volume') ORDER BY created_at", (volume_id,)).fetchall()
        steps: dict[str, dict[str, float]] = {}
        for op_id, _, _ in ops:
            rows = con.execute("SELECT name, state, updated_at FROM operation_steps WHERE operation_id = ?",
                               (op_id,)).fetchall()
            steps[op_id] = {name: _ts(at) for name, state, at in rows if state == "done"}
    finally:
        con.close()
    pending = [(op_id, kind, _ts(created)) for op_id, kind, created in ops]
    for c in cycles:
        kind = f"{c.kind}-volume"
        for i, (op_id, op_kind, created) in enumerate(pending):
            # The clocks are the same machine's: allow a little for rounding.
            if op_kind == kind and c.wall_start - 0.05 <= created <= c.wall_start + c.api + 0.05:
                c.created = created - c.wall_start
                c.steps = {name: at - c.wall_start for name, at in steps[op_id].items()}
                del pending[i]
                break


# -- one protocol ------------------------------------------------------------------------------------


def wait_instance(vbs: Vbs) -> str:
    def find() -> str | None:
        for i in vbs.http.get("/v1/instances").json()["instances"]:
            if i["host"] == HOST and i["vm_id"] == VM and i["state"] == "running":
                return str(i["instance_id"])
        return None

    return wait_until(find, 60, what=f"instance {VM} on {HOST}")  # type: ignore[no-any-return]


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


def attachment_state(vbs: Vbs, volume_id: str) -> str | None:
    atts = vbs.volume(volume_id)["attachments"]
    return atts[0]["state"] if atts else None


def attach_once(vbs: Vbs, guest: TestGuest, volume_id: str, serial: str, waited: str = WAITS[0]) -> Cycle:
    wall, t0 = time.time(), time.perf_counter()
    r = vbs.http.post(f"/v1/volumes/{volume_id}/attach", json={"host": HOST, "vm_id": VM})
    api = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"attach: {r.status_code} {r.text[:300]}")
    watch = OperationWatch(vbs, r.json()["operation_id"], waited, t0)
    guest.wait_for_disk(serial, 60)
    seen = time.perf_counter() - t0
    client_done = watch.result()
    wait_for(lambda: attachment_state(vbs, volume_id) == "attached", 60, "attachment attached")
    return Cycle("attach", wall, api, seen, time.perf_counter() - t0, waited=waited, client_done=client_done)


def detach_once(vbs: Vbs, guest: TestGuest, volume_id: str, serial: str) -> Cycle:
    wall, t0 = time.time(), time.perf_counter()
    r = vbs.http.post(f"/v1/volumes/{volume_id}/detach", json={})
    api = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"detach: {r.status_code} {r.text[:300]}")
    guest.wait_disk_gone(serial, 60)
    gone = time.perf_counter() - t0
    wait_for(lambda: vbs.volume(volume_id)["status"] == "available", 60, "volume available")
    return Cycle("detach", wall, api, gone, time.perf_counter() - t0)


def nodelay_on_export_daemon(data_dir: Path) -> str:
    """Experimental: TCP_NODELAY on the NBD export daemon's listener (see bench/datapath.py)."""
    for pidfile in (data_dir / "storage-state").rglob("qsd.pid"):
        pid = int(pidfile.read_text().strip())
        if str(data_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():  # ours, not a reused PID
            return f"TCP_NODELAY set on {force_nodelay(pid)} socket(s) of qemu-storage-daemon {pid}"
    raise RuntimeError("no qemu-storage-daemon found for --exports nbd-nodelay")


# What each --hypervisor runs: the host agent's flags.
HYPERVISORS = {"qemu": ["--hypervisor", "qemu"], "libvirt": ["--hypervisor", "libvirt"],
               "command": ["--hypervisor", "command", "--hypervisor-profile", "virsh-path"]}


def run_protocol(export: str, cycles: int, work: Path, hypervisor: str = "qemu",
                 machine_type: str = "pc") -> dict[str, Any]:
    protocol, nodelay = export.removesuffix("-nodelay"), export.endswith("-nodelay")
    tmp = Path(tempfile.mkdtemp(prefix=f"attach-{export}-", dir=work))
    data_dir = tmp / "var"
    up = VbsUp(data_dir, tmp / "up.log", extra=["--export", protocol, *HYPERVISORS[hypervisor]])
    guest: TestGuest | None = None
    try:
        log(f"{export}: starting vbs up and the guest")
        vbs = up.start()
        if hypervisor != "qemu":  # libvirt, or virsh through the command driver
            guest = LibvirtGuest(VM, tmp / "guest", build_guest())
        else:
            # A q35 machine takes hot-plugged disks only in PCIe root ports: four spare ones.
            guest = TestGuest(VM, tmp / "guest", build_guest(), data_dir / "vms", machine=machine_type,
                              root_ports=Q35_ROOT_PORTS if machine_type == "q35" else 0)
        guest.start()
        boot = guest.wait_ready(180)
        wait_instance(vbs)
        vol = vbs.create_volume(size_gib=1)
        volume_id = vol["volume_id"]
        vbs.wait_volume(volume_id, "available")
        serial = virtio_serial(volume_id)

        log(f"{export}: warm-up cycle")
        warm = [attach_once(vbs, guest, volume_id, serial), detach_once(vbs, guest, volume_id, serial)]
        note = ""
        if nodelay:  # the daemon runs by now: the warm-up made an export
            note = nodelay_on_export_daemon(data_dir)
            log(f"{export}: {note}")
        done: list[Cycle] = []
        for i in range(cycles):
            a = attach_once(vbs, guest, volume_id, serial, WAITS[i % 2])
            d = detach_once(vbs, guest, volume_id, serial)
            done += [a, d]
            log(f"{export}: cycle {i + 1:2}/{cycles}: attach {a.guest * 1000:6.0f} ms (API {a.api * 1000:4.0f} ms, "
                f"client saw it end {(a.client_done or 0) * 1000:4.0f} ms by {a.waited}, "
                f"load {os.getloadavg()[0]:.1f}), "
                f"detach {d.guest * 1000:6.0f} ms (API {d.api * 1000:4.0f} ms)")
        add_step_times(data_dir / "vbs.db", volume_id, warm + done)
        via = {"qemu": "", "command": " (virsh-path)"}.get(hypervisor, f" ({hypervisor})")
        on = "" if machine_type == "pc" else f" on {machine_type}"
        return {"export": f"{export}{via}{on}", "protocol": export, "machine": machine_type,
                "baseline": hypervisor == "qemu" and machine_type == "pc", "boot_s": boot,
                "warmup": warm, "cycles": done, "note": note}
    finally:
        if guest is not None:
            guest.stop()
        up.stop()


# -- report ------------------------------------------------------------------------------------------


def ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f}"


def timeline(cs: list[Cycle], names: tuple[str, ...]) -> list[list[str]]:
    """Median time from the API call at which each stage ended, and the median length of the stage."""

    def med(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if len(vals) == len(cs) and vals else None

    points: list[tuple[str, list[float | None]]] = [("API call answered", [c.api for c in cs]),
                                                    ("operation recorded", [c.created for c in cs])]
    prev: list[float | None] = [c.created for c in cs]
    stages: list[tuple[str, list[float | None], list[float | None]]] = []
    for name in names:
        ends = [c.steps.get(name) for c in cs]
        lengths = [e - p if e is not None and p is not None else None for e, p in zip(ends, prev, strict=True)]
        stages.append((f"step {name} done", ends, lengths))
        prev = ends
    rows = [[label, ms(med(at)), ""] for label, at in points]
    rows += [[label, ms(med(at)), ms(med(lengths))] for label, at, lengths in stages]
    rows.append(["guest reports the disk " + ("present" if names[0] == "storage-export" else "gone"),
                 ms(med([c.guest for c in cs])), ""])
    rows.append(["API reports it settled (polled after the guest event)", ms(med([c.settled for c in cs])), ""])
    return sorted(rows, key=lambda r: float(r[1]) if r[1] != "—" else float("inf"))


def report(results: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, str]) -> str:
    lines = [f"# VBS attach / detach latency ({args.cycles} cycles per protocol, after 1 warm-up)", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), ""]
    rows = []

    def p50_of(r: dict[str, Any], kind: str) -> float:
        return pct([c.guest for c in r["cycles"] if c.kind == kind], 50)

    for r in results:
        base = next((b for b in results if b.get("baseline") and b.get("protocol") == r.get("protocol")), None)
        for kind, rally in (("attach", RALLY_ATTACH_S), ("detach", RALLY_DETACH_S)):
            cs = [c for c in r["cycles"] if c.kind == kind]
            g = [c.guest for c in cs]
            mean = statistics.mean(g)
            p50 = pct(g, 50)
            vs_base = f"{p50 / p50_of(base, kind):.2f}x" if base is not None else "–"
            rows.append([r["export"], kind, f"{p50 * 1000:.0f}", vs_base, f"{pct(g, 99) * 1000:.0f}",
                         f"{mean * 1000:.0f}",
                         f"{min(g) * 1000:.0f}–{max(g) * 1000:.0f}",
                         f"{pct([c.api for c in cs], 50) * 1000:.0f}",
                         f"{pct([c.settled for c in cs], 50) * 1000:.0f}",
                         f"{'met' if p50 < TARGET_P50_S else 'NOT met'}",
                         f"{rally:.1f} s / {mean:.2f} s = {rally / mean:.1f}x"])
    lines += ["## API call to the guest seeing (or releasing) the disk, ms", "",
              markdown_table(["export", "op", "p50", "p50 / baseline's", "p99", "mean", "min–max", "API answer p50",
                     "API settled p50",
                     f"p50 < {TARGET_P50_S:g} s", "Rally avg / VBS mean"], rows),
              "", "(Baseline: the same protocol through QMP into a pc machine. API settled: the API reports "
                  "the attachment attached / the volume available.)", ""]
    lines += by_wait(results)
    for r in results:
        lines += [f"## Where the time goes: {r['export']} (medians, ms)", ""]
        rows = []
        for kind, names in (("attach", ATTACH_STEPS), ("detach", DETACH_STEPS)):
            cs = [c for c in r["cycles"] if c.kind == kind]
            rows += [[kind, *row] for row in timeline(cs, names)]
        lines += [markdown_table(["op", "event", "at (ms from the call)", "step took (ms)"], rows), ""]
        w = r["warmup"]
        if r["note"]:
            lines.append(f"Experimental, after the warm-up: {r['note']} (accepted connections inherit it).")
        lines.append(f"Warm-up (first attach after start, not counted): attach {w[0].guest * 1000:.0f} ms, "
                     f"detach {w[1].guest * 1000:.0f} ms; guest boot {r['boot_s']:.1f} s.")
        lines.append("")
    return "\n".join(lines)


def by_wait(results: list[dict[str, Any]]) -> list[str]:
    """Attach p50s under each way the client waited: the client seeing the end, and the guest the disk."""
    rows = []
    for r in results:
        p50: dict[str, tuple[float, float]] = {}
        for waited in WAITS:
            cs = [c for c in r["cycles"] if c.kind == "attach" and c.waited == waited and c.client_done is not None]
            if cs:
                p50[waited] = (pct([c.client_done for c in cs], 50), pct([c.guest for c in cs], 50))
                rows.append([r["export"], waited, str(len(cs)), ms(p50[waited][0]), ms(p50[waited][1])])
        if len(p50) == len(WAITS):
            (poll_client, poll_guest), (long_client, long_guest) = (p50[w] for w in WAITS)
            rows.append([r["export"], "poll ÷ long-poll", "", f"{poll_client / long_client:.2f}x",
                         f"{poll_guest / long_guest:.2f}x"])
    return ["## Attach: how the client waited for the operation's end (p50, ms from the call)", "",
            markdown_table(["export", "client waited by", "cycles", "client saw it succeed", "guest saw the disk"],
                           rows), ""]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="5 cycles per protocol")
    p.add_argument("--cycles", type=int, default=None, help="measured cycles per protocol (default 20)")
    p.add_argument("--exports", default="nbd,iscsi",
                   help="protocols, comma-separated (default nbd,iscsi); nbd-nodelay: NBD with TCP_NODELAY "
                        "forced on the export daemon after the warm-up (experimental)")
    p.add_argument("--hypervisor", default="qemu",
                   help="the host agent's drivers, comma-separated: qemu, libvirt, command (the virsh-path "
                        "profile); libvirt and command start a libvirtd for the run")
    p.add_argument("--machines", default="pc,q35",
                   help="the guest's machine types, comma-separated (default pc,q35; q35 with "
                        f"{Q35_ROOT_PORTS} PCIe root ports, the qemu hypervisor only)")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp"), help="temporary install (default /var/tmp)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures to this file")
    p.add_argument("--keep", action="store_true", help="keep the temporary install (logs, console) afterwards")
    args = p.parse_args(argv)
    if args.cycles is None:
        args.cycles = 5 if args.quick else 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine()
    results = []
    work = Path(tempfile.mkdtemp(prefix="vbs-attach-", dir=args.work_dir))
    failed = False
    hypervisors = args.hypervisor.split(",")
    if not set(hypervisors) <= set(HYPERVISORS):
        raise SystemExit(f"--hypervisor: some of {', '.join(HYPERVISORS)}")
    libvirtd = Libvirtd(work / "libvirtd") if set(hypervisors) - {"qemu"} else None
    machines = args.machines.split(",")
    if not set(machines) <= {"pc", "q35"}:
        raise SystemExit("--machines: some of pc, q35")
    # The libvirt guest is a pc domain: q35 runs through the QEMU driver only.
    runs = [(h, m, e) for h in hypervisors for m in machines for e in args.exports.split(",")
            if h == "qemu" or m == "pc"]
    try:
        if libvirtd is not None:
            libvirtd.setup()
        for hypervisor, machine_type, export in runs:
            try:
                results.append(run_protocol(export, args.cycles, work, hypervisor, machine_type))
            except Exception as exc:  # one protocol failing must not lose the other's figures
                failed = True
                log(f"{export} ({hypervisor}, {machine_type}): FAILED {type(exc).__name__}: {exc}")
    finally:
        if libvirtd is not None:
            libvirtd.teardown()
    if args.keep or failed:
        log(f"logs and console output kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if not results:
        return 1
    print(report(results, args, info))
    if args.json:
        args.json.write_text(json.dumps({
            "machine": info, "cycles": args.cycles,
            "results": [{**r, "warmup": [vars(c) for c in r["warmup"]], "cycles": [vars(c) for c in r["cycles"]]}
                        for r in results]}, indent=1))
    return 0 if len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
