"""Completion without polling on a real install: ``GET /v1/operations/{id}?wait=N`` (and the same on a
volume or snapshot) answers when the operation ends, or after N seconds with its current state; bad
values are refused with a reason; the token is still required; ``vbs … --wait`` uses it; with two
controllers on PostgreSQL an operation that the other controller ends is still seen.

Real processes (``vbs up`` with its controller(s) and storage agent, PostgreSQL 15). An operation is
kept running by the engine's step hold (``VBS_TEST_HOOKS=1``) until the test releases it.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import VBS, Vbs, VbsUp, node_token, wait_until
from tests.postgres_cluster import PostgresForTests

pytestmark = pytest.mark.integration

HOOK = {"kind": "create-snapshot", "step": "storage-snapshot"}
LONG_WAIT_S = 30
OUTLASTS_IDLE_S = 12  # > vbs.net.web.IDLE_CONNECTION_TIMEOUT_S


@dataclass
class HeldSnapshot:
    """A snapshot whose operation waits at its storage step on ``holder`` until ``release``."""

    holder: Vbs
    snapshot_id: str
    operation_id: str
    internal: dict[str, str] = field(repr=False)

    def release(self) -> None:
        r = self.holder.http.post("/internal/v1/test/release-step", json=HOOK, headers=self.internal)
        assert r.status_code == 200, r.text


def hold_snapshot(holder: Vbs, volume_id: str) -> HeldSnapshot:
    internal = {"authorization": f"Bearer {node_token(holder.data_dir, 'storage', 'storage-1')}"}
    assert holder.http.post("/internal/v1/test/hold-step", json=HOOK, headers=internal).status_code == 200
    r = holder.http.post("/v1/snapshots", json={"volume_id": volume_id})
    assert r.status_code == 200, r.text
    snap = r.json()["snapshot_id"]
    wait_until(lambda: holder.http.post("/internal/v1/test/held-step", json=HOOK, headers=internal).json()["held"],
               30, what="the snapshot's storage step is held")
    ops = holder.http.get("/v1/operations", params={"resource_id": snap}).json()["operations"]
    assert [o["status"] for o in ops] == ["running"]
    return HeldSnapshot(holder, snap, ops[0]["operation_id"], internal)


class Background:
    """One HTTP call in a thread: whether it has answered yet, its answer, and when."""

    def __init__(self, call: Any) -> None:
        self.answer: httpx.Response | None = None
        self.started = time.monotonic()
        self.took = 0.0
        self._thread = threading.Thread(target=self._run, args=(call,))
        self._thread.start()

    def _run(self, call: Any) -> None:
        self.answer = call()
        self.took = time.monotonic() - self.started

    def answered(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> httpx.Response:
        self._thread.join(LONG_WAIT_S + 30)
        assert self.answer is not None
        return self.answer


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Vbs, str]]:
    """One embedded install with the test hooks, and an available 1 GiB volume on it."""
    tmp = tmp_path_factory.mktemp("long-poll")
    up = VbsUp(tmp / "var", tmp / "up.log", env={"VBS_TEST_HOOKS": "1"})
    try:
        vbs = up.start()
        vol = vbs.create_volume(size_gib=1)["volume_id"]
        vbs.wait_volume(vol, "available")
        yield vbs, vol
    finally:
        up.stop()


def test_a_long_poll_started_before_the_end_answers_the_final_state_when_the_operation_ends(
        install: tuple[Vbs, str]) -> None:
    vbs, vol = install
    held = hold_snapshot(vbs, vol)
    poll = Background(lambda: vbs.http.get(f"/v1/operations/{held.operation_id}",
                                           params={"wait": LONG_WAIT_S}, timeout=LONG_WAIT_S + 30))
    snap_poll = Background(lambda: vbs.http.get(f"/v1/snapshots/{held.snapshot_id}",
                                                params={"wait": LONG_WAIT_S}, timeout=LONG_WAIT_S + 30))
    time.sleep(1)  # the requests reach the controller and wait there
    assert not poll.answered() and not snap_poll.answered()  # nothing to answer while the step is held
    held.release()
    op, snap = poll.result(), snap_poll.result()
    assert op.status_code == 200, op.text
    assert op.json()["status"] == "succeeded"
    # storage-snapshot, store-upload (into the snapshot store: issue 33), mark-completed
    assert [(s["name"], s["state"]) for s in op.json()["steps"]] == [
        ("storage-snapshot", "done"), ("store-upload", "done"), ("mark-completed", "done")]
    assert snap.status_code == 200 and snap.json()["status"] == "completed"
    assert poll.took < LONG_WAIT_S and snap_poll.took < LONG_WAIT_S  # the ending answered it, not the clock


def test_a_long_poll_whose_wait_runs_out_answers_the_current_state(install: tuple[Vbs, str]) -> None:
    vbs, vol = install
    held = hold_snapshot(vbs, vol)
    try:
        started = time.monotonic()
        # Longer than the server's idle-connection deadline (10 s): a waiting request is not idle.
        r = vbs.http.get(f"/v1/operations/{held.operation_id}", params={"wait": OUTLASTS_IDLE_S})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "running"
        assert r.json()["operation_id"] == held.operation_id
        assert time.monotonic() - started >= OUTLASTS_IDLE_S  # it waited its time before answering
    finally:
        held.release()
    assert vbs.wait_snapshot(held.snapshot_id, "completed")


def test_a_finished_operation_answers_at_once_whatever_the_wait(install: tuple[Vbs, str]) -> None:
    vbs, vol = install
    snap = vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
    done = vbs.http.get(f"/v1/snapshots/{snap}", params={"wait": LONG_WAIT_S}, timeout=LONG_WAIT_S + 30).json()
    assert done["status"] == "completed"
    op = vbs.http.get("/v1/operations", params={"resource_id": snap}).json()["operations"][0]
    started = time.monotonic()
    again = vbs.http.get(f"/v1/operations/{op['operation_id']}", params={"wait": LONG_WAIT_S})
    assert again.json()["status"] == "succeeded"
    assert time.monotonic() - started < LONG_WAIT_S


@pytest.mark.parametrize("path", ["/v1/operations/op-0123456789abcdef0", "/v1/volumes/vol-0123456789abcdef0",
                                  "/v1/snapshots/snap-0123456789abcdef0"])
@pytest.mark.parametrize("bad", ["-1", "61", "1000000", "soon", "1.5", ""])
def test_a_bad_wait_is_refused_with_a_reason(install: tuple[Vbs, str], path: str, bad: str) -> None:
    vbs, _ = install
    r = vbs.http.get(path, params={"wait": bad})
    assert r.status_code == 400, r.text
    body = r.json()["error"]
    assert body["code"] == "InvalidParameterValue"
    assert "wait" in body["message"]


def test_a_long_poll_without_a_token_is_refused(install: tuple[Vbs, str]) -> None:
    vbs, vol = install
    for path in ("/v1/operations/op-0123456789abcdef0", f"/v1/volumes/{vol}"):
        r = httpx.get(vbs.endpoint + path, params={"wait": 5})
        assert r.status_code == 401, r.text
        r = httpx.get(vbs.endpoint + path, params={"wait": 5}, headers={"authorization": "Bearer nope"})
        assert r.status_code == 401, r.text


def snapshot_gets(vbs: Vbs) -> float:
    """How many GETs of one snapshot the controller has answered (its request counter)."""
    for family in text_string_to_metric_families(vbs.http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "vbs_api_requests_total" and sample.labels.get("route") == "/v1/snapshots/{snapshot_id}" \
                    and sample.labels.get("method") == "GET":
                return sample.value
    return 0.0


def test_the_cli_waits_for_a_snapshot_with_one_long_poll_not_a_polling_loop(install: tuple[Vbs, str]) -> None:
    vbs, vol = install
    held_first = hold_snapshot(vbs, vol)  # a snapshot whose operation is held: the CLI's must wait behind none
    held_first.release()
    vbs.wait_snapshot(held_first.snapshot_id, "completed")
    internal = held_first.internal
    assert vbs.http.post("/internal/v1/test/hold-step", json=HOOK, headers=internal).status_code == 200
    before = snapshot_gets(vbs)
    env = {**os.environ, "VBS_ENDPOINT": vbs.endpoint, "VBS_ACCESS_KEY_ID": vbs.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": vbs.key.secret_access_key}
    cli = subprocess.Popen([*VBS, "-o", "json", "create-snapshot", vol, "--wait"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: vbs.http.post("/internal/v1/test/held-step", json=HOOK, headers=internal).json()["held"],
                   60, what="the CLI's snapshot is held")
        time.sleep(2)  # the old --wait polled every 0.25 s: some eight GETs in this time
        assert cli.poll() is None
        vbs.http.post("/internal/v1/test/release-step", json=HOOK, headers=internal)
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, err
    assert '"completed"' in out
    assert snapshot_gets(vbs) - before == 1  # one long-poll, answered when the snapshot completed


def test_an_operation_that_the_other_controller_ends_is_seen_by_a_long_poll(
        tmp_path: Path, postgres: PostgresForTests) -> None:
    up = VbsUp(tmp_path / "var", tmp_path / "up.log", env={"VBS_TEST_HOOKS": "1"}, ports=2,
               extra=["--controllers", "2", "--database-url", postgres.upgraded_database()])
    first = up.start()
    try:
        second = Vbs(f"http://127.0.0.1:{up.port + 1}", first.data_dir)
        wait_until(lambda: second.http.get("/health").status_code == 200, 60, what="the second controller")
        vol = second.create_volume(size_gib=1)["volume_id"]
        second.wait_volume(vol, "available")
        held = hold_snapshot(second, vol)  # run, held and ended by the second controller
        poll = Background(lambda: first.http.get(f"/v1/operations/{held.operation_id}",
                                                 params={"wait": LONG_WAIT_S}, timeout=LONG_WAIT_S + 30))
        time.sleep(1)
        assert not poll.answered()
        held.release()
        r = poll.result()
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "succeeded"
        assert poll.took < LONG_WAIT_S  # the first controller saw the other's ending by reading the row again
    finally:
        up.stop()
