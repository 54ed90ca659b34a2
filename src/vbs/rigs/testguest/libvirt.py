"""The test guest as a transient libvirt domain (``type='qemu'``: TCG), for the libvirt driver's tests.

The domain boots the same kernel and initramfs as ``TestGuest``; its serial console is a unix socket
QEMU listens on (``<serial type='unix'>`` in bind mode), which this class connects to as soon as the
domain is created, so it sees the guest's first line. With ``bare``, the domain has no OS at all: it
takes hot-plugged disks but never acknowledges an unplug (a guest that holds its disk).
"""

from __future__ import annotations

import socket
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import libvirt

from vbs.errors import DriverError
from vbs.rigs.testguest.build import GuestImage
from vbs.rigs.testguest.guest import KERNEL_CMDLINE, TestGuest

__all__ = ["LibvirtGuest", "domain_xml"]


def domain_xml(name: str, image: GuestImage | None, console: Path | None, memory_mib: int = 256, *,
               machine: str = "pc", root_ports: int = 0) -> str:
    """A transient domain booting ``image`` (None: no OS) with its console on the unix socket ``console``;
    ``root_ports`` empty PCIe root ports (where a ``q35`` machine takes hot-plugged disks)."""
    dom = ET.Element("domain", {"type": "qemu"})
    ET.SubElement(dom, "name").text = name
    ET.SubElement(dom, "memory", {"unit": "MiB"}).text = str(memory_mib)
    ET.SubElement(dom, "vcpu").text = "1"
    os_el = ET.SubElement(dom, "os")
    ET.SubElement(os_el, "type", {"arch": "x86_64", "machine": machine}).text = "hvm"
    if image is not None:
        ET.SubElement(os_el, "kernel").text = str(image.kernel)
        ET.SubElement(os_el, "initrd").text = str(image.initrd)
        ET.SubElement(os_el, "cmdline").text = KERNEL_CMDLINE
    # ACPI: without it the PCI bus of machine "pc" takes no hot-plugged device.
    ET.SubElement(ET.SubElement(dom, "features"), "acpi")
    ET.SubElement(dom, "on_reboot").text = "destroy"
    devices = ET.SubElement(dom, "devices")
    if root_ports:
        # Index 0 is the root bus; the ports come after it (libvirt numbers them and picks their slots).
        # libvirt would put its default USB controller and balloon into ports too: none, so they stay empty.
        ET.SubElement(devices, "controller", {"type": "pci", "index": "0", "model": "pcie-root"})
        ET.SubElement(devices, "controller", {"type": "usb", "model": "none"})
        ET.SubElement(devices, "memballoon", {"model": "none"})
        for _ in range(root_ports):
            ET.SubElement(devices, "controller", {"type": "pci", "model": "pcie-root-port"})
    if console is not None:
        serial = ET.SubElement(devices, "serial", {"type": "unix"})
        ET.SubElement(serial, "source", {"mode": "bind", "path": str(console)})
        ET.SubElement(serial, "target", {"port": "0"})
    return ET.tostring(dom, encoding="unicode")


class LibvirtGuest(TestGuest):
    """``TestGuest`` run by libvirt at ``uri``: commands and disk reports over the console socket."""

    def __init__(self, name: str, workdir: Path, image: GuestImage, uri: str = "qemu:///system", *,
                 memory_mib: int = 256, bare: bool = False, machine: str = "pc", root_ports: int = 0) -> None:
        super().__init__(name, workdir, image, workdir, memory_mib=memory_mib, machine=machine, root_ports=root_ports)
        self.uri = uri
        self.bare = bare
        self.console_socket = self.workdir / f"{name}.console.sock"
        self._conn: libvirt.virConnect | None = None
        self._dom: libvirt.virDomain | None = None
        self._sock: socket.socket | None = None

    def domain(self) -> libvirt.virDomain:
        """The domain, through a live connection (libvirtd may have restarted since the last call)."""
        if self._conn is not None:
            try:
                return self._conn.lookupByName(self.name)
            except libvirt.libvirtError:
                if self._conn.isAlive():
                    raise
                self._conn.close()  # no event loop here: a closed connection shows only when used
        self._conn = libvirt.open(self.uri)
        return self._conn.lookupByName(self.name)

    def start(self) -> LibvirtGuest:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.console_socket.unlink(missing_ok=True)
        self._conn = libvirt.open(self.uri)
        self._started_at = time.monotonic()
        xml = domain_xml(self.name, None if self.bare else self.image, None if self.bare else self.console_socket,
                         self.memory_mib, machine=self.machine, root_ports=self.root_ports)
        self._dom = self._conn.createXML(xml, 0)
        if self.bare:
            return self
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 30
        while True:
            try:
                sock.connect(str(self.console_socket))
                break
            except OSError:
                if time.monotonic() > deadline:
                    sock.close()
                    raise DriverError(f"test guest {self.name}: its console socket never opened") from None
                time.sleep(0.02)
        self._sock = sock
        self._reader = threading.Thread(target=self._read_console, args=(sock.makefile("rb"),),
                                        name=f"console-{self.name}", daemon=True)
        self._reader.start()
        return self

    def alive(self) -> bool:
        if self.bare:
            return self._dom is not None
        return self._reader is not None and self._reader.is_alive()

    def _send(self, line: bytes) -> None:
        if self._sock is None or not self.alive():
            raise DriverError(f"test guest {self.name} is not running")
        self._sock.sendall(line)

    def stop(self, timeout: float = 10.0) -> None:
        """Destroy the domain (a transient one is gone with it) and close the console."""
        if self._dom is not None:
            try:
                self.domain().destroy()
            except libvirt.libvirtError as exc:
                if exc.get_error_code() not in (libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_ERR_OPERATION_INVALID):
                    raise
        if self._sock is not None:
            self._sock.close()
        if self._reader is not None:
            self._reader.join(timeout)
        if self._conn is not None:
            self._conn.close()
        self._dom = self._conn = self._sock = None
        self.console_socket.unlink(missing_ok=True)
