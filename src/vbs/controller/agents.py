"""The controller's side of the agent APIs: one typed method per idempotent agent call.

Agents are found by node name from their last heartbeat; one HTTP client is kept per agent URL.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from vbs.connection import HostIdentity
from vbs.controller.db import Database, Node
from vbs.errors import AgentUnavailable
from vbs.web import ApiClient

GIB = 1 << 30


@dataclass(frozen=True)
class ItemStatus:
    state: str
    size_bytes: int = 0
    progress: int = 0
    error: str | None = None

    @classmethod
    def of(cls, body: dict[str, Any]) -> ItemStatus:
        return cls(state=str(body["state"]), size_bytes=int(body.get("size_bytes", 0)),
                   progress=int(body.get("progress", 0)), error=body.get("error"))


class StorageAgent:
    """Calls to one storage agent, addressed by its node name."""

    def __init__(self, client: ApiClient) -> None:
        self._client = client

    def ensure_volume(self, pool: str, volume_id: str, size_gib: int, source_snapshot_id: str | None) -> ItemStatus:
        body = {"size_bytes": size_gib * GIB, "source_snapshot_id": source_snapshot_id}
        return ItemStatus.of(self._client.call("PUT", f"/v1/pools/{pool}/volumes/{volume_id}", body))

    def remove_volume(self, pool: str, volume_id: str) -> None:
        self._client.call("DELETE", f"/v1/pools/{pool}/volumes/{volume_id}")

    def volume_status(self, pool: str, volume_id: str) -> ItemStatus:
        return ItemStatus.of(self._client.call("GET", f"/v1/pools/{pool}/volumes/{volume_id}"))

    def resize_volume(self, pool: str, volume_id: str, size_gib: int) -> ItemStatus:
        body = {"size_bytes": size_gib * GIB}
        return ItemStatus.of(self._client.call("PUT", f"/v1/pools/{pool}/volumes/{volume_id}/size", body))

    def refresh_export(self, pool: str, volume_id: str, host_name: str) -> dict[str, Any]:
        """A new export of the (grown) volume for ``host_name``; the old one serves until retired."""
        answer = self._client.call("PUT", f"/v1/exports/{volume_id}/hosts/{host_name}/refresh", {"pool": pool})
        return answer["connection"]  # type: ignore[no-any-return]

    def retire_exports(self, volume_id: str, host_name: str) -> None:
        self._client.call("DELETE", f"/v1/exports/{volume_id}/hosts/{host_name}/retired")

    def ensure_snapshot(self, pool: str, snapshot_id: str, volume_id: str) -> ItemStatus:
        body = {"volume_id": volume_id}
        return ItemStatus.of(self._client.call("PUT", f"/v1/pools/{pool}/snapshots/{snapshot_id}", body))

    def remove_snapshot(self, pool: str, snapshot_id: str) -> None:
        self._client.call("DELETE", f"/v1/pools/{pool}/snapshots/{snapshot_id}")

    def inventory(self) -> dict[str, dict[str, list[str]]]:
        return self._client.call("GET", "/v1/inventory")  # type: ignore[no-any-return]

    def ensure_export(self, pool: str, volume_id: str, host: HostIdentity, read_only: bool) -> dict[str, Any]:
        body = {"pool": pool, "host": host.model_dump(), "read_only": read_only}
        answer = self._client.call("PUT", f"/v1/exports/{volume_id}/hosts/{host.name}", body)
        return answer["connection"]  # type: ignore[no-any-return]

    def remove_export(self, volume_id: str, host_name: str) -> None:
        self._client.call("DELETE", f"/v1/exports/{volume_id}/hosts/{host_name}")

    def list_exports(self) -> list[dict[str, str]]:
        return self._client.call("GET", "/v1/exports")  # type: ignore[no-any-return]


class HostAgent:
    """Calls to one host agent, addressed by its node name."""

    def __init__(self, client: ApiClient) -> None:
        self._client = client

    def attach(self, vm_id: str, serial: str, connection: dict[str, Any], *, read_only: bool,
               qos: dict[str, int | None] | None) -> dict[str, Any]:
        body = {"connection": connection, "read_only": read_only, "qos": qos}
        return self._client.call("PUT", f"/v1/vms/{vm_id}/disks/{serial}", body)  # type: ignore[no-any-return]

    def detach(self, vm_id: str, serial: str, *, force: bool, timeout: float) -> None:
        # The HTTP call outlives the guest's own deadline by a margin, so "busy" comes back as an answer.
        self._client.call("DELETE", f"/v1/vms/{vm_id}/disks/{serial}?force={str(force).lower()}&timeout={timeout}",
                          timeout=timeout + 15)

    def resize(self, vm_id: str, serial: str, connection: dict[str, Any], size_gib: int) -> None:
        body = {"connection": connection, "size_bytes": size_gib * GIB}
        self._client.call("PUT", f"/v1/vms/{vm_id}/disks/{serial}/size", body)

    def list_disks(self, vm_id: str) -> list[dict[str, Any]]:
        return self._client.call("GET", f"/v1/vms/{vm_id}/disks")  # type: ignore[no-any-return]


class AgentDirectory:
    """Finds the agent of a node from its last heartbeat; clients are reused per URL."""

    def __init__(self, db: Database, token: str | None, *, timeout: float = 30.0) -> None:
        self._db = db
        self._token = token
        self._timeout = timeout
        self._clients: dict[str, ApiClient] = {}
        self._lock = threading.Lock()

    def _client(self, name: str, kind: str) -> ApiClient:
        with self._db.session() as s:
            url = s.scalar(select(Node.url).where(Node.name == name, Node.kind == kind))
        if url is None:
            raise AgentUnavailable(f"{kind} node {name!r} has never reported to this controller")
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = ApiClient(url, self._token, timeout=self._timeout)
        return client

    def storage(self, name: str) -> StorageAgent:
        return StorageAgent(self._client(name, "storage"))

    def host(self, name: str) -> HostAgent:
        return HostAgent(self._client(name, "host"))

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
