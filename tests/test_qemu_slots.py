"""Where the QEMU driver puts a disk's device: unit tests on QMP answers shaped as QEMU 7.2 gives them.

The real VMs (a ``pc`` guest and a ``q35`` guest with root ports) are in test_qemu_hypervisor.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from vbs.errors import IncorrectState, InvalidParameter
from vbs.host.hypervisors.qemu_slots import Placements, device_slot, free_ports, placement
from vbs.qemu.qmp import QmpCommandError

pytestmark = pytest.mark.unit


def bridge(qdev_id: str, *behind: dict[str, Any]) -> dict[str, Any]:
    return {"bus": 0, "qdev_id": qdev_id, "class_info": {"class": 1540, "desc": "PCI bridge"},
            "pci_bridge": {"bus": {"number": 0, "secondary": 1, "subordinate": 1}, "devices": list(behind)}}


def device(qdev_id: str) -> dict[str, Any]:
    return {"bus": 1, "qdev_id": qdev_id, "class_info": {"class": 256, "desc": "SCSI controller"}}


class Monitor:
    """Answers query-pci and qom-get as one VM would; records what was asked."""

    def __init__(self, machine: str, devices: list[dict[str, Any]], types: dict[str, str],
                 props: dict[tuple[str, str], Any] | None = None) -> None:
        self.machine, self.devices, self.types, self.props = machine, devices, types, props or {}
        self.asked: list[tuple[str, Any]] = []

    def __call__(self, command: str, args: dict[str, Any] | None = None) -> Any:
        self.asked.append((command, args))
        if command == "query-pci":
            # The host bridge in slot 0 and the ISA bridge in slot 1, as on a pc machine.
            root = [{"bus": 0, "slot": n, "qdev_id": "", "class_info": {"class": 1536}} for n in (0, 1)]
            return [{"bus": 0, "devices": [*root, *self.devices]}]
        assert command == "qom-get" and args is not None
        path, prop = args["path"], args["property"]
        if path == "/machine" and prop == "type":
            return self.machine
        name = path.removeprefix("/machine/peripheral/")
        if prop == "type" and name in self.types:
            return self.types[name]
        if (name, prop) in self.props:
            return self.props[(name, prop)]
        raise QmpCommandError("qom-get", "DeviceNotFound", f"Device '{name}' not found")


def test_a_pc_machine_takes_the_disk_on_its_root_bus() -> None:
    vm = Monitor("pc-i440fx-7.2-machine", [{"bus": 0, "slot": 2, "qdev_id": "vbs-disk-a"}], {})
    assert placement(vm, "vm1", None, Placements()) == {"addr": "03.0"}


def test_a_slot_just_emptied_is_taken_last() -> None:
    """A guest may still hold an eject request for a slot it emptied a moment ago: of the empty slots (or
    ports), a new disk takes the one touched longest ago, never touched first, in bus order."""
    vm = Monitor("pc-i440fx-7.2-machine", [], {})
    placed = Placements()
    assert [placement(vm, "vm1", None, placed)["addr"] for _ in range(3)] == ["02.0", "03.0", "04.0"]
    placed.touch("vm1", "02.0")  # a disk unplugged from slot 2 (Monitor lists none: every slot is empty)
    assert placement(vm, "vm1", None, placed) == {"addr": "05.0"}
    # Another VM's slots are its own; every slot taken: QEMU says so itself.
    assert placement(vm, "vm2", None, placed) == {"addr": "02.0"}
    full = Monitor("pc-i440fx-7.2-machine", [{"bus": 0, "slot": n, "qdev_id": f"d{n}"} for n in range(2, 32)], {})
    assert placement(full, "vm1", None, placed) == {}
    ports = [bridge("rp1"), bridge("rp2"), bridge("rp3")]
    q35 = Monitor("pc-q35-7.2-machine", ports, dict.fromkeys(("rp1", "rp2", "rp3"), "pcie-root-port"))
    placed.touch("vm3", "rp1/00.0")  # a disk unplugged from the port rp1
    assert [placement(q35, "vm3", None, placed)["bus"] for _ in range(3)] == ["rp2", "rp3", "rp1"]
    # A slot given (a live migration's destination) is taken as given, and counts as touched.
    placed.touch("vm4", "02.0")
    assert placement(vm, "vm4", "03.0", placed) == {"addr": "03.0"}
    assert placement(vm, "vm4", None, placed) == {"addr": "04.0"}


def test_the_first_empty_port_with_an_id_takes_the_disk() -> None:
    devices = [bridge("rp1", device("vbs-disk-a")), bridge(""), bridge("br1"), bridge("rp2"), bridge("rp3")]
    vm = Monitor("pc-q35-7.2-machine", devices, {"rp1": "pcie-root-port", "br1": "pci-bridge",
                                                 "rp2": "pcie-root-port", "rp3": "ioh3420"})
    assert placement(vm, "vm1", None, Placements()) == {"bus": "rp2"}
    assert list(free_ports(vm)) == ["rp2", "rp3"]
    # A port that holds a device, one without an id and a PCI-PCI bridge are not asked about or taken.
    asked = [a["path"] for c, a in vm.asked if c == "qom-get"]
    assert "/machine/peripheral/rp1" not in asked and "/machine/peripheral/" not in asked


def test_a_switch_downstream_port_behind_a_full_root_port_is_found() -> None:
    upstream = {**bridge("up1", bridge("down1")), "qdev_id": "up1"}
    vm = Monitor("pc-q35-7.2-machine", [bridge("rp1", upstream)],
                 {"up1": "x3130-upstream", "down1": "xio3130-downstream", "rp1": "pcie-root-port"})
    assert placement(vm, "vm1", None, Placements()) == {"bus": "down1"}


def test_a_q35_machine_without_a_free_port_is_refused_with_the_reason() -> None:
    vm = Monitor("pc-q35-7.2-machine", [bridge("rp1", device("vbs-disk-a"))], {"rp1": "pcie-root-port"})
    with pytest.raises(IncorrectState, match="no free slot for another disk.*pcie-root-port") as err:
        placement(vm, "vm1", None, Placements())
    assert err.value.status == 409


def test_a_given_slot_is_used_as_it_is_and_checked() -> None:
    vm = Monitor("pc-q35-7.2-machine", [], {})
    assert placement(vm, "vm1", "rp2/00.0", Placements()) == {"bus": "rp2", "addr": "00.0"}
    assert placement(vm, "vm1", "05.0", Placements()) == {"addr": "05.0"}
    assert vm.asked == []  # nothing looked up: the source's slot is where it goes
    for bad in ("rp2/", "2rp/00.0", "rp2/00.8", "a/b/00.0", "rp2 /00.0"):
        with pytest.raises(InvalidParameter):
            placement(vm, "vm1", bad, Placements())


def test_a_device_slot_names_its_port_when_it_sits_in_one() -> None:
    vm = Monitor("pc-q35-7.2-machine", [], {}, {
        ("d-port", "addr"): 0, ("d-port", "parent_bus"): "/machine/peripheral/rp2/rp2",
        ("d-root", "addr"): 0x28, ("d-root", "parent_bus"): "/machine/i440fx/pci.0",
        ("d-odd", "addr"): 300, ("d-odd", "parent_bus"): "/machine/i440fx/pci.0"})
    assert device_slot(vm, "d-port") == "rp2/00.0"
    assert device_slot(vm, "d-root") == "05.0"
    assert device_slot(vm, "d-odd") is None
    assert device_slot(vm, "d-gone") is None
