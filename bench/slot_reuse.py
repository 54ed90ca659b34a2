#!/usr/bin/env python3
"""Hot-plug slot reuse on a ``pc`` guest: how often the guest ejects a disk nobody asked it to (prints
figures; it is not a test).

A ``pc`` (i440fx) guest asked to unplug two disks a moment apart may still hold an eject request for
the first one's slot once that slot is empty again: a disk hot-plugged into it next is then ejected by
the guest, with no ``device_del`` for it. The QEMU driver therefore puts a new disk in the empty slot it
touched longest ago (``vbs.host.hypervisors.qemu_slots.Placements``), not the first one, which is
QEMU's own choice. Each round, with both choices in turn on one test guest (TCG):

    plug disks a and b; unplug a; 0.3 s later unplug b; once a is gone, plug x; once b is gone, wait 2 s:
    is x still there?

``--load N`` runs N busy loops beside the guest (stopped by their PIDs at the end): the eject shows
on a busy machine, as in make test. Printed: the rounds whose x the guest ejected, per choice.

    .venv/bin/python bench/slot_reuse.py --rounds 6 --load 3
    .venv/bin/python bench/slot_reuse.py --rounds 8 --choice qemu    # one choice alone on a fresh guest
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import log, text_table  # noqa: E402

from vbs.host.hypervisors.qemu_slots import Placements, device_slot, placement  # noqa: E402
from vbs.qemu.qmp import QmpCommandError  # noqa: E402
from vbs.rigs.testguest import TestGuest, build_guest  # noqa: E402

VM = "slotprobe"
Qmp = Callable[..., Any]


def _slots(qmp: Qmp) -> dict[str, int]:
    return {d["qdev_id"]: d["slot"] for bus in qmp("query-pci") for d in bus["devices"] if d.get("qdev_id")}


def _wait_gone(qmp: Qmp, device: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while device in _slots(qmp) and time.monotonic() < deadline:
        time.sleep(0.02)


def _round(qmp: Qmp, tag: str, placements: Placements | None) -> bool:
    """One round; True if the guest ejected x unasked."""

    def plug(name: str) -> None:
        qmp("blockdev-add", {"driver": "null-co", "node-name": f"n-{name}", "size": 1 << 30, "read-zeroes": True})
        where = placement(qmp, VM, None, placements) if placements is not None else {}
        qmp("device_add", {"driver": "virtio-blk-pci", "id": name, "drive": f"n-{name}", "serial": name, **where})

    def unplug(name: str) -> None:
        slot = device_slot(qmp, name)
        qmp("device_del", {"id": name})
        if placements is not None and slot is not None:
            placements.touch(VM, slot)

    a, b, x = f"a{tag}", f"b{tag}", f"x{tag}"
    plug(a)
    plug(b)
    time.sleep(0.3)
    unplug(a)
    time.sleep(0.3)
    unplug(b)
    _wait_gone(qmp, a)
    plug(x)
    _wait_gone(qmp, b)
    time.sleep(2)
    ejected = x not in _slots(qmp)
    if not ejected:
        unplug(x)
        _wait_gone(qmp, x)
    for name in (a, b, x):
        try:
            qmp("blockdev-del", {"node-name": f"n-{name}"})
        except QmpCommandError as exc:  # a device the loaded guest has not let go yet: its node stays
            log(f"{name}: {exc.desc}")
    return ejected


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="slot_reuse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per choice (1-100)")
    parser.add_argument("--load", type=int, default=3, help="busy loops beside the guest (0-16)")
    parser.add_argument("--choice", choices=("both", "qemu", "vbs"), default="both",
                        help="both choices round by round on one guest (the default), or one of them alone")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 100 or not 0 <= args.load <= 16:
        parser.error("--rounds takes 1-100, --load 0-16")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    labels = {"qemu": "first empty slot (QEMU's)", "vbs": "touched longest ago (VBS)"}
    ejected = {label: 0 for key, label in labels.items() if args.choice in (key, "both")}
    try:
        with tempfile.TemporaryDirectory(prefix="vbs-slot-reuse-") as tmp:
            guest = TestGuest(VM, Path(tmp), build_guest(), Path(tmp)).start()
            try:
                guest.wait_ready(120)
                placements = Placements()
                for n in range(args.rounds):
                    # Interleaved, so that the load falls on both alike.
                    for label in ejected:
                        chosen = placements if label == labels["vbs"] else None
                        hit = _round(guest.qmp, f"{n}{'v' if chosen else 'q'}", chosen)
                        ejected[label] += hit
                        log(f"round {n}, {label}: {'x EJECTED by the guest' if hit else 'x stays'}")
            finally:
                guest.stop()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(text_table(["slot choice", "rounds", "x ejected unasked"],
                     [[label, str(args.rounds), str(n)] for label, n in ejected.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
