"""VMs paused for a crash-consistent snapshot set, and the guarantee that each runs again.

The controller pauses a VM, has every disk's storage node take its snapshot at that one instant, then
resumes it. Should the controller (or the network) fail in between, the VM must not stay paused: each
pause carries a hold, after which this agent resumes the VM by itself, and a marker file per paused VM
lets a restarted agent resume what its predecessor paused. A VM that was not running when asked (paused
by its operator) is never resumed by VBS.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from vbs.errors import VbsError
from vbs.host.hypervisors.base import PausingDriver
from vbs.system.files import write_private

log = logging.getLogger(__name__)


class Pauses:
    def __init__(self, driver: PausingDriver, state_dir: Path | None) -> None:
        self.driver = driver
        self.dir = state_dir / "pauses" if state_dir is not None else None
        self._timers: dict[str, threading.Timer] = {}
        self._lock = threading.Lock()

    def recover(self) -> None:
        """Resume every VM an earlier run of this agent paused (its controller's resume is lost)."""
        if self.dir is None or not self.dir.is_dir():
            return
        for marker in sorted(self.dir.iterdir()):
            try:
                self.driver.resume(marker.name)
                log.warning("VM %s: resumed; it was paused for a snapshot set when this agent stopped", marker.name)
                marker.unlink(missing_ok=True)
            except VbsError as exc:
                log.error("VM %s: could not resume it after a restart: %s", marker.name, exc.message)

    def pause(self, vm_id: str, hold_s: float) -> bool:
        """Pause ``vm_id`` for at most ``hold_s``; whether VBS paused it (a repeat renews the hold)."""
        with self._lock:
            ours = vm_id in self._timers
            if ours:
                self._timers.pop(vm_id).cancel()
            elif not self.driver.pause(vm_id):
                return False
            if self.dir is not None:
                self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_private(self.dir / vm_id, "paused for a snapshot set\n")
            timer = threading.Timer(hold_s, self._expire, (vm_id,))
            timer.daemon = True
            self._timers[vm_id] = timer
            timer.start()
            return True

    def resume(self, vm_id: str) -> None:
        """Resume ``vm_id`` if VBS paused it; otherwise nothing."""
        with self._lock:
            timer = self._timers.pop(vm_id, None)
            marker = self.dir / vm_id if self.dir is not None else None
            if timer is None and (marker is None or not marker.exists()):
                return
            if timer is not None:
                timer.cancel()
            self.driver.resume(vm_id)
            if marker is not None:
                marker.unlink(missing_ok=True)

    def _expire(self, vm_id: str) -> None:
        log.warning("VM %s: no one resumed it within its hold; resuming it", vm_id)
        try:
            self.resume(vm_id)
        except VbsError as exc:
            log.error("VM %s: could not resume it: %s", vm_id, exc.message)

    def close(self) -> None:
        """Resume every VM still paused (the agent is stopping)."""
        for vm_id in list(self._timers):
            try:
                self.resume(vm_id)
            except VbsError as exc:
                log.error("VM %s: could not resume it: %s", vm_id, exc.message)
