"""VMs that wait for space: QEMU pauses a VM whose write to a disk finds its storage full (a thin pool
that filled up), and this loop lets each one retry every few seconds, so that a guest runs on by itself
once an operator frees space in the pool (docs/operations.md "A full pool"). The guest sees no error: its
write waits while the VM is paused.
"""

from __future__ import annotations

import logging

from vbs.errors import VbsError
from vbs.host.hypervisors.base import SpaceWaitingDriver
from vbs.net.repeating import Repeating

__all__ = ["SpaceWaits", "RETRY_S"]

log = logging.getLogger(__name__)

# How often a VM paused for space retries its write: each retry on a pool still full costs one failed
# write and pauses the VM again at once.
RETRY_S = 3.0


class SpaceWaits(Repeating):
    """A round every ``interval_s`` (the first at start) in a background thread (vbs.net.repeating)."""

    def __init__(self, driver: SpaceWaitingDriver, interval_s: float = RETRY_S) -> None:
        super().__init__("space-waits")
        self.driver = driver
        self.interval_s = interval_s
        self._waiting: set[str] = set()

    def check(self) -> None:
        """One round: resume the VMs paused for space, and say which started or stopped waiting."""
        try:
            resumed = set(self.driver.resume_paused_for_space())
        except VbsError as exc:
            log.warning("VMs waiting for space: %s", exc.message)
            return
        for vm_id in sorted(resumed - self._waiting):
            log.warning("VM %s: paused by its hypervisor, a write to a VBS disk found its pool full; resuming it "
                        "every %g s until the write fits (free space in the pool)", vm_id, self.interval_s)
        for vm_id in sorted(self._waiting - resumed):
            log.warning("VM %s: runs again, its writes fit", vm_id)
        self._waiting = resumed

    def _run_once(self) -> float:
        self.check()
        return self.interval_s
