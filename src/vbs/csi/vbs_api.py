"""The CSI driver's calls to the VBS controller (its REST API, docs/rest-api.md), through the one JSON client
(``vbs.net.api_client``) and the CLI's long-polls (``vbs.cli.client.LongPoll``). Every wait is bounded: a CSI
call that would outlast it answers ABORTED and the sidecar's retry picks the work up where it is (every call
here is idempotent; docs/kubernetes.md "Errors")."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from urllib.parse import quote, urlencode

from vbs import ids
from vbs.cli.client import LongPoll
from vbs.csi.errors import CsiError
from vbs.errors import IncorrectState, VbsError
from vbs.net.api_client import ApiClient
from vbs.trust.credentials import AccessKey

__all__ = ["VbsApi", "NAME_TAG", "Body"]

Body = dict[str, Any]

# The CSI name a volume or snapshot was made for: CreateVolume and CreateSnapshot are idempotent by it.
NAME_TAG = "vbs.csi/name"
# What a volume made as a clone of another was copied through (a snapshot the driver took and removes).
CLONE_TAG = "vbs.csi/clone-for"

VOLUME_BUSY = frozenset({"creating", "deleting"})
SNAPSHOT_BUSY = frozenset({"pending", "deleting"})
GONE = frozenset({"deleted", "deleting"})

# The bearer token of the CSI call this thread serves, when its secrets carry a key (``VbsApi.calls_as``).
_CALL_BEARER: ContextVar[str | None] = ContextVar("vbs_csi_call_bearer", default=None)


class VbsApi:
    """The controller as the CSI services use it; ``wait_s`` bounds every wait for a change to settle."""

    def __init__(self, client: ApiClient, *, wait_s: float = 120.0, per_call_keys: bool = False) -> None:
        """``per_call_keys``: ``client`` takes its token from ``calls_as`` (as ``connect`` makes it)."""
        self.client = client
        self.wait_s = wait_s
        self.per_call_keys = per_call_keys

    @classmethod
    def connect(cls, urls: Sequence[str], key: AccessKey, *, verify: ssl.SSLContext | bool,
                wait_s: float = 120.0) -> VbsApi:
        """The controllers at ``urls``, called with ``key``, or with the key of the call under way (``calls_as``)."""
        default = key.bearer
        client = ApiClient(list(urls), lambda: _CALL_BEARER.get() or default, timeout=60, label="csi", verify=verify)
        return cls(client, wait_s=wait_s, per_call_keys=True)

    @contextmanager
    def calls_as(self, key: AccessKey | None) -> Iterator[None]:
        """Every call to VBS in this block (in this thread) made with ``key``; None: with the driver's own."""
        if key is not None and not self.per_call_keys:
            raise CsiError("INTERNAL", "this driver's VBS client cannot take a key per call")
        token = _CALL_BEARER.set(key.bearer if key is not None else None)
        try:
            yield
        finally:
            _CALL_BEARER.reset(token)

    # -- volumes -----------------------------------------------------------------------------------

    def volume(self, volume_id: str) -> Body | None:
        """The volume, or None when it does not exist (or its id is not one)."""
        return self._live("volume", volume_id)

    def volume_named(self, name: str) -> Body | None:
        """The live volume made for CSI name ``name``, if any."""
        return self._named("volumes", name, GONE)

    def create_volume(self, body: Body) -> Body:
        made: Body = self.client.call("POST", "/v1/volumes", body)
        return self.settle_volume(made["volume_id"])

    def settle_volume(self, volume_id: str) -> Body:
        """The volume once it is no longer creating (ABORTED if that takes longer than the wait)."""
        return self._settle(f"/v1/volumes/{volume_id}", VOLUME_BUSY - {"deleting"}, volume_id)

    def delete_volume(self, volume_id: str) -> None:
        """Delete it and wait until it is gone; absent is success."""
        self._delete(f"/v1/volumes/{volume_id}", volume_id)

    def volumes_page(self, max_results: int, next_token: str, filters: list[str]) -> Body:
        return self._page("/v1/volumes", max_results, next_token, filters)

    def grow(self, volume_id: str, size_gib: int) -> None:
        """Modify the volume to ``size_gib`` and wait until the new size is served."""
        try:
            started: Body = self.client.call("POST", f"/v1/volumes/{volume_id}/modify", {"size_gib": size_gib})
        except IncorrectState as exc:
            if "detach it first" in exc.message:  # a host that cannot grow it online: no retry will do
                raise CsiError("FAILED_PRECONDITION", f"{exc.code}: {exc.message}") from exc
            raise  # another operation holds the volume: ABORTED, retried
        deadline = time.monotonic() + self.wait_s
        while True:
            page: Body = self.client.call("GET", "/v1/volume-modifications?" + urlencode([("volume_id", volume_id)]))
            mod = next((m for m in page["modifications"]
                        if m["modification_id"] == started["modification_id"]), started)
            if mod["state"] == "failed":
                raise CsiError("INTERNAL", f"growing {volume_id} failed: {mod.get('status_message') or 'no reason'}")
            if mod["state"] != "modifying":
                return
            if time.monotonic() >= deadline:
                raise CsiError("ABORTED", f"{volume_id} is still being modified: try again")
            time.sleep(0.25)

    # -- attachments -------------------------------------------------------------------------------

    def instance(self, host: str, vm_id: str) -> Body | None:
        """The instance ``vm_id`` on ``host`` as the controller knows it (None: it does not)."""
        token = ""
        while True:
            params = [("max_results", "1000")] + ([("next_token", token)] if token else [])
            page: Body = self.client.call("GET", "/v1/instances?" + urlencode(params))
            for inst in page["instances"]:
                if inst["host"] == host and inst["vm_id"] == vm_id:
                    return dict(inst)
            token = page.get("next_token") or ""
            if not token:
                return None

    def attach(self, volume_id: str, host: str, vm_id: str, device: str, read_only: bool) -> Body:
        started: Body = self.client.call("POST", f"/v1/volumes/{volume_id}/attach",
                                         {"host": host, "vm_id": vm_id, "device": device, "read_only": read_only})
        self._operation(started.get("operation_id"), volume_id)
        return started

    def wait_attachment(self, volume_id: str, attachment_id: str) -> None:
        """Wait until the attachment is no longer attaching; one that ended detached is an error."""
        deadline = time.monotonic() + self.wait_s
        while True:
            volume = self.volume(volume_id)
            att = next((a for a in (volume or {}).get("attachments", []) if a["attachment_id"] == attachment_id), None)
            if att is None or att["state"] in ("detached", "detaching"):
                raise CsiError("INTERNAL", f"attaching {volume_id} failed: "
                                           f"{(att or {}).get('state_reason') or 'the attachment ended'}")
            if att["state"] != "attaching":
                return
            if time.monotonic() >= deadline:
                raise CsiError("ABORTED", f"{volume_id} is still being attached: try again")
            time.sleep(0.25)

    def detach(self, volume_id: str, instance_id: str) -> None:
        try:
            started: Body = self.client.call("POST", f"/v1/volumes/{volume_id}/detach", {"instance_id": instance_id})
        except VbsError as exc:
            if exc.status == 404:
                return
            raise
        self._operation(started.get("operation_id"), volume_id)

    # -- snapshots ---------------------------------------------------------------------------------

    def snapshot(self, snapshot_id: str) -> Body | None:
        """The snapshot, or None when it does not exist (or its id is not one)."""
        return self._live("snapshot", snapshot_id)

    def snapshot_named(self, name: str) -> Body | None:
        return self._named("snapshots", name, GONE)

    def create_snapshot(self, volume_id: str, tags: dict[str, str]) -> Body:
        made: Body = self.client.call("POST", "/v1/snapshots", {"volume_id": volume_id, "tags": tags})
        return made

    def settle_snapshot(self, snapshot_id: str) -> Body:
        return self._settle(f"/v1/snapshots/{snapshot_id}", SNAPSHOT_BUSY - {"deleting"}, snapshot_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._delete(f"/v1/snapshots/{snapshot_id}", snapshot_id)

    def snapshots_page(self, max_results: int, next_token: str, filters: list[str]) -> Body:
        return self._page("/v1/snapshots", max_results, next_token, filters)

    def _delete(self, path: str, resource_id: str) -> None:
        """DELETE ``path`` and wait until it is gone; absent is success."""
        try:
            self.client.call("DELETE", path)
        except VbsError as exc:
            if exc.status != 404:
                raise
            return
        self._gone(path, resource_id)

    def _page(self, path: str, max_results: int, next_token: str, filters: list[str]) -> Body:
        params = ([("max_results", str(max_results))] + ([("next_token", next_token)] if next_token else [])
                  + [("filter", f) for f in filters])
        page: Body = self.client.call("GET", f"{path}?{urlencode(params)}")
        return page

    # -- capacity ----------------------------------------------------------------------------------

    def free_bytes(self, zone: str | None) -> int:
        """What the live, undrained storage nodes' pools (of ``zone``) have free (an admin key's view)."""
        total = 0
        token = ""
        while True:
            params = [("max_results", "1000")] + ([("next_token", token)] if token else [])
            page: Body = self.client.call("GET", "/v1/storage-nodes?" + urlencode(params))
            for node in page["storage_nodes"]:
                if node["state"] == "up" and not node["drained"] and zone in (None, node["availability_zone"]):
                    total += sum(int(p["free_bytes"]) for p in node["pools"] if not p.get("lost"))
            token = page.get("next_token") or ""
            if not token:
                return total

    def can_read_capacity(self) -> bool:
        try:
            self.client.call("GET", "/v1/storage-nodes?max_results=1")
        except VbsError as exc:
            if exc.status in (401, 403):
                return False
            raise
        return True

    # -- inside ------------------------------------------------------------------------------------

    def _live(self, kind: str, resource_id: str) -> Body | None:
        """The ``kind`` (volume, snapshot) ``resource_id``; None when it is gone, absent, or not such an id."""
        if not ids.is_valid(kind, resource_id):
            return None
        try:
            body: Body = self.client.call("GET", f"/v1/{kind}s/{resource_id}")
        except VbsError as exc:
            if exc.status == 404:
                return None
            raise
        return None if body["status"] in GONE else body

    def _named(self, collection: str, name: str, gone: frozenset[str]) -> Body | None:
        params = [("filter", f"tag:{NAME_TAG}={name}"), ("max_results", "1000")]
        page: Body = self.client.call("GET", f"/v1/{collection}?" + urlencode(params))
        live = [item for item in page[collection] if item["status"] not in gone and item["tags"].get(NAME_TAG) == name]
        return dict(live[0]) if live else None

    def _settle(self, path: str, busy: frozenset[str], what: str) -> Body:
        poll = LongPoll(self.client, path, show=False)
        deadline = time.monotonic() + self.wait_s
        while True:
            body = poll()
            if body["status"] not in busy:
                return body
            if time.monotonic() >= deadline:
                raise CsiError("ABORTED", f"{what} is still {body['status']} ({body.get('progress', 0)}%): try again")

    def _gone(self, path: str, what: str) -> None:
        poll = LongPoll(self.client, path, show=False)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                body = poll()
            except VbsError as exc:
                if exc.status == 404:
                    return
                raise
            if body["status"] == "deleted":
                return
            if body["status"] != "deleting":
                raise CsiError("INTERNAL", f"{what} is {body['status']} after its delete: "
                                           f"{body.get('status_reason') or 'no reason given'}")
            if time.monotonic() >= deadline:
                raise CsiError("ABORTED", f"{what} is still being deleted: try again")

    def _operation(self, operation_id: str | None, what: str) -> None:
        """Wait until the operation ends; one that failed or rolled back is an error with its reason."""
        if not operation_id:
            return
        poll = LongPoll(self.client, f"/v1/operations/{quote(operation_id)}", show=False)
        deadline = time.monotonic() + self.wait_s
        while True:
            op = poll()
            if op["status"] == "succeeded":
                return
            if op["status"] in ("failed", "rolled-back"):
                raise CsiError("INTERNAL", f"{op.get('kind', 'the operation')} of {what} {op['status']}: "
                                           f"{op.get('error') or 'no reason given'}")
            if time.monotonic() >= deadline:
                raise CsiError("ABORTED", f"{op.get('kind', 'an operation')} of {what} is still running: try again")
