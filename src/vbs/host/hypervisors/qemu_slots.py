"""Where the QEMU driver hot-plugs a disk's device, and where a device sits.

A ``pc`` (i440fx) machine's root bus takes hot-plugged PCI devices: a disk goes there and QEMU picks
the slot. A PCI Express machine's root bus (``q35``'s ``pcie.0``) takes none: a hot-plugged device
goes into an empty PCIe root port (or a switch's downstream port), one device per port, so such a VM
must be started with spare ports, as libvirt does (``-device pcie-root-port,id=rp1,chassis=1`` on a
QEMU command line). A port is used only if it has an id: ``device_add`` names the port's bus by it.
When the VM has an empty port, the disk goes there, whatever the machine.

Of the empty slots or ports, the disk takes the one the driver touched longest ago (``Placements``: a
disk placed there or unplugged from there), not the first. A guest may still hold an eject request for a
slot it has just emptied: a ``pc`` guest under TCG, asked to unplug two disks a moment apart, was seen to
eject the disk hot-plugged next into the first one's slot, with no ``device_del`` for it (2 of 8 tries of
a probe; a make test lost an attached disk that way). The slot emptied last is the one taken last.

The slot a device sits in is ``02.0`` on a root bus and ``rp1/00.0`` in a port (the port's id, then
the address on its bus): a live migration's destination puts each disk at the source's slot.

Under TCG the port is also the faster way in (measured, docs/benchmarks-history.md "Attach / detach"):
a guest of a ``pc`` machine evaluates the ACPI ``_PRT`` method of QEMU's i440fx host bridge, a
128-entry AML loop, to route the new device's legacy interrupt, 140-290 ms under TCG, before its
driver probes.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from vbs.errors import IncorrectState, InvalidParameter
from vbs.qemu.qmp import QmpCommandError
from vbs.wire.host import PCI_SLOT_RE

__all__ = ["HOTPLUG_PORT_TYPES", "Placements", "device_slot", "free_ports", "placement", "slot_of"]

Command = Callable[..., Any]

# QEMU's PCIe ports that take one hot-plugged device each.
HOTPLUG_PORT_TYPES = frozenset({"pcie-root-port", "ioh3420", "xio3130-downstream"})
# Machines whose root bus is PCI Express, so takes no hot-plugged device.
_PCIE_MACHINE_RE = re.compile(r"(?:pc-)?q35\b.*|virt\b.*")
_PERIPHERAL = "/machine/peripheral/"
# The slots of a root bus that take hot-plugged devices: 1-31 (0 is the host bridge), function 0.
_ROOT_SLOTS = range(1, 32)


class Placements:
    """When the driver last touched each slot or port of each VM (monotonic time): placed a disk there, or
    unplugged one from there. A new disk takes the empty one touched longest ago (never: first, in bus
    order). Kept in memory: after a host agent's restart every empty slot is as good as another until
    touched again, which is QEMU's own choice (the first)."""

    MAX_VMS = 4096  # the VMs remembered, the least recently touched forgotten first

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._touched: OrderedDict[str, dict[str, float]] = OrderedDict()

    def touch(self, vm_id: str, where: str) -> None:
        """``where`` (a root bus slot "03.0", a port id, or a device's slot "rp1/00.0") was used just now."""
        with self._lock:
            self._vm(vm_id)[where.split("/")[0]] = time.monotonic()

    def choose(self, vm_id: str, empty: list[str]) -> str:
        """The one of ``empty`` (in bus order, not empty itself) touched longest ago, touched now."""
        with self._lock:
            touched = self._vm(vm_id)
            chosen = min(empty, key=lambda where: touched.get(where, float("-inf")))
            touched[chosen] = time.monotonic()
            return chosen

    def _vm(self, vm_id: str) -> dict[str, float]:
        touched = self._touched.setdefault(vm_id, {})
        self._touched.move_to_end(vm_id)
        while len(self._touched) > self.MAX_VMS:
            self._touched.popitem(last=False)
        return touched


