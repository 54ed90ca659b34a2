"""``vbs csi`` driven through its gRPC API as the Kubernetes sidecars drive it, on a real ``vbs up`` (the rig of
tests/test_csi_sanity.py): provision, publish to the node, write through the mounted filesystem, snapshot,
restore into a new volume and read it back bit-exact, expand (offline, as the driver advertises), unpublish,
delete; and GetCapacity with an admin key (docs/kubernetes.md "Proof")."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import VBS, stop_process, wait_until
from tests.test_csi_sanity import NODE, ZONE, CsiRig, accepts, release_node, rig  # noqa: F401 - the fixture
from vbs.csi import proto
from vbs.csi.requests import GIB, TOPOLOGY_KEY

pytestmark = pytest.mark.integration


class Sidecars:
    """The calls external-provisioner, -attacher, -snapshotter, -resizer and the kubelet make."""

    def __init__(self, socket: Path) -> None:
        import grpc

        self.pb, services = proto.pb(), proto.pb_grpc()
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.controller = services.ControllerStub(self.channel)
        self.node = services.NodeStub(self.channel)
        self.identity = services.IdentityStub(self.channel)

    fs_type = "ext4"

    def capability(self) -> Any:
        cap = self.pb.VolumeCapability(mount=self.pb.VolumeCapability.MountVolume(fs_type=self.fs_type))
        cap.access_mode.mode = self.pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
        return cap

    def create(self, name: str, gib: int, snapshot_id: str = "") -> Any:
        request = self.pb.CreateVolumeRequest(name=name, volume_capabilities=[self.capability()],
                                              parameters={"type": "gp3"})
        request.capacity_range.required_bytes = gib * GIB
        request.accessibility_requirements.preferred.add().segments[TOPOLOGY_KEY] = ZONE
        if snapshot_id:
            request.volume_content_source.snapshot.snapshot_id = snapshot_id
        return self.controller.CreateVolume(request).volume

    def publish(self, volume_id: str, staging: Path, target: Path) -> None:
        published = self.controller.ControllerPublishVolume(self.pb.ControllerPublishVolumeRequest(
            volume_id=volume_id, node_id=NODE, volume_capability=self.capability()))
        self.node.NodeStageVolume(self.pb.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), volume_capability=self.capability(),
            publish_context=published.publish_context))
        self.node.NodePublishVolume(self.pb.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), target_path=str(target),
            volume_capability=self.capability()))

    def unpublish(self, volume_id: str, staging: Path, target: Path) -> None:
        self.node.NodeUnpublishVolume(self.pb.NodeUnpublishVolumeRequest(volume_id=volume_id,
                                                                         target_path=str(target)))
        self.node.NodeUnstageVolume(self.pb.NodeUnstageVolumeRequest(volume_id=volume_id,
                                                                     staging_target_path=str(staging)))
        self.controller.ControllerUnpublishVolume(self.pb.ControllerUnpublishVolumeRequest(volume_id=volume_id,
                                                                                            node_id=NODE))

    def stats(self, volume_id: str, target: Path) -> dict[str, Any]:
        answer = self.node.NodeGetVolumeStats(self.pb.NodeGetVolumeStatsRequest(volume_id=volume_id,
                                                                                volume_path=str(target)))
        return {self.pb.VolumeUsage.Unit.Name(u.unit): (u.total, u.used, u.available) for u in answer.usage}


@pytest.fixture
def sidecars(rig: CsiRig, tmp_path: Path) -> Iterator[Sidecars]:  # noqa: F811 - the imported fixture
    s = Sidecars(rig.socket)
    yield s
    s.channel.close()  # (a test that made its own closes its own)
    release_node(tmp_path)  # what a failed test left mounted in its staging and pod paths


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_a_volume_goes_from_provisioning_through_a_snapshot_and_a_restore_to_its_delete(
        rig: CsiRig, sidecars: Sidecars, tmp_path: Path, fs_type: str) -> None:  # noqa: F811
    """The restore is mounted beside its source: the same filesystem UUID twice on one node (xfs: nouuid)."""
    sidecars.fs_type = fs_type
    paths = {k: tmp_path / k for k in ("staging-a", "pod-a", "staging-b", "pod-b")}
    for p in (paths["staging-a"], paths["staging-b"]):
        p.mkdir()
    started = time.monotonic()
    source = sidecars.create(f"e2e-source-{fs_type}", 1)
    sidecars.publish(source.volume_id, paths["staging-a"], paths["pod-a"])
    print(f"CreateVolume -> NodePublishVolume ({fs_type}): {time.monotonic() - started:.2f} s")
    assert sidecars.create(f"e2e-source-{fs_type}", 1).volume_id == source.volume_id, "idempotent by name"
    assert dict(source.accessible_topology[0].segments) == {TOPOLOGY_KEY: ZONE}

    data = os.urandom(4 << 20)
    with open(paths["pod-a"] / "data.bin", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.sync()
    snapshot = sidecars.controller.CreateSnapshot(sidecars.pb.CreateSnapshotRequest(
        name=f"e2e-snap-{fs_type}", source_volume_id=source.volume_id)).snapshot
    assert snapshot.ready_to_use and snapshot.size_bytes == GIB

    restored = sidecars.create(f"e2e-restored-{fs_type}", 1, snapshot.snapshot_id)
    assert restored.content_source.snapshot.snapshot_id == snapshot.snapshot_id
    sidecars.publish(restored.volume_id, paths["staging-b"], paths["pod-b"])
    assert (paths["pod-b"] / "data.bin").read_bytes() == data, "the restored volume holds the snapshot's bytes"
    before = sidecars.stats(restored.volume_id, paths["pod-b"])["BYTES"][0]

    # Offline expansion (the plugin advertises VolumeExpansion OFFLINE): refused while published, done
    # after, and the filesystem grows at the next stage.
    expand = sidecars.pb.ControllerExpandVolumeRequest(volume_id=restored.volume_id)
    expand.capacity_range.required_bytes = 2 * GIB
    import grpc

    with pytest.raises(grpc.RpcError) as refused:
        sidecars.controller.ControllerExpandVolume(expand)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    sidecars.unpublish(restored.volume_id, paths["staging-b"], paths["pod-b"])
    assert sidecars.controller.ControllerExpandVolume(expand).capacity_bytes == 2 * GIB
    sidecars.publish(restored.volume_id, paths["staging-b"], paths["pod-b"])
    after = sidecars.stats(restored.volume_id, paths["pod-b"])["BYTES"][0]
    assert after > before + GIB // 2, (before, after)
    assert (paths["pod-b"] / "data.bin").read_bytes() == data

    # The driver restarts (an upgrade of its pod): it kept nothing in memory, so what it staged and
    # published is found again from the kernel, and unpublished and unstaged as if it had not.
    sidecars.channel.close()
    rig.restart()
    sidecars = Sidecars(rig.socket)
    sidecars.fs_type = fs_type
    for volume, staging, pod in ((source, "staging-a", "pod-a"), (restored, "staging-b", "pod-b")):
        sidecars.unpublish(volume.volume_id, paths[staging], paths[pod])
        assert not paths[pod].exists() and not Path(paths[staging]).is_mount()
        sidecars.unpublish(volume.volume_id, paths[staging], paths[pod])  # again: nothing left to do, success
    sidecars.controller.DeleteSnapshot(sidecars.pb.DeleteSnapshotRequest(snapshot_id=snapshot.snapshot_id))
    for volume in (restored, source):
        sidecars.controller.DeleteVolume(sidecars.pb.DeleteVolumeRequest(volume_id=volume.volume_id))
        sidecars.controller.DeleteVolume(sidecars.pb.DeleteVolumeRequest(volume_id=volume.volume_id))  # again: ok
    listed = sidecars.controller.ListVolumes(sidecars.pb.ListVolumesRequest())
    assert [e.volume.volume_id for e in listed.entries] == []
    assert not rig.disks.exists() or os.listdir(rig.disks) == []
    sidecars.channel.close()


def test_get_capacity_is_offered_to_an_admin_key_with_the_pools_free_space(rig: CsiRig) -> None:  # noqa: F811
    """A controller-only driver with the install's admin key (a user's cannot read the storage nodes)."""
    socket = rig.tmp / "admin-plugin" / "csi.sock"
    proc = subprocess.Popen([*VBS, "csi", "--endpoint", f"unix://{socket}", "--controller-url", rig.vbs.endpoint,
                             "--credentials-file", str(rig.vbs.data_dir / "credentials")],
                            stdout=(rig.tmp / "csi-admin.log").open("ab"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: accepts(socket) or proc.poll() is not None, 60, what="the CSI socket")
        s = Sidecars(socket)
        caps = s.controller.ControllerGetCapabilities(s.pb.ControllerGetCapabilitiesRequest()).capabilities
        assert "GET_CAPACITY" in {s.pb.ControllerServiceCapability.RPC.Type.Name(c.rpc.type) for c in caps}
        request = s.pb.GetCapacityRequest()
        request.accessible_topology.segments[TOPOLOGY_KEY] = ZONE
        answer = s.controller.GetCapacity(request)
        nodes = rig.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]
        capacity = sum(p["capacity_bytes"] for n in nodes for p in n["pools"])
        assert 0 < answer.available_capacity <= capacity
        assert answer.maximum_volume_size.value == 16384 * GIB and answer.minimum_volume_size.value == GIB
        request.accessible_topology.segments[TOPOLOGY_KEY] = "eu-west-9z"
        assert s.controller.GetCapacity(request).available_capacity == 0, "no pool in another zone"
        s.channel.close()
    finally:
        stop_process(proc)
