"""The CSI driver's checks of what a request asks (vbs.csi.requests) and its errors as gRPC codes
(vbs.csi.errors): capacity ranges, StorageClass parameters, capabilities, topology, and the codes the
sidecars act on (docs/kubernetes.md "Errors")."""

from __future__ import annotations

import pytest

from vbs.csi.errors import CsiError, code_of, from_vbs
from vbs.csi.requests import (
    GIB,
    MAX_GIB,
    TOPOLOGY_KEY,
    Capability,
    check_name,
    create_fields,
    node_path,
    size_gib,
    unsupported,
    zone_of,
)
from vbs.errors import (
    AgentUnavailable,
    AuthFailure,
    IdempotentParameterMismatch,
    IncorrectState,
    InsufficientCapacity,
    InvalidParameter,
    LimitExceeded,
    MissingParameter,
    NotFound,
    SnapshotInUse,
    UnauthorizedOperation,
    VbsError,
    VolumeInUse,
)

pytestmark = pytest.mark.unit


def code(call: object) -> str:
    assert callable(call)
    with pytest.raises(CsiError) as caught:
        call()
    return caught.value.code


@pytest.mark.parametrize(("required", "limit", "gib"), [
    (0, 0, 1), (1, 0, 1), (GIB, 0, 1), (GIB + 1, 0, 2), (10 * GIB, 10 * GIB, 10), (GIB + 1, 3 * GIB, 2),
    (0, 5 * GIB, 1), (0, 5 * GIB + 7, 1), (MAX_GIB * GIB, 0, MAX_GIB)])
def test_a_capacity_range_is_whole_gib_rounded_up_within_its_limit(required: int, limit: int, gib: int) -> None:
    assert size_gib(required, limit) == gib


def test_a_capacity_range_no_whole_gib_fits_is_out_of_range_and_a_reversed_one_invalid() -> None:
    assert code(lambda: size_gib(GIB + 1, GIB + 100)) == "OUT_OF_RANGE"
    assert code(lambda: size_gib(0, GIB - 1)) == "OUT_OF_RANGE"
    assert code(lambda: size_gib(MAX_GIB * GIB + 1, 0)) == "OUT_OF_RANGE"
    assert code(lambda: size_gib(2 * GIB, GIB)) == "INVALID_ARGUMENT"
    assert code(lambda: size_gib(-1, 0)) == "INVALID_ARGUMENT"


def test_storage_class_parameters_become_the_fields_of_a_create() -> None:
    assert create_fields({}) == {"volume_type": "gp3"}
    assert create_fields({"type": "io2", "iops": "4000", "multiAttach": "true",
                          "csi.storage.k8s.io/pv/name": "pvc-1", "csi.storage.k8s.io/fstype": "xfs"}) == {
        "volume_type": "io2", "iops": 4000, "multi_attach": True}
    assert create_fields({"type": "gp3", "throughput": "250", "encrypted": "TRUE", "kmsKeyId": "alias/k8s",
                          "pool": "fast-1", "fsType": "ext4"}) == {
        "volume_type": "gp3", "throughput": 250, "encrypted": True, "kms_key_id": "alias/k8s", "pool": "fast-1"}


@pytest.mark.parametrize("params", [
    {"type": "gp9"}, {"iops": "many"}, {"iops": "99"}, {"iops": "1e4"}, {"throughput": "4001"},
    {"encrypted": "yes"}, {"kmsKeyId": "alias/k"}, {"encrypted": "true", "kmsKeyId": "a b"},
    {"pool": "../etc"}, {"pool": "Fast"}, {"fsType": "btrfs"}, {"csi.storage.k8s.io/fstype": "ntfs"},
    {"volumeType": "gp3"}, {"zone": "us-east-1a"}])
def test_a_parameter_that_is_unknown_or_out_of_range_is_invalid(params: dict[str, str]) -> None:
    assert code(lambda: create_fields(params)) == "INVALID_ARGUMENT"


def test_names_are_printable_and_bounded() -> None:
    assert check_name("pvc-0a1b") == "pvc-0a1b"
    assert code(lambda: check_name("")) == "INVALID_ARGUMENT"
    assert code(lambda: check_name("a\nb")) == "INVALID_ARGUMENT"
    assert code(lambda: check_name("x" * 257)) == "INVALID_ARGUMENT"


