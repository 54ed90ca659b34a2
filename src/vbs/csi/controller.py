"""The CSI Controller service's volumes (docs/kubernetes.md "What the driver does"): create (by name, from a
snapshot or a volume, in a zone), delete, publish to a node and unpublish, list, get, validate, expand,
capacity. Snapshots are ``controller_snapshots``. A node is a VBS host; what a volume is attached to there
is the host agent's node instance (``node_vm``: the csi-node hypervisor profile's one VM)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from vbs.csi import proto
from vbs.csi.controller_snapshots import SnapshotMethods
from vbs.csi.errors import CsiError
from vbs.csi.messages import LIVE_ATTACHMENT, capabilities, published_hosts, volume_message
from vbs.csi.requests import (
    GIB,
    MAX_GIB,
    check_name,
    create_fields,
    key_of_secrets,
    required,
    size_gib,
    unsupported,
    zone_of,
)
from vbs.csi.rpc import KeyedLocks, rpc, unimplemented
from vbs.csi.vbs_api import CLONE_TAG, NAME_TAG, Body, VbsApi
from vbs.errors import VbsError

__all__ = ["ControllerService"]

_DEVICES = [f"vd{a}" for a in "bcdefghijklmnopqrstuvwxyz"] + [
    f"vd{a}{b}" for a in "bcdefghijklmnopqrstuvwxyz" for b in "bcdefghijklmnopqrstuvwxyz"]


class ControllerService(SnapshotMethods):
    def __init__(self, api: VbsApi, *, node_vm: str, capacity: bool) -> None:
        """``capacity``: the key may read the storage nodes' free space (GetCapacity is offered)."""
        self.pb = proto.pb()
        self.api = api
        self.node_vm = node_vm
        self.capacity = capacity
        # One call at a time per name or volume; another while it runs answers ABORTED (a sidecar's retry
        # overlapping its first try, which goes on).
        self.locked = KeyedLocks()

    def call_scope(self, request: Any) -> AbstractContextManager[None]:
        """The call acts with the VBS key its secrets carry (the sidecars fill them from the StorageClass's
        csi.storage.k8s.io/*-secret-name), else with the driver's own (``rpc`` enters this)."""
        return self.api.calls_as(key_of_secrets(dict(getattr(request, "secrets", {}))))

    @rpc
    def ControllerGetCapabilities(self, request: Any, context: Any) -> Any:  # noqa: N802 - the spec's names
        rpc_type = self.pb.ControllerServiceCapability.RPC.Type
        offered = ["CREATE_DELETE_VOLUME", "PUBLISH_UNPUBLISH_VOLUME", "LIST_VOLUMES", "CREATE_DELETE_SNAPSHOT",
                   "LIST_SNAPSHOTS", "CLONE_VOLUME", "PUBLISH_READONLY", "EXPAND_VOLUME",
                   "LIST_VOLUMES_PUBLISHED_NODES", "GET_VOLUME"]
        # GetSnapshot is answered but GET_SNAPSHOT not offered: the capability is alpha, and csi-sanity v5.4.0
        # fails a driver that offers one it does not know.
        offered += ["GET_CAPACITY"] if self.capacity else []
        cap = self.pb.ControllerServiceCapability
        return self.pb.ControllerGetCapabilitiesResponse(
            capabilities=[cap(rpc=cap.RPC(type=rpc_type.Value(name))) for name in offered])

    # -- create and delete -------------------------------------------------------------------------

    @rpc
    def CreateVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        name = check_name(request.name)
        fields = create_fields(dict(request.parameters))
        caps = capabilities(self.pb, request.volume_capabilities)
        reason = unsupported(caps, multi_attach=bool(fields.get("multi_attach")))
        if reason:
            raise CsiError("INVALID_ARGUMENT", reason)
        gib = size_gib(request.capacity_range.required_bytes, request.capacity_range.limit_bytes)
        zone = self._zone(request.accessibility_requirements)
        source = request.volume_content_source if request.HasField("volume_content_source") else None
        with self.locked(f"volume-name:{name}"):
            found = self.api.volume_named(name)
            if found is not None and found["status"] == "error":
                self.api.delete_volume(found["volume_id"])  # a failed create of this name: made again
                found = None
            if found is None:
                found = self._create(name, gib, zone, fields, source)
            else:
                found = self.api.settle_volume(found["volume_id"])
                self._same_request(found, name, gib, request.capacity_range.limit_bytes, source)
        if found["status"] == "error":
            raise CsiError("INTERNAL", f"creating {found['volume_id']} failed: {found.get('status_reason')}")
        return self.pb.CreateVolumeResponse(volume=volume_message(self.pb, found, source=source))

    def _zone(self, requirements: Any) -> str | None:
        """The zone to create in: the first preferred topology, else the first requisite one."""
        for segment in [*requirements.preferred, *requirements.requisite]:
            zone = zone_of(dict(segment.segments))
            if zone is not None:
                return zone
        return None

    def _create(self, name: str, gib: int, zone: str | None, fields: dict[str, Any], source: Any) -> Body:
        body: dict[str, Any] = {**fields, "size_gib": gib, "tags": {NAME_TAG: name}}
        if zone is not None:
            body["availability_zone"] = zone
        if source is None:
            return self.api.create_volume(body)
        kind = source.WhichOneof("type")
        if kind == "snapshot":
            snapshot = self.api.snapshot(source.snapshot.snapshot_id)
            if snapshot is None:
                raise CsiError("NOT_FOUND", f"snapshot {source.snapshot.snapshot_id[:40]!r} does not exist")
            if snapshot["volume_size_gib"] > gib:
                raise CsiError("OUT_OF_RANGE", f"the snapshot holds {snapshot['volume_size_gib']} GiB, more than "
                                               f"the {gib} GiB asked for")
            return self.api.create_volume({**body, "snapshot_id": snapshot["snapshot_id"]})
        if kind == "volume":
            return self._clone(body, source.volume.volume_id, gib)
        raise CsiError("INVALID_ARGUMENT", "a volume content source is a snapshot or a volume")

    def _clone(self, body: dict[str, Any], source_id: str, gib: int) -> Body:
        """A volume made from another through a snapshot of it, removed once the copy no longer needs it
        (a snapshot still in use by the copy stays, tagged with the clone's name, and goes with a later delete)."""
        origin = self.api.volume(source_id)
        if origin is None:
            raise CsiError("NOT_FOUND", f"volume {source_id[:40]!r} does not exist")
        if origin["size_gib"] > gib:
            raise CsiError("OUT_OF_RANGE", f"{source_id} holds {origin['size_gib']} GiB, more than {gib} GiB")
        through = self.api.create_snapshot(source_id, {CLONE_TAG: body["tags"][NAME_TAG]})
        snapshot = self.api.settle_snapshot(through["snapshot_id"])
        if snapshot["status"] != "completed":
            self.api.delete_snapshot(snapshot["snapshot_id"])
            raise CsiError("INTERNAL", f"the snapshot of {source_id} to copy it failed: "
                                       f"{snapshot.get('status_reason')}")
        try:
            return self.api.create_volume({**body, "snapshot_id": snapshot["snapshot_id"]})
        finally:
            try:
                self.api.delete_snapshot(snapshot["snapshot_id"])
            except VbsError:
                pass  # still read by the new volume's copy: it stays, tagged CLONE_TAG

    def _same_request(self, volume: Body, name: str, gib: int, limit: int, source: Any) -> None:
        """ALREADY_EXISTS when the volume made for ``name`` does not fit this request."""
        size = int(volume["size_gib"])
        if size < gib or (limit and size * GIB > limit):
            raise CsiError("ALREADY_EXISTS", f"volume {name!r} exists with {size} GiB, not {gib} GiB")
        if source is not None and source.WhichOneof("type") == "snapshot" and \
                volume.get("snapshot_id") != source.snapshot.snapshot_id:
            raise CsiError("ALREADY_EXISTS", f"volume {name!r} exists from another source")

    @rpc
    def DeleteVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "volume_id")
        self._delete_live(request.volume_id, self.api.volume, self.api.delete_volume)
        return self.pb.DeleteVolumeResponse()

    # -- publish and unpublish ---------------------------------------------------------------------

    @rpc
    def ControllerPublishVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        if not request.volume_id or not request.node_id:
            raise CsiError("INVALID_ARGUMENT", "volume_id and node_id are required")
        if not request.HasField("volume_capability"):
            raise CsiError("INVALID_ARGUMENT", "volume_capability is required")
        with self.locked(request.volume_id):
            volume = self._volume(request.volume_id)
            instance = self._node(request.node_id)
            reason = unsupported(capabilities(self.pb, [request.volume_capability]),
                                 multi_attach=bool(volume["multi_attach"]))
            if reason:
                raise CsiError("INVALID_ARGUMENT", reason)
            mode = "ro" if request.readonly else "rw"
            mine = [a for a in volume["attachments"]
                    if a["instance_id"] == instance["instance_id"] and a["state"] in LIVE_ATTACHMENT]
            if mine and mine[0]["mode"] != mode:
                raise CsiError("ALREADY_EXISTS", f"{request.volume_id} is published to {request.node_id} as "
                                                 f"{mine[0]['mode']}, not {mode}")
            if not mine:
                others = published_hosts(volume)
                if others and not volume["multi_attach"]:
                    raise CsiError("FAILED_PRECONDITION", f"{request.volume_id} is published to {others[0]} and "
                                                          "is not multi-attach")
                self._attach(request.volume_id, instance, request.readonly)
            else:
                self._attached(request.volume_id, instance["instance_id"])
        return self.pb.ControllerPublishVolumeResponse(publish_context={"readOnly": str(request.readonly).lower()})

    def _attach(self, volume_id: str, instance: Body, read_only: bool) -> None:
        """Attach under a device name the node's instance does not use. Another tenant's attachments are
        not shown to this key: a name VBS answers taken is skipped, and the next one tried."""
        used = {a["device"].removeprefix("/dev/") for a in instance["volumes"]}
        for device in (d for d in _DEVICES if d not in used):
            try:
                self.api.attach(volume_id, instance["host"], self.node_vm, device, read_only)
                return
            except VbsError as exc:
                if exc.code != "InvalidParameterValue" or f"'{device}' is already in use" not in str(exc):
                    raise
        raise CsiError("RESOURCE_EXHAUSTED", f"node {instance['host']} has no device name left")

    def _attached(self, volume_id: str, instance_id: str) -> None:
        """Wait for an attach under way (a retry of a publish that is still running)."""
        volume = self.api.settle_volume(volume_id)
        for att in volume["attachments"]:
            if att["instance_id"] == instance_id and att["state"] == "attaching":
                self.api.wait_attachment(volume_id, att["attachment_id"])

    @rpc
    def ControllerUnpublishVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "volume_id")
        with self.locked(request.volume_id):
            volume = self.api.volume(request.volume_id)
            if volume is not None:
                for att in volume["attachments"]:
                    if att["state"] in LIVE_ATTACHMENT and att["vm_id"] == self.node_vm and \
                            request.node_id in ("", att["host"]) and att["instance_id"]:
                        self.api.detach(request.volume_id, att["instance_id"])
        return self.pb.ControllerUnpublishVolumeResponse()

    def _volume(self, volume_id: str) -> Body:
        volume = self.api.volume(volume_id)
        if volume is None:
            raise CsiError("NOT_FOUND", f"volume {volume_id[:40]!r} does not exist")
        return volume

    def _node(self, node_id: str) -> Body:
        instance = self.api.instance(node_id, self.node_vm) if len(node_id) <= 63 else None
        if instance is None or instance["state"] != "running":
            raise CsiError("NOT_FOUND", f"node {node_id[:63]!r} is not a VBS host serving CSI volumes "
                                        f"(its host agent reports no running {self.node_vm!r})")
        return instance

    # -- describe ----------------------------------------------------------------------------------

    @rpc
    def ValidateVolumeCapabilities(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "volume_id")
        caps = capabilities(self.pb, request.volume_capabilities)
        if not caps:
            raise CsiError("INVALID_ARGUMENT", "volume_capabilities are required")
        volume = self._volume(request.volume_id)
        create_fields(dict(request.parameters))
        reason = unsupported(caps, multi_attach=bool(volume["multi_attach"]))
        if reason:
            return self.pb.ValidateVolumeCapabilitiesResponse(message=reason)
        confirmed = self.pb.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=dict(request.volume_context), volume_capabilities=list(request.volume_capabilities),
            parameters=dict(request.parameters))
        return self.pb.ValidateVolumeCapabilitiesResponse(confirmed=confirmed)

    @rpc
    def ListVolumes(self, request: Any, context: Any) -> Any:  # noqa: N802
        if request.max_entries < 0:
            raise CsiError("INVALID_ARGUMENT", "max_entries may not be negative")
        want = min(request.max_entries or 1000, 1000)
        token = request.starting_token
        entries: list[Any] = []
        while True:
            try:
                page = self.api.volumes_page(want, token, [f"tag-key={NAME_TAG}"])
            except VbsError as exc:
                if exc.status == 400 and token:
                    raise CsiError("ABORTED", f"starting_token is not valid: {exc}") from exc
                raise
            for volume in page["volumes"]:
                status = self.pb.ListVolumesResponse.VolumeStatus(published_node_ids=published_hosts(volume))
                entries.append(self.pb.ListVolumesResponse.Entry(volume=volume_message(self.pb, volume),
                                                                 status=status))
            token = page.get("next_token") or ""
            if request.max_entries or not token:
                return self.pb.ListVolumesResponse(entries=entries, next_token=token)

    @rpc
    def ControllerGetVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "volume_id")
        volume = self._volume(request.volume_id)
        status = self.pb.ControllerGetVolumeResponse.VolumeStatus(published_node_ids=published_hosts(volume))
        return self.pb.ControllerGetVolumeResponse(volume=volume_message(self.pb, volume), status=status)

    @rpc
    def GetCapacity(self, request: Any, context: Any) -> Any:  # noqa: N802
        if not self.capacity:
            raise CsiError("UNIMPLEMENTED", "GetCapacity needs an admin key (the storage nodes' free space)")
        zone = zone_of(dict(request.accessible_topology.segments)) if request.HasField("accessible_topology") \
            else None
        response = self.pb.GetCapacityResponse(available_capacity=self.api.free_bytes(zone))
        response.maximum_volume_size.value = MAX_GIB * GIB
        response.minimum_volume_size.value = GIB
        return response

    @rpc
    def ControllerExpandVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "volume_id")
        if not request.HasField("capacity_range"):
            raise CsiError("INVALID_ARGUMENT", "capacity_range is required")
        gib = size_gib(request.capacity_range.required_bytes, request.capacity_range.limit_bytes)
        with self.locked(request.volume_id):
            volume = self._volume(request.volume_id)
            if int(volume["size_gib"]) < gib:
                # Online: VBS moves each node's view of a published volume onto the grown export (the csi-node
                # profile's online_resize); the node's NodeExpandVolume then grows its loop device and filesystem.
                readers = sorted({a["host"] for a in volume["attachments"]
                                  if a["state"] in LIVE_ATTACHMENT and a["mode"] == "ro"})
                if readers:
                    raise CsiError("FAILED_PRECONDITION", f"{request.volume_id} is published read-only to "
                                   f"{', '.join(readers)}, where it cannot grow: unpublish it to expand it")
                self.api.grow(request.volume_id, gib)
                volume = self._volume(request.volume_id)
        # The node grows the filesystem (or a block volume's loop device) now if the volume is staged, else at
        # its next stage.
        return self.pb.ControllerExpandVolumeResponse(capacity_bytes=int(volume["size_gib"]) * GIB,
                                                      node_expansion_required=True)

    ControllerModifyVolume = unimplemented("ControllerModifyVolume")
    ControllerGetVolumeHealth = unimplemented("ControllerGetVolumeHealth")
    ControllerListVolumeHealth = unimplemented("ControllerListVolumeHealth")
