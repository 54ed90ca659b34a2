"""NBD exports from one long-lived qemu-storage-daemon (QSD) per storage agent, driven over QMP.

Each (volume, host) attachment gets its own file + raw node and NBD export; TLS-PSK is optional.

Access control (measured on QEMU 7.2, the version installed here):

* The NBD server is one per daemon and answers ``NBD_OPT_LIST`` with every export, and QEMU has no
  per-export ACL. So a client that can open a session can list and open every export.
* Plain mode (``tls=False``): isolation is the network only. Bind ``listen_host`` to the storage
  network (or loopback). Export names are ``<volume_id>-<128-bit random token>`` per attachment:
  a host that asks for a name it was not given (a typo, a stale id, a re-created volume) fails
  rather than reaching the wrong volume. Any client that can reach the port can still list the names.
* TLS mode (``tls=True``): plaintext clients are refused before any option (``NBD_OPT_LIST``
  included). Each host gets its own PSK identity (its host name) and a 256-bit key. The key lives in
  ``<state_dir>/tls/keys.psk`` only while the host has at least one export here. GnuTLS reads that
  file at every handshake, so a host is admitted as soon as its key is written and refused for new
  sessions as soon as its last export is removed, with no restart. The traffic is encrypted.
  What TLS does not give: a host that holds a live key can list and open the exports of other
  hosts on this daemon. ``tls-authz`` does not close this gap. On 7.2 it checks only x509
  distinguished names and ignores the PSK identity: an ``authz-simple`` naming one identity still
  admitted another. And it is set once for the whole server, never per export. Strict per-host
  isolation would need one daemon (one NBD server, one port) per host.
So TLS-PSK is the mode for a storage network that untrusted machines can reach, and binding is
the mode for a dedicated or loopback network. Per-attachment export names are used in both.

Other choices: desired exports are kept in memory and in ``<state_dir>/exports.json`` (mode 0600),
keys only in ``keys.psk``. That way ``check()`` can rebuild a dead daemon, and a restarted agent can
adopt a running one, with the same names and keys, so connected clients just reconnect. Removal
uses ``block-export-del`` mode ``hard``. The controller removes an export only after the host
unplugged the disk. Any client still connected at that point (a forced detach) must be cut off,
or the volume could never be deleted.

Online resize (measured on QEMU 7.2): an NBD export's size is fixed when it is added, and a node
opened before the file grew keeps its old size (``block_resize`` on it is refused: the export's
BlockBackend does not share ``resize``; a second export on the same node has the old size too). So
``refresh_export`` opens the grown file again as a new node chain, exported under a new name: a new
*generation* of the (volume, host) export. The old generation keeps serving until the host moved
to the new one and ``retire_exports`` removes it. Every generation is in ``exports.json``; the one
with the highest number is current (what ``ensure_export`` returns). Two file nodes on one file in
one daemon are fine (no lock conflict: none of them takes ``resize``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from vbs import ids
from vbs.connection import HOST_NAME_RE, Connection, HostIdentity, NbdConnection
from vbs.errors import DriverError, IdempotentParameterMismatch, InvalidParameter, NotFound
from vbs.files import write_private
from vbs.processes import cmdline, pid_alive
from vbs.runtime import socket_path
from vbs.storage.exports.base import ExportInfo
from vbs.storage.exports.nodelay import force_nodelay
from vbs.storage.exports.qmp_sync import (
    QmpCommandError,
    QmpConnectionError,
    QmpError,
    QmpSync,
    wait_for_socket,
)

__all__ = ["NbdExportDriver"]

log = logging.getLogger(__name__)

QSD = "qemu-storage-daemon"
_ID_PREFIX = "vbs_"  # "_" never occurs in a volume id or a host name, so ids split back unambiguously
_STATE_VERSION = 1
_WILDCARDS = {"0.0.0.0", "::", ""}
_LISTEN_RE = re.compile(r"^[0-9a-fA-F.:]{2,45}$|^[a-z0-9][a-z0-9.-]{0,252}$")


@dataclass
class _Desired:
    volume_id: str
    host: str
    path: str
    read_only: bool
    name: str  # the NBD export name: the per-attachment secret-ish handle
    gen: int = 0  # generation: a refresh (online resize) adds the next one, retire drops older ones
    size: int | None = None  # bytes the export reported when the daemon last created it (None: unknown)

    @property
    def export_id(self) -> str:
        return _export_id(self.volume_id, self.host, self.gen)


def _export_id(volume_id: str, host: str, gen: int = 0) -> str:
    # Generation 0 keeps the id of the exports made before generations existed.
    base = f"{_ID_PREFIX}{volume_id}_{host}"
    return base if gen == 0 else f"{base}_{gen}"


def _parse_export_id(export_id: str) -> tuple[str, str, int] | None:
    """(volume id, host, generation) of one of our export ids, None for anyone else's."""
    if not export_id.startswith(_ID_PREFIX):
        return None
    parts = export_id[len(_ID_PREFIX):].split("_")
    if len(parts) == 2:
        return parts[0], parts[1], 0
    if len(parts) == 3 and parts[2].isdigit():
        return parts[0], parts[1], int(parts[2])
    return None


