"""/metrics on every service (docs/metrics.md): the shared plumbing, each service's collectors, and a
real ``vbs up`` whose counters must move by exactly what a workload did."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import UNIT_DATABASES, Vbs, fresh_database, node_token, running_vbs_up, wait_until
from vbs import ids
from vbs.controller.auth.authenticator import Authenticator
from vbs.controller.auth.keys import KeyStore, MasterKey
from vbs.controller.db import Database, Volume
from vbs.controller.db.tables import utcnow
from vbs.controller.fleet.nodes import record_host_heartbeat, record_storage_heartbeat
from vbs.controller.metrics import ControllerMetrics
from vbs.controller.workflows import Params, Step, StepContext, Workflow, WorkflowEngine
from vbs.errors import DriverError, InvalidParameter, UnauthorizedOperation
from vbs.host.hypervisors.base import DiskStats
from vbs.host.hypervisors.qemu_monitors import disk_stats
from vbs.host.metrics import volume_metrics
from vbs.ids import virtio_serial
from vbs.net.metrics import ScrapeCollector, install_metrics, new_registry
from vbs.net.web import PreAuth, agent_auth, install_error_handlers
from vbs.rigs.testguest import TestGuest, build_guest
from vbs.trust.node_credentials import TokenSource
from vbs.wire.host import HostHeartbeat, HypervisorCapabilities
from vbs.wire.storage import ExportInfo, PoolInfo, StorageHeartbeat

MIB = 1 << 20
GIB = 1 << 30
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by name and sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def matching(samples: Samples, name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``name`` whose labels include ``labels``."""
    return {lab: v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab)}


DOCS = Path(__file__).resolve().parent.parent / "docs"


def documented() -> dict[str, set[str]]:
    """The metrics docs/metrics.md lists, by section (``Every service``, ``Controller``, …)."""
    sections: dict[str, set[str]] = {}
    current = ""
    for line in (DOCS / "metrics.md").read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
        elif line.startswith("| `vbs_"):
            sections.setdefault(current, set()).add(line.split("`")[1])
    return sections


def served(text: str) -> set[str]:
    """The metric names a /metrics answer declares (counters with their ``_total``)."""
    return {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)}


@pytest.mark.unit
def test_the_dashboard_is_grafana_json_over_documented_metrics_only() -> None:
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    assert dashboard["title"] and dashboard["schemaVersion"] >= 30
    names = set().union(*documented().values())
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert {"id", "type", "title", "gridPos"} <= set(panel)
        for target in panel.get("targets", []):
            used |= {re.sub(r"_(bucket|count|sum)$", "", m) for m in re.findall(r"vbs_[a-z_]+", target["expr"])}
    assert used and used <= names, used - names
    assert len(used) >= 15


# -- the shared plumbing ------------------------------------------------------------------------------