def test_single_node_modes_are_served_everywhere_and_multi_node_ones_by_multi_attach_volumes_only() -> None:
    ext4_rw = Capability("mount", "ext4", "SINGLE_NODE_WRITER")
    block_many = Capability("block", "", "MULTI_NODE_MULTI_WRITER")
    readers = Capability("mount", "", "MULTI_NODE_READER_ONLY")
    assert unsupported([ext4_rw, Capability("block", "", "SINGLE_NODE_READER_ONLY"),
                        Capability("mount", "xfs", "SINGLE_NODE_SINGLE_WRITER")], multi_attach=False) is None
    assert "multi-attach" in str(unsupported([block_many], multi_attach=False))
    assert unsupported([block_many, readers], multi_attach=True) is None
    assert "filesystem" in str(unsupported([Capability("mount", "ext4", "MULTI_NODE_MULTI_WRITER")],
                                           multi_attach=True))
    assert "btrfs" in str(unsupported([Capability("mount", "btrfs", "SINGLE_NODE_WRITER")], multi_attach=False))
    assert unsupported([Capability("", "", "SINGLE_NODE_WRITER")], multi_attach=False)
    assert unsupported([Capability("mount", "", "UNKNOWN")], multi_attach=True)
    assert unsupported([], multi_attach=False)


def test_topology_names_a_zone_by_the_drivers_key_only() -> None:
    assert zone_of({TOPOLOGY_KEY: "us-east-1a"}) == "us-east-1a"
    assert zone_of({}) is None
    assert code(lambda: zone_of({"topology.kubernetes.io/zone": "a"})) == "INVALID_ARGUMENT"
    assert code(lambda: zone_of({TOPOLOGY_KEY: "US East"})) == "INVALID_ARGUMENT"


@pytest.mark.parametrize(("error", "grpc_code"), [
    (InvalidParameter("bad"), "INVALID_ARGUMENT"),
    (MissingParameter("none"), "INVALID_ARGUMENT"),
    (NotFound("gone", code="InvalidVolume.NotFound"), "NOT_FOUND"),
    (NotFound("gone", code="InvalidSnapshot.NotFound"), "NOT_FOUND"),
    (NotFound("gone"), "NOT_FOUND"),
    (IdempotentParameterMismatch("other"), "ALREADY_EXISTS"),
    (VbsError("quota", code="VolumeLimitExceeded", status=400), "RESOURCE_EXHAUSTED"),
    (LimitExceeded("quota"), "RESOURCE_EXHAUSTED"),
    (InsufficientCapacity("full"), "RESOURCE_EXHAUSTED"),
    (VolumeInUse("attached"), "FAILED_PRECONDITION"),
    (SnapshotInUse("read by a copy"), "FAILED_PRECONDITION"),
    (IncorrectState("another operation holds it"), "ABORTED"),
    (AuthFailure("who"), "UNAUTHENTICATED"),
    (UnauthorizedOperation("admin only"), "PERMISSION_DENIED"),
    (AgentUnavailable("down"), "UNAVAILABLE"),
    (VbsError("odd", code="Odd", status=418), "INTERNAL"),
    (VbsError("broken"), "INTERNAL"),
])
def test_vbs_errors_answer_the_grpc_codes_csi_expects(error: VbsError, grpc_code: str) -> None:
    assert code_of(error) == grpc_code
    mapped = from_vbs(error)
    assert mapped.code == grpc_code and error.code in mapped.message and str(error) in mapped.message


def test_every_mapped_code_is_a_grpc_status() -> None:
    import grpc

    from vbs.csi import errors

    for name in {*errors._BY_CODE.values(), *errors._BY_STATUS.values(), "INTERNAL", "OUT_OF_RANGE", "ABORTED"}:
        assert isinstance(getattr(grpc.StatusCode, name), grpc.StatusCode)


@pytest.mark.parametrize("path", [
    "/var/lib/kubelet/pods/0f1e/volumes/kubernetes.io~csi/pvc-1/mount",
    "/var/lib/kubelet/plugins/kubernetes.io/csi/vbs.io/abc/globalmount", "/x", "/a b/.hidden/..x"])
def test_a_node_path_is_taken_when_absolute_and_normalised(path: str) -> None:
    assert node_path(path, "target_path") == path


@pytest.mark.parametrize("path", [
    "", "relative/dir", "-o/remount", "/a/../etc", "/a/./b", "/..", "/a//b", "/a/", "/a\nb", "/a\x00b",
    "/" + "x" * 256, "/a" * 2100])
def test_a_node_path_that_is_relative_climbs_or_holds_control_characters_is_invalid(path: str) -> None:
    assert code(lambda: node_path(path, "target_path")) == "INVALID_ARGUMENT"
