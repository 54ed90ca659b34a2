"""The volume calls of a pool's backend on the HTTP API (ensure, status, resize, remove): a storage
node's pools answer them, and a host's local pools (semi-shared storage) with the same code.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from vbs import ids
from vbs.errors import IncorrectState
from vbs.pools.backend import Backend, EncryptingBackend
from vbs.wire.storage import EnsureVolume, ItemStatus, Removed, ResizeVolume

__all__ = ["add_volume_routes"]


def add_volume_routes(router: APIRouter, pool: Callable[[str], Backend], prefix: str = "/pools") -> None:
    """The volume calls of a pool's backend (ensure, status, resize, remove), under ``prefix``: a
    storage node's pools, and a host's local pools (semi-shared storage) with the same code."""

    @router.put(prefix + "/{pool_name}/volumes/{volume_id}")
    def ensure_volume(pool_name: str, volume_id: str, body: EnsureVolume) -> ItemStatus:
        backend = pool(pool_name)
        if body.encrypted or body.luks_passphrase is not None:
            if not isinstance(backend, EncryptingBackend):
                raise IncorrectState(f"pool {pool_name} cannot make encrypted volumes")
            return backend.ensure_encrypted_volume(ids.check("volume", volume_id), body.size_bytes,
                                                   body.luks_passphrase, body.source_snapshot_id,
                                                   body.source_luks_passphrase)
        return backend.ensure_volume(ids.check("volume", volume_id), body.size_bytes, body.source_snapshot_id)

    @router.get(prefix + "/{pool_name}/volumes/{volume_id}")
    def volume_status(pool_name: str, volume_id: str) -> ItemStatus:
        return pool(pool_name).volume_status(ids.check("volume", volume_id))

    @router.put(prefix + "/{pool_name}/volumes/{volume_id}/size")
    def resize_volume(pool_name: str, volume_id: str, body: ResizeVolume) -> ItemStatus:
        backend = pool(pool_name)
        if body.encrypted:
            if not isinstance(backend, EncryptingBackend):
                raise IncorrectState(f"pool {pool_name} holds no encrypted volumes")
            return backend.resize_encrypted_volume(ids.check("volume", volume_id), body.size_bytes)
        return backend.resize_volume(ids.check("volume", volume_id), body.size_bytes)

    @router.delete(prefix + "/{pool_name}/volumes/{volume_id}")
    def remove_volume(pool_name: str, volume_id: str) -> Removed:
        pool(pool_name).remove_volume(ids.check("volume", volume_id))
        return Removed()
