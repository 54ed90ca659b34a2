"""Local paths for hypervisors that open only a file or a device (``xl`` ``phy:``, ``qm set``, a
``virsh attach-disk`` of a file): a volume's connection opened on the host and shown as a file.

Each opened volume gets its own qemu-storage-daemon on the host. The daemon opens the connection
exactly as a QEMU guest would — the same host connectors, so NBD over TLS (X.509 or PSK), iSCSI with
CHAP and RBD with cephx all work, and their secrets reach the daemon only through QMP and key files
that exist for a moment — and serves it through a FUSE export on a regular file: the path the
hypervisor gets. TLS to the storage node terminates here, on the host, as it does in a QEMU guest.
(``nbdfuse`` would do for plain NBD, but not for iSCSI, RBD or TLS-PSK; one mechanism serves all.)

The daemons outlive the host agent (their own session, a pidfile each): a restarted agent finds
what is open in its state directory and adopts the daemons by PID. A daemon that died leaves a
FUSE mount nobody serves ("Transport endpoint is not connected"); it is detached before the path is
opened again. Nothing secret is written to the state directory or put on an argv.

An encrypted volume (a LUKS container) is opened with its passphrase, given to the daemon as a QMP
``secret`` object (never a file or an argv): the node the path serves is then ``luks`` instead of
``raw``, and the path holds the plaintext, as a QEMU guest's disk does.

The FUSE export serves a ``raw`` node over the protocol node, so that a grown volume is shown in
place (``grow``): a second protocol node on the refreshed connection (the other generation of ids),
the raw node pointed at it with ``blockdev-reopen``, ``block_resize`` to the new size (the FUSE file
then reports it), the old node removed. A path opened before this layering answers that it must be
opened again.

A writable path's FUSE connection is limited to one background request at a time before the path is
handed out (``vbs.system.fuse_connections``): qemu-storage-daemon 7.2's FUSE export can otherwise store
another concurrent write's bytes for a write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from vbs.connectors import connector_for
from vbs.connectors.base import QemuIds, open_in_qemu
from vbs.connectors.tunnels import IscsiTunnels
from vbs.errors import DriverError, IncorrectState, InvalidParameter
from vbs.qemu.luks_nodes import LUKS_OPEN_TIMEOUT_S, qemu_luks_node, qemu_secret
from vbs.qemu.qmp import QmpClient, QmpError, connect_until
from vbs.qemu.tls import X509Files, qemu_x509_dir
from vbs.system.daemons import Daemon, DaemonSpec, argv0_is
from vbs.system.files import write_private
from vbs.system.fuse_connections import one_request_at_a_time
from vbs.system.mounts import detach_mount as _unmount
from vbs.system.mounts import is_mounted as _mounted
from vbs.system.socket_paths import socket_path
from vbs.wire.connection import AnyConnection

__all__ = ["LocalPaths", "LOCAL_PATH_KEY_RE", "STATE_SUBDIR"]

log = logging.getLogger(__name__)

LOCAL_PATH_KEY_RE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
# Where in a host agent's state directory the local paths are (the Kubernetes node plugin mounts it:
# docs/kubernetes.md "What the node pod runs").
STATE_SUBDIR = "local-paths"
_DAEMON = "qemu-storage-daemon"
_RAW = "vbs-raw"  # the node the FUSE export serves (raw, or luks), over the protocol node of the current generation
_LUKS_SECRET = "vbs-luks-secret"  # the passphrase of an encrypted volume's luks node
# Two generations of protocol node ids: a growth opens the other one before the current one goes.
_GENERATIONS = (QemuIds(proto="vbs-proto", secret="vbs-secret", tls="vbs-tls"),
                QemuIds(proto="vbs-proto-1", secret="vbs-secret-1", tls="vbs-tls-1"))


class _Opened:
    """One key's directory: its daemon's socket, pidfile and log, the path and what it opens."""

    def __init__(self, root: Path, key: str) -> None:
        self.dir = root / key
        self.path = self.dir / "disk"
        # In the key's directory when the path fits a unix socket (107 bytes), else under /run/vbs.
        self.socket = socket_path(self.dir, "qmp.sock")
        self.meta = self.dir / "opened.json"
        sock = str(self.socket)
        self.daemon = Daemon(DaemonSpec(
            name=f"{_DAEMON} for {key}",
            argv=(_DAEMON, "--chardev", f"socket,id=vbs-mon,path={sock},server=on,wait=off",
                  "--monitor", "chardev=vbs-mon"),
            pid_path=self.dir / "pid", log_path=self.dir / "daemon.log",
            owns=lambda pid: argv0_is(pid, _DAEMON, mentions=f"path={sock},"),
            stale_files=(self.socket,)))

    def fingerprint(self) -> str | None:
        return str(self.recorded().get("fingerprint")) if self.recorded() else None

    def recorded(self) -> dict[str, Any]:
        """What ``opened.json`` says (empty when there is none or it cannot be read)."""
        try:
            meta = json.loads(self.meta.read_text())
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) and "fingerprint" in meta else {}


class LocalPaths:
    """Volumes opened as local files, one qemu-storage-daemon each, keyed by the caller's ``key``."""

    def __init__(self, state_dir: Path, *, secrets_dir: Path, x509: X509Files | None = None,
                 timeout: float = 30.0) -> None:
        self.root = Path(state_dir)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        self.secrets_dir = Path(secrets_dir)
        self.x509_dir = qemu_x509_dir(x509, self.secrets_dir / "x509", "client") if x509 else None
        self.tunnels = IscsiTunnels(self.secrets_dir / "tunnels", x509)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._opened: dict[str, _Opened] = {}

    def open(self, key: str, connection: AnyConnection, *, read_only: bool = False,
             luks: SecretStr | None = None) -> Path:
        """The path that opens ``connection`` (the plaintext of a LUKS container with ``luks``, its
        passphrase). Idempotent: the same key and connection answer the same path from the running
        daemon; a key open on another connection (or mode) is closed and opened again on this one —
        the caller asks for a key only while nothing uses its path."""
        item = self._item(key)
        fingerprint = _fingerprint(connection, read_only, encrypted=luks is not None)
        with self._lock:
            if item.daemon.running() or item.daemon.adopt(same_config=True):
                if item.fingerprint() == fingerprint and _mounted(item.path):
                    if not read_only:  # also a path an earlier version opened without the limit
                        one_request_at_a_time(item.path)
                    return item.path
                log.info("local path %s: opened on another connection; opening it again", key)
                self._stop(item)
            self._start(item, connection, read_only, fingerprint, luks)
            return item.path

    def close(self, key: str) -> None:
        """Stop serving ``key``'s path (whatever still reads it gets errors); absent is success."""
        item = self._item(key)
        with self._lock:
            if item.daemon.running() or item.daemon.adopt(same_config=False):
                self._stop(item)
            _unmount(item.path)
            shutil.rmtree(item.dir, ignore_errors=True)
            if item.socket.parent != item.dir:
                item.socket.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    item.socket.parent.rmdir()  # the /run/vbs fallback of a long state path
            self._opened.pop(key, None)

    def close_all(self) -> None:
        """Close every key of the state directory: live daemons, and mounts a dead one left."""
        if self.root.is_dir():
            for entry in sorted(self.root.iterdir()):
                if entry.is_dir() and re.fullmatch(LOCAL_PATH_KEY_RE, entry.name):
                    self.close(entry.name)

    def opened(self) -> dict[str, Path]:
        """What is open now, also what an earlier agent opened (its daemons are adopted)."""
        found: dict[str, Path] = {}
        if not self.root.is_dir():
            return found
        with self._lock:
            for entry in sorted(self.root.iterdir()):
                if not re.fullmatch(LOCAL_PATH_KEY_RE, entry.name) or not entry.is_dir():
                    continue
                item = self._item(entry.name)
                if (item.daemon.running() or item.daemon.adopt(same_config=True)) and _mounted(item.path):
                    found[entry.name] = item.path
        return found

    def grow(self, key: str, connection: AnyConnection, size_bytes: int) -> Path:
        """Show ``key``'s path at ``size_bytes``, moved onto ``connection`` (the grown volume's refreshed
        connection) while it is in use; idempotent. ``IncorrectState`` when the path is not open, is
        read-only, or was opened before paths could grow."""
        item = self._item(key)
        with self._lock:
            if not (item.daemon.running() or item.daemon.adopt(same_config=True)) or not _mounted(item.path):
                raise IncorrectState(f"local path {key} is not open")
            meta = item.recorded()
            if meta.get("read_only"):
                raise IncorrectState(f"local path {key} is read-only: it cannot grow while open")
            if meta.get("luks"):
                raise IncorrectState(f"local path {key} is encrypted: it grows while it is not open")
            if "generation" not in meta:
                raise IncorrectState(f"local path {key} was opened before paths could grow: open it again")
            fingerprint = _fingerprint(connection, False)
            with QmpClient(item.socket, name="vbs-local-path", timeout=self.timeout) as qmp:
                self._move(qmp, meta, self.tunnels.local(connection), size_bytes,
                           moved=meta["fingerprint"] == fingerprint)
            write_private(item.meta, json.dumps({**meta, "fingerprint": fingerprint}) + "\n")
            return item.path

    def _move(self, qmp: QmpClient, meta: dict[str, Any], connection: AnyConnection, size_bytes: int, *,
              moved: bool) -> None:
        """The raw node moved to a protocol node on ``connection`` (unless it is on it: ``moved``) and
        resized; ``meta["generation"]`` updated to the node it is on."""
        def execute(command: str, args: dict[str, Any]) -> object:
            return qmp.execute(command, args)

        nodes = {n["node-name"]: n for n in _as_list(qmp.execute("query-named-block-nodes", {"flat": True}))}
        raw = nodes.get(_RAW)
        if raw is None:
            raise DriverError(f"the daemon has no node {_RAW}")
        # The generation the raw node is on: the one whose protocol node it reads (a node's "file" is its
        # child's filename; the exports' names differ). The record says it unless a crash came between the
        # reopen and the record.
        on = [n for n, ids in enumerate(_GENERATIONS) if ids.proto in nodes and nodes[ids.proto]["file"] == raw["file"]]
        meta["generation"] = on[0] if len(on) == 1 else int(meta["generation"]) % 2
        old = _GENERATIONS[meta["generation"]]
        if moved or (old.proto in nodes and connector_for(connection).qemu_node_opens(nodes[old.proto], connection)):
            if int(raw["image"]["virtual-size"]) != size_bytes:  # an interrupted growth: only the resize is missing
                execute("block_resize", {"node-name": _RAW, "size": size_bytes})
            return
        new = _GENERATIONS[(meta["generation"] + 1) % 2]
        if new.proto in nodes:  # of a growth that failed half-way, or the connection before the last growth
            execute("blockdev-del", {"node-name": new.proto})
        for obj in new.objects:
            with contextlib.suppress(QmpError):
                execute("object-del", {"id": obj})
        undo: list[Any] = []
        try:
            blockdev = connector_for(connection).qemu_blockdev(connection, new)
            open_in_qemu(execute, blockdev, new.proto, read_only=False, secrets_dir=self.secrets_dir,
                         x509_dir=self.x509_dir, undo=undo)
            execute("blockdev-reopen", {"options": [_raw_options(new.proto, False)]})
            undo.append(lambda: execute("blockdev-reopen", {"options": [_raw_options(old.proto, False)]}))
            # Exactly the new node's size: more is refused ("Cannot grow NBD nodes").
            execute("block_resize", {"node-name": _RAW, "size": size_bytes})
        except BaseException:
            for step in reversed(undo):
                with contextlib.suppress(QmpError, DriverError):
                    step()
            raise
        meta["generation"] = (int(meta["generation"]) + 1) % 2
        try:
            execute("blockdev-del", {"node-name": old.proto})
            for obj in old.objects:
                with contextlib.suppress(QmpError):
                    execute("object-del", {"id": obj})
        except QmpError as exc:  # the next growth removes it
            log.warning("local path: could not release the old connection: %s", exc)

    def size_of(self, key: str) -> int | None:
        item = self._item(key)
        try:
            return item.path.stat().st_size if _mounted(item.path) else None
        except OSError:
            return None

    def release(self) -> None:
        """Let go of the daemons without stopping them (the agent stops; the next one adopts them)."""
        with self._lock:
            for item in self._opened.values():
                item.daemon.forget()
            self._opened.clear()
        self.tunnels.close()

    # -- inside ------------------------------------------------------------------------------------

    def _item(self, key: str) -> _Opened:
        if not isinstance(key, str) or not re.fullmatch(LOCAL_PATH_KEY_RE, key):
            raise InvalidParameter(f"invalid local path key {str(key)[:70]!r}")
        item = self._opened.get(key)
        if item is None:
            item = self._opened.setdefault(key, _Opened(self.root, key))
        return item

    def _start(self, item: _Opened, connection: AnyConnection, read_only: bool, fingerprint: str,
               luks: SecretStr | None) -> None:
        _unmount(item.path)
        item.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        item.meta.unlink(missing_ok=True)
        client: list[QmpClient] = []

        def ready(deadline: float) -> None:
            try:
                client.append(connect_until(item.socket, deadline, alive=item.daemon.running,
                                            name="vbs-local-path", timeout=self.timeout))
            except QmpError as exc:
                raise DriverError(exc.message) from exc

        item.daemon.spawn(ready)
        qmp = client[0]
        try:
            self._export(qmp, item, self.tunnels.local(connection), read_only, luks)
            write_private(item.meta, json.dumps({"fingerprint": fingerprint, "read_only": read_only,
                                                 "generation": 0, "luks": luks is not None}) + "\n")
        except BaseException:
            qmp.close()
            self._stop(item)
            raise
        qmp.close()

    def _export(self, qmp: QmpClient, item: _Opened, connection: AnyConnection, read_only: bool,
                luks: SecretStr | None) -> None:
        def execute(command: str, args: dict[str, Any], timeout: float | None = None) -> object:
            return qmp.execute(command, args, timeout=timeout)

        ids = _GENERATIONS[0]
        blockdev = connector_for(connection).qemu_blockdev(connection, ids)
        undo: list[Any] = []
        open_in_qemu(execute, blockdev, ids.proto, read_only=read_only, secrets_dir=self.secrets_dir,
                     x509_dir=self.x509_dir, undo=undo)
        if luks is None:
            execute("blockdev-add", _raw_options(ids.proto, read_only))
        else:
            execute("object-add", qemu_secret(_LUKS_SECRET, luks))
            execute("blockdev-add", qemu_luks_node(_RAW, ids.proto, _LUKS_SECRET, read_only),
                    timeout=max(self.timeout, LUKS_OPEN_TIMEOUT_S))
        fd = os.open(item.path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        execute("block-export-add", {"type": "fuse", "id": "vbs-path", "node-name": _RAW,
                                     "mountpoint": str(item.path), "writable": not read_only,
                                     "allow-other": "on"})
        deadline = time.monotonic() + self.timeout
        while not _mounted(item.path):
            if time.monotonic() >= deadline:
                raise DriverError(f"the FUSE export at {item.path} did not appear")
            time.sleep(0.01)
        if not read_only:
            one_request_at_a_time(item.path)  # before anyone can write to it: vbs.system.fuse_connections

    def _stop(self, item: _Opened) -> None:
        def ask() -> bool:
            with QmpClient(item.socket, name="vbs-local-path", timeout=self.timeout) as qmp:
                try:
                    qmp.execute("block-export-del", {"id": "vbs-path"})
                except QmpError:
                    pass  # not exported (a start that failed half-way): quit anyway
                qmp.execute("quit")
            return True

        item.daemon.stop(ask, grace=self.timeout)
        _unmount(item.path)
        item.meta.unlink(missing_ok=True)


def _raw_options(proto: str, read_only: bool) -> dict[str, Any]:
    """Every option of the raw node (``blockdev-reopen`` resets the ones left out to their defaults)."""
    return {"driver": "raw", "node-name": _RAW, "file": proto, "read-only": read_only, "discard": "unmap"}


def _as_list(answer: object) -> list[dict[str, Any]]:
    if not isinstance(answer, list):
        raise DriverError("query-named-block-nodes did not answer a list")
    return [n for n in answer if isinstance(n, dict)]


def _fingerprint(connection: AnyConnection, read_only: bool, *, encrypted: bool = False) -> str:
    """What identifies a connection without holding its secrets: a digest of its JSON form (a
    one-way hash of fields that include a key, so the key cannot be read back from it)."""
    text = connection.model_dump_json() + ("ro" if read_only else "rw") + ("luks" if encrypted else "")
    return hashlib.sha256(text.encode()).hexdigest()
