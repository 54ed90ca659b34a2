"""``vbs csi`` driven through its gRPC API as the Kubernetes sidecars drive it, on a real ``vbs up`` (the rig of
tests/test_csi_sanity.py): provision, publish to the node, write through the mounted filesystem, snapshot,
restore into a new volume and read it back bit-exact, expand online (the volume grows in VBS while published,
then its loop device and filesystem on the node), unpublish, delete; a block volume grown online; a second
tenant's key passed in the calls' secrets, as the sidecars pass a StorageClass's; and GetCapacity with an
admin key (docs/kubernetes.md "Proof")."""

from __future__ import annotations

import mmap
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
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

    fs_type = "ext4"  # "" for a block volume

    def capability(self) -> Any:
        if not self.fs_type:
            cap = self.pb.VolumeCapability(block=self.pb.VolumeCapability.BlockVolume())
        else:
            cap = self.pb.VolumeCapability(mount=self.pb.VolumeCapability.MountVolume(fs_type=self.fs_type))
        cap.access_mode.mode = self.pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
        return cap

    def create(self, name: str, gib: int, snapshot_id: str = "", **parameters: str) -> Any:
        request = self.pb.CreateVolumeRequest(name=name, volume_capabilities=[self.capability()],
                                              parameters={"type": "gp3", **parameters})
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

    def expand(self, volume_id: str, gib: int, staging: Path, target: Path) -> tuple[Any, Any]:
        """ControllerExpandVolume as the external-resizer calls it, then NodeExpandVolume as the kubelet does
        when the answer says the node must grow it (the gRPC error of the latter, if any, in place of it)."""
        request = self.pb.ControllerExpandVolumeRequest(volume_id=volume_id)
        request.capacity_range.required_bytes = gib * GIB
        grown = self.controller.ControllerExpandVolume(request)
        node = self.pb.NodeExpandVolumeRequest(volume_id=volume_id, volume_path=str(target),
                                               staging_target_path=str(staging), volume_capability=self.capability())
        node.capacity_range.required_bytes = gib * GIB
        try:
            return grown, self.node.NodeExpandVolume(node)
        except grpc.RpcError as exc:
            return grown, exc

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

    # Online expansion (the plugin advertises VolumeExpansion ONLINE): the volume grows in VBS while it is
    # published, the host agent moves the node's FUSE file onto the grown export, NodeExpandVolume re-reads the
    # loop device and grows the mounted filesystem.
    grown, node = sidecars.expand(restored.volume_id, 2, paths["staging-b"], paths["pod-b"])
    assert grown.capacity_bytes == 2 * GIB and grown.node_expansion_required
    assert _loop_size(paths["staging-b"]) == 2 * GIB, "the node's device shows the new size"
    if fs_type == "ext4" and not _may_resize_ext4_online():
        # The kernel grows a mounted ext4 only for CAP_SYS_RESOURCE, which this machine's root lacks (a
        # Kubernetes node's privileged pod has it): the node says so, and the filesystem grows at its next stage.
        assert node.code() == grpc.StatusCode.FAILED_PRECONDITION and "CAP_SYS_RESOURCE" in node.details()
        assert (paths["pod-b"] / "data.bin").read_bytes() == data
        sidecars.unpublish(restored.volume_id, paths["staging-b"], paths["pod-b"])
        sidecars.publish(restored.volume_id, paths["staging-b"], paths["pod-b"])
    else:
        assert node.capacity_bytes == 2 * GIB
    after = sidecars.stats(restored.volume_id, paths["pod-b"])["BYTES"][0]
    assert after > before + GIB // 2, (before, after)
    assert (paths["pod-b"] / "data.bin").read_bytes() == data
    more = os.urandom(1 << 20)
    (paths["pod-b"] / "more.bin").write_bytes(more)
    os.sync()
    assert (paths["pod-b"] / "more.bin").read_bytes() == more

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


