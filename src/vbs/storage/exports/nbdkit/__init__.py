"""NBD exports through one nbdkit process per (key, host): ``NbdkitExportDriver`` (the driver entry
point) and ``NBDKIT`` (the program's name)."""

from vbs.storage.exports.nbdkit.driver import NbdkitExportDriver
from vbs.storage.exports.nbdkit.process import NBDKIT

__all__ = ["NbdkitExportDriver", "NBDKIT"]
