"""Ports a process plans for daemons it starts later: never one handed out before, never a taken one."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator

import pytest

from vbs.net import ports
from vbs.net.ports import PortPicker

pytestmark = pytest.mark.unit


def kernel_answers(monkeypatch: pytest.MonkeyPatch, answers: list[int]) -> None:
    """What ``bind(0)`` returns, in order: the kernel may hand a port it gave before out again, as soon
    as nobody holds it."""
    it: Iterator[int] = iter(answers)
    monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": next(it))


def test_a_port_planned_for_a_later_daemon_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_answers(monkeypatch, [40001, 40001, 40002, 40001, 40002, 40003])
    pick = PortPicker(taken=[40001])  # e.g. a controller's port, bound only once it starts
    assert [pick(), pick()] == [40002, 40003]
    assert pick.taken == {40001, 40002, 40003}


def test_a_picker_that_finds_nothing_new_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": 40001)
    with pytest.raises(RuntimeError, match="no free port on 127.0.0.1"):
        PortPicker(taken=[40001])()


def test_a_picked_port_can_be_bound() -> None:
    pick = PortPicker()
    first, second = pick(), pick()
    assert first != second
    for port in (first, second):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_free_port_is_outside_the_range_outgoing_connections_draw_from() -> None:
    """A client connecting anywhere between the pick and the daemon's bind cannot hold the port."""
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    picked = {ports.free_port() for _ in range(20)}
    assert all(not low <= port <= high for port in picked), (picked, low, high)
    assert len(picked) > 1


def test_a_port_already_bound_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        # Twice the bound port, then other ports (one of those may be taken too, by a test running beside).
        rolls = itertools.chain([busy, busy], (p for p in range(20000, 65536) if p != busy))
        monkeypatch.setattr(ports, "_ephemeral_floor", lambda: 65536)
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(rolls))
        assert ports.free_port() != busy


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_floor", lambda: 10500)
    port = ports.free_port()
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert low <= port <= high
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
