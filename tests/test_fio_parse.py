"""The reading of fio's JSON (fio 3.33, Debian's) into the figures bench/guest_datapath.py prints, and
the jobs ``run_fio`` accepts. The figures are those of a run on this machine (``fio --name=job
--filename=F --size=4M --rw=randread --bs=4k --ioengine=psync --output-format=json``), cut to the keys
read; fio prints its warnings before the JSON document on the same stream."""

from __future__ import annotations

import json

import pytest

from vbs.errors import DriverError, InvalidParameter
from vbs.rigs.testguest.fio import MIB, FioJob, parse_json

pytestmark = pytest.mark.unit

HOST_RUN = {
    "fio version": "fio-3.33",
    "jobs": [{
        "jobname": "job",
        "read": {"iops": 23813.953488, "bw_bytes": 97541953, "clat_ns": {"mean": 41023.46875}},
        "write": {"iops": 0.0, "bw_bytes": 0, "clat_ns": {"mean": 0.0}},
    }],
}  # fmt: skip


def test_the_side_asked_for_is_read_after_any_warnings() -> None:
    out = "fio: note: both iodepth >= 1 and synchronous I/O engine are selected\n" + json.dumps(HOST_RUN, indent=2)
    result = parse_json(out, "read")
    assert result.iops == pytest.approx(23813.953488)
    assert result.bytes_s == 97541953
    assert result.lat_mean_us == pytest.approx(41.02346875)


@pytest.mark.parametrize("out", ["", "fio: failed to open /dev/vdz\n", '{"jobs": []}', '{"jobs": [{"read": {}}]}'])
def test_output_without_the_figures_is_refused(out: str) -> None:
    with pytest.raises(DriverError):
        parse_json(out, "read")


@pytest.mark.parametrize("job", [("randrw", 4096, 32, 10), ("read", 1000, 8, 10), ("read", 32 * MIB, 8, 10),
                                 ("read", MIB, 0, 10), ("read", MIB, 8, -1)])
def test_jobs_outside_what_the_bench_runs_are_refused(job: tuple[str, int, int, int]) -> None:
    with pytest.raises(InvalidParameter):
        FioJob(*job)
