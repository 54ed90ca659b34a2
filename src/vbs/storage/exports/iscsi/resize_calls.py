"""The iSCSI driver's online resize (``refresh_export`` and ``retire_exports``, hooks of
``SupervisedExportDriver``): a LUN of the grown size beside the one a host uses, then the old one
retired. A mixin of ``IscsiExportDriver``.

tgt reads a LUN's size when the LUN is made and never again (no tgtd parameter changes it; QEMU's
initiator re-reads the capacity on ``block_resize`` but gets the old one). So ``refresh_export`` adds
another LUN on the same target, backed by the same (grown) file: the host logs in to it next to its
current session (same ACL and CHAP account) and moves its disk over, then ``retire_exports`` deletes
the LUN it left. Each host's grant names the LUN it uses and the ones it may still be using; a LUN is
kept while any grant names it, so hosts of a multi-attached volume move independently and share the
newest LUN. Numbers are reused: a lone host alternates 1 and 2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from vbs.errors import DriverError
from vbs.wire.connection import Connection, IscsiConnection

from .control import TgtControl
from .state import Export, Grant
from .targets import Targets

log = logging.getLogger("vbs.storage.exports.iscsi.driver")  # the driver's records keep its name


class _Driver(Protocol):
    """What the calls use of the driver they are mixed into."""

    _tgt: TgtControl
    _targets: Targets

    def _connection(self, exp: Export, grant: Grant) -> IscsiConnection: ...

    def _desired_first(self, undo: Callable[[], None]) -> AbstractContextManager[None]: ...

    def _save(self) -> None: ...

    def _running(self) -> bool: ...


class ResizeCalls:
    """``_refresh`` and ``_retire`` of the iSCSI driver."""

    def _refresh(self: _Driver, item: Export, host_name: str, size: int) -> Connection:
        """A LUN of the key's target that reports the file's current (grown) size: the newest LUN
        if it does already (another host refreshed first), else a new one. The LUN the host uses
        now keeps serving until ``retire_exports``. Same target, ACL and CHAP account; the
        connection differs in its LUN only."""
        exp, grant = item, item.grants[host_name]
        if exp.rbd is not None:
            exp.image_size = size  # a LUN made from now on opens the grown image
        view = self._tgt.show()
        # What should exist must, first (tgtd may have restarted): a LUN made now has the file's size.
        self._targets.apply(exp, view)
        if exp.lun_sizes.get(grant.lun) == size:
            return self._connection(exp, grant)
        before = (exp.lun, grant.lun, list(grant.old_luns))
        if exp.lun_sizes.get(exp.lun) != size:
            exp.lun = self._targets.free_lun(exp, view)
        if grant.lun not in grant.old_luns:
            grant.old_luns.append(grant.lun)
        grant.lun = exp.lun

        def undo() -> None:
            exp.lun, grant.lun, grant.old_luns = before
            try:
                self._targets.apply(exp, self._tgt.show())  # drops a half-made LUN
            except DriverError as exc:
                log.error("could not roll back the refresh of %s: %s", exp.key, exc.message)

        with self._desired_first(undo):  # after a crash, check() makes the LUN
            self._targets.apply(exp, view)
        log.info("refreshed the iSCSI export of %s for %s: LUN %d serves %d bytes",
                 exp.key, host_name, grant.lun, exp.lun_sizes.get(grant.lun, 0))
        return self._connection(exp, grant)

    def _retire(self: _Driver, item: Export, host_name: str) -> None:
        """Forget the LUNs the host used before its refreshes and delete those no other host uses
        (a client still on one gets I/O errors)."""
        grant = item.grants[host_name]
        if grant.old_luns:
            retired, grant.old_luns = grant.old_luns, []
            self._save()
            log.info("retired LUN(s) %s of %s for %s", retired, item.key, host_name)
        if self._running():
            self._targets.apply(item, self._tgt.show())  # also finishes a retire a crash interrupted
