"""EBS volume types: what each allows (sizes, IOPS, throughput, multi-attach) and what describe reports.

One set of rules for the REST and the EC2 API, applied on create and on modify, with EC2's error codes:
``InvalidParameterCombination`` for a parameter the type does not take, ``MissingParameter`` for one it
needs, ``InvalidParameterValue`` for a value out of the type's range.

A volume row keeps only the limits a user gave (``iops``/``throughput`` None otherwise): those are
enforced at the data path. A type's nominal figures — gp2's 3 IOPS per GiB, gp3's 3,000 IOPS and
125 MiB/s — are what describe reports where none was given (``reported_iops``/``reported_throughput``),
and are enforced only where the operator turns on ``enforce_type_limits`` (``enforced_limits``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vbs.errors import InvalidParameter, MissingParameter
from vbs.wire.qos import VOLUME_TYPE_RE, ExportLimits, QoS


@dataclass(frozen=True)
class TypeSpec:
    min_gib: int
    max_gib: int
    iops: tuple[int, int] | None = None  # settable IOPS range; None: the type takes no Iops
    iops_per_gib: int | None = None  # the most IOPS per GiB of size
    iops_required: bool = False
    throughput: tuple[int, int] | None = None  # settable MiB/s range
    multi_attach: bool = False
    default_iops: int | None = None
    default_throughput: int | None = None


SPECS: dict[str, TypeSpec] = {
    "gp2": TypeSpec(1, 16384),
    "gp3": TypeSpec(1, 16384, iops=(3000, 16000), iops_per_gib=500, throughput=(125, 1000), default_iops=3000,
                    default_throughput=125),
    "io1": TypeSpec(4, 16384, iops=(100, 64000), iops_per_gib=50, iops_required=True, multi_attach=True),
    "io2": TypeSpec(4, 16384, iops=(100, 256000), iops_per_gib=1000, iops_required=True, multi_attach=True),
    "st1": TypeSpec(125, 16384),
    "sc1": TypeSpec(125, 16384),
    "standard": TypeSpec(1, 1024),
}

# gp2: 3 IOPS per GiB, at least 100 and at most 16,000.
GP2_IOPS_PER_GIB, GP2_MIN_IOPS, GP2_MAX_IOPS = 3, 100, 16000
# gp3: at most 0.25 MiB/s per provisioned IOPS.
GP3_MIBPS_PER_IOPS = 0.25


def check(volume_type: str, size_gib: int, iops: int | None, throughput: int | None, multi_attach: bool) -> None:
    """Refuse a combination EC2 refuses; nothing is returned."""
    spec = SPECS.get(volume_type)
    if spec is None:
        raise InvalidParameter(f"Value ({volume_type[:16]}) for parameter volumeType is invalid. "
                               f"Valid types: {', '.join(SPECS)}.")
    if not spec.min_gib <= size_gib <= spec.max_gib:
        raise InvalidParameter(f"Volume of {size_gib} GiB is too {'small' if size_gib < spec.min_gib else 'large'}"
                               f" for {volume_type}; {volume_type} volumes are {spec.min_gib}-{spec.max_gib} GiB.")
    if iops is not None and spec.iops is None:
        raise InvalidParameter(f"The parameter iops is not supported for {volume_type} volumes.",
                               code="InvalidParameterCombination")
    if iops is None and spec.iops_required:
        raise MissingParameter(f"The parameter iops must be specified for {volume_type} volumes.")
    if throughput is not None and spec.throughput is None:
        raise InvalidParameter(f"The parameter throughput is only supported for gp3 volumes, not {volume_type}.",
                               code="InvalidParameterCombination")
    if multi_attach and not spec.multi_attach:
        raise InvalidParameter(f"Multi-Attach is supported only on io1 and io2 volumes, not {volume_type}.",
                               code="InvalidParameterCombination")
    if iops is not None and spec.iops is not None:
        low, high = spec.iops
        if not low <= iops <= high:
            raise InvalidParameter(f"Iops {iops} is invalid for {volume_type}: {low}-{high}.")
        if spec.iops_per_gib is not None and iops > spec.iops_per_gib * size_gib and iops > low:
            raise InvalidParameter(f"Iops {iops} is too high for a {size_gib} GiB {volume_type} volume: at most "
                                   f"{spec.iops_per_gib} IOPS per GiB ({max(low, spec.iops_per_gib * size_gib)}).")
    if throughput is not None and spec.throughput is not None:
        low, high = spec.throughput
        if not low <= throughput <= high:
            raise InvalidParameter(f"Throughput {throughput} MiB/s is invalid for {volume_type}: {low}-{high}.")
        allowed = int((iops or spec.default_iops or 0) * GP3_MIBPS_PER_IOPS)
        if throughput > max(allowed, low):
            raise InvalidParameter(f"Throughput {throughput} MiB/s is too high for {iops or spec.default_iops} IOPS: "
                                   f"at most {GP3_MIBPS_PER_IOPS:g} MiB/s per IOPS ({allowed}).")


def reported_iops(volume_type: str, size_gib: int, iops: int | None) -> int | None:
    if iops is not None:
        return iops
    if volume_type == "gp2":
        return min(max(GP2_IOPS_PER_GIB * size_gib, GP2_MIN_IOPS), GP2_MAX_IOPS)
    spec = SPECS.get(volume_type)
    return spec.default_iops if spec is not None else None


def reported_throughput(volume_type: str, throughput: int | None) -> int | None:
    if throughput is not None:
        return throughput
    spec = SPECS.get(volume_type)
    return spec.default_throughput if spec is not None else None


def retarget(new_type: str, iops: int | None, throughput: int | None,
             asked_iops: int | None, asked_throughput: int | None) -> tuple[int | None, int | None]:
    """The limits a modification leaves: what was asked, else what the volume had where its new type takes
    it (a gp3 volume made gp2 loses its throughput, as on EC2)."""
    spec = SPECS.get(new_type)
    kept_iops = iops if spec is not None and spec.iops is not None else None
    kept_throughput = throughput if spec is not None and spec.throughput is not None else None
    return (asked_iops if asked_iops is not None else kept_iops,
            asked_throughput if asked_throughput is not None else kept_throughput)


def enforced_limits(volume_type: str, size_gib: int, iops: int | None, throughput: int | None, *,
                    type_limits: bool) -> ExportLimits:
    """What the data path enforces for a volume. Limits a user gave always; a type's nominal ones
    (gp3's 3,000 IOPS and 125 MiB/s, gp2's 3 IOPS per GiB) only with ``type_limits`` (the operator's
    ``enforce_type_limits``). The type goes along: it names a storage node's fair-dispatch group."""
    if type_limits:
        iops, throughput = reported_iops(volume_type, size_gib, iops), reported_throughput(volume_type, throughput)
    qos = QoS(iops=iops, mbps=throughput)
    return ExportLimits(qos=qos if qos.limits_anything() else None,
                        volume_type=volume_type if re.fullmatch(VOLUME_TYPE_RE, volume_type) else None)
