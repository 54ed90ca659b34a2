"""The storage agent's HTTP API: idempotent ``ensure``/``remove`` calls keyed by volume/snapshot id.

The agent keeps no records of its own: the controller's DB is the truth, and every call here may
be repeated after a crash with the same result. Every body and answer is a ``vbs.wire`` model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from fastapi import APIRouter, Depends, FastAPI
from starlette.responses import Response

from vbs import ids
from vbs.errors import IncorrectState, InvalidParameter, NotFound, matching
from vbs.net.agent_app import agent_app
from vbs.net.web import Scope
from vbs.pools.backend import Backend, PullingBackend
from vbs.pools.exports import ExportDriver, LimitEnforcer
from vbs.pools.routes import add_volume_routes
from vbs.storage.metrics import storage_registry
from vbs.storage.store_routes import add_store_routes
from vbs.storage.stored_snapshots import StoredSnapshots
from vbs.wire.connection import HOST_NAME_RE, HostIdentity
from vbs.wire.qos import ExportLimits, LimitsAnswer
from vbs.wire.storage import (
    ConnectionAnswer,
    ConnectionRequest,
    EnsureSnapshot,
    ExportList,
    Inventory,
    ItemStatus,
    PoolList,
    PullVolume,
    Removed,
    SnapshotTargetRequest,
)


def _host_name(name: str) -> str:
    return matching(HOST_NAME_RE, name, "host name")


class Reach(NamedTuple):
    """A volume of a pool and a host, as the path names them (checked)."""

    backend: Backend
    volume_id: str
    host: str


def _same_host(host: HostIdentity, host_name: str) -> None:
    if host.name != host_name:
        raise InvalidParameter("the host in the path and in the body differ")


def create_app(backends: dict[str, Backend], exports: ExportDriver, auth: Callable[[Scope], Response | None],
               node_name: str, stored: StoredSnapshots | None = None) -> FastAPI:
    """The agent's API over its pools; ``stored``: its snapshot store's jobs (None: it has no store)."""
    stored = stored or StoredSnapshots(None)
    app = agent_app("VBS storage agent", auth, node_name, storage_registry(backends, exports))
    router = APIRouter(prefix="/v1")

    def pool(name: str) -> Backend:
        try:
            return backends[name]
        except KeyError:
            raise NotFound(f"no pool named {name[:64]!r} on {node_name}", code="InvalidPool.NotFound") from None

    @router.get("/pools")
    def pools() -> PoolList:
        return PoolList(pools=[stored.pool_info(b) for b in backends.values()])

    @router.get("/inventory")
    def inventory() -> Inventory:
        return Inventory(pools={name: b.inventory() for name, b in backends.items()})

    add_volume_routes(router, pool)
    add_store_routes(router, pool, stored)

    @router.put("/pools/{pool_name}/volumes/{volume_id}/pull")
    def pull_volume(pool_name: str, volume_id: str, body: PullVolume) -> ItemStatus:
        """Copy the volume here from another storage node's export of it (it moves here); answers progress."""
        backend = pool(pool_name)
        if not isinstance(backend, PullingBackend):
            raise IncorrectState(f"pool {pool_name} cannot take a volume from another storage node")
        return backend.pull_volume(ids.check("volume", volume_id), body.size_bytes, body.source)

    # -- snapshots -----------------------------------------------------------------------------------

    @router.put("/pools/{pool_name}/snapshots/{snapshot_id}")
    def ensure_snapshot(pool_name: str, snapshot_id: str, body: EnsureSnapshot) -> ItemStatus:
        return pool(pool_name).ensure_snapshot(ids.check("snapshot", snapshot_id), body.volume_id)

    @router.get("/pools/{pool_name}/snapshots/{snapshot_id}")
    def snapshot_status(pool_name: str, snapshot_id: str) -> ItemStatus:
        return pool(pool_name).snapshot_status(ids.check("snapshot", snapshot_id))

    @router.delete("/pools/{pool_name}/snapshots/{snapshot_id}")
    def remove_snapshot(pool_name: str, snapshot_id: str) -> Removed:
        pool(pool_name).remove_snapshot(ids.check("snapshot", snapshot_id))
        return Removed()

    @router.put("/pools/{pool_name}/snapshots/{snapshot_id}/targets/{host_name}")
    def snapshot_target(pool_name: str, snapshot_id: str, host_name: str, body: SnapshotTargetRequest
                        ) -> ConnectionAnswer:
        """An empty snapshot that this host's hypervisor copies the volume into at one instant."""
        _same_host(body.host, _host_name(host_name))
        conn = pool(pool_name).snapshot_target(ids.check("snapshot", snapshot_id), body.volume_id, body.host)
        return ConnectionAnswer(connection=conn)

    @router.delete("/pools/{pool_name}/snapshots/{snapshot_id}/targets/{host_name}")
    def finish_snapshot_target(pool_name: str, snapshot_id: str, host_name: str) -> ItemStatus:
        """The hypervisor's copy is complete: close the host's access and make the snapshot ready."""
        return pool(pool_name).finish_snapshot_target(ids.check("snapshot", snapshot_id), _host_name(host_name))

    # -- how hosts reach volumes ------------------------------------------------------------------------

    def reach(pool_name: str, volume_id: str, host_name: str) -> Reach:
        return Reach(pool(pool_name), ids.check("volume", volume_id), _host_name(host_name))

    enforcer = exports if isinstance(exports, LimitEnforcer) else None

    @router.put("/pools/{pool_name}/volumes/{volume_id}/connections/{host_name}")
    def connection_for(body: ConnectionRequest, at: Reach = Depends(reach)) -> ConnectionAnswer:
        """The host's connection, and whether this node's export daemon enforces the volume's limits
        on it (set before the export is made: its first I/O is limited already)."""
        _same_host(body.host, at.host)
        enforced = False
        if body.limits is not None and enforcer is not None:
            enforced = enforcer.set_limits(at.volume_id, body.limits)
        conn = at.backend.connection_for(at.volume_id, body.host, read_only=body.read_only, protocols=body.protocols)
        # A native connection (RBD) does not pass through the daemon: the hypervisor limits it.
        return ConnectionAnswer(connection=conn, limits_enforced=enforced and conn.protocol == exports.protocol)

    @router.delete("/pools/{pool_name}/volumes/{volume_id}/connections/{host_name}")
    def remove_connection(at: Reach = Depends(reach)) -> Removed:
        at.backend.remove_connection(at.volume_id, at.host)
        return Removed()

    @router.put("/pools/{pool_name}/volumes/{volume_id}/connections/{host_name}/refresh")
    def refresh_connection(at: Reach = Depends(reach)) -> ConnectionAnswer:
        """After the volume grew: a new connection for that host with the new size (the old one serves on)."""
        return ConnectionAnswer(connection=at.backend.refresh_connection(at.volume_id, at.host))

    @router.delete("/pools/{pool_name}/volumes/{volume_id}/connections/{host_name}/retired")
    def retire_connections(at: Reach = Depends(reach)) -> Removed:
        """Remove what a refresh replaced, once the host uses the new connection."""
        at.backend.retire_connections(at.volume_id, at.host)
        return Removed()

    # -- the export daemon, for reconciliation -------------------------------------------------------------

    @router.get("/exports")
    def list_exports() -> ExportList:
        """The export daemon's exports and the grants of native connections (RBD's cephx users)."""
        native = [grant for backend in backends.values() for grant in backend.native_connections()]
        return ExportList(exports=exports.list_exports() + native)

    @router.put("/exports/{key}/limits")
    def set_limits(key: str, body: ExportLimits) -> LimitsAnswer:
        """Change a volume's limits live on every export of it here. ``enforced`` False: nothing of it
        is exported through this node's daemon (the hypervisors limit it), or not with a throttle."""
        volume_id = ids.check("volume", key)
        if enforcer is None or not exports.is_exported(volume_id):
            return LimitsAnswer(enforced=False)
        return LimitsAnswer(enforced=enforcer.set_limits(volume_id, body))

    @router.delete("/exports/{key}/hosts/{host_name}")
    def remove_export(key: str, host_name: str) -> Removed:
        """Remove an export the controller knows no reason for (whatever pool its data is in)."""
        if not (ids.is_valid("volume", key) or ids.is_valid("snapshot", key)):
            raise InvalidParameter(f"invalid export key {key[:40]!r}: expecting a volume or snapshot id")
        host = _host_name(host_name)
        exports.remove_export(key, host)
        for backend in backends.values():
            if any((g.key, g.host) == (key, host) for g in backend.native_connections()):
                backend.remove_connection(key, host)
        return Removed()

    app.include_router(router)
    return app