class InProcess:
    """Requests to an ASGI app in this process (through httpx's ASGI transport)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def request(self, method: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        async def send() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://127.0.0.1") as c:
                return await c.request(method, path, headers=headers)

        return asyncio.run(send())

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return self.request("GET", path, headers)

    def post(self, path: str) -> httpx.Response:
        return self.request("POST", path)


def _small_app(token: str | None) -> InProcess:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(PreAuth, check=agent_auth(TokenSource(token, None), insecure=token is None))
    install_metrics(app, new_registry())
    router = APIRouter(prefix="/v1")  # as the services' routes are: in an included router

    @router.get("/things/{thing_id}")
    def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    app.include_router(router)
    return InProcess(app)


@pytest.mark.unit
def test_requests_are_counted_by_route_template_and_code_not_by_raw_path() -> None:
    client = _small_app(None)
    for thing in ("a", "b", "c"):
        assert client.get(f"/v1/things/{thing}").status_code == 200
    assert client.post("/v1/things/a").status_code == 405
    assert client.get("/no/such/path/x1").status_code == 404
    assert client.get("/no/such/path/x2").status_code == 404
    samples = parse(client.get("/metrics").text)
    assert value(samples, "vbs_api_requests_total", method="GET", route="/v1/things/{thing_id}", code="200") == 3
    assert value(samples, "vbs_api_requests_total", method="POST", route="/v1/things/{thing_id}", code="405") == 1
    assert value(samples, "vbs_api_requests_total", method="GET", route="unrouted", code="404") == 2
    assert value(samples, "vbs_api_request_duration_seconds_count", method="GET", route="/v1/things/{thing_id}") == 3
    # No raw path became a label.
    assert not any("x1" in str(lab) or "/v1/things/a" in str(lab) for (_n, lab) in samples)


@pytest.mark.unit
def test_an_agents_metrics_need_its_node_token_and_refusals_are_counted() -> None:
    client = _small_app("s3cret-token-for-tests")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
    answer = client.get("/metrics", headers={"authorization": "Bearer s3cret-token-for-tests"})
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    samples = parse(answer.text)
    assert value(samples, "vbs_api_requests_total", method="GET", route="/metrics", code="401") == 2


@pytest.mark.unit
def test_two_apps_in_one_process_keep_their_own_counts() -> None:
    first, second = _small_app(None), _small_app(None)
    first.get("/v1/things/a")
    assert value(parse(second.get("/metrics").text), "vbs_api_requests_total", method="GET",
                 route="/v1/things/{thing_id}", code="200") == 0
    assert value(parse(first.get("/metrics").text), "vbs_api_requests_total", method="GET",
                 route="/v1/things/{thing_id}", code="200") == 1


# -- the controller's collectors ----------------------------------------------------------------------


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    """The metadata DB, SQLite and (integration tier) PostgreSQL."""
    return fresh_database(request.param, request, tmp_path)


def _volume(node: str, pool: str, size_gib: int, status: str) -> Volume:
    now = utcnow()
    return Volume(id=ids.new_id("volume"), size_gib=size_gib, volume_type="gp3", placement="shared",
                  storage_node=node, pool=pool, status=status, created_at=now, updated_at=now)


@pytest.mark.unit
def test_the_controller_reads_pools_exports_heartbeats_and_states_from_the_db(db: Database) -> None:
    started = utcnow()
    pool = PoolInfo(name="fast", backend="file", capacity_bytes=100 * GIB, free_bytes=70 * GIB, clone_method="copy",
                    point_in_time=True)
    exports = [ExportInfo(key=ids.new_id("volume"), host="h1", protocol="nbd", target="t") for _ in range(3)]
    with db.session() as s:
        record_storage_heartbeat(s, StorageHeartbeat(name="s1", url="http://127.0.0.1:1", address="127.0.0.1",
                                                     started_at=started, pools=[pool], exports=exports))
        record_host_heartbeat(s, HostHeartbeat(name="h1", url="http://127.0.0.1:2", address="127.0.0.1",
                                               hypervisor="qemu", started_at=started,
                                               capabilities=HypervisorCapabilities(protocols=["nbd"]), vms=[]))
        s.add_all([_volume("s1", "fast", 4, "available"), _volume("s1", "fast", 6, "in-use"),
                   _volume("s1", "fast", 50, "deleted")])
    metrics = ControllerMetrics(db)
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "vbs_pool_capacity_bytes", node="s1", pool="fast") == 100 * GIB
    assert value(samples, "vbs_pool_used_bytes", node="s1", pool="fast") == 30 * GIB
    assert value(samples, "vbs_pool_provisioned_bytes", node="s1", pool="fast") == 10 * GIB  # deleted not counted
    assert value(samples, "vbs_exports", node="s1", protocol="nbd") == 3
    assert value(samples, "vbs_volumes", state="available") == 1
    assert value(samples, "vbs_volumes", state="deleted") == 1
    for kind, node in (("storage", "s1"), ("host", "h1")):
        age = value(samples, "vbs_node_heartbeat_age_seconds", kind=kind, node=node)
        assert 0 <= age < 60


@pytest.mark.unit
def test_operations_and_drift_are_counted_by_kind_and_outcome(db: Database) -> None:
    metrics = ControllerMetrics(db)
    metrics.operation_ended("create-volume", "succeeded", utcnow() - timedelta(seconds=3))
    metrics.operation_ended("create-volume", "succeeded", utcnow() - timedelta(seconds=20))
    metrics.operation_ended("attach-volume", "rolled-back", utcnow())
    metrics.drift([("orphan-file", "repaired"), ("orphan-file", "waiting"), ("missing-export", "repaired"),
                   ("unreachable", "reported")])
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "vbs_operations_total", kind="create-volume", outcome="succeeded") == 2
    assert value(samples, "vbs_operations_total", kind="attach-volume", outcome="rolled-back") == 1
    assert value(samples, "vbs_operation_duration_seconds_count", kind="create-volume", outcome="succeeded") == 2
    assert value(samples, "vbs_operation_duration_seconds_bucket", kind="create-volume", outcome="succeeded",
                 le="5.0") == 1
    assert value(samples, "vbs_operation_duration_seconds_sum", kind="create-volume", outcome="succeeded") >= 23
    assert value(samples, "vbs_reconciler_drift_found_total", kind="orphan-file") == 2
    assert value(samples, "vbs_reconciler_drift_repaired_total", kind="orphan-file") == 1
    assert value(samples, "vbs_reconciler_drift_repaired_total", kind="missing-export") == 1
    assert not matching(samples, "vbs_reconciler_drift_found_total", kind="unreachable")


class Nothing(Params):
    pass


def _step(name: str, fails: bool = False) -> Step[Nothing]:
    def do(_ctx: StepContext[Nothing]) -> None:
        if fails:
            raise DriverError(f"{name} failed")

    return Step(name, do, lambda _ctx: None)


@pytest.mark.unit
def test_the_engine_counts_each_operation_once_when_it_ends(db: Database) -> None:
    metrics = ControllerMetrics(db)
    workflows = [Workflow("make", Nothing, "rollback", (_step("a"), _step("b"))),
                 Workflow("break", Nothing, "rollback", (_step("a"), _step("b", fails=True)))]
    engine = WorkflowEngine(db, workflows, None, on_end=metrics.operation_ended)  # type: ignore[arg-type]
    for kind, resource in (("make", "vol-0123456789abcdef0"), ("make", "vol-0123456789abcdef1"),
                           ("break", "vol-0123456789abcdef2")):
        with db.session() as s:
            op_id = engine.begin(s, engine.workflows[kind], resource, Nothing())
        engine.run_now(op_id)
        engine.run_now(op_id)  # an ended operation is not run, nor counted, again
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "vbs_operations_total", kind="make", outcome="succeeded") == 2
    assert value(samples, "vbs_operations_total", kind="break", outcome="rolled-back") == 1
    assert value(samples, "vbs_operation_duration_seconds_count", kind="break", outcome="rolled-back") == 1
    assert len(matching(samples, "vbs_operations_total")) == 2


def _bearer_request(key: Any) -> Request:
    header = f"Bearer {key.access_key_id}:{key.secret_access_key}".encode()
    return Request({"type": "http", "method": "GET", "path": "/metrics", "headers": [(b"authorization", header)],
                    "query_string": b""})


@pytest.mark.unit
def test_a_metrics_key_reads_metrics_only_and_a_user_key_does_not_read_them(db: Database, tmp_path: Path) -> None:
    store = KeyStore(db, MasterKey(tmp_path / "master.key"), {})
    auth = Authenticator(store, "us-east-1")
    reader, user = store.create("monitoring", "metrics"), store.create("team", "user")
    assert auth.check_metrics_reader(_bearer_request(reader), b"").role == "metrics"
    with pytest.raises(UnauthorizedOperation, match="metrics key"):
        auth.check(_bearer_request(reader), b"")
    with pytest.raises(UnauthorizedOperation, match="admin or a metrics key"):
        auth.check_metrics_reader(_bearer_request(user), b"")
    assert auth.check(_bearer_request(user), b"").role == "user"
    assert {k.role for k in store.list()} == {"metrics", "user"}
    with pytest.raises(InvalidParameter):
        store.create("team", "auditor")


# -- the host agent's block statistics ----------------------------------------------------------------

# The shape of QEMU 7.2's answer to query-blockstats: a VBS disk, and the VM's own root disk.
BLOCKSTATS: list[dict[str, Any]] = [
    {"device": "", "node-name": "vbs-vol0123456789abcdef0-thr",
     "qdev": "/machine/peripheral/vbs-vol0123456789abcdef0-dev/virtio-backend",
     "stats": {"rd_bytes": 4096, "wr_bytes": 1 << 20, "rd_operations": 1, "wr_operations": 256, "flush_operations": 2,
               "rd_total_time_ns": 500_000, "wr_total_time_ns": 3_000_000_000, "flush_total_time_ns": 1_000}},
    {"device": "", "qdev": "/machine/peripheral-anon/device[2]/virtio-backend", "stats": {"rd_bytes": 99}},
]


@pytest.mark.unit
def test_blockstats_become_per_volume_counters_in_base_units() -> None:
    disks = disk_stats("vm1", BLOCKSTATS)
    assert disks == [DiskStats(vm_id="vm1", serial="vol0123456789abcdef0", read_bytes=4096, write_bytes=1 << 20,
                               read_ops=1, write_ops=256, flush_ops=2, read_time_ns=500_000,
                               write_time_ns=3_000_000_000, flush_time_ns=1_000)]
    registry = new_registry()
    registry.register(ScrapeCollector(lambda: volume_metrics(disks)))
    samples = parse(generate_latest(registry).decode())
    on = {"volume_id": "vol-0123456789abcdef0", "vm_id": "vm1"}
    assert value(samples, "vbs_volume_written_bytes_total", **on) == 1 << 20
    assert value(samples, "vbs_volume_write_operations_total", **on) == 256
    assert value(samples, "vbs_volume_write_time_seconds_total", **on) == pytest.approx(3.0)
    assert value(samples, "vbs_host_attached_volumes") == 1


# -- a real vbs up -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    with running_vbs_up(tmp_path_factory.mktemp("metrics")) as v:
        yield v


def scrape(vbs: Vbs) -> Samples:
    answer = vbs.http.get("/metrics")
    assert answer.status_code == 200, answer.text
    return parse(answer.text)


def api_requests(samples: Samples) -> Counter[tuple[str, str, str]]:
    """The public APIs' requests (REST, EC2) by (method, route, code); /metrics and the agents' calls left out."""
    out: Counter[tuple[str, str, str]] = Counter()
    for (name, lab), v in samples.items():
        labels = dict(lab)
        if name == "vbs_api_requests_total" and labels["route"].startswith(("/v1/", "/?Action=")):
            out[(labels["method"], labels["route"], labels["code"])] = int(v)
    return out


def operations(samples: Samples) -> Counter[tuple[str, str]]:
    return Counter({(dict(lab)["kind"], dict(lab)["outcome"]): int(v)
                    for (name, lab), v in samples.items() if name == "vbs_operations_total"})


@pytest.mark.integration
def test_a_workload_moves_the_controllers_counters_by_exactly_what_it_did(vbs: Vbs) -> None:
    before = scrape(vbs)
    made: Counter[tuple[str, str, str]] = Counter()

    def call(method: str, path: str, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
        answer = vbs.http.request(method, path, json=body)
        made[(method, route, str(answer.status_code))] += 1
        return answer

    def ended(expected: Counter[tuple[str, str]]) -> Samples:
        """Scrape until the operations ``expected`` have ended (more than that is a failure below)."""
        def done() -> Samples | None:
            now = scrape(vbs)
            moved = operations(now) - operations(before)
            return now if all(moved[k] >= n for k, n in expected.items()) else None
        found: Samples = wait_until(done, 90, interval=0.3, what=f"operations {dict(expected)}")
        return found

    small = call("POST", "/v1/volumes", "/v1/volumes", {"size_gib": 1}).json()["volume_id"]
    big = call("POST", "/v1/volumes", "/v1/volumes", {"size_gib": 2}).json()["volume_id"]
    ended(Counter({("create-volume", "succeeded"): 2}))
    assert call("POST", "/v1/snapshots", "/v1/snapshots", {"volume_id": small}).status_code == 200
    ended(Counter({("create-volume", "succeeded"): 2, ("create-snapshot", "succeeded"): 1}))
    assert call("DELETE", f"/v1/volumes/{big}", "/v1/volumes/{volume_id}").status_code == 200
    # A few bad requests: each is counted under its route's template, with its code.
    assert call("POST", "/v1/volumes", "/v1/volumes", {"size_gib": 0}).status_code == 400
    assert call("GET", "/v1/volumes/vol-00000000000000000", "/v1/volumes/{volume_id}").status_code == 404
    assert call("GET", "/v1/volumes/not-a-volume", "/v1/volumes/{volume_id}").status_code in (400, 404)
    assert call("DELETE", f"/v1/volumes/{small}-x", "/v1/volumes/{volume_id}").status_code in (400, 404)
    # The EC2 Query API serves every action on one path: each action is a route of its own.
    for action in ("DescribeVolumes", "DescribeVolumes", "DescribeSnapshots"):
        ec2 = vbs.http.post("/", data={"Action": action, "Version": "2016-11-15"})
        made[("POST", f"/?Action={action}", str(ec2.status_code))] += 1
        assert ec2.status_code == 200, ec2.text
    after = ended(Counter({("create-volume", "succeeded"): 2, ("create-snapshot", "succeeded"): 1,
                          ("delete-volume", "succeeded"): 1}))

    assert operations(after) - operations(before) == Counter({
        ("create-volume", "succeeded"): 2, ("create-snapshot", "succeeded"): 1, ("delete-volume", "succeeded"): 1})
    for kind, n in (("create-volume", 2), ("create-snapshot", 1), ("delete-volume", 1)):
        count = "vbs_operation_duration_seconds_count"
        assert value(after, count, kind=kind, outcome="succeeded") - value(before, count, kind=kind,
                                                                           outcome="succeeded") == n
    assert api_requests(after) - api_requests(before) == made
    assert value(after, "vbs_volumes", state="available") - value(before, "vbs_volumes", state="available") == 1
    assert value(after, "vbs_snapshots", state="completed") - value(before, "vbs_snapshots", state="completed") == 1
    provisioned = sum(matching(after, "vbs_pool_provisioned_bytes").values())
    assert provisioned - sum(matching(before, "vbs_pool_provisioned_bytes").values()) == 1 * GIB
    capacity = matching(after, "vbs_pool_capacity_bytes")
    assert capacity and all(v > 0 for v in capacity.values())
    ages = matching(after, "vbs_node_heartbeat_age_seconds")
    assert {dict(lab)["kind"] for lab in ages} == {"storage", "host"}
    assert all(0 <= age < 30 for age in ages.values())


@pytest.mark.integration
def test_reconciliation_counts_the_drift_it_found_and_repaired(vbs: Vbs) -> None:
    before = scrape(vbs)
    orphan = vbs.pool / "volumes" / f"{ids.new_id('volume')}.raw"
    orphan.write_bytes(b"\0" * 4096)
    report = vbs.http.post("/v1/admin/reconcile", params={"now": "true"}).json()
    assert any(f["kind"] == "orphan-file" and f["action"] == "repaired" for f in report["findings"]), report
    after = scrape(vbs)
    name = "vbs_reconciler_drift_repaired_total"
    assert value(after, name, kind="orphan-file") - value(before, name, kind="orphan-file") == 1
    name = "vbs_reconciler_drift_found_total"
    assert value(after, name, kind="orphan-file") - value(before, name, kind="orphan-file") >= 1


@pytest.mark.integration
def test_a_metrics_key_reads_metrics_and_nothing_else(vbs: Vbs) -> None:
    key = vbs.http.post("/v1/keys", json={"tenant": "monitoring", "role": "metrics"}).json()
    user = vbs.http.post("/v1/keys", json={"tenant": "team", "role": "user"}).json()
    with httpx.Client(base_url=vbs.endpoint, timeout=30) as anon:
        def bearer(k: dict[str, Any]) -> dict[str, str]:
            return {"authorization": f"Bearer {k['access_key_id']}:{k['secret_access_key']}"}

        answer = anon.get("/metrics", headers=bearer(key))
        assert answer.status_code == 200 and "vbs_api_requests_total" in answer.text
        refused = anon.post("/v1/volumes", json={"size_gib": 1}, headers=bearer(key))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "UnauthorizedOperation"
        assert anon.get("/v1/volumes", headers=bearer(key)).status_code == 403
        ec2 = anon.post("/", data={"Action": "DescribeVolumes", "Version": "2016-11-15"}, headers=bearer(key))
        assert ec2.status_code == 403 and "UnauthorizedOperation" in ec2.text
        # A user key is no metrics reader; no key at all is refused before anything is read.
        assert anon.get("/metrics", headers=bearer(user)).status_code == 403
        assert anon.get("/metrics").status_code == 401
        assert anon.get("/metrics", headers={"authorization": "Bearer AKIANOTAKEY:nope"}).status_code == 401
    # The CLI makes such keys too.
    made = vbs.cli("create-key", "--tenant", "monitoring", "--role", "metrics")
    with httpx.Client(base_url=vbs.endpoint, timeout=30,
                      headers={"authorization": f"Bearer {made['access_key_id']}:{made['secret_access_key']}"}) as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/snapshots").status_code == 403


def _agents(vbs: Vbs) -> dict[str, dict[str, Any]]:
    services = json.loads((vbs.data_dir / "up.json").read_text())["services"]
    return {s["role"]: s for s in services if s["role"] in ("storage-agent", "host-agent")}


@pytest.mark.integration
def test_each_agent_serves_metrics_to_its_node_token_only(vbs: Vbs) -> None:
    agents = _agents(vbs)
    for role, kind in (("storage-agent", "storage"), ("host-agent", "host")):
        agent = agents[role]
        token = node_token(vbs.data_dir, kind, agent["name"])
        with httpx.Client(base_url=agent["url"], timeout=30) as c:
            assert c.get("/metrics").status_code == 401
            assert c.get("/metrics", headers={"authorization": f"Bearer {token}x"}).status_code == 401
            answer = c.get("/metrics", headers={"authorization": f"Bearer {token}"})
            assert answer.status_code == 200, answer.text
            samples = parse(answer.text)
        assert value(samples, "vbs_api_requests_total", method="GET", route="/metrics", code="401") >= 2
        if kind == "storage":
            assert all(v > 0 for v in matching(samples, "vbs_storage_pool_capacity_bytes").values())
            assert matching(samples, "vbs_storage_pool_capacity_bytes")
            # The controller's calls (create, delete, snapshot, reconciliation) are counted by template.
            routes = {dict(lab)["route"] for lab in matching(samples, "vbs_api_requests_total")}
            assert all("vol-" not in r and "snap-" not in r for r in routes), routes
        else:
            assert value(samples, "vbs_host_attached_volumes") == 0



def agent_text(vbs: Vbs, role: str, kind: str) -> str:
    agent = _agents(vbs)[role]
    token = node_token(vbs.data_dir, kind, agent["name"])
    answer = httpx.get(f"{agent['url']}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.text


def agent_metrics(vbs: Vbs, role: str, kind: str) -> Samples:
    return parse(agent_text(vbs, role, kind))


class Guest(Protocol):
    def wait_for_disk(self, serial: str, timeout: float = 10.0) -> str: ...

    def write_pattern(self, dev: str, seed: str, mib: int) -> str: ...

    def wait_disk_gone(self, serial: str, timeout: float = 10.0) -> None: ...


def guest_io_is_counted(vbs: Vbs, guest: Guest, vm_id: str, attach: list[str]) -> None:
    """Attach a new volume (``vbs attach-volume VOL ATTACH``), have the guest write and read 4 MiB on
    it, and find that I/O in the host agent's counters of that volume; then detach it."""
    before = scrape(vbs)
    volume_id = vbs.cli("create-volume", "--size", "1", "--wait")["volume_id"]
    vbs.cli("attach-volume", volume_id, *attach, "--wait")
    dev = guest.wait_for_disk(virtio_serial(volume_id), 30)
    on = {"volume_id": volume_id, "vm_id": vm_id}
    idle = agent_metrics(vbs, "host-agent", "host")
    guest.write_pattern(dev, "metrics", 4)  # writes 4 MiB, then reads them back past the guest's cache
    busy_text = agent_text(vbs, "host-agent", "host")
    busy = parse(busy_text)
    assert value(busy, "vbs_host_attached_volumes") == 1
    assert documented()["Host agent"] <= served(busy_text), documented()["Host agent"] - served(busy_text)
    for name, at_least in (("vbs_volume_written_bytes_total", 4 * MIB), ("vbs_volume_read_bytes_total", 4 * MIB),
                           ("vbs_volume_write_operations_total", 1), ("vbs_volume_read_operations_total", 1)):
        assert value(busy, name, **on) - value(idle, name, **on) >= at_least, name
    write_time = "vbs_volume_write_time_seconds_total"
    assert value(busy, write_time, **on) > value(idle, write_time, **on)
    after = scrape(vbs)
    assert (operations(after) - operations(before))[("attach-volume", "succeeded")] == 1
    assert value(after, "vbs_attachments", state="attached") - value(before, "vbs_attachments", state="attached") == 1
    vbs.cli("detach-volume", volume_id, "--wait")
    guest.wait_disk_gone(virtio_serial(volume_id), 30)
    assert not matching(agent_metrics(vbs, "host-agent", "host"), "vbs_volume_written_bytes_total", **on)


