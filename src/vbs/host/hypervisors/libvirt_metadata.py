"""The ids an external cloud wrote into a libvirt domain, for instance-id resolvers.

OpenStack Nova's libvirt driver gives every domain it defines a ``<metadata>`` element in its own
namespace (``<nova:instance xmlns:nova="http://openstack.org/xmlns/libvirt/nova/1.1">``) and the
domain the instance's UUID: so a domain carrying that element is the Nova instance of its UUID
(``nova:<uuid>``). Read only, with libvirt's own metadata call (no XML of the whole domain).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import libvirt

__all__ = ["NOVA_NS", "cloud_ids"]

NOVA_NS = "http://openstack.org/xmlns/libvirt/nova/1.1"


def cloud_ids(dom: libvirt.virDomain) -> dict[str, str]:
    """``{"nova": uuid}`` for a domain Nova defined; ``{}`` for any other."""
    try:
        text = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, NOVA_NS)
    except libvirt.libvirtError:
        return {}  # no element in that namespace
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return {}
    if root.tag not in ("instance", f"{{{NOVA_NS}}}instance"):
        return {}
    return {"nova": dom.UUIDString()}
