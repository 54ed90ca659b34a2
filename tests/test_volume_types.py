"""EBS volume-type rules (vbs.controller.placement.volume_types) and EC2's time filter values, without a service."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from vbs.controller.placement import volume_types as vt
from vbs.controller.requests.filters import time_span
from vbs.errors import InvalidParameter, MissingParameter

pytestmark = pytest.mark.unit


def code_of(volume_type: str, size: int, iops: int | None = None, throughput: int | None = None,
            multi: bool = False) -> str | None:
    try:
        vt.check(volume_type, size, iops, throughput, multi)
    except (InvalidParameter, MissingParameter) as exc:
        return exc.code
    return None


def test_what_each_type_takes() -> None:
    assert code_of("gp2", 1) is None and code_of("gp3", 1, 3000, 125) is None
    assert code_of("io2", 4, 1000, multi=True) is None and code_of("io1", 10, 500, multi=True) is None
    assert code_of("gp2", 1, throughput=125) == "InvalidParameterCombination"  # throughput only on gp3
    assert code_of("io2", 4, 1000, throughput=125) == "InvalidParameterCombination"
    assert code_of("gp3", 1, multi=True) == "InvalidParameterCombination"  # multi-attach only on io1/io2
    assert code_of("gp2", 1, iops=300) == "InvalidParameterCombination"
    assert code_of("io1", 10) == "MissingParameter"  # io1/io2 need their IOPS
    assert code_of("io1", 10, 501) == "InvalidParameterValue"  # over 50 IOPS per GiB
    assert code_of("gp3", 1, 2999) == "InvalidParameterValue"
    assert code_of("gp3", 100, 3000, 751) == "InvalidParameterValue"  # over 0.25 MiB/s per IOPS
    assert code_of("st1", 124) == "InvalidParameterValue" and code_of("sc1", 125) is None
    assert code_of("ssd", 1) == "InvalidParameterValue"


def test_reported_figures_are_the_types_nominal_ones_where_none_was_given() -> None:
    assert [vt.reported_iops("gp2", size, None) for size in (1, 33, 34, 100, 5334, 16384)] == [
        100, 100, 102, 300, 16000, 16000]
    assert (vt.reported_iops("gp3", 1, None), vt.reported_throughput("gp3", None)) == (3000, 125)
    assert (vt.reported_iops("gp3", 1, 4000), vt.reported_throughput("gp3", 250)) == (4000, 250)
    assert (vt.reported_iops("st1", 500, None), vt.reported_throughput("gp2", None)) == (None, None)


def test_a_modification_keeps_limits_the_new_type_takes() -> None:
    assert vt.retarget("gp3", 4000, 250, None, None) == (4000, 250)
    assert vt.retarget("gp2", 4000, 250, None, None) == (None, None)  # gp2 takes neither
    assert vt.retarget("io2", 4000, 250, None, None) == (4000, None)
    assert vt.retarget("gp3", 4000, 250, 5000, None) == (5000, 250)


def test_time_filter_values() -> None:
    def at(*parts: int) -> datetime:
        return datetime(*parts, tzinfo=UTC)  # type: ignore[arg-type]

    assert time_span("2026-11-26T08:30:00.000Z") == (at(2026, 11, 26, 8, 30), at(2026, 11, 26, 8, 30, 0, 1000))
    assert time_span("2026-11-26T08:30:00Z") == (at(2026, 11, 26, 8, 30), at(2026, 11, 26, 8, 30, 1))
    assert time_span("2026-11-26T08:*") == (at(2026, 11, 26, 8), at(2026, 11, 26, 9))
    assert time_span("2026-12-*") == (at(2026, 12, 1), at(2027, 1, 1))
    assert time_span("2026-*") == (at(2026, 1, 1), at(2027, 1, 1))
    for bad in ("2026", "2026-13-*", "x*", "2026-11-26T08:30Z", "2026-02-30T00:00:00Z"):
        with pytest.raises(ValueError, match="is not a time"):
            time_span(bad)
