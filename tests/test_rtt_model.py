"""The RTT model of placement advice, the probe tickets and the attach warning, without daemons."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from vbs.controller.db import Database, Node
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import record_host_heartbeat
from vbs.controller.placement.rtt_model import Calibration, Point, fit, from_probes
from vbs.controller.requests.attach_volume import rtt_warnings
from vbs.errors import AuthFailure, InvalidParameter
from vbs.trust import probe_tickets
from vbs.wire.host import HostHeartbeat, HypervisorCapabilities
from vbs.wire.probes import Probe

pytestmark = pytest.mark.unit


def window_limited(link: float, window: float, rtt_ms: float) -> float:
    """MiB/s of a path that moves ``window`` MiB per round trip over a ``link`` MiB/s link."""
    return 1 / (1 / link + rtt_ms / 1000 / window)


def test_the_fit_recovers_link_and_window_from_points_at_several_rtts() -> None:
    points = [Point(r, window_limited(1000.0, 2.0, r)) for r in (0.05, 1, 2, 4, 8, 16, 50)]
    line = fit(points)
    assert line.slope is not None
    assert math.isclose(1 / line.intercept, 1000.0, rel_tol=1e-6)
    assert math.isclose(1 / line.slope, 2.0, rel_tol=1e-6)
    # Throughput halves where the round trip costs as much as the link: rtt = window / link.
    assert math.isclose(line.at(2.0 / 1000.0 * 1000), 500.0, rel_tol=1e-6)


def test_points_at_one_rtt_fix_no_slope() -> None:
    model = from_probes([(0.05, 800.0), (0.06, 1200.0)])
    assert model.window_mib is None
    # The harmonic mean: the rate at which both would move the same bytes.
    assert math.isclose(model.mbps(0.05), 2 / (1 / 800 + 1 / 1200))
    assert model.mbps(50.0) == model.mbps(0.05)
    # IOPS at queue depth 1 still pay a round trip each.
    assert model.iops_at(10.0) < model.iops_at(1.0) < model.iops_at(0.0)
    assert model.iops_at(10.0) < 100.0


def test_probes_over_several_rtts_make_remote_io_dearer_with_distance() -> None:
    model = from_probes([(r, window_limited(900.0, 1.0, r)) for r in (0.1, 2.0, 10.0)])
    assert model.window_mib is not None and math.isclose(model.window_mib, 1.0, rel_tol=1e-6)
    near = model.io_seconds(0.1, mib=1024, ios=10_000)
    far = model.io_seconds(10.0, mib=1024, ios=10_000)
    assert far > near * 5


def test_a_calibration_table_gives_each_protocol_its_own_model() -> None:
    table = Calibration.model_validate({
        "protocols": {
            "nbd": [{"rtt_ms": r, "mbps": window_limited(600, 4.0, r), "iops": 1 / (1e-4 + r / 1000 / 32)}
                    for r in (0, 1, 4, 16)],
            "iscsi": [{"rtt_ms": r, "mbps": window_limited(400, 1.0, r), "iops": 1 / (2e-4 + r / 1000 / 16)}
                      for r in (0, 1, 4, 16)]},
        "copy_mbps": 250.0})
    nbd, iscsi = table.model("nbd"), table.model("iscsi")
    assert nbd is not None and iscsi is not None and table.model("rbd") is None
    assert math.isclose(nbd.link_mbps, 600, rel_tol=1e-6) and math.isclose(iscsi.window_mib or 0, 1.0, rel_tol=1e-6)
    assert math.isclose(nbd.iops_at(8), 1 / (1e-4 + 8 / 1000 / 32), rel_tol=1e-6)
    assert nbd.mbps(16) > iscsi.mbps(16)


def test_nothing_to_fit_is_refused() -> None:
    with pytest.raises(InvalidParameter):
        fit([])
    with pytest.raises(InvalidParameter):
        fit([Point(1.0, 0.0)])


def test_a_probe_ticket_opens_one_node_for_one_host_for_a_while() -> None:
    token = "storage.storage-1.1." + "A" * 43
    ticket = probe_tickets.mint(token, "storage-1", "host-1", now=1000.0, ttl_s=60)
    assert probe_tickets.verify(ticket, token, "storage-1", now=1059.0) == "host-1"
    for bad_token, node, now in ((token, "storage-1", 1061.0),          # expired
                                 (token, "storage-2", 1000.0),          # another node
                                 (token + "x", "storage-1", 1000.0)):   # another node token
        with pytest.raises(AuthFailure):
            probe_tickets.verify(ticket, bad_token, node, now=now)
    host, expires, mac = ticket.split(":")
    for forged in (f"host-2:{expires}:{mac}", f"{host}:{int(expires) + 600}:{mac}", "", "x" * 300):
        with pytest.raises(AuthFailure):
            probe_tickets.verify(forged, token, "storage-1", now=1000.0)


def _host(name: str, probes: dict[str, float]) -> HostHeartbeat:
    now = datetime.now(UTC)
    return HostHeartbeat(name=name, url="http://127.0.0.1:2", address="127.0.0.1", hypervisor="qemu", started_at=now,
                         capabilities=HypervisorCapabilities(protocols=["nbd"]), vms=[],
                         probes=[Probe(storage_node=n, rtt_ms=r, mbps=100.0, probe_bytes=1 << 20, measured_at=now)
                                 for n, r in probes.items()])


def test_the_attach_warning_names_the_host_nearest_the_volumes_node(tmp_path: Path) -> None:
    db = Database.for_data_dir(tmp_path)
    db.migrate()
    try:
        with db.session() as s:
            record_host_heartbeat(s, _host("far", {"s1": 12.5, "s2": 0.3}))
            record_host_heartbeat(s, _host("near", {"s1": 0.4}))
            record_host_heartbeat(s, _host("nearer-but-silent", {"s1": 0.1}))
            s.execute(update(Node).where(Node.name == "nearer-but-silent")
                      .values(last_heartbeat=utcnow() - timedelta(seconds=120)))
        with db.read() as s:
            [warning] = rtt_warnings(s, "far", "s1", 2.0, 30)
            assert "host far measured an RTT of 12.50 ms to storage node s1, above rtt_warn_ms 2 ms" in warning
            assert "host near measured 0.40 ms" in warning
            assert rtt_warnings(s, "far", "s2", 2.0, 30) == []      # below the threshold
            assert rtt_warnings(s, "near", "s2", 2.0, 30) == []     # never measured: nothing to say
            assert rtt_warnings(s, "far", "s1", 20.0, 30) == []
            [alone] = rtt_warnings(s, "near", "s1", 0.0, 30)         # the nearest already: no other named
            assert "(`vbs advise`" not in alone
    finally:
        db.dispose()
