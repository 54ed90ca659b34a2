"""The CSI Controller service's decisions, on an in-memory VBS (``FakeVbs`` in place of ``vbs_api.VbsApi``):
idempotency by name, the conflicts CSI names (ALREADY_EXISTS, FAILED_PRECONDITION, NOT_FOUND), device names
on a node, online expansion, paging, and VBS's errors as gRPC statuses through the services' ``rpc`` wrapper.
The same calls against a real ``vbs up`` are tests/test_csi_sanity.py and tests/test_csi_e2e.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest

from vbs.csi import proto
from vbs.csi.controller import ControllerService
from vbs.csi.requests import GIB, TOPOLOGY_KEY
from vbs.csi.vbs_api import NAME_TAG
from vbs.errors import AuthFailure, IncorrectState, InvalidParameter
from vbs.trust.credentials import AccessKey

pytestmark = pytest.mark.unit

pb = proto.pb()
NODE_VM = "csi-node"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Context:
    """What a servicer gets from gRPC: ``abort`` raises, as grpc's does."""

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


class FakeVbs:
    """The calls ControllerService makes of VbsApi, on dicts shaped as the REST API's answers."""

    def __init__(self) -> None:
        self.volumes: dict[str, dict[str, Any]] = {}
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.instances = {("host-1", NODE_VM): {"instance_id": "i-00000000000000001", "host": "host-1",
                                                "vm_id": NODE_VM, "state": "running", "volumes": []},
                          ("host-2", NODE_VM): {"instance_id": "i-00000000000000002", "host": "host-2",
                                                "vm_id": NODE_VM, "state": "running", "volumes": []}}
        self.ids = itertools.count(1)
        self.attaches: list[tuple[str, str, str, bool]] = []
        self.fail_next: Exception | None = None
        self.key: str | None = None  # the key id of the call under way (None: the driver's own)

    @contextmanager
    def calls_as(self, key: AccessKey | None) -> Iterator[None]:
        self.key = key.access_key_id if key is not None else None
        try:
            yield
        finally:
            self.key = None

    def _check(self) -> None:
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure

    def volume(self, volume_id: str) -> dict[str, Any] | None:
        self._check()
        return self.volumes.get(volume_id)

    def volume_named(self, name: str) -> dict[str, Any] | None:
        return next((v for v in self.volumes.values() if v["tags"].get(NAME_TAG) == name), None)

    def create_volume(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check()
        volume_id = f"vol-{next(self.ids):017x}"
        self.volumes[volume_id] = {"volume_id": volume_id, "size_gib": body["size_gib"], "status": "available",
                                   "availability_zone": body.get("availability_zone", "us-east-1a"),
                                   "snapshot_id": body.get("snapshot_id"), "multi_attach": body.get("multi_attach",
                                                                                                      False),
                                   "tags": dict(body["tags"]), "attachments": [], "body": body, "key": self.key}
        return self.volumes[volume_id]

    def settle_volume(self, volume_id: str) -> dict[str, Any]:
        return self.volumes[volume_id]

    def delete_volume(self, volume_id: str) -> None:
        self.volumes.pop(volume_id, None)

    def volumes_page(self, max_results: int, next_token: str, filters: list[str]) -> dict[str, Any]:
        ids = sorted(self.volumes)
        if next_token and next_token not in ids:
            raise InvalidParameter("The token is not valid.")
        start = ids.index(next_token) if next_token else 0
        page = ids[start:start + max_results]
        rest = ids[start + max_results:]
        return {"volumes": [self.volumes[i] for i in page], "next_token": rest[0] if rest else None}

    def grow(self, volume_id: str, size_gib: int) -> None:
        self.volumes[volume_id]["size_gib"] = size_gib

    def instance(self, host: str, vm_id: str) -> dict[str, Any] | None:
        return self.instances.get((host, vm_id))

    def attach(self, volume_id: str, host: str, vm_id: str, device: str, read_only: bool) -> dict[str, Any]:
        self._check()
        inst = self.instances[(host, vm_id)]
        att = {"attachment_id": f"att-{next(self.ids)}", "instance_id": inst["instance_id"], "host": host,
               "vm_id": vm_id, "device": device, "mode": "ro" if read_only else "rw", "state": "attached"}
        self.volumes[volume_id]["attachments"].append(att)
        inst["volumes"].append(att)
        self.attaches.append((volume_id, host, device, read_only))
        return att

    def detach(self, volume_id: str, instance_id: str) -> None:
        volume = self.volumes[volume_id]
        volume["attachments"] = [a for a in volume["attachments"] if a["instance_id"] != instance_id]

    def snapshot(self, snapshot_id: str) -> dict[str, Any] | None:
        return self.snapshots.get(snapshot_id)


def service(fake: FakeVbs) -> ControllerService:
    return ControllerService(fake, node_vm=NODE_VM, capacity=False)  # type: ignore[arg-type]


def call(svc: ControllerService, method: str, request: Any) -> Any:
    return getattr(svc, method)(request, Context())


def status(svc: ControllerService, method: str, request: Any) -> grpc.StatusCode:
    with pytest.raises(Aborted) as caught:
        call(svc, method, request)
    return caught.value.code


def cap(mode: str = "SINGLE_NODE_WRITER", block: bool = False) -> Any:
    c = pb.VolumeCapability()
    if block:
        c.block.SetInParent()
    else:
        c.mount.fs_type = "ext4"
    c.access_mode.mode = pb.VolumeCapability.AccessMode.Mode.Value(mode)
    return c


def create(name: str, gib: int = 1, **params: str) -> Any:
    request = pb.CreateVolumeRequest(name=name, volume_capabilities=[cap()], parameters=params)
    request.capacity_range.required_bytes = gib * GIB
    return request


def test_create_is_idempotent_by_name_and_another_size_already_exists() -> None:
    fake = FakeVbs()
    svc = service(fake)
    first = call(svc, "CreateVolume", create("pvc-1", 2, type="io2", iops="3000")).volume
    assert call(svc, "CreateVolume", create("pvc-1", 2, type="io2", iops="3000")).volume.volume_id == first.volume_id
    assert len(fake.volumes) == 1 and first.capacity_bytes == 2 * GIB
    assert fake.volumes[first.volume_id]["body"] == {"volume_type": "io2", "iops": 3000, "size_gib": 2,
                                                     "tags": {NAME_TAG: "pvc-1"}}
    assert status(svc, "CreateVolume", create("pvc-1", 3)) == grpc.StatusCode.ALREADY_EXISTS
    assert status(svc, "CreateVolume", create("pvc-2", 1, type="gp9")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status(svc, "CreateVolume", create("")) == grpc.StatusCode.INVALID_ARGUMENT


def test_create_goes_to_the_preferred_zone_and_answers_its_topology() -> None:
    fake = FakeVbs()
    svc = service(fake)
    request = create("pvc-z")
    request.accessibility_requirements.requisite.add().segments[TOPOLOGY_KEY] = "us-east-1b"
    request.accessibility_requirements.preferred.add().segments[TOPOLOGY_KEY] = "us-east-1c"
    volume = call(svc, "CreateVolume", request).volume
    assert fake.volumes[volume.volume_id]["body"]["availability_zone"] == "us-east-1c"
    assert dict(volume.accessible_topology[0].segments) == {TOPOLOGY_KEY: "us-east-1c"}


def test_a_create_from_a_snapshot_that_does_not_exist_is_not_found() -> None:
    svc = service(FakeVbs())
    request = create("pvc-s")
    request.volume_content_source.snapshot.snapshot_id = "snap-0123456789abcdef0"
    assert status(svc, "CreateVolume", request) == grpc.StatusCode.NOT_FOUND


def publish(volume_id: str, node: str = "host-1", readonly: bool = False, mode: str = "SINGLE_NODE_WRITER",
            block: bool = False) -> Any:
    return pb.ControllerPublishVolumeRequest(volume_id=volume_id, node_id=node, readonly=readonly,
                                             volume_capability=cap(mode, block))


def test_publish_is_idempotent_per_node_and_conflicts_are_named() -> None:
    fake = FakeVbs()
    svc = service(fake)
    vol = call(svc, "CreateVolume", create("pvc-p")).volume.volume_id
    assert call(svc, "ControllerPublishVolume", publish(vol)).publish_context["readOnly"] == "false"
    call(svc, "ControllerPublishVolume", publish(vol))
    assert len(fake.attaches) == 1, "the same publish again attaches nothing"
    assert status(svc, "ControllerPublishVolume", publish(vol, readonly=True)) == grpc.StatusCode.ALREADY_EXISTS
    assert status(svc, "ControllerPublishVolume", publish(vol, "host-2")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status(svc, "ControllerPublishVolume", publish(vol, "host-9")) == grpc.StatusCode.NOT_FOUND
    assert status(svc, "ControllerPublishVolume", publish("vol-0123456789abcdef0")) == grpc.StatusCode.NOT_FOUND
    assert status(svc, "ControllerPublishVolume", publish(vol, "")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status(svc, "ControllerPublishVolume",
                  publish(vol, "host-2", mode="MULTI_NODE_MULTI_WRITER", block=True)) == \
        grpc.StatusCode.INVALID_ARGUMENT, "multi-node modes need a multi-attach volume"
    call(svc, "ControllerUnpublishVolume", pb.ControllerUnpublishVolumeRequest(volume_id=vol, node_id="host-1"))
    call(svc, "ControllerUnpublishVolume", pb.ControllerUnpublishVolumeRequest(volume_id=vol, node_id="host-1"))
    assert fake.volumes[vol]["attachments"] == []


def test_a_multi_attach_volume_is_published_to_several_nodes_in_block_mode() -> None:
    fake = FakeVbs()
    svc = service(fake)
    vol = call(svc, "CreateVolume", create("pvc-m", 4, type="io2", iops="1000", multiAttach="true")).volume.volume_id
    for node in ("host-1", "host-2"):
        call(svc, "ControllerPublishVolume", publish(vol, node, mode="MULTI_NODE_MULTI_WRITER", block=True))
    assert sorted(a[1] for a in fake.attaches) == ["host-1", "host-2"]
    listed = call(svc, "ControllerGetVolume", pb.ControllerGetVolumeRequest(volume_id=vol))
    assert list(listed.status.published_node_ids) == ["host-1", "host-2"]


def test_each_volume_on_a_node_gets_a_device_name_the_node_does_not_use() -> None:
    fake = FakeVbs()
    svc = service(fake)
    fake.instances[("host-1", NODE_VM)]["volumes"].append({"device": "/dev/vdb"})  # another tenant's
    vols = [call(svc, "CreateVolume", create(f"pvc-{i}")).volume.volume_id for i in range(3)]
    for vol in vols:
        call(svc, "ControllerPublishVolume", publish(vol))
    assert [a[2] for a in fake.attaches] == ["vdc", "vdd", "vde"]


def test_expansion_grows_a_published_volume_never_shrinks_and_refuses_a_read_only_publish() -> None:
    fake = FakeVbs()
    svc = service(fake)
    vol = call(svc, "CreateVolume", create("pvc-e", 2)).volume.volume_id

    def expand(gib: int) -> Any:
        request = pb.ControllerExpandVolumeRequest(volume_id=vol)
        request.capacity_range.required_bytes = gib * GIB
        return request

    assert call(svc, "ControllerExpandVolume", expand(1)).capacity_bytes == 2 * GIB
    answer = call(svc, "ControllerExpandVolume", expand(3))
    assert answer.capacity_bytes == 3 * GIB and answer.node_expansion_required
    call(svc, "ControllerPublishVolume", publish(vol))
    answer = call(svc, "ControllerExpandVolume", expand(4))  # online: VBS grows it under the node
    assert answer.capacity_bytes == 4 * GIB and answer.node_expansion_required
    assert fake.volumes[vol]["size_gib"] == 4
    call(svc, "ControllerUnpublishVolume", pb.ControllerUnpublishVolumeRequest(volume_id=vol, node_id="host-1"))
    call(svc, "ControllerPublishVolume", publish(vol, readonly=True))
    assert status(svc, "ControllerExpandVolume", expand(5)) == grpc.StatusCode.FAILED_PRECONDITION
    assert fake.volumes[vol]["size_gib"] == 4


def test_delete_of_an_absent_volume_succeeds_and_vbs_errors_keep_their_codes() -> None:
    fake = FakeVbs()
    svc = service(fake)
    call(svc, "DeleteVolume", pb.DeleteVolumeRequest(volume_id="vol-0123456789abcdef0"))
    call(svc, "DeleteVolume", pb.DeleteVolumeRequest(volume_id="not-a-volume-id"))
    assert status(svc, "DeleteVolume", pb.DeleteVolumeRequest()) == grpc.StatusCode.INVALID_ARGUMENT
    vol = call(svc, "CreateVolume", create("pvc-d")).volume.volume_id
    fake.fail_next = IncorrectState("another operation holds the volume")
    assert status(svc, "DeleteVolume", pb.DeleteVolumeRequest(volume_id=vol)) == grpc.StatusCode.ABORTED
    fake.fail_next = RuntimeError("a bug")
    assert status(svc, "DeleteVolume", pb.DeleteVolumeRequest(volume_id=vol)) == grpc.StatusCode.INTERNAL


def test_list_volumes_pages_with_tokens_and_refuses_a_bad_one() -> None:
    fake = FakeVbs()
    svc = service(fake)
    made = sorted(call(svc, "CreateVolume", create(f"pvc-l{i}")).volume.volume_id for i in range(5))
    seen: list[str] = []
    token = ""
    while True:
        page = call(svc, "ListVolumes", pb.ListVolumesRequest(max_entries=2, starting_token=token))
        assert len(page.entries) <= 2
        seen += [e.volume.volume_id for e in page.entries]
        token = page.next_token
        if not token:
            break
    assert seen == made
    everything = call(svc, "ListVolumes", pb.ListVolumesRequest())
    assert [e.volume.volume_id for e in everything.entries] == made and not everything.next_token
    assert status(svc, "ListVolumes", pb.ListVolumesRequest(starting_token="bogus")) == grpc.StatusCode.ABORTED
    assert status(svc, "ListVolumes", pb.ListVolumesRequest(max_entries=-1)) == grpc.StatusCode.INVALID_ARGUMENT


def test_capacity_is_unimplemented_without_a_key_that_reads_the_storage_nodes() -> None:
    svc = service(FakeVbs())
    caps = call(svc, "ControllerGetCapabilities", pb.ControllerGetCapabilitiesRequest()).capabilities
    names = {pb.ControllerServiceCapability.RPC.Type.Name(c.rpc.type) for c in caps}
    assert "GET_CAPACITY" not in names and {"CREATE_DELETE_VOLUME", "PUBLISH_UNPUBLISH_VOLUME"} <= names
    assert status(svc, "GetCapacity", pb.GetCapacityRequest()) == grpc.StatusCode.UNIMPLEMENTED


def test_a_call_on_a_volume_another_call_holds_is_aborted_and_the_retry_succeeds() -> None:
    fake = FakeVbs()
    svc = service(fake)
    vol = call(svc, "CreateVolume", create("pvc-a")).volume.volume_id
    with svc.locked(vol):  # a publish of it still running
        assert status(svc, "DeleteVolume", pb.DeleteVolumeRequest(volume_id=vol)) == grpc.StatusCode.ABORTED
        assert vol in fake.volumes
    call(svc, "DeleteVolume", pb.DeleteVolumeRequest(volume_id=vol))
    assert vol not in fake.volumes


def test_a_device_name_another_tenant_holds_on_the_node_is_skipped() -> None:
    fake = FakeVbs()
    svc = service(fake)
    vol = call(svc, "CreateVolume", create("pvc-t")).volume.volume_id
    taken = {"vdb", "vdc"}  # attachments of another tenant: not in this key's view of the instance
    attach = fake.attach

    def attach_unless_taken(volume_id: str, host: str, vm_id: str, device: str, read_only: bool) -> dict[str, Any]:
        if device in taken:
            raise InvalidParameter(f"The device name '{device}' is already in use on that instance.")
        return attach(volume_id, host, vm_id, device, read_only)

    fake.attach = attach_unless_taken  # type: ignore[method-assign]
    call(svc, "ControllerPublishVolume", publish(vol))
    assert [a[2] for a in fake.attaches] == ["vdd"]


def test_a_key_in_the_secrets_is_used_for_that_call_only_and_bad_secrets_are_refused_without_their_values(
) -> None:
    fake = FakeVbs()
    svc = service(fake)
    secret = "tenant-b-secret-0123456789"
    request = create("pvc-tenant-b")
    request.secrets.update({"accessKeyId": "VBSKTENANTB000000001", "secretAccessKey": secret})
    made = call(svc, "CreateVolume", request).volume.volume_id
    assert fake.volumes[made]["key"] == "VBSKTENANTB000000001"
    assert fake.key is None, "the key is the call's only"
    mine = call(svc, "CreateVolume", create("pvc-file-key")).volume.volume_id
    assert fake.volumes[mine]["key"] is None  # no secrets: the driver's own key
    for bad in ({"accessKeyId": "VBSKTENANTB000000001"},  # half a key
                {"accessKeyId": "VBSKTENANTB000000001", "secretAccessKey": secret, "accesskeyid": "x"},  # misspelt
                {"accessKeyId": "not a key id", "secretAccessKey": secret},
                {"accessKeyId": "VBSKTENANTB000000001", "secretAccessKey": secret + " ;"}):
        request = create("pvc-bad")
        request.secrets.update(bad)
        with pytest.raises(Aborted) as caught:
            call(svc, "CreateVolume", request)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert secret not in str(caught.value)
    assert "pvc-bad" not in {v["tags"][NAME_TAG] for v in fake.volumes.values()}
    request = create("pvc-wrong-key")
    request.secrets.update({"accessKeyId": "VBSKUNKNOWN000000001", "secretAccessKey": secret})
    fake.fail_next = AuthFailure("The access key is not valid.")
    assert status(svc, "CreateVolume", request) == grpc.StatusCode.UNAUTHENTICATED


def test_get_snapshot_answers_the_snapshot_by_id_and_not_found_for_another() -> None:
    fake = FakeVbs()
    svc = service(fake)
    fake.snapshots["snap-00000000000000001"] = {"snapshot_id": "snap-00000000000000001", "volume_id": "vol-1",
                                                "volume_size_gib": 2, "status": "completed",
                                                "started_at": "2026-11-30T08:00:00Z"}
    caps = call(svc, "ControllerGetCapabilities", pb.ControllerGetCapabilitiesRequest()).capabilities
    assert "GET_SNAPSHOT" not in {pb.ControllerServiceCapability.RPC.Type.Name(c.rpc.type) for c in caps}  # alpha
    got = call(svc, "GetSnapshot", pb.GetSnapshotRequest(snapshot_id="snap-00000000000000001")).snapshot
    assert (got.snapshot_id, got.source_volume_id, got.size_bytes, got.ready_to_use) == \
        ("snap-00000000000000001", "vol-1", 2 * GIB, True)
    assert status(svc, "GetSnapshot", pb.GetSnapshotRequest(snapshot_id="snap-00000000000000002")) == \
        grpc.StatusCode.NOT_FOUND
    assert status(svc, "GetSnapshot", pb.GetSnapshotRequest()) == grpc.StatusCode.INVALID_ARGUMENT
