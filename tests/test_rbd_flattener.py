"""The flattener's bookkeeping, with a stand-in child process the test steps through: at most N run at
once, the rest wait in order, progress comes from the child's stderr as ``rbd flatten`` writes it,
a cancel stops the child and a closed flattener starts nothing. The real ``rbd flatten`` runs in
tests/test_rbd_chains.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import wait_until
from vbs.cli.admin import _emit_pool_details
from vbs.storage.backends.rbd_chains import Flattener

pytestmark = pytest.mark.unit

# Writes rbd flatten's progress to stderr, then waits for <dir>/<volume>.go and ends as it says.
CHILD = r"""
import os, sys, time
volume, where = sys.argv[1], sys.argv[2]
open(os.path.join(where, volume + ".started"), "w").close()
sys.stderr.write("\rImage flatten: 40% complete..."); sys.stderr.flush()
while not os.path.exists(os.path.join(where, volume + ".go")):
    time.sleep(0.02)
sys.stderr.write("\rImage flatten: 100% complete...done.\n"); sys.stderr.flush()
sys.exit(int(open(os.path.join(where, volume + ".go")).read() or 0))
"""
VOLS = [f"vol-0123456789abcdef{i}" for i in range(5)]


class Steps:
    def __init__(self, where: Path, max_running: int, skip: frozenset[str] = frozenset(),
                 failing_prepare: frozenset[str] = frozenset()) -> None:
        self.where = where
        self.ended: list[tuple[str, bool]] = []
        self.prepared: list[str] = []
        self.restored: list[str] = []
        self.failing_prepare = failing_prepare
        self.flattener = Flattener(lambda v: [sys.executable, "-c", CHILD, v, str(where)], max_running=max_running,
                                   stall_s=60, should_run=lambda v: v not in skip,
                                   done=lambda v, ok: self.ended.append((v, ok)), prepare=self.prepare,
                                   finish=self.restore)

    def prepare(self, volume: str) -> None:
        """What the backend's object map switched off stands for: it runs before the child exists."""
        assert not (self.where / f"{volume}.started").exists(), "prepare runs before the flatten"
        self.prepared.append(volume)
        if volume in self.failing_prepare:
            raise OSError("prepare failed half-way")

    def restore(self, volume: str) -> None:
        """The object map switched on again: after the flatten, however it ended."""
        assert volume in self.prepared, "finish only after prepare"
        self.restored.append(volume)

    def finish(self, volume: str, rc: int = 0) -> None:
        (self.where / f"{volume}.go").write_text(str(rc))

    def states(self) -> dict[str, tuple[str, int]]:
        return {f.volume_id: (f.state, f.progress) for f in self.flattener.report()}


def test_at_most_n_run_at_once_and_the_rest_wait_in_order(tmp_path: Path) -> None:
    steps = Steps(tmp_path, max_running=2)
    f = steps.flattener
    for v in VOLS:
        f.submit(v)
    f.submit(VOLS[0])  # again: nothing more
    wait_until(lambda: steps.states().get(VOLS[1]) == ("running", 40) and steps.states()[VOLS[0]][1] == 40, 30,
               what="two children report progress")
    assert steps.states() == {VOLS[0]: ("running", 40), VOLS[1]: ("running", 40), VOLS[2]: ("queued", 0),
                              VOLS[3]: ("queued", 0), VOLS[4]: ("queued", 0)}
    assert f.progress(VOLS[0]) == 40 and f.progress(VOLS[2]) == 0
    steps.finish(VOLS[1])
    wait_until(lambda: steps.states().get(VOLS[2], ("", 0))[0] == "running", 30, what="the next one starts")
    assert VOLS[1] not in steps.states() and f.progress(VOLS[1]) is None
    for v in VOLS:
        steps.finish(v, rc=1 if v == VOLS[4] else 0)
    assert f.wait_idle(30)
    assert f.peak == 2
    assert sorted(steps.ended) == sorted((v, v != VOLS[4]) for v in VOLS)
    assert sorted(f.completed) == sorted(VOLS[:4])  # the one whose child failed is retried by the next scan
    assert sorted(steps.prepared) == sorted(VOLS) == sorted(steps.restored)


def test_a_cancel_stops_the_child_and_a_queued_one_never_starts(tmp_path: Path) -> None:
    steps = Steps(tmp_path, max_running=1)
    f = steps.flattener
    f.submit(VOLS[0])
    f.submit(VOLS[1])
    wait_until(lambda: f.progress(VOLS[0]) == 40, 30, what="the child reports progress")
    f.cancel(VOLS[1])
    f.cancel(VOLS[0])
    assert f.wait_idle(30)
    assert steps.ended == [] and f.completed == []  # a cancelled flatten reports nothing
    assert f.report() == []
    assert steps.restored == [VOLS[0]], "a stopped flatten is followed by finish; one never started is not"


def test_finish_follows_a_prepare_that_failed_and_the_flatten_does_not_run(tmp_path: Path) -> None:
    steps = Steps(tmp_path, max_running=1, failing_prepare=frozenset({VOLS[0]}))
    f = steps.flattener
    f.submit(VOLS[0])
    assert f.wait_idle(30)
    assert steps.ended == [(VOLS[0], False)] and f.completed == []
    assert steps.restored == [VOLS[0]] and not (tmp_path / f"{VOLS[0]}.started").exists()


def test_one_no_longer_needed_is_skipped_and_a_closed_flattener_starts_nothing(tmp_path: Path) -> None:
    steps = Steps(tmp_path, max_running=1, skip=frozenset({VOLS[0]}))
    f = steps.flattener
    f.submit(VOLS[0])
    assert f.wait_idle(30)
    assert steps.ended == [(VOLS[0], False)] and f.completed == [] and steps.prepared == steps.restored == []
    f.close()
    f.submit(VOLS[1])
    assert f.report() == []


def test_vbs_check_tables_show_the_trash_the_chains_and_a_flattens_percentage(capsys: pytest.CaptureFixture[str]
                                                                              ) -> None:
    vol, parent = VOLS[0], f"{VOLS[1]}@snap-0123456789abcdef0"
    _emit_pool_details([{"node": "storage-1", "pool": "default",
                         "trash": [{"id": "106ecf0aa77b", "name": VOLS[2], "snapshots": 0, "children": 1,
                                    "kept_for": "children"}],
                         "chains": [{"volume_id": vol, "depth": 2, "parents": [parent, f"{VOLS[2]}@x"]}],
                         "flattens": [{"volume_id": VOLS[3], "state": "running", "progress": 37}]}], "table")
    out = capsys.readouterr().out
    assert "106ecf0aa77b" in out and "children" in out
    assert f"{vol} <- {parent} <- {VOLS[2]}@x" in out
    assert VOLS[3] in out and "37%" in out and "storage-1/default" in out
