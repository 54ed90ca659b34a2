"""I/O threads of the libvirt driver's disks (``[host_agent.options.libvirt] iothreads``, on unless false).

As the qemu driver's (docs/drivers.md, "I/O threads"), each disk VBS attaches runs in an IOThread of its
own instead of QEMU's main loop: the domain gets the thread (``virDomainAddIOThread``) before the disk's
XML names it (``<driver iothread='N'>``), and loses it once no disk names it any more.

VBS's threads take ids from ``VBS_IOTHREAD_BASE`` up, far above the small ids a domain's own
``<iothreadids>`` use. That range is the mark: a thread of it that no disk of the domain names is a
leftover of VBS's (an attach that failed, or crashed, between the two calls; a disk a forced detach
left until the guest let go) and is taken for the next disk or deleted; a thread below it is never
touched. The live domain and, with ``--libvirt-persist``, its configuration are kept alike, each
against its own disks. Calls on one domain are serialised by the driver, so two attaches never pick
the same id.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import libvirt

__all__ = ["VBS_IOTHREAD_BASE", "thread_for_disk", "ensure_thread", "drop_unused_threads", "vbs_threads"]

# 0x5642_0000 ("VB"): libvirt's ids are unsigned 32-bit integers, a domain's own count from 1.
VBS_IOTHREAD_BASE = 0x5642_0000


def _scopes(config: bool) -> list[tuple[int, int]]:
    """(the flags of ioThreadInfo/addIOThread/delIOThread, the XMLDesc flags) per part of the domain."""
    scopes = [(int(libvirt.VIR_DOMAIN_AFFECT_LIVE), 0)]
    if config:
        scopes.append((int(libvirt.VIR_DOMAIN_AFFECT_CONFIG), int(libvirt.VIR_DOMAIN_XML_INACTIVE)))
    return scopes


def vbs_threads(dom: libvirt.virDomain, flags: int = 0) -> set[int]:
    """The ids of VBS's I/O threads of the domain (its live part, or with ``AFFECT_CONFIG`` its configuration)."""
    return {int(tid) for tid, _cpus in dom.ioThreadInfo(flags) if int(tid) >= VBS_IOTHREAD_BASE}


def _named_by_disks(dom: libvirt.virDomain, xml_flags: int) -> set[int]:
    named = set()
    for driver in ET.fromstring(dom.XMLDesc(xml_flags)).iterfind("devices/disk/driver"):
        value = driver.get("iothread", "")
        if value.isdigit():
            named.add(int(value))
    return named


def thread_for_disk(dom: libvirt.virDomain, *, config: bool) -> int:
    """The id of an I/O thread no disk names yet, in the live domain and with ``config`` in its
    configuration too: a leftover of VBS's if there is one, else a new thread (the lowest free id)."""
    named = set()
    for _flags, xml_flags in _scopes(config):
        named |= _named_by_disks(dom, xml_flags)
    tid = VBS_IOTHREAD_BASE + 1
    while tid in named:
        tid += 1
    for flags, _xml_flags in _scopes(config):
        if tid not in vbs_threads(dom, flags):
            dom.addIOThread(tid, flags)
    return tid


def ensure_thread(dom: libvirt.virDomain, tid: int, flags: int) -> None:
    """The thread ``tid`` exists in the part of the domain ``flags`` names (for a disk copied there)."""
    if tid >= VBS_IOTHREAD_BASE and tid not in vbs_threads(dom, flags):
        dom.addIOThread(tid, flags)


def drop_unused_threads(dom: libvirt.virDomain, *, config: bool) -> None:
    """Delete VBS's I/O threads that no disk names, in the live domain and with ``config`` in its configuration."""
    for flags, xml_flags in _scopes(config):
        for tid in sorted(vbs_threads(dom, flags) - _named_by_disks(dom, xml_flags)):
            dom.delIOThread(tid, flags)
