"""RTT-aware placement for real: vbs up with two storage nodes, its host agent and a second one,
both probing every second; describe-hosts shows what they measured, attach-volume warns above the
threshold, and `vbs advise` costs staying remote against moving the VM or the volume from those
measurements. The probe endpoint refuses hosts without a ticket the controller signed for that node.
"""

from __future__ import annotations

import json
import math
import os
import re
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import VBS, Vbs, VbsUp, free_port, node_token, stop_process, wait_until
from vbs.controller.placement.rtt_model import Point, fit
from vbs.rigs.testguest import TestGuest, build_guest
from vbs.trust import probe_tickets

pytestmark = pytest.mark.integration

PROBE_ENV = {"VBS_HOST_AGENT_PROBE_INTERVAL_S": "1", "VBS_HOST_AGENT_PROBE_BYTES": str(256 << 10)}


class Site:
    def __init__(self, vbs: Vbs, up: VbsUp, instance: str, calibration: Path) -> None:
        self.vbs, self.up, self.instance, self.calibration = vbs, up, instance, calibration

    def hosts(self) -> dict[str, dict[str, Any]]:
        return {h["name"]: h for h in self.vbs.http.get("/v1/hosts").json()["hosts"]}

    def probes(self, host: str) -> dict[str, dict[str, Any]]:
        return {p["storage_node"]: p for p in self.hosts()[host]["probes"]}

    def storage_url(self, name: str) -> str:
        nodes = self.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]
        return str(next(n["url"] for n in nodes if n["name"] == name))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("rtt")
    # Any measured RTT is above 0 ms: every attach warns. The calibration table is read at each
    # advice, when it exists (one test writes it).
    calibration = tmp / "rtt-calibration.json"
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--storage-nodes", "2"],
               env={**PROBE_ENV, "VBS_CONTROLLER_RTT_WARN_MS": "0",
                    "VBS_CONTROLLER_RTT_CALIBRATION_FILE": str(calibration)})
    guest = TestGuest("vm1", tmp / "guests", build_guest(), tmp / "var" / "vms")
    host2: subprocess.Popen[bytes] | None = None
    try:
        guest.start()
        vbs = up.start()
        host2 = subprocess.Popen(
            [*VBS, "host-agent", "--node-name", "host-2", "--port", str(free_port()), "--controller-url",
             vbs.endpoint, "--vm-dir", str(tmp / "vms-2")],
            env={**os.environ, **PROBE_ENV, "VBS_AGENT_TOKEN": node_token(tmp / "var", "host", "host-2")},
            stdout=(tmp / "host-2.log").open("ab"), stderr=subprocess.STDOUT)
        guest.wait_ready(120)

        def instance() -> str | None:
            found = [i["instance_id"] for i in vbs.http.get("/v1/instances").json()["instances"]
                     if i["vm_id"] == "vm1" and i["state"] == "running"]
            return found[0] if found else None

        site = Site(vbs, up, wait_until(instance, 60, what="instance vm1"), calibration)
        wait_until(lambda: all(len(site.hosts().get(h, {}).get("probes", [])) == 2 for h in ("host-1", "host-2")),
                   60, what="both hosts probed both storage nodes")
        yield site
    finally:
        if host2 is not None:
            stop_process(host2)
        guest.stop()
        up.stop()