def placement(cmd: Command, vm_id: str, pci_slot: str | None, placements: Placements) -> dict[str, str]:
    """The ``bus``/``addr`` arguments of ``device_add`` for a new disk: ``pci_slot`` where given, else an
    empty port, else an empty slot of the root bus (where the machine's root bus takes hot-plugged
    devices); of several, the one ``placements`` says was touched longest ago."""
    if pci_slot is not None:
        found = PCI_SLOT_RE.fullmatch(pci_slot)
        if found is None:
            raise InvalidParameter(f"invalid PCI slot {pci_slot!r}: expected 02.0 or <port id>/00.0")
        placements.touch(vm_id, pci_slot)
        return {"addr": found["addr"], **({"bus": found["bus"]} if found["bus"] else {})}
    ports = list(free_ports(cmd))
    if ports:
        return {"bus": placements.choose(vm_id, ports)}
    machine = str(cmd("qom-get", {"path": "/machine", "property": "type"}))
    if _PCIE_MACHINE_RE.match(machine.removesuffix("-machine")):
        raise IncorrectState(
            f"VM {vm_id} has no free slot for another disk: its machine ({machine}) hot-plugs PCI devices "
            "only into PCIe root ports, and none with an id is empty; start it with spare ones "
            "(-device pcie-root-port,id=rp1,chassis=1 ...)", code="IncorrectInstanceState")
    empty = _empty_root_slots(cmd)
    # None empty: QEMU's own answer (it says the bus is full).
    return {"addr": placements.choose(vm_id, empty)} if empty else {}


def _empty_root_slots(cmd: Command) -> list[str]:
    """The root bus's slots that hold no device, as ``addr`` values ("03.0"), in bus order."""
    root = next((bus for bus in cmd("query-pci") if bus.get("bus") == 0), None)
    if root is None:
        return []
    taken = {dev.get("slot") for dev in root.get("devices") or []}
    return [f"{slot:02x}.0" for slot in _ROOT_SLOTS if slot not in taken]


def free_ports(cmd: Command) -> Iterator[str]:
    """Ids of the VM's empty hot-plug ports, in bus order."""
    for bus in cmd("query-pci"):
        yield from _empty_ports(cmd, bus.get("devices") or [])


def _empty_ports(cmd: Command, devices: list[dict[str, Any]]) -> Iterator[str]:
    for dev in devices:
        bridge = dev.get("pci_bridge")
        if not isinstance(bridge, dict):
            continue
        behind = bridge.get("devices") or []
        port = dev.get("qdev_id")
        if not behind and isinstance(port, str) and port:
            kind = cmd("qom-get", {"path": _PERIPHERAL + port, "property": "type"})
            if kind in HOTPLUG_PORT_TYPES:
                yield port
        yield from _empty_ports(cmd, behind)


def slot_of(devfn: int) -> str:
    """QEMU's ``addr`` of a device from its devfn as ``qom-get`` answers it ("02.0")."""
    return f"{devfn >> 3:02x}.{devfn & 7:x}"


def device_slot(cmd: Command, device: str) -> str | None:
    """The slot of the device with id ``device`` ("02.0" or "rp1/00.0"), where QEMU tells one.

    Read from the QOM tree, not from one ``query-pci`` for all disks: ``query-pci`` walks the buses by
    the numbers the guest gave the bridges, so it lists nothing behind a port before the guest
    enumerated it (a live migration's incoming VM, a guest still booting)."""
    try:
        devfn = cmd("qom-get", {"path": _PERIPHERAL + device, "property": "addr"})
        bus = cmd("qom-get", {"path": _PERIPHERAL + device, "property": "parent_bus"})
    except QmpCommandError:
        return None
    if not isinstance(devfn, int) or not 0 <= devfn < 256:
        return None
    # A port's bus is a child of the port: /machine/peripheral/<port id>/<bus name>.
    parts = bus.split("/") if isinstance(bus, str) else []
    port = parts[3] if len(parts) == 5 and bus.startswith(_PERIPHERAL) else None
    slot = slot_of(devfn)
    return f"{port}/{slot}" if port is not None and PCI_SLOT_RE.fullmatch(f"{port}/{slot}") else slot
