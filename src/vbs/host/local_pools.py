"""Local pools of a hypervisor node (semi-shared storage): volumes on the node's own disks.

A local pool is made by the storage agents' own backend drivers (found by name, as a storage node
finds them), so a local volume is created, grown and removed by the same code as a shared one. It
serves no other machine: its "export driver" refuses every export, and the host agent opens its
volumes by pool and volume id (``LocalConnection``), resolved here to the pool's own file.

Data crosses between shared and local storage through the storage node's export path only: a local
volume made from a snapshot is filled from an NBD export of that snapshot's data (``fill``), and a
snapshot of a local volume is copied into an NBD export of a shared volume (``copy_out``), each by
``qemu-img convert`` with its progress, opening the export with the same host connector a VM's disk
uses (NBD over TLS included).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from vbs import drivers
from vbs.config import HostAgentConfig, StorageAgentConfig
from vbs.connectors import connector_for
from vbs.connectors.base import QemuIds
from vbs.errors import DriverError, IncorrectState, NotFound
from vbs.pools.backend import Backend
from vbs.pools.exports import ExportSource
from vbs.wire.connection import Connection, FileConnection, HostIdentity, IscsiConnection
from vbs.wire.storage import ExportInfo, ItemStatus

__all__ = ["LocalPools", "NoExports", "CopyCredentials", "build_local_pools"]

log = logging.getLogger(__name__)

_PROGRESS_RE = re.compile(rb"\((\d{1,3})(?:\.\d+)?/100%\)")


class NoExports:
    """The export driver of a local pool: it serves no other machine, so every export is refused."""

    protocol = "none"

    @classmethod
    def from_config(cls, cfg: StorageAgentConfig, state_dir: Path) -> NoExports:
        return cls()

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None

    def check(self) -> None:
        return None

    def ensure_export(self, key: str, source: ExportSource, host: HostIdentity, *, read_only: bool = False
                      ) -> Connection:
        raise IncorrectState("a local pool serves its own host only; its volumes are not exported")

    def remove_export(self, key: str, host_name: str) -> None:
        return None

    def refresh_export(self, key: str, source: ExportSource, host_name: str) -> Connection:
        raise IncorrectState("a local pool serves its own host only; its volumes are not exported")

    def retire_exports(self, key: str, host_name: str) -> None:
        return None

    def is_exported(self, key: str) -> bool:
        return False

    def list_exports(self) -> list[ExportInfo]:
        return []


@runtime_checkable
class HasVolumePath(Protocol):
    """A backend whose volumes are files (or devices) on this machine: what a local pool needs."""

    def volume_path(self, volume_id: str) -> Path: ...


def build_local_pools(cfg: HostAgentConfig) -> dict[str, Backend]:
    """The local pools the host agent's config names, each made by the backend driver ``local_backend``."""
    if not cfg.local_pools:
        return {}
    backend_cls: Any = drivers.load("backend", cfg.local_backend)
    pools: dict[str, Backend] = {}
    for pool in cfg.local_pools:
        # The backend reads its pool as a storage node's config names it.
        view = StorageAgentConfig(node_name=cfg.node_name, pool_name=pool.name, pool_path=pool.path,
                                  backend=cfg.local_backend, options=cfg.options)
        backend = backend_cls.from_config(view, NoExports())
        if not isinstance(backend, Backend) or not isinstance(backend, HasVolumePath):
            raise DriverError(f"backend {cfg.local_backend!r} cannot make a local pool (its volumes are no files)")
        pools[pool.name] = backend
    return pools


@dataclass(frozen=True)
class CopyCredentials:
    """Where a copy's key files exist while ``qemu-img`` starts (a private directory), and the host's
    X.509 client credentials for NBD over TLS (None: such exports are refused)."""

    secrets_dir: Path
    x509_dir: Path | None = None


def _endpoint(conn: Connection | FileConnection, role: str, creds: CopyCredentials, keys: ExitStack
              ) -> tuple[list[str], str]:
    """The ``--object`` arguments and the ``json:`` image name ``qemu-img`` opens ``conn`` with: the
    same host connector a VM's disk uses (NBD with TLS, iSCSI with CHAP…). Key files stay until ``keys``
    closes; a secret that would have to go on the command line (an RBD key) is refused."""
    if isinstance(conn, IscsiConnection) and conn.tls is not None:
        raise IncorrectState("a local pool cannot copy over iSCSI through a TLS tunnel (yet)")
    blockdev = connector_for(conn).qemu_blockdev(conn, QemuIds(proto=role, secret=f"{role}-secret",
                                                               tls=f"{role}-tls"))
    objects: list[str] = []
    for obj in blockdev.objects:
        if obj.secret_props:
            raise IncorrectState(f"a local pool cannot copy over {conn.protocol}: its secret would be on a "
                                 "command line")
        objects += ["--object", json.dumps(keys.enter_context(obj.qmp_arguments(creds.secrets_dir, creds.x509_dir)))]
    return objects, "json:" + json.dumps({"driver": "raw", "file": dict(blockdev.options)})


