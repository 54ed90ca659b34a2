"""The controller's side of the storage agent API: one typed method per idempotent agent call."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

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

    def ensure_snapshot(self, pool: str, snapshot_id: str, volume_id: str) -> ItemStatus:
        body = {"volume_id": volume_id}
        return ItemStatus.of(self._client.call("PUT", f"/v1/pools/{pool}/snapshots/{snapshot_id}", body))

    def remove_snapshot(self, pool: str, snapshot_id: str) -> None:
        self._client.call("DELETE", f"/v1/pools/{pool}/snapshots/{snapshot_id}")

    def inventory(self) -> dict[str, dict[str, list[str]]]:
        return self._client.call("GET", "/v1/inventory")  # type: ignore[no-any-return]


class StorageAgents:
    """Finds the agent of a storage node from its last heartbeat; clients are reused per URL."""

    def __init__(self, db: Database, token: str | None, *, timeout: float = 30.0) -> None:
        self._db = db
        self._token = token
        self._timeout = timeout
        self._clients: dict[str, ApiClient] = {}
        self._lock = threading.Lock()

    def for_node(self, name: str) -> StorageAgent:
        with self._db.session() as s:
            url = s.scalar(select(Node.url).where(Node.name == name, Node.kind == "storage"))
        if url is None:
            raise AgentUnavailable(f"storage node {name!r} has never reported to this controller")
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = ApiClient(url, self._token, timeout=self._timeout)
        return StorageAgent(client)

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
