"""The CSI Node service: stage (loop device, filesystem, mount), publish (bind mount, read-only honoured),
unpublish and unstage (idempotent), online expansion, volume stats, the node's identity and zone. The
devices themselves are ``node_devices``; what a volume is on this host comes from its publish
(docs/kubernetes.md "On the node")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vbs.csi import proto
from vbs.csi.errors import CsiError
from vbs.csi.messages import capabilities
from vbs.csi.node_devices import NodeDevices
from vbs.csi.requests import TOPOLOGY_KEY, Capability, node_path, required, size_gib, unsupported
from vbs.csi.rpc import KeyedLocks, rpc, unimplemented

__all__ = ["NodeService", "MAX_VOLUMES_PER_NODE"]

MAX_VOLUMES_PER_NODE = 650  # the device names an attachment may take (vdb…vdzz)


class NodeService:
    def __init__(self, devices: NodeDevices, *, node_id: str, zone: str) -> None:
        self.pb = proto.pb()
        self.devices = devices
        self.node_id = node_id
        self.zone = zone
        self._locked = KeyedLocks()  # one call at a time per volume

    @rpc
    def NodeGetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802 - the spec's names
        return self.pb.NodeGetInfoResponse(node_id=self.node_id, max_volumes_per_node=MAX_VOLUMES_PER_NODE,
                                           accessible_topology=self.pb.Topology(segments={TOPOLOGY_KEY: self.zone}))

    @rpc
    def NodeGetCapabilities(self, request: Any, context: Any) -> Any:  # noqa: N802
        cap = self.pb.NodeServiceCapability
        kinds = [cap.RPC.STAGE_UNSTAGE_VOLUME, cap.RPC.GET_VOLUME_STATS, cap.RPC.EXPAND_VOLUME]
        return self.pb.NodeGetCapabilitiesResponse(capabilities=[cap(rpc=cap.RPC(type=k)) for k in kinds])

    def _capability(self, request: Any) -> Capability:
        if not request.HasField("volume_capability"):
            raise CsiError("INVALID_ARGUMENT", "volume_capability is required")
        cap = capabilities(self.pb, [request.volume_capability])[0]
        # The controller checked the mode against the volume; here only what the node can do with it.
        reason = unsupported([Capability(cap.access_type, cap.fs_type, "SINGLE_NODE_WRITER")], multi_attach=False)
        if reason:
            raise CsiError("INVALID_ARGUMENT", reason)
        return cap

    @rpc
    def NodeStageVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        staging = _volume_path(request, "staging_target_path")
        cap = self._capability(request)
        # Read-only when the publish was (the attach is: writes would fail) or the mode only reads.
        read_only = request.publish_context.get("readOnly") == "true" or cap.mode.endswith("_READER_ONLY")
        with self._locked(request.volume_id):
            device = self.devices.attach_loop(request.volume_id, read_only)
            if cap.access_type == "mount":
                self.devices.stage_filesystem(device, staging, cap.fs_type, read_only)
        return self.pb.NodeStageVolumeResponse()

    @rpc
    def NodeUnstageVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._unmounted(request, "staging_target_path"):
            self.devices.detach_loops(request.volume_id)
        return self.pb.NodeUnstageVolumeResponse()

    @contextmanager
    def _unmounted(self, request: Any, field: str) -> Iterator[Path]:
        """Undoing a stage or a publish: the path in ``request``'s ``field`` unmounted under the volume's lock,
        which the block (the rest of the undo, given the path) still holds."""
        path = _volume_path(request, field)
        with self._locked(request.volume_id):
            self.devices.unmount(path)
            yield path

    @rpc
    def NodePublishVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        target = _volume_path(request, "target_path")
        cap = self._capability(request)
        if not request.staging_target_path:
            raise CsiError("FAILED_PRECONDITION", "staging_target_path is required (the driver stages volumes)")
        staged = node_path(request.staging_target_path, "staging_target_path")
        with self._locked(request.volume_id):
            self.devices.disk(request.volume_id)  # NOT_FOUND when not published here
            if cap.access_type == "block":
                loops = self.devices.loops(request.volume_id)
                if not loops:
                    raise CsiError("FAILED_PRECONDITION", f"{request.volume_id} is not staged")
                source = loops[0]
            else:
                source = staged
                if not self.devices.is_mount(Path(source)):
                    raise CsiError("FAILED_PRECONDITION", f"{request.volume_id} is not staged at {source}")
            self.devices.bind(source, target, block=cap.access_type == "block",
                              read_only=request.readonly)
        return self.pb.NodePublishVolumeResponse()

    @rpc
    def NodeUnpublishVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._unmounted(request, "target_path") as target:
            self.devices.remove_target(target)
        return self.pb.NodeUnpublishVolumeResponse()

    @rpc
    def NodeGetVolumeStats(self, request: Any, context: Any) -> Any:  # noqa: N802
        required(request, "volume_id", "volume_path")
        self.devices.disk(request.volume_id)
        try:
            path = Path(node_path(request.volume_path, "volume_path"))
        except CsiError as exc:  # no volume can be there (csi-sanity: NOT_FOUND for a path that does not exist)
            raise CsiError("NOT_FOUND", exc.message) from exc
        kind, total, used, available, inodes, inodes_used = self.devices.stats(path)
        usage = self.pb.VolumeUsage
        if kind == "block":
            return self.pb.NodeGetVolumeStatsResponse(usage=[usage(unit=usage.BYTES, total=total)])
        return self.pb.NodeGetVolumeStatsResponse(usage=[
            usage(unit=usage.BYTES, total=total, used=used, available=available),
            usage(unit=usage.INODES, total=inodes, used=inodes_used, available=inodes - inodes_used)])

    @rpc
    def NodeExpandVolume(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The grown volume shown on this node: its loop device re-reads the size of the volume's file (which
        the host agent moved onto the grown export during ControllerExpandVolume), then the mounted
        filesystem grows online; a block volume only needs the first."""
        required(request, "volume_id", "volume_path")
        self.devices.disk(request.volume_id)  # NOT_FOUND when not published here
        path = Path(node_path(request.volume_path, "volume_path"))
        size_gib(request.capacity_range.required_bytes, request.capacity_range.limit_bytes)  # a valid range
        with self._locked(request.volume_id):
            kind = self.devices.kind(path)
            if request.HasField("volume_capability") and self._capability(request).access_type != kind:
                raise CsiError("INVALID_ARGUMENT", f"{path} holds a {kind} volume, not what volume_capability says")
            size = self.devices.refresh_loops(request.volume_id, request.capacity_range.required_bytes)
            if kind == "mount":
                device = self.devices.loops(request.volume_id)[0]
                if self.devices.mounted_from(path) != device:
                    raise CsiError("NOT_FOUND", f"{path} is not where {request.volume_id} is mounted")
                self.devices.grow_filesystem(device, path)
        return self.pb.NodeExpandVolumeResponse(capacity_bytes=size)

    NodeGetVolumeHealth = unimplemented("NodeGetVolumeHealth")
    NodeGetStorageHealth = unimplemented("NodeGetStorageHealth")


def _volume_path(request: Any, field: str) -> Path:
    """The checked path in ``request``'s ``field`` of a request that names its volume (both required)."""
    required(request, "volume_id")
    return Path(node_path(getattr(request, field), field))
