"""The CSI Controller service's snapshots: create (idempotent by name), delete, get, list (by id, by source
volume, paged). A snapshot is a VBS snapshot tagged with its CSI name (``vbs_api.NAME_TAG``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from vbs.csi.errors import CsiError
from vbs.csi.messages import snapshot_message
from vbs.csi.requests import SIDECAR_PREFIX, check_name, required
from vbs.csi.rpc import KeyedLocks, rpc
from vbs.csi.vbs_api import NAME_TAG, Body, VbsApi
from vbs.errors import VbsError

__all__ = ["SnapshotMethods"]


class SnapshotMethods:
    """Mixed into ``ControllerService``, which gives ``pb``, ``api`` and ``locked``."""

    pb: Any
    api: VbsApi
    locked: KeyedLocks

    @rpc
    def CreateSnapshot(self, request: Any, context: Any) -> Any:  # noqa: N802 - the spec's names
        name = check_name(request.name, "snapshot")
        required(request, "source_volume_id")
        if any(not k.startswith(SIDECAR_PREFIX) for k in request.parameters):
            raise CsiError("INVALID_ARGUMENT", "a VolumeSnapshotClass takes no parameters for VBS (but the "
                                               f"sidecars' {SIDECAR_PREFIX}…)")
        with self.locked(f"snapshot-name:{name}"):
            found = self.api.snapshot_named(name)
            if found is not None and found["volume_id"] != request.source_volume_id:
                raise CsiError("ALREADY_EXISTS", f"snapshot {name!r} exists, of another volume")
            if found is not None and found["status"] == "error":
                self.api.delete_snapshot(found["snapshot_id"])  # a failed snapshot of this name: taken again
                found = None
            if found is None:
                if self.api.volume(request.source_volume_id) is None:
                    raise CsiError("NOT_FOUND", f"volume {request.source_volume_id[:40]!r} does not exist")
                found = self.api.create_snapshot(request.source_volume_id, {NAME_TAG: name})
            found = self.api.settle_snapshot(found["snapshot_id"])
        if found["status"] == "error":
            raise CsiError("INTERNAL", f"snapshot {found['snapshot_id']} failed: {found.get('status_reason')}")
        return self.pb.CreateSnapshotResponse(snapshot=snapshot_message(self.pb, found))

    @rpc
    def DeleteSnapshot(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "snapshot_id")
        self._delete_live(request.snapshot_id, self.api.snapshot, self.api.delete_snapshot)
        return self.pb.DeleteSnapshotResponse()

    def _delete_live(self, resource_id: str, lookup: Callable[[str], Body | None],
                     delete: Callable[[str], None]) -> None:
        """DeleteVolume's and DeleteSnapshot's work: under the id's lock, ``delete`` the volume or snapshot
        ``lookup`` finds live; one gone, absent or not such an id is success (CSI's deletes are idempotent)."""
        with self.locked(resource_id):
            if lookup(resource_id) is not None:
                delete(resource_id)

    @rpc
    def GetSnapshot(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The snapshot by id (the spec's alpha GET_SNAPSHOT, not advertised: see ControllerGetCapabilities)."""
        required(request, "snapshot_id")
        found = self.api.snapshot(request.snapshot_id)
        if found is None:
            raise CsiError("NOT_FOUND", f"snapshot {request.snapshot_id[:40]!r} does not exist")
        return self.pb.GetSnapshotResponse(snapshot=snapshot_message(self.pb, found))

    @rpc
    def ListSnapshots(self, request: Any, context: Any) -> Any:  # noqa: N802
        if request.max_entries < 0:
            raise CsiError("INVALID_ARGUMENT", "max_entries may not be negative")
        if request.snapshot_id:
            found = self.api.snapshot(request.snapshot_id)
            wanted = found is not None and request.source_volume_id in ("", found["volume_id"])
            entries = [self._entry(found)] if found is not None and wanted else []
            return self.pb.ListSnapshotsResponse(entries=entries)
        filters = [f"tag-key={NAME_TAG}"]
        if request.source_volume_id:
            if self.api.volume(request.source_volume_id) is None:
                return self.pb.ListSnapshotsResponse()
            filters.append(f"volume-id={request.source_volume_id}")
        entries = list(self._pages(request, filters))
        return self.pb.ListSnapshotsResponse(entries=entries[:-1], next_token=entries[-1]) if entries and \
            isinstance(entries[-1], str) else self.pb.ListSnapshotsResponse(entries=entries)

    def _pages(self, request: Any, filters: list[str]) -> Iterator[Any]:
        """The entries of one page (``max_entries``) and then its next token, or of every page."""
        want = min(request.max_entries or 1000, 1000)
        token = request.starting_token
        while True:
            try:
                page = self.api.snapshots_page(want, token, filters)
            except VbsError as exc:
                if exc.status == 400 and token:
                    raise CsiError("ABORTED", f"starting_token is not valid: {exc}") from exc
                raise
            for snapshot in page["snapshots"]:
                if snapshot["status"] not in ("deleting", "deleted"):
                    yield self._entry(snapshot)
            token = page.get("next_token") or ""
            if not token:
                return
            if request.max_entries:
                yield token
                return

    def _entry(self, snapshot: dict[str, Any]) -> Any:
        return self.pb.ListSnapshotsResponse.Entry(snapshot=snapshot_message(self.pb, snapshot))
