"""iSCSI exports through one userspace tgtd per storage agent: ``IscsiExportDriver`` (the driver
entry point) and ``parse_targets`` (tgtd's listing of targets, as tgtadm prints it, parsed)."""

from vbs.storage.exports.iscsi.driver import IscsiExportDriver
from vbs.storage.exports.iscsi.state import parse_targets

__all__ = ["IscsiExportDriver", "parse_targets"]
