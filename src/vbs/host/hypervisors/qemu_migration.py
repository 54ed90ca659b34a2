"""Live migration with QEMU's own ``migrate``: what each side of one does, read from the VM's state.

The destination is a QEMU the orchestrator started with ``-incoming defer`` (same machine, same VM id,
its monitor in the destination agent's VM directory): ``query-status`` says ``inmigrate``. VBS plugs
the disks into it first (in the source's PCI slots), then ``listen`` has it wait for the stream on an
ephemeral port of the host's address (``migrate-incoming tcp:ADDR:0``; ``query-migrate`` tells the
port), and ``send`` has the source stream to it. Every call answers the VM's side as it is now
(``MigrationInfo``), so repeating one after a crash changes nothing: a destination already listening
is not asked again, a source already migrating (or migrated: ``postmigrate``) is not sent twice.

Hosts with X.509 credentials (``tls_cert``/``tls_key``/``tls_ca``) migrate over TLS only: the
destination takes the stream from a peer whose certificate chains to the CA (``verify-peer``), the
source checks the destination's certificate against the address it dials. Without them the stream
is plain TCP (an insecure install: anyone reaching the port first could feed the destination).

``cancel`` stops a source's migration that has not completed. A source whose migration completed
is resumed only when asked (the controller asks when the destination did not take the guest over:
it died). ``cont`` on a ``postmigrate`` source whose destination runs would run the guest twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vbs.errors import IncorrectState, InvalidParameter
from vbs.qemu.qmp import QmpCommandError
from vbs.wire.host import MIGRATION_ACTIVE_STATES, MigrationInfo, StartMigration

MIB = 1024 * 1024

__all__ = ["migration_info", "listen", "send", "cancel", "checked_mibps", "ACTIVE_STATES", "TLS_ID",
           "MAX_MIGRATION_MIBPS"]

Command = Callable[..., Any]

ACTIVE_STATES = MIGRATION_ACTIVE_STATES
_CANCEL_WAIT_S = 10.0
# The tls-creds-x509 object a migrating VM's stream uses (server on a destination, client on a source).
TLS_ID = "vbs-migration-tls"


def migration_info(cmd: Command, vm_id: str) -> MigrationInfo:
    status = str(cmd("query-status").get("status", "unknown"))
    found = cmd("query-migrate")
    ram = found.get("ram") or {}
    uri = None
    for address in found.get("socket-address") or []:
        if address.get("type") == "inet":
            host = str(address["host"])
            uri = f"tcp:{'[' + host + ']' if ':' in host else host}:{address['port']}"
            break
    return MigrationInfo(vm_id=vm_id, status=status, state=found.get("status"), uri=uri,
                         transferred_bytes=int(ram.get("transferred", 0)), remaining_bytes=int(ram.get("remaining", 0)),
                         total_bytes=int(ram.get("total", 0)), total_time_ms=_ms(found.get("total-time")),
                         downtime_ms=_ms(found.get("downtime")),
                         error=str(found["error-desc"])[:2000] if found.get("error-desc") else None)


def _use_tls(cmd: Command, x509_dir: Path | None, endpoint: str, hostname: str | None = None) -> None:
    """Make the stream TLS with this host's credentials in ``x509_dir`` (None: plain TCP)."""
    if x509_dir is None:
        return
    objects = {c["name"] for c in cmd("qom-list", {"path": "/objects"}) if c["type"].startswith("child<")}
    if TLS_ID not in objects:
        cmd("object-add", {"qom-type": "tls-creds-x509", "id": TLS_ID, "dir": str(x509_dir), "endpoint": endpoint,
                           "verify-peer": True})
    cmd("migrate-set-parameters", {"tls-creds": TLS_ID, **({"tls-hostname": hostname} if hostname else {})})


def _ms(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def listen(cmd: Command, vm_id: str, address: str, x509_dir: Path | None = None) -> MigrationInfo:
    """Have a destination VM wait for the migration stream on an ephemeral port of ``address`` (over TLS
    with the server credentials in ``x509_dir``)."""
    info = migration_info(cmd, vm_id)
    if info.status != "inmigrate":
        raise IncorrectState(f"VM {vm_id} is {info.status}, not waiting for an incoming migration "
                             "(start its QEMU with -incoming defer)")
    if info.uri is None:
        _use_tls(cmd, x509_dir, "server")
        host = f"[{address}]" if ":" in address else address
        cmd("migrate-incoming", {"uri": f"tcp:{host}:0"})
        info = migration_info(cmd, vm_id)
    return info


MAX_MIGRATION_MIBPS = 1 << 20  # 1 TiB/s: no link is faster; QEMU takes bytes/s as a 64-bit count


def checked_mibps(mibps: object) -> int | None:
    """The ``migration_mibps`` option: None (QEMU's default cap, 128 MiB/s) or 1..MAX_MIGRATION_MIBPS."""
    if mibps is None:
        return None
    if isinstance(mibps, bool) or not isinstance(mibps, int) or not 1 <= mibps <= MAX_MIGRATION_MIBPS:
        raise InvalidParameter(f"migration_mibps of the qemu driver: an integer from 1 to {MAX_MIGRATION_MIBPS}")
    return mibps


def send(cmd: Command, vm_id: str, target: StartMigration, x509_dir: Path | None = None,
         mibps: int | None = None) -> MigrationInfo:
    """Start migrating the source VM to ``target`` unless it migrates (or migrated) already (over TLS
    with the client credentials in ``x509_dir``, the destination's certificate checked for its address),
    the stream capped at ``mibps`` where given (else QEMU's default, 128 MiB/s)."""
    info = migration_info(cmd, vm_id)
    if info.status == "postmigrate" or info.state in ACTIVE_STATES:
        return info
    if info.status not in ("running", "paused"):
        raise IncorrectState(f"VM {vm_id} is {info.status}: it cannot be migrated")
    _use_tls(cmd, x509_dir, "client", target.uri.split(":", 1)[1].rsplit(":", 1)[0].strip("[]"))
    if mibps is not None:
        cmd("migrate-set-parameters", {"max-bandwidth": mibps * MIB})
    cmd("migrate", {"uri": target.uri})
    return migration_info(cmd, vm_id)


def cancel(cmd: Command, vm_id: str, *, resume: bool) -> MigrationInfo:
    """Stop the source's migration if it runs (the guest keeps running here); with ``resume``, run again a
    source whose migration completed (only when its destination never took the guest over)."""
    info = migration_info(cmd, vm_id)
    if info.state in ACTIVE_STATES:
        try:
            cmd("migrate_cancel")
        except QmpCommandError:
            pass  # it ended meanwhile: what it ended as is read below
        deadline = time.monotonic() + _CANCEL_WAIT_S
        while info.state in ACTIVE_STATES and time.monotonic() < deadline:
            time.sleep(0.1)
            info = migration_info(cmd, vm_id)
    if resume and info.status == "postmigrate":
        cmd("cont")
        info = migration_info(cmd, vm_id)
    return info
