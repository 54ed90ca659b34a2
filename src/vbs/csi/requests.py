"""What a CSI request asks, checked and turned into VBS terms (docs/kubernetes.md "StorageClass parameters"):
capacity ranges as GiB, StorageClass parameters as a create's fields, volume capabilities against what a
volume can serve. Plain values in and out (no gRPC here): the services convert their messages."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vbs.csi.errors import CsiError
from vbs.errors import InvalidParameter
from vbs.trust.credentials import AccessKey
from vbs.wire.connection import POOL_NAME_RE
from vbs.wire.storage import ZONE_NAME_RE

__all__ = ["GIB", "MAX_GIB", "size_gib", "create_fields", "Capability", "unsupported", "check_name",
           "TOPOLOGY_KEY", "zone_of", "FS_TYPES", "PARAMETERS", "SIDECAR_PREFIX", "VOLUME_TYPES", "node_path",
           "SECRET_KEY_ID", "SECRET_ACCESS_KEY", "key_of_secrets", "required"]

GIB = 1 << 30
MAX_GIB = 16384  # the REST API's largest volume (docs/rest-api.md)
TOPOLOGY_KEY = "topology.vbs.io/zone"
FS_TYPES = frozenset({"ext4", "xfs"})
DEFAULT_FS = "ext4"

# Keys the external-provisioner adds to every request's parameters (--extra-create-metadata): not ours.
SIDECAR_PREFIX = "csi.storage.k8s.io/"
VOLUME_TYPES = frozenset({"standard", "gp2", "gp3", "io1", "io2", "st1", "sc1"})
# The StorageClass parameters the driver knows (docs/kubernetes.md "StorageClass parameters"); the
# manifests' StorageClasses are checked against this table (tests/test_k8s_manifests.py).
PARAMETERS = frozenset({"type", "iops", "throughput", "encrypted", "kmsKeyId", "multiAttach", "pool", "fsType",
                        "csi.storage.k8s.io/fstype"})
# The keys of a Secret the sidecars pass a call (csi.storage.k8s.io/provisioner-secret-name and the like): a VBS
# access key that the call uses in place of the driver's own (docs/kubernetes.md "A key per namespace").
SECRET_KEY_ID = "accessKeyId"
SECRET_ACCESS_KEY = "secretAccessKey"
_POOL_RE = re.compile(POOL_NAME_RE)
_ZONE_RE = re.compile(ZONE_NAME_RE)
_KMS_RE = re.compile(r"[\x21-\x7e]{1,256}")
_NAME_RE = re.compile(r"[^\x00-\x1f\x7f]{1,256}")
# A path the CO gives the node (kubelet's staging and target paths): absolute, printable, no "." or ".."
# component, no doubled or trailing slash; it reaches mount(8) and losetup(8) as an argument of its own.
_PATH_RE = re.compile(r"(/(?!\.\.?(/|$))[^/\x00-\x1f\x7f]{1,255})+")
MAX_PATH = 4096


def required(request: Any, *fields: str) -> None:
    """Refuse a request that leaves any of these (string) fields empty, the first named first."""
    for name in fields:
        if not getattr(request, name):
            raise CsiError("INVALID_ARGUMENT", f"{name} is required")


def node_path(raw: str, what: str) -> str:
    """``raw`` if it is a path the node may mount at or stat (``_PATH_RE``), else INVALID_ARGUMENT."""
    if not raw:
        raise CsiError("INVALID_ARGUMENT", f"{what} is required")
    if len(raw) > MAX_PATH or not _PATH_RE.fullmatch(raw):
        raise CsiError("INVALID_ARGUMENT", f"{what} must be an absolute, normalised path of printable characters")
    return raw


def key_of_secrets(secrets: Mapping[str, str]) -> AccessKey | None:
    """The VBS key a call's secrets carry (None: they carry nothing). Any other key in them, or one of the two
    alone, is refused rather than ignored: a misspelt name must not make the call act with the driver's own
    key, in another tenant. No message holds a value."""
    if not secrets:
        return None
    unknown = sorted(k for k in secrets if k not in (SECRET_KEY_ID, SECRET_ACCESS_KEY))
    if unknown:
        raise CsiError("INVALID_ARGUMENT", f"the secrets hold unknown keys {', '.join(k[:40] for k in unknown[:5])}: "
                                           f"a VBS key is {SECRET_KEY_ID} and {SECRET_ACCESS_KEY}")
    if len(secrets) != 2:
        raise CsiError("INVALID_ARGUMENT", f"the secrets must hold both {SECRET_KEY_ID} and {SECRET_ACCESS_KEY}")
    try:
        return AccessKey(secrets[SECRET_KEY_ID], secrets[SECRET_ACCESS_KEY])
    except InvalidParameter as exc:
        raise CsiError("INVALID_ARGUMENT", f"the VBS key in the secrets is not valid: {exc.message}") from None


def check_name(name: str, what: str = "volume") -> str:
    """A CSI name (kept as a tag value: at most 256 printable characters)."""
    if not name:
        raise CsiError("INVALID_ARGUMENT", f"the {what}'s name is required")
    if not _NAME_RE.fullmatch(name):
        raise CsiError("INVALID_ARGUMENT", f"the {what}'s name must be 1-256 printable characters")
    return name


def size_gib(required_bytes: int, limit_bytes: int, default_gib: int = 1) -> int:
    """The whole GiB a capacity range asks for: the required bytes rounded up (the default when neither
    bound is given), within the limit; OUT_OF_RANGE when no whole GiB fits."""
    if required_bytes < 0 or limit_bytes < 0:
        raise CsiError("INVALID_ARGUMENT", "capacity bounds may not be negative")
    if limit_bytes and required_bytes > limit_bytes:
        raise CsiError("INVALID_ARGUMENT", f"required_bytes {required_bytes} is above limit_bytes {limit_bytes}")
    gib = -(-required_bytes // GIB) if required_bytes else default_gib
    if limit_bytes and gib * GIB > limit_bytes:
        gib = limit_bytes // GIB
        if gib < 1 or gib * GIB < required_bytes:
            raise CsiError("OUT_OF_RANGE", f"no whole GiB lies within {required_bytes}-{limit_bytes} bytes")
    gib = max(gib, 1)
    if gib > MAX_GIB:
        raise CsiError("OUT_OF_RANGE", f"{gib} GiB is above the largest volume, {MAX_GIB} GiB")
    return gib


def _int(params: Mapping[str, str], key: str, low: int, high: int) -> int | None:
    if key not in params:
        return None
    raw = params[key]
    if not re.fullmatch(r"[0-9]{1,7}", raw) or not low <= int(raw) <= high:
        raise CsiError("INVALID_ARGUMENT", f"parameter {key} must be a whole number {low}-{high}, not {raw[:20]!r}")
    return int(raw)


def _flag(params: Mapping[str, str], key: str) -> bool:
    raw = params.get(key, "false").lower()
    if raw not in ("true", "false"):
        raise CsiError("INVALID_ARGUMENT", f"parameter {key} must be true or false, not {raw[:20]!r}")
    return raw == "true"


def _match(params: Mapping[str, str], key: str, pattern: re.Pattern[str]) -> str | None:
    raw = params.get(key)
    if raw is not None and not pattern.fullmatch(raw):
        raise CsiError("INVALID_ARGUMENT", f"parameter {key} is not valid: {raw[:40]!r}")
    return raw


def create_fields(params: Mapping[str, str]) -> dict[str, Any]:
    """A StorageClass's parameters as the fields of ``POST /v1/volumes``: ``type``, ``iops``,
    ``throughput``, ``encrypted``, ``kmsKeyId``, ``multiAttach``, ``pool``, and ``fsType`` (the node's, not
    the volume's; checked here). Unknown keys are refused; the sidecars' own keys are let through."""
    unknown = sorted(k for k in params if k not in PARAMETERS and not k.startswith(SIDECAR_PREFIX))
    if unknown:
        raise CsiError("INVALID_ARGUMENT", f"unknown parameters: {', '.join(k[:40] for k in unknown[:5])} "
                                           f"(known: {', '.join(sorted(PARAMETERS))})")
    fields: dict[str, Any] = {"volume_type": params.get("type", "gp3")}
    if fields["volume_type"] not in VOLUME_TYPES:
        raise CsiError("INVALID_ARGUMENT", f"parameter type must be one of {', '.join(sorted(VOLUME_TYPES))}")
    iops = _int(params, "iops", 100, 256000)
    throughput = _int(params, "throughput", 1, 4000)
    if iops is not None:
        fields["iops"] = iops
    if throughput is not None:
        fields["throughput"] = throughput
    if _flag(params, "encrypted"):
        fields["encrypted"] = True
        kms = _match(params, "kmsKeyId", _KMS_RE)
        if kms is not None:
            fields["kms_key_id"] = kms
    elif "kmsKeyId" in params:
        raise CsiError("INVALID_ARGUMENT", "parameter kmsKeyId goes with encrypted: \"true\"")
    if _flag(params, "multiAttach"):
        fields["multi_attach"] = True
    pool = _match(params, "pool", _POOL_RE)
    if pool is not None:
        fields["pool"] = pool
    for key in ("fsType", "csi.storage.k8s.io/fstype"):
        if key in params and params[key] not in FS_TYPES:
            raise CsiError("INVALID_ARGUMENT", f"parameter {key} must be one of {', '.join(sorted(FS_TYPES))}")
    return fields


def zone_of(segments: Mapping[str, str]) -> str | None:
    """The zone a topology segment names (None: it names none); another key is refused."""
    unknown = sorted(set(segments) - {TOPOLOGY_KEY})
    if unknown:
        raise CsiError("INVALID_ARGUMENT", f"unknown topology keys {unknown[:3]} (VBS knows {TOPOLOGY_KEY})")
    zone = segments.get(TOPOLOGY_KEY)
    if zone is not None and not _ZONE_RE.fullmatch(zone):
        raise CsiError("INVALID_ARGUMENT", f"invalid zone {zone[:40]!r}")
    return zone


# CSI's access modes by name (csi.proto VolumeCapability.AccessMode.Mode).
_SINGLE_NODE = frozenset({"SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY", "SINGLE_NODE_SINGLE_WRITER",
                          "SINGLE_NODE_MULTI_WRITER"})


@dataclass(frozen=True)
class Capability:
    """One VolumeCapability: ``access_type`` "mount" or "block" ("" when the request left it out), the
    filesystem a mount asks for ("" for the driver's default), the access mode's name."""

    access_type: str
    fs_type: str
    mode: str


def unsupported(caps: list[Capability], *, multi_attach: bool) -> str | None:
    """Why a volume cannot serve ``caps`` (None: it can serve them all). Single-node modes everywhere;
    multi-node ones on multi-attach volumes only, and a filesystem is never written from several nodes."""
    if not caps:
        return "no volume capability given"
    for cap in caps:
        if cap.access_type not in ("mount", "block"):
            return "a volume capability must say mount or block"
        if cap.access_type == "mount" and cap.fs_type and cap.fs_type not in FS_TYPES:
            return f"filesystem {cap.fs_type[:20]!r} is not one of {', '.join(sorted(FS_TYPES))}"
        if cap.mode in _SINGLE_NODE:
            continue
        if cap.mode not in ("MULTI_NODE_READER_ONLY", "MULTI_NODE_SINGLE_WRITER", "MULTI_NODE_MULTI_WRITER"):
            return f"access mode {cap.mode} is not supported"
        if not multi_attach:
            return f"access mode {cap.mode} needs a multi-attach volume (io1 or io2, multiAttach: \"true\")"
        if cap.access_type == "mount" and cap.mode != "MULTI_NODE_READER_ONLY":
            return f"access mode {cap.mode} on a filesystem would corrupt it: use block"
    return None
