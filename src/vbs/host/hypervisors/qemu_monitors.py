"""The VMs of a QEMU host and their monitors: ``<vm_id>.qmp`` sockets in one directory, one persistent QMP
connection per VM (QEMU serves one client per monitor), and one lock per VM that serialises the driver's calls.
"""

from __future__ import annotations

import logging
import re
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from vbs.errors import InvalidParameter, NotFound
from vbs.host.hypervisors.base import DiskStats
from vbs.host.hypervisors.qemu_blockdev import Vm, our_device
from vbs.qemu.qmp import QmpClient, QmpConnectionError, QmpError, QmpGone
from vbs.wire.host import VM_ID_RE, VmInfo

__all__ = ["QemuMonitors", "disk_stats", "PROBE_TIMEOUT"]

log = logging.getLogger(__name__)

_RUN_STATE_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
# Probing many sockets must not take qmp_timeout each when a monitor does not answer.
PROBE_TIMEOUT = 3.0
# Deciding whether a VM went during a call: a connect is refused at once when nothing listens.
_GONE_CHECK_TIMEOUT = 1.0
_PROBE_THREADS = 8

T = TypeVar("T")


class QemuMonitors:
    """The VMs whose QMP sockets are in ``vm_dir``, each monitor held by one persistent connection, made on
    first use and dropped when the VM is gone. Thread-safe; calls on one VM are serialised."""

    def __init__(self, vm_dir: Path, qmp_timeout: float) -> None:
        self.vm_dir = vm_dir
        self.qmp_timeout = qmp_timeout
        self._guard = threading.Lock()  # guards the three dicts below
        self._locks: dict[str, threading.Lock] = {}
        self._clients: dict[str, QmpClient] = {}
        self._last_seen: dict[str, VmInfo] = {}

    def vm_ids(self) -> list[str]:
        """The VMs whose QMP sockets are in the VM directory."""
        if not self.vm_dir.is_dir():
            return []
        return sorted(p.stem for p in self.vm_dir.glob("*.qmp") if VM_ID_RE.fullmatch(p.stem) and _is_socket(p))

    def list_vms(self) -> list[VmInfo]:
        vm_ids = self.vm_ids()
        with self._guard:
            vanished = [(v, c) for v, c in self._clients.items() if v not in vm_ids]
        for vm_id, client in vanished:  # a call busy with one finds out for itself
            if self._vm_lock(vm_id).acquire(blocking=False):
                try:
                    self._forget(vm_id, client)
                finally:
                    self._vm_lock(vm_id).release()
        # A VM this driver is busy with is not probed: report what was last seen rather than wait.
        free: list[str] = []
        busy: list[str] = []
        for vm_id in vm_ids:
            (free if self._vm_lock(vm_id).acquire(blocking=False) else busy).append(vm_id)
        try:
            if len(free) > 1:
                with ThreadPoolExecutor(min(_PROBE_THREADS, len(free)), thread_name_prefix="vbs-probe") as pool:
                    found = list(pool.map(self._probe, free))
            else:
                found = [self._probe(vm_id) for vm_id in free]
        finally:
            for vm_id in free:
                self._vm_lock(vm_id).release()
        probed = [vm for vm in found if vm is not None]
        with self._guard:
            self._last_seen.update((vm.vm_id, vm) for vm in probed)
            in_use = [self._last_seen.get(v, VmInfo(vm_id=v, name=v, running=True)) for v in busy]
        return sorted(probed + in_use, key=lambda vm: vm.vm_id)

    def block_stats(self) -> list[DiskStats]:
        found: list[DiskStats] = []
        limit = min(self.qmp_timeout, PROBE_TIMEOUT)
        for vm_id in self.vm_ids():
            lock = self._vm_lock(vm_id)
            if not lock.acquire(blocking=False):
                continue  # busy with an attach or a detach: left out of this scrape rather than waited for
            client = self._client(vm_id)
            try:
                client.connect(timeout=limit)
                found += disk_stats(vm_id, client.execute("query-blockstats", timeout=limit))
            except QmpGone:
                self._forget(vm_id, client)
            except QmpError as exc:
                log.warning("VM %s: block statistics: %s", vm_id, exc)
            finally:
                lock.release()
        return found

    def close(self) -> None:
        with self._guard:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _vm_lock(self, vm_id: str) -> threading.Lock:
        self._socket(vm_id)  # validates the id before it names anything
        with self._guard:
            return self._locks.setdefault(vm_id, threading.Lock())

    def _socket(self, vm_id: str) -> Path:
        if not isinstance(vm_id, str) or not VM_ID_RE.fullmatch(vm_id):
            raise InvalidParameter(f"invalid VM id {vm_id!r}")
        return self.vm_dir / f"{vm_id}.qmp"

    def _client(self, vm_id: str) -> QmpClient:
        with self._guard:
            client = self._clients.get(vm_id)
            if client is None:
                client = QmpClient(self._socket(vm_id), name=f"vbs-{vm_id}", connect_timeout=self.qmp_timeout,
                                   timeout=self.qmp_timeout)
                self._clients[vm_id] = client
            return client

    def _forget(self, vm_id: str, client: QmpClient) -> None:
        """Drop the connection of a VM that is gone (a new QEMU on that socket gets a new one)."""
        with self._guard:
            if self._clients.get(vm_id) is client:
                del self._clients[vm_id]
                self._last_seen.pop(vm_id, None)
        client.close()

    def on_vm(self, vm_id: str, call: Callable[[Vm], T]) -> T:
        """Run ``call`` on the VM's monitor, serialised with this driver's other calls on the VM.

        Raises ``QmpGone`` if no QEMU listens on the VM's socket, also when it went during the call.
        A VM that is there but does not answer raises ``QmpConnectionError`` (a ``DriverError``).
        """
        with self._vm_lock(vm_id):
            return self._call(vm_id, call)

    def on_idle_vm(self, vm_id: str, call: Callable[[Vm], T]) -> T | None:
        """``on_vm`` unless this driver is busy with the VM (an attach, a detach): then None at once."""
        lock = self._vm_lock(vm_id)
        if not lock.acquire(blocking=False):
            return None
        try:
            return self._call(vm_id, call)
        finally:
            lock.release()

    def _call(self, vm_id: str, call: Callable[[Vm], T]) -> T:
        client = self._client(vm_id)
        try:
            return call(Vm(vm_id, client))
        except QmpGone:
            self._forget(vm_id, client)
            raise
        except QmpConnectionError as exc:
            if self._went(client):
                self._forget(vm_id, client)
                raise QmpGone(f"VM {vm_id} went during the call: {exc}") from exc
            raise

    def on_present_vm(self, vm_id: str, call: Callable[[Vm], T]) -> T:
        """``on_vm`` for calls that need the VM: one that is gone is ``NotFound``."""
        try:
            return self.on_vm(vm_id, call)
        except QmpGone as exc:
            raise NotFound(f"VM {vm_id} not found (no QEMU behind {vm_id}.qmp)", code="InvalidInstanceID.NotFound",
                           vm_id=vm_id) from exc

    @staticmethod
    def _went(client: QmpClient) -> bool:
        try:
            client.connect(timeout=_GONE_CHECK_TIMEOUT)
        except QmpGone:
            return True
        except QmpError:
            return False  # there, but busy or hung
        return False

    def _probe(self, vm_id: str) -> VmInfo | None:
        client = self._client(vm_id)
        limit = min(self.qmp_timeout, PROBE_TIMEOUT)
        try:
            client.connect(timeout=limit)
            status = client.execute("query-status", timeout=limit)
            name = client.execute("query-name", timeout=limit).get("name") or vm_id
            return VmInfo(vm_id=vm_id, name=name, running=bool(status.get("running")),
                          status=_run_state(status.get("status")))
        except QmpGone:
            self._forget(vm_id, client)
            return None  # a stale socket left by a QEMU that is gone
        except QmpError as exc:
            # The process is there but its monitor does not answer us: list it, but not as running.
            log.warning("VM %s: %s", vm_id, exc)
            return VmInfo(vm_id=vm_id, name=vm_id, running=False)


def disk_stats(vm_id: str, blockstats: list[dict[str, Any]]) -> list[DiskStats]:
    """The VBS disks' counters in a ``query-blockstats`` answer (devices with our ids)."""
    found = []
    for entry in blockstats:
        match = our_device(entry.get("qdev", ""))
        stats = entry.get("stats")
        if match is None or not isinstance(stats, dict):
            continue
        found.append(DiskStats.of(vm_id, match.group(1), stats, times="_total_time_ns"))
    return found


def _run_state(status: object) -> str | None:
    return status if isinstance(status, str) and _RUN_STATE_RE.fullmatch(status) else None


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False