def test_a_published_block_volume_grows_online_and_keeps_its_bytes(
        rig: CsiRig, sidecars: Sidecars, tmp_path: Path) -> None:  # noqa: F811
    sidecars.fs_type = ""
    staging, pod = tmp_path / "staging", tmp_path / "pod"
    staging.mkdir()
    volume = sidecars.create("e2e-block-grow", 1)
    sidecars.publish(volume.volume_id, staging, pod)
    head, tail = os.urandom(1 << 20), os.urandom(1 << 20)
    _write_at(pod, 0, head)
    _write_at(pod, GIB - len(tail), tail)
    grown, node = sidecars.expand(volume.volume_id, 2, staging, pod)
    assert grown.capacity_bytes == 2 * GIB and node.capacity_bytes == 2 * GIB
    assert _size(pod) == 2 * GIB, "the published device shows the new size"
    beyond = os.urandom(1 << 20)
    _write_at(pod, GIB + (GIB // 2), beyond)
    assert _read_at(pod, 0, len(head)) == head and _read_at(pod, GIB - len(tail), len(tail)) == tail
    assert _read_at(pod, GIB + (GIB // 2), len(beyond)) == beyond
    assert sidecars.stats(volume.volume_id, pod)["BYTES"][0] == 2 * GIB
    sidecars.unpublish(volume.volume_id, staging, pod)
    sidecars.controller.DeleteVolume(sidecars.pb.DeleteVolumeRequest(volume_id=volume.volume_id))


def test_a_key_in_the_secrets_acts_for_its_tenant_and_a_wrong_one_is_refused(
        rig: CsiRig, sidecars: Sidecars, tmp_path: Path) -> None:  # noqa: F811
    """The sidecars pass the Secret a StorageClass names (csi.storage.k8s.io/provisioner-secret-name …) as each
    call's secrets: with a key there, the call acts as that key's tenant, not as the driver's own key's."""
    answer = rig.vbs.http.post("/v1/keys", json={"tenant": "k8s-team-b", "role": "user"})
    assert answer.status_code == 200, answer.text
    key = answer.json()
    team_b = {"accessKeyId": key["access_key_id"], "secretAccessKey": key["secret_access_key"]}
    as_team_b = {"authorization": f"Bearer {key['access_key_id']}:{key['secret_access_key']}"}
    pb = sidecars.pb
    request = pb.CreateVolumeRequest(name="e2e-team-b", volume_capabilities=[sidecars.capability()], secrets=team_b)
    request.accessibility_requirements.preferred.add().segments[TOPOLOGY_KEY] = ZONE
    volume = sidecars.controller.CreateVolume(request).volume
    assert rig.vbs.http.get(f"/v1/volumes/{volume.volume_id}", headers=as_team_b).status_code == 200
    with pytest.raises(grpc.RpcError) as other_tenant:  # the driver's own key (tenant k8s) does not see it
        sidecars.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=volume.volume_id))
    assert other_tenant.value.code() == grpc.StatusCode.NOT_FOUND

    published = sidecars.controller.ControllerPublishVolume(pb.ControllerPublishVolumeRequest(
        volume_id=volume.volume_id, node_id=NODE, volume_capability=sidecars.capability(), secrets=team_b))
    assert published.publish_context["readOnly"] == "false"
    expand = pb.ControllerExpandVolumeRequest(volume_id=volume.volume_id, secrets=team_b)
    expand.capacity_range.required_bytes = 2 * GIB
    assert sidecars.controller.ControllerExpandVolume(expand).capacity_bytes == 2 * GIB  # online, unstaged
    snapshot = sidecars.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="e2e-team-b-snap", source_volume_id=volume.volume_id, secrets=team_b)).snapshot
    assert rig.vbs.http.get(f"/v1/snapshots/{snapshot.snapshot_id}", headers=as_team_b).status_code == 200
    listed = sidecars.controller.ListSnapshots(pb.ListSnapshotsRequest(snapshot_id=snapshot.snapshot_id,
                                                                       secrets=team_b))
    assert [e.snapshot.snapshot_id for e in listed.entries] == [snapshot.snapshot_id]
    got = sidecars.controller.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=snapshot.snapshot_id, secrets=team_b))
    assert got.snapshot.source_volume_id == volume.volume_id and got.snapshot.ready_to_use
    sidecars.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snapshot.snapshot_id, secrets=team_b))
    sidecars.controller.ControllerUnpublishVolume(pb.ControllerUnpublishVolumeRequest(
        volume_id=volume.volume_id, node_id=NODE, secrets=team_b))

    wrong = [({**team_b, "secretAccessKey": "x" * 40}, grpc.StatusCode.UNAUTHENTICATED),
             ({"accessKeyId": "VBSK" + "0" * 16, "secretAccessKey": "x" * 40}, grpc.StatusCode.UNAUTHENTICATED),
             ({"accessKeyId": key["access_key_id"]}, grpc.StatusCode.INVALID_ARGUMENT),
             ({**team_b, "accessKeyID": key["access_key_id"]}, grpc.StatusCode.INVALID_ARGUMENT)]
    for secrets, code in wrong:
        with pytest.raises(grpc.RpcError) as refused:
            sidecars.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id, secrets=secrets))
        assert refused.value.code() == code, secrets.keys()
    assert rig.vbs.http.get(f"/v1/volumes/{volume.volume_id}", headers=as_team_b).json()["status"] == "available"
    sidecars.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id, secrets=team_b))
    assert rig.vbs.http.get(f"/v1/volumes/{volume.volume_id}", headers=as_team_b).json()["status"] == "deleted"
    assert key["secret_access_key"] not in rig.log.read_text(errors="replace"), "no secret in the driver's log"


