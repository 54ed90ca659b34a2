"""What ``make bench`` and ``make bench-quick`` run: the whole set in full, the five-minute set, and
named benches in their own short mode (``bench/run_all.py``)."""

from __future__ import annotations

import pytest
from bench.run_all import BENCHES, plan

pytestmark = pytest.mark.unit


def test_the_full_set_runs_every_bench_in_its_full_mode() -> None:
    assert [(b.name, a) for b, a in plan(quick=False, only=None)] == [(b.name, b.full) for b in BENCHES]


def test_the_five_minute_set_measures_each_target_of_the_performance_issue() -> None:
    names = [b.name for b, _ in plan(quick=True, only=None)]
    # create / page latency, attach in both guests and the snapshot curves come from scale; the CLI,
    # two controllers, completion, the copy fallback, NBD / iSCSI / RBD reads and Bonnie++ each once
    assert names == ["cli_startup", "scale", "control_plane_rbd", "cluster", "copy_fallback", "datapath",
                     "datapath_rbd", "completion", "bonnie"]
    args = dict((b.name, a) for b, a in plan(quick=True, only=None))
    assert "--reads-only" in args["datapath"] and "--reads-only" in args["datapath_rbd"]
    # its scale plot goes to the logs, not over the full run's docs/scale.png
    assert args["scale"][args["scale"].index("--plot") + 1] == "{log_dir}/scale.png"


def test_named_benches_run_in_their_own_short_mode_even_outside_the_five_minute_set() -> None:
    chosen = plan(quick=True, only=["rtt", "attach"])
    assert [(b.name, a) for b, a in chosen] == [("attach", ("--quick",)), ("rtt", ("--quick",))]
    assert [(b.name, a) for b, a in plan(quick=False, only=["rtt"])] == [("rtt", ())]