@pytest.mark.integration
def test_a_qemu_guests_io_on_an_attached_volume_shows_in_the_host_agents_counters(vbs: Vbs, tmp_path: Path) -> None:
    guest = TestGuest("vm1", tmp_path / "guests", build_guest(), vbs.data_dir / "vms")
    try:
        guest.start()
        guest.wait_ready(120)
        guest_io_is_counted(vbs, guest, "vm1", ["--host", "host-1", "--vm", "vm1"])
    finally:
        guest.stop()


@pytest.mark.integration
def test_a_libvirt_domains_io_on_an_attached_volume_shows_in_the_host_agents_counters(libvirtd: Any,
                                                                                       tmp_path: Path) -> None:
    from tests.clouds import LibvirtCloud

    with LibvirtCloud(tmp_path, "nbd", libvirtd, ("lv-metrics", "lv-metrics"), ["--hypervisor", "libvirt"]) as cloud:
        instance = cloud.instance("host-1", "lv-metrics")
        guest_io_is_counted(cloud.vbs, cloud.vm1, "lv-metrics", ["--instance", instance])


@pytest.mark.integration
def test_every_documented_metric_is_served_by_its_service(vbs: Vbs) -> None:
    docs = documented()
    everywhere = docs["Every service"]
    controller = served(vbs.http.get("/metrics").text)
    assert everywhere | docs["Controller"] <= controller, (everywhere | docs["Controller"]) - controller
    storage = served(agent_text(vbs, "storage-agent", "storage"))
    assert everywhere | docs["Storage agent"] <= storage, (everywhere | docs["Storage agent"]) - storage
    assert everywhere <= served(agent_text(vbs, "host-agent", "host"))
