"""NBD exports through one qemu-storage-daemon per storage agent: ``NbdExportDriver`` (the driver
entry point), ``TlsMode`` (its session boundary) and ``QSD`` (the daemon's program name)."""

from vbs.storage.exports.nbd.daemon import QSD, TlsMode
from vbs.storage.exports.nbd.driver import NbdExportDriver

__all__ = ["NbdExportDriver", "TlsMode", "QSD"]
