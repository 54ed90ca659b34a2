"""The controller's side of the agent APIs: one typed method per idempotent agent call.

Every body and answer is a ``vbs.wire`` model; an agent's error arrives as the exception class it
raised. Agents are found by node name from their last heartbeat; one HTTP client is kept per URL.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Sequence
from urllib.parse import urlsplit

from pydantic import SecretStr
from sqlalchemy import bindparam, select

from vbs.controller.db import Database, Node
from vbs.controller.fleet.nodes import storage_info_document
from vbs.errors import AgentUnavailable, DriverError
from vbs.net.web import ApiClient, is_loopback
from vbs.trust import probe_tickets
from vbs.trust.node_credentials import NodeKeyring
from vbs.trust.tls import TlsFiles
from vbs.wire import host as host_wire
from vbs.wire.connection import Connection, HostIdentity, LocalConnection, NbdConnection, ProtocolName, RbdConnection
from vbs.wire.direct_blocks import BlockData, BlockRead, BlockWrite, BlockWritten, DirectManifest, SnapshotBlockList
from vbs.wire.qos import ExportLimits, LimitsAnswer
from vbs.wire.storage import (
    CheckStore,
    ConnectionAnswer,
    ConnectionRequest,
    EnsureSnapshot,
    EnsureVolume,
    ExportInfo,
    ExportList,
    Inventory,
    ItemStatus,
    PullVolume,
    Removed,
    ResizeVolume,
    RestoreVolume,
    SnapshotTargetRequest,
    StoreCheckReport,
    StoredStatus,
    StoreSnapshot,
    TierMove,
)

GIB = 1 << 30
# A deep check of a store reads all of it: an hour allows about 16 GiB at the slowest S3 rates.
CHECK_TIMEOUT_S = 3600.0


class StorageAgent:
    """Calls to one storage agent, addressed by its node name.

    A connection it answers is vouched for before any host sees it: it must lead to this node's own
    address (what its authenticated heartbeats declare), so a compromised storage node cannot send
    hosts to another machine, and a raw path cannot even be expressed (``Connection`` has none)."""

    def __init__(self, client: ApiClient, name: str = "", addresses: frozenset[str] = frozenset(),
                 monitors: frozenset[str] = frozenset()) -> None:
        self._client = client
        self._name = name
        self._addresses = addresses
        self._monitors = monitors  # the Ceph monitors its heartbeat reported for its pools

    def _vouched(self, connection: Connection) -> Connection:
        if isinstance(connection, RbdConnection):
            # A host opens what the connection names: only the monitors of this node's cluster.
            unknown = [m for m in connection.monitors if m not in self._monitors]
            if unknown:
                raise DriverError(f"storage node {self._name} answered a connection to the Ceph monitor "
                                  f"{unknown[0][:64]}, which its heartbeat does not report: refused")
            return connection
        if connection.host is None:
            # A unix socket (NBD) is the same-machine path of an all-in-one install: only from a
            # storage node whose own address is loopback, and the wire model checked the path.
            if not any(is_loopback(a) for a in self._addresses):
                raise DriverError(f"storage node {self._name} answered a unix-socket connection, but it is not "
                                  f"on this machine: refused")
            return connection
        if connection.host not in self._addresses:
            raise DriverError(f"storage node {self._name} answered a connection to {connection.host[:64]}, "
                              f"which is not its address: refused")
        return connection

    # -- volumes and snapshots -------------------------------------------------------------------

    def ensure_volume(self, pool: str, volume_id: str, size_gib: int, source_snapshot_id: str | None, *,
                      encrypted: bool = False, luks: SecretStr | None = None,
                      source_luks: SecretStr | None = None) -> ItemStatus:
        """``encrypted``: a LUKS container, written under ``luks`` (formatted, or the snapshot re-encrypted,
        opened with ``source_luks``), or without it a clone of an encrypted snapshot."""
        body = EnsureVolume(size_bytes=size_gib * GIB, source_snapshot_id=source_snapshot_id, encrypted=encrypted,
                            luks_passphrase=luks, source_luks_passphrase=source_luks)
        return self._client.request("PUT", f"/v1/pools/{pool}/volumes/{volume_id}", ItemStatus, body)

    def remove_volume(self, pool: str, volume_id: str) -> None:
        self._client.request("DELETE", f"/v1/pools/{pool}/volumes/{volume_id}", Removed)

    def pull_volume(self, pool: str, volume_id: str, size_bytes: int, source: NbdConnection) -> ItemStatus:
        """Copy the volume (``size_bytes`` in its pool: an encrypted one's header included) onto this node
        from ``source``, another node's export of it, already vouched for."""
        return self._client.request("PUT", f"/v1/pools/{pool}/volumes/{volume_id}/pull", ItemStatus,
                                    PullVolume(size_bytes=size_bytes, source=source))

    def volume_status(self, pool: str, volume_id: str) -> ItemStatus:
        return self._client.request("GET", f"/v1/pools/{pool}/volumes/{volume_id}", ItemStatus)

    def resize_volume(self, pool: str, volume_id: str, size_gib: int, *, encrypted: bool = False) -> ItemStatus:
        return self._client.request("PUT", f"/v1/pools/{pool}/volumes/{volume_id}/size", ItemStatus,
                                    ResizeVolume(size_bytes=size_gib * GIB, encrypted=encrypted))

    def ensure_snapshot(self, pool: str, snapshot_id: str, volume_id: str) -> ItemStatus:
        return self._client.request("PUT", f"/v1/pools/{pool}/snapshots/{snapshot_id}", ItemStatus,
                                    EnsureSnapshot(volume_id=volume_id))

    def remove_snapshot(self, pool: str, snapshot_id: str) -> None:
        self._client.request("DELETE", f"/v1/pools/{pool}/snapshots/{snapshot_id}", Removed)

    # -- the snapshot store ------------------------------------------------------------------------

    def store_snapshot(self, pool: str, snapshot_id: str, volume_id: str, tenant: str, store_key: SecretStr,
                       parent_snapshot_id: str | None = None) -> StoredStatus:
        """Put the pool's snapshot into the snapshot store (incremental against the parent's manifest),
        or say how far it got. ``store_key`` goes with this one request only."""
        return self._client.request("PUT", f"/v1/pools/{pool}/snapshots/{snapshot_id}/stored", StoredStatus,
                                    StoreSnapshot(volume_id=volume_id, tenant=tenant, store_key=store_key,
                                                  parent_snapshot_id=parent_snapshot_id))

    def stored_status(self, pool: str, snapshot_id: str) -> StoredStatus:
        return self._client.request("GET", f"/v1/pools/{pool}/snapshots/{snapshot_id}/stored", StoredStatus)

    def delete_stored(self, snapshot_id: str) -> None:
        """Delete the snapshot's manifest from the store this agent uses (chunks go with garbage collection)."""
        self._client.request("DELETE", f"/v1/snapshot-store/snapshots/{snapshot_id}", Removed)

    def archive_stored(self, snapshot_id: str, tenant: str, store_key: SecretStr) -> StoredStatus:
        """Move the snapshot from the snapshot store into the archive store, or say how far it got."""
        return self._client.request("PUT", f"/v1/archive-store/snapshots/{snapshot_id}", StoredStatus,
                                    TierMove(tenant=tenant, store_key=store_key))

    def restore_archived(self, snapshot_id: str, tenant: str, store_key: SecretStr, *, permanent: bool
                         ) -> StoredStatus:
        """Copy the snapshot back from the archive store (``permanent``: then out of it), or say how far."""
        return self._client.request("PUT", f"/v1/snapshot-store/snapshots/{snapshot_id}/from-archive", StoredStatus,
                                    TierMove(tenant=tenant, store_key=store_key, permanent=permanent))

    def check_store(self, snapshot_ids: list[str], *, deep: bool, store_key: SecretStr | None,
                    archive: bool = False) -> StoreCheckReport:
        """Check the snapshots in the store this agent uses (``deep``: every chunk hashed again, which takes
        as long as reading them: no time limit but the store's own)."""
        return self._client.request("POST", "/v1/snapshot-store/check", StoreCheckReport,
                                    CheckStore(snapshot_ids=snapshot_ids, deep=deep, store_key=store_key,
                                               archive=archive),
                                    timeout=CHECK_TIMEOUT_S)

    # -- the EBS direct APIs' blocks --------------------------------------------------------------------

    def put_block(self, tenant: str, store_key: SecretStr, data: bytes) -> str | None:
        """Put one 512 KiB block into the store: its chunk's id, or None for zeros (nothing stored)."""
        return self._client.request("POST", "/v1/snapshot-store/blocks", BlockWritten,
                                    BlockWrite(tenant=tenant, store_key=store_key, data=data)).chunk_id

    def complete_direct(self, snapshot_id: str, body: DirectManifest) -> SnapshotBlockList:
        return self._client.request("PUT", f"/v1/snapshot-store/snapshots/{snapshot_id}/manifest", SnapshotBlockList,
                                    body, timeout=CHECK_TIMEOUT_S)

    def snapshot_blocks(self, snapshot_id: str) -> SnapshotBlockList:
        return self._client.request("GET", f"/v1/snapshot-store/snapshots/{snapshot_id}/blocks", SnapshotBlockList)

    def read_block(self, snapshot_id: str, block_index: int, tenant: str, store_key: SecretStr) -> bytes:
        return self._client.request("POST", f"/v1/snapshot-store/snapshots/{snapshot_id}/blocks/read", BlockData,
                                    BlockRead(tenant=tenant, store_key=store_key, block_index=block_index)).data

    def restore_volume(self, pool: str, volume_id: str, size_gib: int, snapshot_id: str, tenant: str,
                       store_key: SecretStr, *, encrypted: bool = False, luks: SecretStr | None = None,
                       source_luks: SecretStr | None = None) -> ItemStatus:
        """Make the volume from the snapshot's manifest in the store, every chunk checked (a clone of an
        encrypted snapshot stays its container; with ``luks``, re-encrypted under it)."""
        body = RestoreVolume(snapshot_id=snapshot_id, size_bytes=size_gib * GIB, tenant=tenant, store_key=store_key,
                             encrypted=encrypted, luks_passphrase=luks, source_luks_passphrase=source_luks)
        return self._client.request("PUT", f"/v1/pools/{pool}/volumes/{volume_id}/restore", ItemStatus, body)

    def snapshot_target(self, pool: str, snapshot_id: str, volume_id: str, host: HostIdentity) -> Connection:
        answer = self._client.request("PUT", f"/v1/pools/{pool}/snapshots/{snapshot_id}/targets/{host.name}",
                                      ConnectionAnswer, SnapshotTargetRequest(volume_id=volume_id, host=host))
        return self._vouched(answer.connection)

    def finish_snapshot_target(self, pool: str, snapshot_id: str, host_name: str) -> ItemStatus:
        return self._client.request("DELETE", f"/v1/pools/{pool}/snapshots/{snapshot_id}/targets/{host_name}",
                                    ItemStatus)

    def inventory(self) -> Inventory:
        return self._client.request("GET", "/v1/inventory", Inventory)

    # -- how hosts reach volumes --------------------------------------------------------------------

    def connection_for(self, pool: str, volume_id: str, host: HostIdentity, read_only: bool,
                       protocols: Sequence[ProtocolName] = (), *, limits: ExportLimits | None = None
                       ) -> ConnectionAnswer:
        """``protocols``: what the host's hypervisor opens itself (its heartbeat's capabilities). A
        native connection is asked only of a node that reported its Ceph monitors: one that did not
        could not be vouched for (and may be older than the field). ``limits``: the volume's, which the
        answer says whether the node enforces."""
        native = list(protocols) if self._monitors else []
        request = ConnectionRequest(host=host, read_only=read_only, protocols=native, limits=limits)
        answer = self._client.request("PUT", f"/v1/pools/{pool}/volumes/{volume_id}/connections/{host.name}",
                                      ConnectionAnswer, request)
        return answer.model_copy(update={"connection": self._vouched(answer.connection)})

    def remove_connection(self, pool: str, volume_id: str, host_name: str) -> None:
        self._client.request("DELETE", f"/v1/pools/{pool}/volumes/{volume_id}/connections/{host_name}", Removed)

    def refresh_connection(self, pool: str, volume_id: str, host_name: str) -> Connection:
        """A new connection of the (grown) volume for ``host_name``; the old one serves until retired."""
        answer = self._client.request(
            "PUT", f"/v1/pools/{pool}/volumes/{volume_id}/connections/{host_name}/refresh", ConnectionAnswer)
        return self._vouched(answer.connection)

    def retire_connections(self, pool: str, volume_id: str, host_name: str) -> None:
        self._client.request("DELETE", f"/v1/pools/{pool}/volumes/{volume_id}/connections/{host_name}/retired",
                             Removed)

    # -- the export daemon, for reconciliation ---------------------------------------------------------

    def set_limits(self, volume_id: str, limits: ExportLimits) -> bool:
        """Change the volume's limits live on its exports here; whether this node enforces them."""
        return self._client.request("PUT", f"/v1/exports/{volume_id}/limits", LimitsAnswer, limits).enforced

    def list_exports(self) -> list[ExportInfo]:
        return self._client.request("GET", "/v1/exports", ExportList).exports

    def remove_export(self, key: str, host_name: str) -> None:
        self._client.request("DELETE", f"/v1/exports/{key}/hosts/{host_name}", Removed)


class HostAgent:
    """Calls to one host agent, addressed by its node name."""

    def __init__(self, client: ApiClient) -> None:
        self._client = client

    def attach(self, vm_id: str, serial: str, connection: Connection | LocalConnection, *, read_only: bool,
               qos: host_wire.QoS | None, luks: SecretStr | None = None,
               pci_slot: str | None = None) -> host_wire.DiskInfo:
        return self._client.request("PUT", f"/v1/vms/{vm_id}/disks/{serial}", host_wire.DiskInfo,
                                    host_wire.AttachDisk(connection=connection, read_only=read_only, qos=qos,
                                               luks_passphrase=luks, pci_slot=pci_slot))

    def migration_info(self, vm_id: str) -> host_wire.MigrationInfo:
        return self._client.request("GET", f"/v1/vms/{vm_id}/migration", host_wire.MigrationInfo)

    def listen_for_migration(self, vm_id: str) -> host_wire.MigrationInfo:
        return self._client.request("PUT", f"/v1/vms/{vm_id}/migration/incoming", host_wire.MigrationInfo)

    def migrate(self, vm_id: str, uri: str) -> host_wire.MigrationInfo:
        return self._client.request("PUT", f"/v1/vms/{vm_id}/migration", host_wire.MigrationInfo,
                                    host_wire.StartMigration(uri=uri))

    def cancel_migration(self, vm_id: str, *, resume: bool) -> host_wire.MigrationInfo:
        return self._client.request("DELETE", f"/v1/vms/{vm_id}/migration", host_wire.MigrationInfo,
                                    params={"resume": str(resume).lower()})

    def set_qos(self, vm_id: str, serial: str, qos: host_wire.QoS | None) -> host_wire.DiskInfo:
        """Change the limits of an attached disk live (the hypervisor's throttle)."""
        return self._client.request("PUT", f"/v1/vms/{vm_id}/disks/{serial}/qos", host_wire.DiskInfo,
                                    host_wire.DiskQoS(qos=qos))

    def pause(self, vm_id: str, hold_s: int) -> bool:
        """Pause the VM (the agent resumes it after ``hold_s`` at the latest); whether VBS paused it."""
        answer = self._client.request("PUT", f"/v1/vms/{vm_id}/pause", host_wire.PauseAnswer,
                                      host_wire.PauseVm(hold_s=hold_s))
        return answer.paused_by_vbs

    def resume(self, vm_id: str) -> None:
        self._client.request("DELETE", f"/v1/vms/{vm_id}/pause", Removed)

    def detach(self, vm_id: str, serial: str, *, force: bool, timeout: float) -> None:
        # The HTTP call outlives the guest's own deadline by a margin, so "busy" comes back as an answer.
        self._client.request("DELETE", f"/v1/vms/{vm_id}/disks/{serial}", Removed, timeout=timeout + 15,
                             params={"force": str(force).lower(), "timeout": f"{timeout:g}"})

    def resize(self, vm_id: str, serial: str, connection: Connection, size_gib: int) -> host_wire.DiskInfo:
        return self._client.request("PUT", f"/v1/vms/{vm_id}/disks/{serial}/size", host_wire.DiskInfo,
                                    host_wire.ResizeDisk(connection=connection, size_bytes=size_gib * GIB))

    def list_disks(self, vm_id: str) -> list[host_wire.DiskInfo]:
        return self._client.request("GET", f"/v1/vms/{vm_id}/disks", host_wire.DiskList).disks

    def ensure_copy(self, vm_id: str, serial: str, copy_id: str, target: Connection) -> ItemStatus:
        return self._client.request("PUT", f"/v1/vms/{vm_id}/disks/{serial}/copies/{copy_id}", ItemStatus,
                                    host_wire.CopyDisk(target=target))

    def remove_copy(self, vm_id: str, serial: str, copy_id: str) -> None:
        self._client.request("DELETE", f"/v1/vms/{vm_id}/disks/{serial}/copies/{copy_id}", Removed)

    # -- local pools (semi-shared storage) --------------------------------------------------------------

    def ensure_local_volume(self, pool: str, volume_id: str, size_gib: int) -> ItemStatus:
        return self._client.request("PUT", f"/v1/local-pools/{pool}/volumes/{volume_id}", ItemStatus,
                                    EnsureVolume(size_bytes=size_gib * GIB))

    def remove_local_volume(self, pool: str, volume_id: str) -> None:
        self._client.request("DELETE", f"/v1/local-pools/{pool}/volumes/{volume_id}/fill", Removed)
        self._client.request("DELETE", f"/v1/local-pools/{pool}/volumes/{volume_id}", Removed)

    def fill_local_volume(self, pool: str, volume_id: str, source: Connection) -> ItemStatus:
        return self._client.request("PUT", f"/v1/local-pools/{pool}/volumes/{volume_id}/fill", ItemStatus,
                                    host_wire.FillVolume(source=source))

    def forget_fill(self, pool: str, volume_id: str) -> None:
        self._client.request("DELETE", f"/v1/local-pools/{pool}/volumes/{volume_id}/fill", Removed)

    def copy_local_volume(self, pool: str, volume_id: str, copy_id: str, target: Connection) -> ItemStatus:
        return self._client.request("PUT", f"/v1/local-pools/{pool}/volumes/{volume_id}/copies/{copy_id}",
                                    ItemStatus, host_wire.CopyDisk(target=target))

    def forget_local_copy(self, pool: str, volume_id: str, copy_id: str) -> None:
        self._client.request("DELETE", f"/v1/local-pools/{pool}/volumes/{volume_id}/copies/{copy_id}", Removed)

    def ensure_mirror(self, vm_id: str, serial: str, target: Connection, *, pivot: bool) -> ItemStatus:
        return self._client.request("PUT", f"/v1/vms/{vm_id}/disks/{serial}/mirror", ItemStatus,
                                    host_wire.MirrorDisk(target=target, pivot=pivot))

    def remove_mirror(self, vm_id: str, serial: str) -> None:
        self._client.request("DELETE", f"/v1/vms/{vm_id}/disks/{serial}/mirror", Removed)


# A storage node's address and reported pools, as a plain row (every storage step of a workflow asks).
_STORAGE_QUERY = select(Node.url, Node.address, Node.info).where(Node.name == bindparam("name"),
                                                                  Node.kind == "storage")


class AgentDirectory:
    """Finds the agent of a node from its last heartbeat; clients are reused per URL."""

    def __init__(self, db: Database, keyring: NodeKeyring, *, tls: TlsFiles | None = None,
                 timeout: float = 30.0) -> None:
        self._db = db
        self._keyring = keyring
        self._verify: ssl.SSLContext | bool = tls.client_context() if tls is not None else True
        self._timeout = timeout
        self._clients: dict[tuple[str, str, str], ApiClient] = {}
        self._lock = threading.Lock()

    def _client(self, name: str, kind: str) -> ApiClient:
        return self._node(name, kind)[0]

    def _node(self, name: str, kind: str) -> tuple[ApiClient, frozenset[str]]:
        with self._db.read() as s:
            row = s.execute(select(Node.url, Node.address).where(Node.name == name, Node.kind == kind)).first()
        if row is None:
            raise AgentUnavailable(f"{kind} node {name!r} has never reported to this controller")
        return self._client_at(name, kind, *row)

    def _client_at(self, name: str, kind: str, url: str, address: str | None) -> tuple[ApiClient, frozenset[str]]:
        addresses = frozenset(a for a in (address, urlsplit(url).hostname) if a)
        with self._lock:
            client = self._clients.get((url, kind, name))
            if client is None:
                # Each node is called with its own token (the generation it last used).
                client = self._clients[(url, kind, name)] = ApiClient(
                    url, lambda: self._keyring.token_for_calls(kind, name), timeout=self._timeout,
                    verify=self._verify)
        return client, addresses

    def probe_ticket(self, storage_node: str, host: str) -> str:
        """A ticket that lets ``host`` probe ``storage_node`` for a while (vbs.trust.probe_tickets)."""
        return probe_tickets.mint(self._keyring.token_for_calls("storage", storage_node), storage_node, host)

    def storage(self, name: str) -> StorageAgent:
        with self._db.read() as s:  # one read for the address and the pools (every storage step asks)
            row = s.connection().execute(_STORAGE_QUERY, {"name": name}).first()
        if row is None:
            raise AgentUnavailable(f"storage node {name!r} has never reported to this controller")
        url, address, info = row
        pools = storage_info_document(info).pools
        client, addresses = self._client_at(name, "storage", url, address)
        return StorageAgent(client, name, addresses, frozenset(m for p in pools for m in p.monitors))

    def host(self, name: str) -> HostAgent:
        return HostAgent(self._client(name, "host"))

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
