"""Per-volume QoS: the limits computed for a volume, and a real qemu-storage-daemon throttling its NBD
exports as a real NBD client (fio's ``nbd`` engine, libnbd) measures them.

Rates are compared with the limit and with an unlimited export measured in the same test, never with
absolute times; the tolerance is generous (the machine is shared) but far tighter than the gap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.export_fixtures import MiB, drivers_of, runs, wait_dead
from vbs.controller.placement import volume_types
from vbs.controller.workflows.attach_volume import AttachParams, host_qos
from vbs.ids import virtio_serial
from vbs.net.web import agent_auth
from vbs.pools.exports import FileSource, LimitEnforcer
from vbs.storage.api import create_app as create_storage_app
from vbs.storage.backends.file import FileBackend
from vbs.storage.exports.nbd import NbdExportDriver
from vbs.trust.node_credentials import TokenSource
from vbs.wire.connection import HostIdentity, NbdConnection
from vbs.wire.qos import IOPS_SIZE, ExportLimits, QoS, throttle_limits
from vbs.wire.storage import ConnectionAnswer, ConnectionRequest

QSD = "qemu-storage-daemon"
FIO = "/usr/bin/fio"
HOST_A = HostIdentity(name="hv-a", address="127.0.0.1")
HOST_B = HostIdentity(name="hv-b", address="127.0.0.1")
VOL = "vol-0123456789abcdef0"
VOL2 = "vol-0123456789abcdef1"


# -- the limits a volume gets -------------------------------------------------------------------


@pytest.mark.unit
def test_explicit_limits_are_enforced_whatever_the_operator_chose() -> None:
    for type_limits in (False, True):
        got = volume_types.enforced_limits("gp3", 100, 4000, 250, type_limits=type_limits)
        assert got == ExportLimits(qos=QoS(iops=4000, mbps=250), volume_type="gp3")
        assert volume_types.enforced_limits("io2", 100, 5000, None, type_limits=type_limits).qos == QoS(iops=5000)


@pytest.mark.unit
def test_type_baselines_only_where_the_operator_turns_them_on() -> None:
    assert volume_types.enforced_limits("gp3", 100, None, None, type_limits=False) == ExportLimits(volume_type="gp3")
    assert volume_types.enforced_limits("gp3", 100, None, None, type_limits=True).qos == QoS(iops=3000, mbps=125)
    # A limit given is kept, the other one is the type's.
    assert volume_types.enforced_limits("gp3", 100, 6000, None, type_limits=True).qos == QoS(iops=6000, mbps=125)
    assert volume_types.enforced_limits("gp2", 100, None, None, type_limits=True).qos == QoS(iops=300)
    assert volume_types.enforced_limits("gp2", 10, None, None, type_limits=True).qos == QoS(iops=100)
    assert volume_types.enforced_limits("st1", 500, None, None, type_limits=True).qos is None


@pytest.mark.unit
def test_throttle_limits_count_large_io_as_several_operations() -> None:
    assert throttle_limits(QoS(iops=3000, mbps=125)) == {"iops-total": 3000, "bps-total": 125 * MiB,
                                                         "iops-size": IOPS_SIZE}
    assert IOPS_SIZE == 256 * 1024
    # QEMU refuses iops-size without an IOPS limit; every field is given so that zero clears one.
    assert throttle_limits(QoS(mbps=10)) == {"iops-total": 0, "bps-total": 10 * MiB, "iops-size": 0}
    assert throttle_limits(None) == {"iops-total": 0, "bps-total": 0, "iops-size": 0}


@pytest.mark.unit
def test_the_wire_leaves_limits_out_for_older_peers() -> None:
    request = ConnectionRequest(host=HOST_A)
    assert "limits" not in request.model_dump(mode="json")
    answer = ConnectionAnswer(connection=NbdConnection(socket="/run/vbs/nbd.sock", export="x"))
    assert "limits_enforced" not in answer.model_dump(mode="json")
    with pytest.raises(ValueError):
        ExportLimits(volume_type="GP3; rm")


# -- a real daemon, a real NBD client -----------------------------------------------------------


@pytest.fixture
def make_driver(tmp_path: Path) -> Iterator[Callable[..., NbdExportDriver]]:
    yield from drivers_of(NbdExportDriver, tmp_path, QSD)


def _volume(tmp_path: Path, name: str) -> Path:
    """A 64 MiB volume full of data: QEMU's NBD server answers reads of a hole from the block status,
    without reading (nor throttling) anything."""
    path = tmp_path / name
    path.write_bytes(b"\x5a" * (64 * MiB))
    return path


def _uri(conn: NbdConnection) -> str:
    assert conn.socket is not None
    return f"nbd+unix:///{conn.export}?socket={conn.socket}"


def _fio_job(conn: NbdConnection, runtime: float, *, log_prefix: Path | None = None) -> tuple[dict[str, Any], float]:
    """Random 4 KiB reads at queue depth 8 through the export for ``runtime`` seconds: fio's job and
    when it started (epoch ms: its report's time less the job's runtime; its logs count from there)."""
    argv = [FIO, "--name=qos", "--ioengine=nbd", f"--uri={_uri(conn)}", "--rw=randread", "--bs=4k",
            "--iodepth=8", "--time_based", f"--runtime={runtime:g}", "--size=64m", "--output-format=json"]
    if log_prefix is not None:
        argv += [f"--write_iops_log={log_prefix}", "--log_avg_msec=500"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=runtime + 60, check=True).stdout
    report = json.loads(out[out.index("{"):])
    job = report["jobs"][0]
    return job, float(report["timestamp_ms"]) - float(job["job_runtime"])


def _fio(conn: NbdConnection, runtime: float) -> float:
    """IOPS of ``_fio_job``."""
    return float(_fio_job(conn, runtime)[0]["read"]["iops"])


def _socket_driver(make: Callable[..., NbdExportDriver], tmp_path: Path, **kw: object) -> NbdExportDriver:
    drv = make(socket_dir=tmp_path / "sock", **kw)
    drv.start()
    return drv


@pytest.mark.integration
def test_a_limited_export_is_held_to_its_limit_and_an_unlimited_one_is_not(
        make_driver: Callable[..., NbdExportDriver], tmp_path: Path) -> None:
    drv = _socket_driver(make_driver, tmp_path)
    assert isinstance(drv, LimitEnforcer)
    assert drv.set_limits(VOL, ExportLimits(qos=QoS(iops=100), volume_type="io2"))
    limited = drv.ensure_export(VOL, FileSource(_volume(tmp_path, "a.img")), HOST_A)
    free = drv.ensure_export(VOL2, FileSource(_volume(tmp_path, "b.img")), HOST_A)
    assert isinstance(limited, NbdConnection) and isinstance(free, NbdConnection)
    slow, fast = _fio(limited, 3), _fio(free, 3)
    assert 70 <= slow <= 115, f"limited to 100 IOPS, measured {slow:.0f}"
    assert fast > 4 * slow, f"unlimited {fast:.0f} IOPS against limited {slow:.0f}"


@pytest.mark.integration
def test_new_limits_apply_live_to_a_connected_client(make_driver: Callable[..., NbdExportDriver],
                                                     tmp_path: Path) -> None:
    drv = _socket_driver(make_driver, tmp_path)
    drv.set_limits(VOL, ExportLimits(qos=QoS(iops=100)))
    conn = drv.ensure_export(VOL, FileSource(_volume(tmp_path, "a.img")), HOST_A)
    assert isinstance(conn, NbdConnection)
    before = drv.list_exports()
    # One fio process, one NBD connection: the limit changes under it. The samples are split where the
    # change happened in fio's own clock (a loaded machine can start fio late, so not at a fixed offset).
    changed: list[float] = []

    def change() -> None:
        before_ms = time.time() * 1000
        drv.set_limits(VOL, ExportLimits(qos=QoS(iops=400)))
        changed.extend((before_ms, time.time() * 1000))

    timer = threading.Timer(4.0, change)
    timer.start()
    try:
        _, started_ms = _fio_job(conn, 8, log_prefix=tmp_path / "rate")
    finally:
        timer.join()
    samples = [(int(line.split(",")[0]), int(line.split(",")[1]))
               for line in (tmp_path / "rate_iops.1.log").read_text().splitlines() if line.strip()]
    change_from, change_to = (t - started_ms for t in changed)
    first = [v for t, v in samples if 500 < t <= change_from - 200]
    second = [v for t, v in samples if t >= change_to + 800]
    assert first and len(second) >= 2, f"fio's samples {samples} do not straddle the change ({change_from:.0f} ms)"
    low, high = sum(first) / len(first), sum(second) / len(second)
    assert low <= 120 and high >= 2.5 * low, f"{low:.0f} IOPS before the change, {high:.0f} after"
    assert drv.list_exports() == before  # the same export: nothing was re-opened


@pytest.mark.integration
def test_every_host_of_a_volume_shares_its_one_limit(make_driver: Callable[..., NbdExportDriver],
                                                      tmp_path: Path) -> None:
    drv = _socket_driver(make_driver, tmp_path)
    drv.set_limits(VOL, ExportLimits(qos=QoS(iops=150), volume_type="io2"))
    source = FileSource(_volume(tmp_path, "a.img"))
    a, b = drv.ensure_export(VOL, source, HOST_A), drv.ensure_export(VOL, source, HOST_B)
    assert isinstance(a, NbdConnection) and isinstance(b, NbdConnection)
    rates: list[float] = []
    other = threading.Thread(target=lambda: rates.append(_fio(b, 3)))
    other.start()
    rates.append(_fio(a, 3))
    other.join()
    assert sum(rates) <= 150 * 1.2, f"two hosts together did {rates} IOPS under one limit of 150"


@pytest.mark.integration
def test_volumes_of_a_type_share_the_nodes_fair_share_round_robin(make_driver: Callable[..., NbdExportDriver],
                                                                   tmp_path: Path) -> None:
    drv = _socket_driver(make_driver, tmp_path, fair_share={"gp3": QoS(iops=200)})
    conns = []
    for key, name in ((VOL, "a.img"), (VOL2, "b.img")):
        drv.set_limits(key, ExportLimits(volume_type="gp3"))  # no limit of its own
        conn = drv.ensure_export(key, FileSource(_volume(tmp_path, name)), HOST_A)
        assert isinstance(conn, NbdConnection)
        conns.append(conn)
    rates: list[float] = []
    other = threading.Thread(target=lambda: rates.append(_fio(conns[1], 3)))
    other.start()
    rates.append(_fio(conns[0], 3))
    other.join()
    assert sum(rates) <= 200 * 1.2, f"{rates}: more than the type's 200 IOPS together"
    assert min(rates) >= 0.6 * max(rates), f"{rates}: not shared evenly"


@pytest.mark.integration
def test_limits_survive_a_daemon_restart(make_driver: Callable[..., NbdExportDriver], tmp_path: Path) -> None:
    drv = _socket_driver(make_driver, tmp_path)
    drv.set_limits(VOL, ExportLimits(qos=QoS(iops=100)))
    conn = drv.ensure_export(VOL, FileSource(_volume(tmp_path, "a.img")), HOST_A)
    assert isinstance(conn, NbdConnection)
    pid = drv.pid
    assert pid is not None and runs(pid, QSD)
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    drv.check()  # rebuilt from exports.json, limits included
    assert drv.pid != pid
    rate = _fio(conn, 2)
    assert rate <= 115, f"{rate:.0f} IOPS after the restart, limit 100"


# -- the controller's decision and the storage agent's API ---------------------------------------------


@pytest.mark.unit
def test_the_hypervisor_gets_the_limits_only_where_the_storage_node_does_not_enforce_them() -> None:
    conn = NbdConnection(socket="/run/vbs/nbd.sock", export="x")
    limits = ExportLimits(qos=QoS(iops=500), volume_type="io2")
    params = AttachParams(attachment_id="att-0123456789abcdef0", node="s1", pool="p1", host="h1", vm_id="vm1",
                          serial=virtio_serial(VOL), limits=limits)
    assert host_qos(params, ConnectionAnswer(connection=conn, limits_enforced=True)) is None
    assert host_qos(params, ConnectionAnswer(connection=conn)) == QoS(iops=500)
    # An operation begun before limits travelled with the connection: its hypervisor limits, as then.
    older = params.model_copy(update={"limits": None, "qos": QoS(iops=300)})
    assert host_qos(older, ConnectionAnswer(connection=conn, limits_enforced=True)) == QoS(iops=300)


@pytest.mark.integration
def test_the_storage_agent_enforces_what_a_connection_request_carries(
        make_driver: Callable[..., NbdExportDriver], tmp_path: Path) -> None:
    drv = _socket_driver(make_driver, tmp_path)
    (tmp_path / "pool").mkdir()
    backend = FileBackend("pool1", tmp_path / "pool", exports=drv, clone_method="copy")
    backend.ensure_volume(VOL, 64 * MiB, None)
    (tmp_path / "pool" / "volumes" / f"{VOL}.raw").write_bytes(b"\x5a" * (64 * MiB))
    app = create_storage_app({"pool1": backend}, drv, agent_auth(TokenSource("t0ken"), insecure=False), "s1")
    with TestClient(app, headers={"authorization": "Bearer t0ken"}) as http:
        url = f"/v1/pools/pool1/volumes/{VOL}/connections/{HOST_A.name}"
        limits = {"qos": {"iops": 100}, "volume_type": "io2"}
        r = http.put(url, json={"host": HOST_A.model_dump(), "limits": limits})
        assert r.status_code == 200, r.text
        answer = ConnectionAnswer.model_validate(r.json())
        assert answer.limits_enforced and isinstance(answer.connection, NbdConnection)
        assert _fio(answer.connection, 2) <= 115
        r = http.put(f"/v1/exports/{VOL}/limits", json={"qos": {"iops": 1000}, "volume_type": "io2"})
        assert r.status_code == 200 and r.json() == {"enforced": True}, r.text
        assert _fio(answer.connection, 2) > 300
        # Not exported here: the hypervisors must limit it.
        r = http.put(f"/v1/exports/{VOL2}/limits", json={"qos": {"iops": 1000}})
        assert r.status_code == 200 and r.json() == {"enforced": False}, r.text
        for path, body in ((f"/v1/exports/{VOL}/limits", {"qos": {"iops": 0}}),
                           (f"/v1/exports/{VOL}/limits", {"qos": {"mbps": 10**9}}),
                           (f"/v1/exports/{VOL}/limits", {"volume_type": "../x"}),
                           (f"/v1/exports/{VOL}/limits", {"qos": {"iops": "100; rm"}}),
                           ("/v1/exports/snap-0123456789abcdef0/limits", {}),
                           (url, {"host": HOST_A.model_dump(), "limits": {"qos": {"iops": -1}}})):
            r = http.put(path, json=body)
            assert r.status_code == 400, (path, body, r.status_code, r.text)


@pytest.mark.unit
def test_a_modification_changes_the_data_paths_limits_only_where_they_change() -> None:
    from types import SimpleNamespace
    from typing import Any, cast

    from vbs.controller.requests.modify_volume import _new_limits

    def svc(type_limits: bool) -> Any:
        return cast(Any, SimpleNamespace(cfg=SimpleNamespace(enforce_type_limits=type_limits)))

    io2 = cast(Any, SimpleNamespace(volume_type="io2", size_gib=10, iops=1000, throughput=None))
    assert _new_limits(svc(False), io2, (20, "io2", 1000, None)) is None  # a growth alone: nothing to change
    assert _new_limits(svc(False), io2, (10, "io2", 2000, None)) == ExportLimits(qos=QoS(iops=2000), volume_type="io2")
    gp2 = cast(Any, SimpleNamespace(volume_type="gp2", size_gib=100, iops=None, throughput=None))
    assert _new_limits(svc(False), gp2, (200, "gp2", None, None)) is None
    # gp2's baseline grows with its size, where the operator enforces the types' limits.
    assert _new_limits(svc(True), gp2, (200, "gp2", None, None)) == ExportLimits(qos=QoS(iops=600), volume_type="gp2")
    assert _new_limits(svc(False), gp2, (100, "gp3", None, None)) == ExportLimits(volume_type="gp3")


@pytest.mark.unit
def test_the_operator_settings(tmp_path: Path) -> None:
    from vbs.config import ControllerConfig, StorageAgentConfig, load
    from vbs.errors import InvalidParameter

    assert load(ControllerConfig, "controller", environ={}).enforce_type_limits is False
    assert load(ControllerConfig, "controller", environ={"VBS_CONTROLLER_ENFORCE_TYPE_LIMITS": "true"}
                ).enforce_type_limits is True
    fair = {"gp3": {"iops": 20000, "mbps": 400}, "io2": {"iops": 50000}}
    cfg = StorageAgentConfig(nbd_socket_dir=tmp_path / "sock", options={"nbd": {"fair_share": fair}})
    drv = NbdExportDriver.from_config(cfg, tmp_path / "nbd")
    assert drv.fair_share == {"gp3": QoS(iops=20000, mbps=400), "io2": QoS(iops=50000)}
    for bad in ({"GP3!": {"iops": 1}}, {"gp3": {}}, {"gp3": {"iops": 0}}, {"gp3": {"iops": 1, "burst": 2}}):
        with pytest.raises((InvalidParameter, ValueError)):
            NbdExportDriver.from_config(StorageAgentConfig(nbd_socket_dir=tmp_path / "sock",
                                                           options={"nbd": {"fair_share": bad}}), tmp_path / "nbd")