def _node_names(export_id: str) -> tuple[str, str]:
    # QEMU caps node names at 31 characters, too short for a volume id plus a 63-character host
    # name: a hash of the export id keeps them deterministic.
    h = hashlib.sha256(export_id.encode()).hexdigest()[:24]
    return f"vbsf{h}", f"vbsr{h}"


def _is_qsd_for(pid: int, qmp_path: Path) -> bool:
    """Whether ``pid`` is a live qemu-storage-daemon with our monitor socket (guards PID reuse)."""
    cmd = cmdline(pid)
    return pid_alive(pid) and bool(cmd) and Path(cmd[0]).name == QSD and str(qmp_path) in " ".join(cmd)


class NbdExportDriver:
    """Export driver for NBD through one qemu-storage-daemon; see the module docstring."""

    protocol = "nbd"

    def __init__(
        self,
        state_dir: Path,
        listen_host: str = "127.0.0.1",
        port: int = 10809,
        tls: bool = False,
        aio: str = "native",
        cache_direct: bool = True,
        *,
        advertise_host: str | None = None,
        qmp_timeout: float = 30.0,
        start_timeout: float = 15.0,
    ) -> None:
        if aio not in ("native", "threads", "io_uring"):
            raise InvalidParameter(f"aio must be native, threads or io_uring, not {aio!r}")
        if not 1 <= port <= 65535:
            raise InvalidParameter(f"port out of range: {port}")
        if aio == "native" and not cache_direct:
            # QEMU refuses aio=native without O_DIRECT; say so at configuration time.
            raise InvalidParameter("aio=native requires cache_direct=True")
        if not _LISTEN_RE.match(listen_host):
            raise InvalidParameter(f"invalid listen_host: {listen_host[:80]!r}")
        if "," in str(state_dir):
            # QEMU's option syntax would split the path there.
            raise InvalidParameter(f"state_dir must not contain a comma: {state_dir}")
        advertised = advertise_host or listen_host
        if advertised in _WILDCARDS:
            raise InvalidParameter("listen_host is a wildcard: set advertise_host to the address clients use")
        self.state_dir = Path(state_dir)
        self.listen_host = listen_host
        self.port = port
        self.tls = tls
        self.aio = aio
        self.cache_direct = cache_direct
        self.advertise_host = advertised
        self.qmp_timeout = qmp_timeout
        self.start_timeout = start_timeout

        self.qmp_path = socket_path(self.state_dir, "qsd.qmp")
        self.pid_path = self.state_dir / "qsd.pid"
        self.log_path = self.state_dir / "qsd.log"
        self.state_path = self.state_dir / "exports.json"
        self.tls_dir = self.state_dir / "tls"
        self.keys_path = self.tls_dir / "keys.psk"

        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._qmp: QmpSync | None = None
        self._desired: dict[tuple[str, str], _Desired] = {}  # the current generation of each pair
        self._older: dict[tuple[str, str], list[_Desired]] = {}  # generations waiting to be retired
        self._keys: dict[str, str] = {}  # host name -> hex PSK
        self._loaded = False

    # -- daemon lifecycle -------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """PID of the daemon this driver runs or adopted (None when stopped)."""
        return self._pid

    def _argv(self) -> list[str]:
        nbd = f"addr.type=inet,addr.host={self.listen_host},addr.port={self.port}"
        argv = [QSD, "--chardev", f"socket,path={self.qmp_path},server=on,wait=off,id=m",
                "--monitor", "chardev=m"]
        if self.tls:
            argv += ["--object", f"tls-creds-psk,id=tls0,endpoint=server,dir={self.tls_dir}"]
            nbd += ",tls-creds=tls0"
        argv += ["--nbd-server", nbd, "--pidfile", str(self.pid_path)]
        return argv

    def start(self) -> None:
        with self._lock:
            self._load_state()
            if self._running():
                return
            self._ensure_daemon()
            self._reconcile()

    def _ensure_daemon(self) -> None:
        if not self._adopt():
            self._spawn()
        self._set_nodelay()

    def _set_nodelay(self) -> None:
        """QEMU 7.2's NBD server leaves Nagle on, which stalls QEMU's NBD client: turn it off."""
        if self._pid is None:
            return
        try:
            force_nodelay(self._pid)
        except OSError as exc:
            log.warning("could not set TCP_NODELAY on qemu-storage-daemon %d (%s): small random I/O "
                        "through QEMU's NBD client will be slow", self._pid, exc.strerror or exc)

    def _running(self) -> bool:
        if self._pid is None:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        return pid_alive(self._pid)

    def _adopt(self) -> bool:
        """Take over a daemon left by an earlier agent, if it is ours, alive and configured alike."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return False
        if not _is_qsd_for(pid, self.qmp_path):
            return False  # dead, or the PID was reused by another process: never signal it
        if cmdline(pid)[1:] != self._argv()[1:]:
            # Configuration changed (port, bind address, TLS): replace the daemon. Its exports come
            # back on the new one from the desired state.
            log.warning("qemu-storage-daemon %d runs with another configuration: restarting it", pid)
            self._pid = pid
            self._terminate(grace=0.0)
            return False
        qmp = QmpSync(self.qmp_path, name="vbs-nbd")
        try:
            qmp.execute("query-version", timeout=self.qmp_timeout)
        except QmpError as exc:
            qmp.close()
            # The monitor takes one client at a time: most likely another agent still drives this
            # daemon. Killing it would cut every attached host, so an operator decides.
            raise DriverError(
                f"{QSD} pid {pid} is alive but its monitor does not answer ({exc.message}); "
                "is another storage agent using it? Stop that agent or the daemon, then retry"
            ) from exc
        self._pid, self._qmp, self._proc = pid, qmp, None
        log.info("adopted qemu-storage-daemon pid %d", pid)
        return True

    def _spawn(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.tls:
            self.tls_dir.mkdir(exist_ok=True, mode=0o700)
            self._write_keys()  # QSD refuses to start without the keys file
        for stale in (self.qmp_path, self.pid_path):
            stale.unlink(missing_ok=True)
        argv = self._argv()
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        logf = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed just below
        try:
            # A new session: the daemon outlives the agent (it is adopted on restart) and does not
            # get the agent's terminal signals.
            proc = subprocess.Popen(  # noqa: S603 - argv list, no shell
                argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True
            )
        except FileNotFoundError as exc:
            raise DriverError(f"{QSD}: not installed") from exc
        finally:
            logf.close()
        self._proc, self._pid = proc, proc.pid
        deadline = time.monotonic() + self.start_timeout
        up = wait_for_socket(self.qmp_path, deadline, alive=lambda: proc.poll() is None)
        qmp = QmpSync(self.qmp_path, name="vbs-nbd")
        try:
            if not up:
                raise QmpConnectionError("monitor socket did not appear")
            qmp.execute("query-version", timeout=max(1.0, deadline - time.monotonic()))
        except QmpError as exc:
            qmp.close()
            self._terminate(grace=0.0)
            raise DriverError(f"{QSD} did not start: {self._log_tail(log_start)} ({exc.message})") from exc
        self._qmp = qmp
        log.info("started qemu-storage-daemon pid %d on %s:%d (tls=%s)",
                 proc.pid, self.listen_host, self.port, self.tls)

    def _log_tail(self, start: int) -> str:
        """What the daemon wrote since ``start``: its own reason for failing to start."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return "(no log)"
        return text[-500:] or "(no output)"

    def stop(self) -> None:
        """Stop the daemon (QMP ``quit``, then signals by PID). The desired exports are kept:
        ``start()`` brings them back."""
        with self._lock:
            if self._pid is None:
                self._adopt_for_stop()
            if self._pid is None:
                return
            quit_sent = False
            if self._running():
                if self._qmp is None:  # a daemon found by its pidfile: talk to it for a clean quit
                    self._qmp = QmpSync(self.qmp_path, name="vbs-nbd")
                try:
                    self._qmp.execute("quit", timeout=5.0)
                    quit_sent = True
                except QmpError as exc:
                    log.info("QMP quit: %s", exc)
            # After a quit, give it time to close its exports; otherwise go straight to SIGTERM.
            self._terminate(grace=10.0 if quit_sent else 0.0)

    def close(self) -> None:
        """Let go of the daemon without stopping it: the exports keep serving and the next agent
        adopts the daemon. For an agent restart or upgrade."""
        with self._lock:
            if self._qmp is not None:
                self._qmp.close()
            self._qmp, self._proc, self._pid = None, None, None

    def _adopt_for_stop(self) -> None:
        # stop() on a fresh driver object must still stop the daemon a previous agent left.
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return
        if _is_qsd_for(pid, self.qmp_path):
            self._pid = pid

    def _terminate(self, grace: float = 10.0) -> None:
        """Make sure the daemon is gone: wait for it, SIGTERM, then SIGKILL, always by PID."""
        pid, proc = self._pid, self._proc
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None
        if pid is not None:
            for sig, wait in ((None, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if proc is None and not _is_qsd_for(pid, self.qmp_path):
                    break  # an adopted daemon that is gone: its PID may belong to someone else now
                if sig is not None:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                if self._wait_exit(pid, proc, wait):
                    break
            else:
                raise DriverError(f"{QSD} pid {pid} survived SIGKILL")
        self._pid, self._proc = None, None
        for leftover in (self.qmp_path, self.pid_path):
            leftover.unlink(missing_ok=True)

    @staticmethod
    def _wait_exit(pid: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            gone = proc.poll() is not None if proc is not None else not pid_alive(pid)
            if gone:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def check(self) -> None:
        """Restart a dead or hung daemon and re-create every export that should exist."""
        with self._lock:
            self._load_state()
            healthy = self._running() and self._qmp is not None
            if healthy:
                try:
                    self._q("query-version")
                except QmpError as exc:
                    log.warning("qemu-storage-daemon pid %s does not answer (%s): restarting it",
                                self._pid, exc)
                    healthy = False
            if not healthy:
                if self._pid is not None:
                    log.warning("qemu-storage-daemon pid %s is gone: restarting, %d exports to restore",
                                self._pid, len(self._desired))
                    self._terminate(grace=0.0)
                self._ensure_daemon()
            self._reconcile()

    # -- QMP helpers -----------------------------------------------------------------------------

    def _q(self, command: str, args: dict[str, Any] | None = None) -> Any:
        if self._qmp is None:
            raise DriverError(f"{QSD} is not running")
        return self._qmp.execute(command, args, timeout=self.qmp_timeout)

    def _live_exports(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in self._q("query-block-exports")}

    def _live_nodes(self) -> set[str]:
        return {n["node-name"] for n in self._q("query-named-block-nodes", {"flat": True})}

    def _file_attempts(self) -> list[tuple[bool, str]]:
        attempts = [(self.cache_direct, self.aio)]
        if self.aio != "threads":
            attempts.append((self.cache_direct, "threads"))
        if self.cache_direct:
            attempts.append((False, "threads"))  # a filesystem without O_DIRECT (tmpfs)
        return attempts

    def _add_nodes(self, d: _Desired) -> None:
        fnode, rnode = _node_names(d.export_id)
        err: QmpCommandError | None = None
        for direct, aio in self._file_attempts():
            try:
                self._q("blockdev-add", {
                    "driver": "file", "node-name": fnode, "filename": d.path,
                    "cache": {"direct": direct}, "aio": aio, "read-only": d.read_only,
                    "discard": "unmap",  # guest TRIM punches holes: files stay thin
                })
            except QmpCommandError as exc:
                err = err or exc
                log.info("%s: file node with cache.direct=%s aio=%s refused: %s",
                         d.volume_id, direct, aio, exc.desc)
                continue
            if (direct, aio) != (self.cache_direct, self.aio):
                log.warning("%s: serving with cache.direct=%s aio=%s (configured mode refused)",
                            d.volume_id, direct, aio)
            break
        else:
            assert err is not None
            raise DriverError(f"cannot open {d.path} for {d.volume_id}: {err.desc}") from err
        try:
            self._q("blockdev-add", {"driver": "raw", "node-name": rnode, "file": fnode,
                                     "read-only": d.read_only, "discard": "unmap"})
        except QmpError:
            self._del_nodes(d.export_id, {fnode})
            raise

    def _del_nodes(self, export_id: str, present: set[str] | None = None) -> None:
        live = self._live_nodes() if present is None else present
        for node in reversed(_node_names(export_id)):  # raw first: it holds the file node
            if node in live:
                self._q("blockdev-del", {"node-name": node})

    def _create(self, d: _Desired, live: dict[str, dict[str, Any]], *, replace: bool = False) -> bool:
        """Create the nodes and export of ``d`` in the daemon unless it is already there.

        ``replace``: an export with this id that the daemon has is not ``d`` (its name was lost with
        the state file), so it is replaced rather than trusted. Returns whether ``d.size`` changed
        (the caller saves the state).
        """
        if d.export_id in live:
            if not replace and not live[d.export_id].get("shutting-down"):
                return False
            self._remove_live(d.export_id)
        self._del_nodes(d.export_id)  # leftovers of an interrupted attempt
        self._add_nodes(d)
        try:
            self._q("block-export-add", {
                "type": "nbd", "id": d.export_id, "node-name": _node_names(d.export_id)[1],
                "name": d.name, "writable": not d.read_only,
            })
        except QmpError:
            self._del_nodes(d.export_id)
            raise
        # The export serves the size its node had when it was opened, for good: note it, as a refresh
        # compares it with the file's.
        size = self._node_size(_node_names(d.export_id)[1])
        changed = size != d.size
        d.size = size
        return changed

    def _node_size(self, node: str) -> int | None:
        for n in self._q("query-named-block-nodes", {"flat": True}):
            if n["node-name"] == node:
                return int(n["image"]["virtual-size"])
        return None

    def _wait_export_gone(self, export_id: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while export_id in self._live_exports():
            if time.monotonic() >= deadline:
                raise DriverError(f"export {export_id} still shutting down after {timeout:g}s")
            time.sleep(0.05)

    def _reconcile(self) -> None:
        """Create in the daemon every desired export it lacks (after a restart or adoption).

        Older generations too: their host may not have moved to the current one yet.
        """
        live = self._live_exports()
        failed: list[str] = []
        changed = False
        for d in self._all_desired():
            try:
                changed = self._create(d, live) or changed
            except DriverError as exc:
                # One missing volume file must not keep every other host from its disk.
                log.error("re-creating export of %s for %s failed: %s", d.volume_id, d.host, exc.message)
                failed.append(f"{d.volume_id}@{d.host}" + (f"#{d.gen}" if d.gen else ""))
        if changed:
            self._save_state()
        if failed:
            raise DriverError(f"could not re-create {len(failed)} exports: {', '.join(failed)}")

    # -- desired state -----------------------------------------------------------------------------

    def _load_state(self) -> None:
        if self._loaded:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            data = json.loads(self.state_path.read_text())
            items = data["exports"] if data.get("version") == _STATE_VERSION else []
            generations: dict[tuple[str, str], list[_Desired]] = {}
            for item in items:
                d = _Desired(**item)
                generations.setdefault((d.volume_id, d.host), []).append(d)
            for k, gens in generations.items():
                gens.sort(key=lambda x: x.gen)
                self._desired[k] = gens[-1]
                if gens[:-1]:
                    self._older[k] = gens[:-1]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DriverError(f"unreadable export state {self.state_path}: {exc}") from exc
        self._keys = self._read_keys() if self.tls else {}
        hosts = {d.host for d in self._desired.values()}
        if set(self._keys) - hosts:
            # A crash between removing a host's last export and dropping its key: drop it now.
            self._keys = {h: k for h, k in self._keys.items() if h in hosts}
            self._write_keys()
        self._loaded = True

    def _all_desired(self) -> list[_Desired]:
        """Every generation of every export that should exist, older ones first."""
        return [d for k, cur in self._desired.items() for d in (*self._older.get(k, ()), cur)]

    def _save_state(self) -> None:
        data = {"version": _STATE_VERSION, "exports": [asdict(d) for d in self._all_desired()]}
        write_private(self.state_path, json.dumps(data, indent=1) + "\n")

    def _read_keys(self) -> dict[str, str]:
        keys: dict[str, str] = {}
        try:
            text = self.keys_path.read_text()
        except FileNotFoundError:
            return keys
        for line in text.splitlines():
            ident, sep, key = line.strip().partition(":")
            if sep and ident and key:
                keys[ident] = key
        return keys

    def _write_keys(self) -> None:
        # The GnuTLS password-file format that psktool writes: "identity:hexkey" per line.
        self.tls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(self.keys_path, "".join(f"{h}:{k}\n" for h, k in sorted(self._keys.items())))


    # -- the contract ------------------------------------------------------------------------------

    def _connection(self, d: _Desired) -> NbdConnection:
        key = self._keys.get(d.host) if self.tls else None
        return NbdConnection(
            host=self.advertise_host, port=self.port, export=d.name,
            tls_psk_identity=d.host if key else None,
            tls_psk_key=SecretStr(key) if key else None,
        )

    def ensure_export(
        self, volume_id: str, path: Path, host: HostIdentity, *, read_only: bool = False
    ) -> Connection:
        ids.check("volume", volume_id)
        path = Path(path)
        if not path.is_absolute():
            raise InvalidParameter(f"volume path must be absolute: {path}")
        if not path.exists():
            raise NotFound(f"volume file {path} of {volume_id} does not exist", code="InvalidVolume.NotFound")
        with self._lock:
            self._load_state()
            k = (volume_id, host.name)
            d = self._desired.get(k)
            new = d is None
            if d is None:
                d = _Desired(volume_id=volume_id, host=host.name, path=str(path), read_only=read_only,
                             name=f"{volume_id}-{secrets.token_hex(16)}")
            elif d.path != str(path) or d.read_only != read_only:
                raise IdempotentParameterMismatch(
                    f"{volume_id} is already exported to {host.name} "
                    f"(read_only={d.read_only}); remove that export first")
            new_key = self.tls and host.name not in self._keys
            if new_key:
                self._keys[host.name] = secrets.token_hex(32)
            # Desired state first: a crash after this point leaves an export that check() or the
            # next start() re-creates, never one the agent does not know about.
            self._desired[k] = d
            try:
                self._save_state()
                if new_key:
                    self._write_keys()
                started = not self._running()
                if started:
                    self._ensure_daemon()
                if self._create(d, self._live_exports(), replace=new):
                    self._save_state()
                if started:
                    try:
                        self._reconcile()
                    except DriverError:
                        pass  # logged per export; other volumes' trouble is not this caller's
            except Exception:
                if new:
                    self._desired.pop(k, None)
                    if new_key:
                        self._keys.pop(host.name, None)
                    self._best_effort_forget(new_key)
                raise
            log.info("exported %s to %s as NBD export (tls=%s)", volume_id, host.name, self.tls)
            return self._connection(d)

    def _best_effort_forget(self, keys_changed: bool) -> None:
        try:
            self._save_state()
            if keys_changed:
                self._write_keys()
        except OSError as exc:
            log.error("could not roll back export state: %s", exc)

    def remove_export(self, volume_id: str, host_name: str) -> None:
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name: {host_name[:80]!r}")
        with self._lock:
            self._load_state()
            k = (volume_id, host_name)
            d = self._desired.get(k)
            if self._running() and self._qmp is not None:
                # Every generation, also one the state file lost: none must outlive the attachment.
                ours = {x.export_id for x in self._older.get(k, ())} | self._live_ids_of(k)
                ours.add(d.export_id if d is not None else _export_id(volume_id, host_name))
                for export_id in sorted(ours):
                    self._remove_live(export_id)
            if d is not None or k in self._older:
                self._desired.pop(k, None)
                self._older.pop(k, None)
                self._save_state()
            if self.tls and host_name in self._keys and not any(
                x.host == host_name for x in self._desired.values()
            ):
                # The host's last export here: its key goes, so it cannot even open a TLS session.
                del self._keys[host_name]
                self._write_keys()
            log.info("removed NBD export of %s for %s", volume_id, host_name)

    def _live_ids_of(self, k: tuple[str, str]) -> set[str]:
        """Ids of every generation of the (volume, host) export ``k`` that the daemon has."""
        return {e for e in self._live_exports() if (p := _parse_export_id(e)) is not None and p[:2] == k}

    def _remove_live(self, export_id: str) -> None:
        qmp = self._qmp
        assert qmp is not None
        live = self._live_exports()
        if export_id in live:
            mark = qmp.event_mark()
            try:
                # hard: a client still connected (forced detach) is cut off instead of pinning it.
                self._q("block-export-del", {"id": export_id, "mode": "hard"})
            except QmpCommandError as exc:
                if "not found" not in exc.desc:  # raced with its own shutdown: fine
                    raise
            try:
                qmp.wait_event("BLOCK_EXPORT_DELETED", lambda e: e.get("data", {}).get("id") == export_id,
                               since=mark, timeout=self.qmp_timeout)
            except QmpConnectionError:
                self._wait_export_gone(export_id)  # event lost (reconnect): the daemon's state decides
        self._del_nodes(export_id)

    def list_exports(self) -> list[ExportInfo]:
        with self._lock:
            self._load_state()
            if not self._running() or self._qmp is None:
                return []
            # One entry per (volume, host), as the contract has it: while a refresh is pending the
            # daemon serves two generations of a pair, reported as the newest one it has.
            newest: dict[tuple[str, str], int] = {}
            for export_id in self._live_exports():
                parsed = _parse_export_id(export_id)
                if parsed is None:
                    continue  # not ours (an operator's manual export): not reported
                volume_id, host, gen = parsed
                newest[(volume_id, host)] = max(gen, newest.get((volume_id, host), -1))
            names = {(d.volume_id, d.host, d.gen): d.name for d in self._all_desired()}
            return [ExportInfo(volume_id=v, host=h, protocol=self.protocol, target=names.get((v, h, g), ""))
                    for (v, h), g in sorted(newest.items())]

    # -- online resize ---------------------------------------------------------------------------

    def refresh_export(self, volume_id: str, path: Path, host_name: str) -> Connection:
        """A new generation of the export of ``volume_id`` to ``host_name`` that serves the file's
        current (grown) size, under a new name; the older one keeps serving until retired.

        Idempotent: when the current generation already serves the file's size (a repeated call, or
        an export made after the file grew), it is returned as it is.
        """
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name: {host_name[:80]!r}")
        path = Path(path)
        with self._lock:
            self._load_state()
            k = (volume_id, host_name)
            cur = self._desired.get(k)
            if cur is None:
                raise NotFound(f"{volume_id} is not exported to {host_name}", code="InvalidAttachment.NotFound")
            if cur.path != str(path):
                raise IdempotentParameterMismatch(f"{volume_id} is exported to {host_name} from {cur.path}, not {path}")
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise NotFound(f"volume file {path} of {volume_id} does not exist",
                               code="InvalidVolume.NotFound") from None
            if not self._running():
                self._ensure_daemon()
                try:
                    self._reconcile()
                except DriverError:
                    pass  # logged per export; this one is created (or its error raised) just below
            live = self._live_exports()
            # The current generation must serve meanwhile. If the daemon had lost it (restarted before
            # check()), it comes back with the file's size: then it is the refreshed export already.
            if self._create(cur, live):
                self._save_state()
            if cur.size == size:
                return self._connection(cur)
            new = _Desired(volume_id=volume_id, host=host_name, path=cur.path, read_only=cur.read_only,
                           name=f"{volume_id}-{secrets.token_hex(16)}", gen=cur.gen + 1)
            # Desired state first, as in ensure_export: a crash from here on leaves both generations,
            # which the next start() or check() re-creates and retire_exports() cleans up.
            self._desired[k] = new
            self._older.setdefault(k, []).append(cur)
            try:
                self._save_state()
                self._create(new, live, replace=True)
                self._save_state()  # with its size
            except Exception:
                self._desired[k] = self._older[k].pop()
                if not self._older[k]:
                    del self._older[k]
                self._best_effort_forget(False)
                if self._qmp is not None:
                    try:
                        self._remove_live(new.export_id)
                    except DriverError as exc:
                        log.error("could not remove the half-made export %s: %s", new.export_id, exc.message)
                raise
            log.info("refreshed the NBD export of %s for %s: generation %d serves %d bytes",
                     volume_id, host_name, new.gen, new.size or 0)
            return self._connection(new)

    def retire_exports(self, volume_id: str, host_name: str) -> None:
        """Remove the older generations of the export of ``volume_id`` to ``host_name``, once the
        host uses the current one (their clients are cut off). Idempotent: none is success."""
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name: {host_name[:80]!r}")
        with self._lock:
            self._load_state()
            k = (volume_id, host_name)
            cur = self._desired.get(k)
            older = list(self._older.get(k, ()))
            if cur is not None and self._running() and self._qmp is not None:
                # Also generations the state file lost; never the current one.
                going = {d.export_id for d in older} | self._live_ids_of(k)
                going.discard(cur.export_id)
                for export_id in sorted(going):
                    self._remove_live(export_id)
            if older:
                del self._older[k]
                self._save_state()
                log.info("retired %d older NBD export(s) of %s for %s", len(older), volume_id, host_name)