def test_an_encrypted_volume_is_mounted_as_plaintext_and_its_pool_file_holds_only_ciphertext(
        rig: CsiRig, sidecars: Sidecars, tmp_path: Path) -> None:  # noqa: F811
    """The StorageClass's encrypted: "true": the node's FUSE file opens the LUKS container with the passphrase
    the attach brings (decrypted on the node, as a QEMU guest's disk is); the pool keeps ciphertext."""
    staging, pod = tmp_path / "staging", tmp_path / "pod"
    staging.mkdir()
    volume = sidecars.create("e2e-encrypted", 1, encrypted="true")
    as_driver = {"authorization": f"Bearer {rig.user_key}"}  # the driver's tenant
    assert rig.vbs.http.get(f"/v1/volumes/{volume.volume_id}", headers=as_driver).json()["encrypted"] is True
    sidecars.publish(volume.volume_id, staging, pod)
    seed = b"vbs-csi-plaintext-that-must-not-leak-" + os.urandom(8).hex().encode()
    data = seed * ((4 << 20) // len(seed))
    (pod / "data.bin").write_bytes(data)
    os.sync()
    assert sidecars.stats(volume.volume_id, pod)["BYTES"][0] > GIB // 2  # a filesystem on the plaintext
    grow = sidecars.pb.ControllerExpandVolumeRequest(volume_id=volume.volume_id)
    grow.capacity_range.required_bytes = 2 * GIB
    with pytest.raises(grpc.RpcError) as refused:  # VBS grows an encrypted volume while detached only
        sidecars.controller.ControllerExpandVolume(grow)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    sidecars.unpublish(volume.volume_id, staging, pod)
    pool_file = rig.vbs.pool / "volumes" / f"{volume.volume_id}.raw"
    with open(pool_file, "rb") as f:
        raw = f.read()
    assert raw.startswith(b"LUKS\xba\xbe") and seed not in raw, "plaintext in the pool file of an encrypted volume"
    sidecars.publish(volume.volume_id, staging, pod)  # the filesystem made on the plaintext is found again
    assert (pod / "data.bin").read_bytes() == data
    sidecars.unpublish(volume.volume_id, staging, pod)
    sidecars.controller.DeleteVolume(sidecars.pb.DeleteVolumeRequest(volume_id=volume.volume_id))


def _may_resize_ext4_online() -> bool:
    """Whether this process (and the driver it starts) holds CAP_SYS_RESOURCE, which ext4's online resize needs."""
    caps = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) & (1 << 24))


def _loop_size(staging: Path) -> int:
    source = subprocess.run(["findmnt", "--noheadings", "--output", "SOURCE", "--mountpoint", str(staging)],
                            capture_output=True, text=True, check=True).stdout.strip()
    return _size(Path(source))


def _size(device: Path) -> int:
    return int(subprocess.run(["blockdev", "--getsize64", str(device)], capture_output=True, text=True,
                              check=True).stdout.strip())


def _write_at(device: Path, offset: int, data: bytes) -> None:
    fd = os.open(device, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_at(device: Path, offset: int, length: int) -> bytes:
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, length)
        os.preadv(fd, [buf], offset)
        return bytes(buf)
    finally:
        os.close(fd)


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