def test_describe_hosts_shows_each_hosts_measured_rtt_and_throughput(site: Site) -> None:
    for host in ("host-1", "host-2"):
        probes = site.probes(host)
        assert set(probes) == {"storage-1", "storage-2"}
        for p in probes.values():
            assert 0 < p["rtt_ms"] < 1000 and p["mbps"] > 0 and p["probe_bytes"] == 256 << 10
    first = site.probes("host-1")["storage-1"]["measured_at"]
    wait_until(lambda: site.probes("host-1")["storage-1"]["measured_at"] > first, 30, what="a newer probe")

    table = site.vbs.cli("describe-hosts", "--probes")
    assert {(r["host"], r["storage_node"]) for r in table} == {(h, n) for h in ("host-1", "host-2")
                                                               for n in ("storage-1", "storage-2")}
    env = {**os.environ, "VBS_ENDPOINT": site.vbs.endpoint, "VBS_ACCESS_KEY_ID": site.vbs.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": site.vbs.key.secret_access_key, "COLUMNS": "250"}
    shown = subprocess.run([*VBS, "-o", "table", "describe-hosts"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "RTT to storage" in shown.stdout and "storage-2" in shown.stdout and " ms" in shown.stdout


def test_the_controller_exports_the_probes_as_metrics(site: Site) -> None:
    r = site.vbs.http.get("/metrics")
    assert r.status_code == 200
    rtts = {(x.labels["host"], x.labels["storage_node"]): x.value
            for family in text_string_to_metric_families(r.text) if family.name == "vbs_host_storage_rtt_seconds"
            for x in family.samples}
    rates = {(x.labels["host"], x.labels["storage_node"]): x.value
             for family in text_string_to_metric_families(r.text)
             if family.name == "vbs_host_storage_probe_bytes_per_second" for x in family.samples}
    pairs = {(h, n) for h in ("host-1", "host-2") for n in ("storage-1", "storage-2")}
    assert set(rtts) == pairs == set(rates)
    assert all(0 < v < 1 for v in rtts.values()) and all(v > 1 << 20 for v in rates.values())


def test_attach_warns_when_the_measured_rtt_exceeds_the_threshold(site: Site) -> None:
    vol = site.vbs.cli("create-volume", "--size", "1", "--wait")
    env = {**os.environ, "VBS_ENDPOINT": site.vbs.endpoint, "VBS_ACCESS_KEY_ID": site.vbs.key.access_key_id,
           "VBS_SECRET_ACCESS_KEY": site.vbs.key.secret_access_key}
    r = subprocess.run([*VBS, "-o", "json", "attach-volume", vol["volume_id"], "--instance", site.instance, "--wait"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # The figure is host-1's probe at the time of the attach (renewed every second since).
    m = re.search(rf"warning: host host-1 measured an RTT of ([0-9.]+) ms to storage node {vol['storage_node']}, "
                  r"above rtt_warn_ms 0 ms", r.stderr)
    assert m is not None, r.stderr
    assert 0 <= float(m.group(1)) < 1000  # shown to 0.01 ms: loopback may show 0.00
    detached = site.vbs.cli("detach-volume", vol["volume_id"], "--wait")
    assert detached["state"] == "detached"


def test_advise_costs_the_three_placements_from_the_probes(site: Site) -> None:
    vol = site.vbs.cli("create-volume", "--size", "2", "--wait")
    node = vol["storage_node"]
    other = "storage-2" if node == "storage-1" else "storage-1"
    advice = site.vbs.cli("advise", vol["volume_id"], "--instance", site.instance, "--io-gib", "8",
                          "--memory-mib", "512")
    by_action = {o["action"]: o for o in advice["options"]}
    assert set(by_action) == {"stay-remote", "migrate-instance", "migrate-volume"}
    stay, vm, data = by_action["stay-remote"], by_action["migrate-instance"], by_action["migrate-volume"]
    assert (stay["host"], stay["storage_node"], stay["move_s"]) == ("host-1", node, 0)
    assert (vm["host"], vm["storage_node"]) == ("host-2", node)
    assert (data["host"], data["storage_node"]) == ("host-1", other)
    assert vm["command"] == f"vbs migrate-instance {site.instance} --host host-2"
    assert data["command"] == f"vbs migrate-volume {vol['volume_id']} --storage-node {other}"

    # The answer is computed from the probes it lists: both hosts' latest of both nodes.
    measured = {(m["host"], m["storage_node"]): m for m in advice["measured"]}
    assert set(measured) == {(h, n) for h in ("host-1", "host-2") for n in ("storage-1", "storage-2")}
    assert stay["rtt_ms"] == measured[("host-1", node)]["rtt_ms"]
    assert vm["rtt_ms"] == measured[("host-2", node)]["rtt_ms"]
    assert data["rtt_ms"] == measured[("host-1", other)]["rtt_ms"]
    # No calibration file: the model is the fit of those probes (link = the harmonic mean when they span one RTT).
    model = advice["model"]
    assert model["source"] == "probes (4)"
    if model["window_mib"] is None:
        harmonic = 4 / sum(1 / m["mbps"] for m in measured.values())
        assert math.isclose(model["link_mbps"], harmonic, rel_tol=1e-3)
        assert all(math.isclose(o["mbps"], harmonic, rel_tol=1e-3) for o in advice["options"])
    # Moving the VM copies its memory over the path this host measured to the volume's node; moving
    # the volume copies its bytes at the slower of this host's paths to the two nodes.
    assert math.isclose(vm["move_s"], 512 / measured[("host-1", node)]["mbps"], rel_tol=1e-3)
    copy = min(measured[("host-1", node)]["mbps"], measured[("host-1", other)]["mbps"])
    assert math.isclose(model["copy_mbps"], copy, rel_tol=1e-3)
    assert math.isclose(data["move_s"], 2 * 1024 / copy, rel_tol=1e-3)
    for o in advice["options"]:
        assert math.isclose(o["io_s"], 8 * 1024 / o["mbps"], rel_tol=1e-3)
        assert math.isclose(o["total_s"], o["move_s"] + o["io_s"], rel_tol=1e-3, abs_tol=1e-3)
    assert advice["recommended"] == min(advice["options"], key=lambda o: o["total_s"])["action"]


def test_advise_uses_the_benchs_calibration_table_where_the_controller_has_one(site: Site) -> None:
    vol = site.vbs.cli("create-volume", "--size", "1", "--wait")
    # What bench/rtt.py --calibration-out writes: NBD points at several RTTs (the export of vbs up).
    points = [{"rtt_ms": r, "mbps": 1 / (1 / 900 + r / 1000 / 8), "iops": 1 / (5e-5 + r / 1000 / 16)}
              for r in (0.0, 1.0, 4.0, 16.0, 50.0)]
    site.calibration.write_text(json.dumps({"protocols": {"nbd": points}, "copy_mbps": 123.0}))
    try:
        advice = site.vbs.cli("advise", vol["volume_id"], "--instance", site.instance, "--random-ios", "1000")
    finally:
        site.calibration.unlink()
    model = advice["model"]
    assert (model["source"], model["protocol"], model["copy_mbps"]) == ("calibration nbd (5)", "nbd", 123.0)
    assert math.isclose(model["link_mbps"], 900, rel_tol=1e-6) and math.isclose(model["window_mib"], 8, rel_tol=1e-6)
    throughput = fit([Point(p["rtt_ms"], p["mbps"]) for p in points])
    iops = fit([Point(p["rtt_ms"], p["iops"]) for p in points])
    for o in advice["options"]:
        assert math.isclose(o["mbps"], throughput.at(o["rtt_ms"]), rel_tol=1e-3)
        assert math.isclose(o["iops"], iops.at(o["rtt_ms"]), rel_tol=1e-3)
        assert math.isclose(o["io_s"], 1024 / o["mbps"] + 1000 / o["iops"], rel_tol=1e-2)
    data = next(o for o in advice["options"] if o["action"] == "migrate-volume")
    assert math.isclose(data["move_s"], 1024 / 123.0, rel_tol=1e-3)
    assert site.vbs.cli("advise", vol["volume_id"], "--instance", site.instance)["model"]["source"] == "probes (4)"


def test_advise_for_an_unknown_instance_or_a_bad_workload_is_refused(site: Site) -> None:
    vol = site.vbs.cli("create-volume", "--size", "1", "--wait")
    r = site.vbs.http.get(f"/v1/volumes/{vol['volume_id']}/advice", params={"instance": "i-0123456789abcdef0"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "InvalidInstanceID.NotFound")
    r = site.vbs.http.get(f"/v1/volumes/{vol['volume_id']}/advice", params={"instance": site.instance,
                                                                             "io_gib": "-1"})
    assert r.status_code == 400
    r = site.vbs.http.get("/v1/volumes/vol-0123456789abcdef0/advice", params={"instance": site.instance})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "InvalidVolume.NotFound")


def test_the_probe_endpoint_needs_a_ticket_for_that_node(site: Site) -> None:
    url = site.storage_url("storage-1") + "/probe"
    token1 = node_token(site.vbs.data_dir, "storage", "storage-1")
    token2 = node_token(site.vbs.data_dir, "storage", "storage-2")
    good = probe_tickets.mint(token1, "storage-1", "host-1")
    r = httpx.get(url, params={"bytes": "1000"}, headers={"x-vbs-probe-ticket": good}, timeout=10)
    assert r.status_code == 200 and r.content == bytes(1000)
    refused = [
        {},
        {"x-vbs-probe-ticket": probe_tickets.mint(token2, "storage-2", "host-1")},  # another node's
        {"x-vbs-probe-ticket": probe_tickets.mint(token1, "storage-1", "host-1", ttl_s=-5)},  # expired
        {"x-vbs-probe-ticket": good[:-2] + ("AA" if not good.endswith("AA") else "BB")},  # forged
        {"authorization": f"Bearer {node_token(site.vbs.data_dir, 'host', 'host-1')}"},  # a host token
    ]
    for headers in refused:
        r = httpx.get(url, params={"bytes": "1000"}, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.status_code)
    # A ticket opens the probe only, and only so far.
    r = httpx.get(site.storage_url("storage-1") + "/v1/exports", headers={"x-vbs-probe-ticket": good}, timeout=10)
    assert r.status_code == 401
    r = httpx.get(url, params={"bytes": str((4 << 20) + 1)}, headers={"x-vbs-probe-ticket": good}, timeout=10)
    assert r.status_code == 400
    # The controller hands tickets to hosts only.
    r = httpx.get(f"{site.vbs.endpoint}/internal/v1/probe-targets",
                  headers={"authorization": f"Bearer {token1}"}, timeout=10)
    assert r.status_code == 403
    host_token = node_token(site.vbs.data_dir, "host", "host-2")
    r = httpx.get(f"{site.vbs.endpoint}/internal/v1/probe-targets",
                  headers={"authorization": f"Bearer {host_token}"}, timeout=10)
    assert r.status_code == 200
    targets = {t["storage_node"]: t for t in r.json()["targets"]}
    assert set(targets) == {"storage-1", "storage-2"}
    assert probe_tickets.verify(targets["storage-2"]["ticket"], token2, "storage-2") == "host-2"


def test_hosts_probe_over_mutual_tls(tmp_path: Path) -> None:
    """With ``vbs up --tls`` the host presents its certificate to the storage agent (which requires one
    from the install's CA) and its ticket; the probes arrive as over plain HTTP."""
    up = VbsUp(tmp_path / "var", tmp_path / "up.log", extra=["--tls"], env=PROBE_ENV)
    try:
        up.start()
        ca = ssl.create_default_context(cafile=str(tmp_path / "var" / "ca.pem"))
        vbs = Vbs(f"https://127.0.0.1:{up.port}", tmp_path / "var")
        http = httpx.Client(base_url=vbs.endpoint, timeout=30, verify=ca,
                            headers={"authorization": f"Bearer {vbs.key.bearer}"})

        def probes() -> list[dict[str, Any]]:
            return [p for h in http.get("/v1/hosts").json()["hosts"] for p in h["probes"]]

        [probe] = wait_until(probes, 60, what="a probe over TLS")
        assert probe["storage_node"] == "storage-1" and probe["rtt_ms"] > 0 and probe["mbps"] > 0
        node_url = http.get("/v1/storage-nodes").json()["storage_nodes"][0]["url"]
        assert node_url.startswith("https://")
        # Without a client certificate the storage agent does not even answer, ticket or not.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{node_url}/probe", verify=ca, timeout=5)
    finally:
        up.stop()