@dataclass
class _Copy:
    """One ``qemu-img convert`` and how far it got."""

    proc: subprocess.Popen[bytes]
    progress: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def status(self) -> ItemStatus:
        if not self.done.is_set():
            return ItemStatus(state="copying", progress=self.progress)
        if self.error is not None:
            return ItemStatus(state="error", error=self.error)
        return ItemStatus(state="ready", progress=100)


def _start_convert(source: Connection | FileConnection, target: Connection | FileConnection,
                   creds: CopyCredentials) -> _Copy:
    keys = ExitStack()
    try:
        src_objects, src = _endpoint(source, "src", creds, keys)
        dst_objects, dst = _endpoint(target, "dst", creds, keys)
        # An argv, never a shell; -n: the target exists; --target-is-zero: it is new and empty (sparse).
        argv = ["qemu-img", "convert", "-p", "-n", "--target-is-zero", "-W", "-m", "4", *src_objects, *dst_objects,
                src, dst]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except BaseException:
        keys.close()
        raise
    copy = _Copy(proc)

    def follow() -> None:
        assert proc.stdout is not None and proc.stderr is not None
        tail = b""
        while chunk := os.read(proc.stdout.fileno(), 4096):
            found = _PROGRESS_RE.findall(tail + chunk)
            if found:
                copy.progress = min(99, int(found[-1]))
            tail = chunk[-32:]
        err = proc.stderr.read()
        if proc.wait() != 0:
            copy.error = f"qemu-img convert failed: {err.decode(errors='replace').strip()[-400:]}"
        keys.close()  # qemu-img read its key files when it started; they go now at the latest
        copy.done.set()

    threading.Thread(target=follow, name="local-copy", daemon=True).start()
    return copy


class LocalPools:
    """The host's local pools, and the copies between them and shared storage (keyed by volume or snapshot id)."""

    def __init__(self, backends: dict[str, Backend], creds: CopyCredentials) -> None:
        self.backends = backends
        self._creds = creds
        self._copies: dict[str, _Copy] = {}
        self._lock = threading.Lock()

    def pool(self, name: str) -> Backend:
        try:
            return self.backends[name]
        except KeyError:
            raise NotFound(f"no local pool named {name[:64]!r} on this host", code="InvalidPool.NotFound") from None

    def path_of(self, pool: str, volume_id: str) -> Path:
        backend = self.pool(pool)
        assert isinstance(backend, HasVolumePath)  # build_local_pools checked it
        return backend.volume_path(volume_id)

    def fill(self, pool: str, volume_id: str, source: Connection) -> ItemStatus:
        """Copy ``source`` into the (new, empty) local volume; answers progress, ready when done. Idempotent."""
        target = FileConnection(path=str(self.path_of(pool, volume_id)))
        return self._ensure(volume_id, lambda: _start_convert(source, target, self._creds))

    def copy_out(self, pool: str, volume_id: str, copy_id: str, target: Connection) -> ItemStatus:
        """Copy the local volume (not in use by a VM) into ``target`` (a new, empty shared volume)."""
        source = FileConnection(path=str(self.path_of(pool, volume_id)))
        return self._ensure(copy_id, lambda: _start_convert(source, target, self._creds))

    def _ensure(self, key: str, start: Any) -> ItemStatus:
        with self._lock:
            copy = self._copies.get(key)
            if copy is not None and copy.done.is_set() and copy.error is not None:
                # A failure is answered once, then forgotten: the caller sees why, and its next call
                # (a retry) starts the copy again. Restarting at once would hide the error forever.
                del self._copies[key]
                return copy.status()
            if copy is None:
                copy = self._copies[key] = start()
                log.info("copy %s started", key)
        return copy.status()

    def remove_copy(self, key: str) -> None:
        """Forget a finished copy; cancel one still running."""
        with self._lock:
            copy = self._copies.pop(key, None)
        if copy is not None and not copy.done.is_set():
            copy.proc.kill()
            copy.done.wait(30)

    def close(self) -> None:
        with self._lock:
            keys = list(self._copies)
        for key in keys:
            self.remove_copy(key)
        for backend in self.backends.values():
            backend.close()

