"""The storage agent's HTTP API: idempotent ``ensure``/``remove`` calls keyed by volume/snapshot id.

The agent keeps no records of its own: the controller's DB is the truth, and every call here may
be repeated after a crash with the same result.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from pydantic import BaseModel, ConfigDict, Field

from vbs import ids
from vbs.connection import HOST_NAME_RE, HostIdentity
from vbs.errors import InvalidParameter, NotFound
from vbs.storage.backends.base import Backend
from vbs.storage.exports.base import ExportDriver
from vbs.web import install_error_handlers, token_checker

MAX_BYTES = 64 << 40


class EnsureVolume(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    size_bytes: int = Field(ge=1, le=MAX_BYTES)
    source_snapshot_id: str | None = None


class ResizeVolume(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    size_bytes: int = Field(ge=1, le=MAX_BYTES)


class EnsureSnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    volume_id: str


class EnsureExport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pool: str
    host: HostIdentity
    read_only: bool = False


class RefreshExport(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    pool: str


def create_app(backends: dict[str, Backend], exports: ExportDriver, token: str | None, node_name: str) -> FastAPI:
    app = FastAPI(title="VBS storage agent", version="1")
    install_error_handlers(app)
    router = APIRouter(prefix="/v1", dependencies=[Depends(token_checker(token))])

    def pool(name: str) -> Backend:
        try:
            return backends[name]
        except KeyError:
            raise NotFound(f"no pool named {name[:64]!r} on {node_name}", code="InvalidPool.NotFound") from None

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "node": node_name}

    @router.get("/pools")
    def pools() -> list[dict[str, Any]]:
        return [asdict(b.pool_info()) for b in backends.values()]

    @router.put("/pools/{pool_name}/volumes/{volume_id}")
    def ensure_volume(pool_name: str, volume_id: str, body: EnsureVolume) -> dict[str, Any]:
        ids.check("volume", volume_id)
        if body.source_snapshot_id is not None:
            ids.check("snapshot", body.source_snapshot_id)
        return asdict(pool(pool_name).ensure_volume(volume_id, body.size_bytes, body.source_snapshot_id))

    @router.get("/pools/{pool_name}/volumes/{volume_id}")
    def volume_status(pool_name: str, volume_id: str) -> dict[str, Any]:
        return asdict(pool(pool_name).volume_status(ids.check("volume", volume_id)))

    @router.put("/pools/{pool_name}/volumes/{volume_id}/size")
    def resize_volume(pool_name: str, volume_id: str, body: ResizeVolume) -> dict[str, Any]:
        return asdict(pool(pool_name).resize_volume(ids.check("volume", volume_id), body.size_bytes))

    @router.delete("/pools/{pool_name}/volumes/{volume_id}")
    def remove_volume(pool_name: str, volume_id: str) -> dict[str, str]:
        pool(pool_name).remove_volume(ids.check("volume", volume_id))
        return {"state": "absent"}

    @router.put("/pools/{pool_name}/snapshots/{snapshot_id}")
    def ensure_snapshot(pool_name: str, snapshot_id: str, body: EnsureSnapshot) -> dict[str, Any]:
        ids.check("snapshot", snapshot_id)
        return asdict(pool(pool_name).ensure_snapshot(snapshot_id, ids.check("volume", body.volume_id)))

    @router.get("/pools/{pool_name}/snapshots/{snapshot_id}")
    def snapshot_status(pool_name: str, snapshot_id: str) -> dict[str, Any]:
        return asdict(pool(pool_name).snapshot_status(ids.check("snapshot", snapshot_id)))

    @router.delete("/pools/{pool_name}/snapshots/{snapshot_id}")
    def remove_snapshot(pool_name: str, snapshot_id: str) -> dict[str, str]:
        pool(pool_name).remove_snapshot(ids.check("snapshot", snapshot_id))
        return {"state": "absent"}

    @router.get("/inventory")
    def inventory() -> dict[str, dict[str, list[str]]]:
        return {name: b.inventory() for name, b in backends.items()}

    @router.put("/exports/{volume_id}/hosts/{host_name}")
    def ensure_export(volume_id: str, host_name: str, body: EnsureExport) -> dict[str, Any]:
        ids.check("volume", volume_id)
        if body.host.name != host_name:
            raise InvalidParameter("the host in the path and in the body differ")
        path = pool(body.pool).volume_path(volume_id)
        conn = exports.ensure_export(volume_id, path, body.host, read_only=body.read_only)
        return {"connection": conn.model_dump(mode="json")}

    @router.delete("/exports/{volume_id}/hosts/{host_name}")
    def remove_export(volume_id: str, host_name: str) -> dict[str, str]:
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name {host_name[:64]!r}")
        exports.remove_export(volume_id, host_name)
        return {"state": "absent"}

    @router.put("/exports/{volume_id}/hosts/{host_name}/refresh")
    def refresh_export(volume_id: str, host_name: str, body: RefreshExport) -> dict[str, Any]:
        """After the volume grew: a new export for that host with the new size (the old one serves on)."""
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name {host_name[:64]!r}")
        path = pool(body.pool).volume_path(volume_id)
        conn = exports.refresh_export(volume_id, path, host_name)
        return {"connection": conn.model_dump(mode="json")}

    @router.delete("/exports/{volume_id}/hosts/{host_name}/retired")
    def retire_exports(volume_id: str, host_name: str) -> dict[str, str]:
        """Remove the exports a refresh replaced, once the host uses the new one."""
        ids.check("volume", volume_id)
        if not HOST_NAME_RE.match(host_name):
            raise InvalidParameter(f"invalid host name {host_name[:64]!r}")
        exports.retire_exports(volume_id, host_name)
        return {"state": "absent"}

    @router.get("/exports")
    def list_exports() -> list[dict[str, str]]:
        return [asdict(e) for e in exports.list_exports()]

    app.include_router(router)
    return app
