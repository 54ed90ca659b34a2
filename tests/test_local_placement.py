"""Unit tests of local placement (semi-shared storage): a host's local pools as its heartbeat reports them,
the scheduler that places ``placement=local`` volumes there and refuses a host without a pool or room,
and the rules of a local create (a host, no zone/node/pool hints, no encryption)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import select, update

from tests.conftest import UNIT_DATABASES, fresh_database
from tests.fakes import RecordingEngine
from tests.test_scheduler import create, heartbeat, pool
from vbs.config import ControllerConfig
from vbs.controller.db import Attachment, Database, Node, Volume
from vbs.controller.db.tables import DEFAULT_TENANT, utcnow
from vbs.controller.fleet.describe_nodes import describe_hosts
from vbs.controller.fleet.nodes import host_info, record_host_heartbeat
from vbs.controller.requests.attach_volume import attach_volume
from vbs.controller.requests.create_volume import create_volume
from vbs.controller.requests.detach_volume import detach_volume
from vbs.controller.rest.schemas.volumes import AttachVolumeRequest, CreateVolumeRequest, DetachVolumeRequest
from vbs.errors import IncorrectState, InsufficientCapacity, InvalidParameter, MissingParameter
from vbs.wire.host import HostHeartbeat, HypervisorCapabilities, VmInfo
from vbs.wire.storage import PoolInfo

pytestmark = pytest.mark.unit


@pytest.fixture(params=UNIT_DATABASES)
def db(tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    return fresh_database(request.param, request, tmp_path)


def host_heartbeat(db: Database, name: str, *local_pools: PoolInfo, vm: str | None = None) -> None:
    with db.session() as s:
        record_host_heartbeat(s, HostHeartbeat(
            name=name, url="http://127.0.0.1:2", address="127.0.0.1", hypervisor="qemu",
            capabilities=HypervisorCapabilities(protocols=["file", "nbd"]), started_at=utcnow(),
            vms=[VmInfo(vm_id=vm, running=True)] if vm else [], local_pools=list(local_pools)))


def test_a_hosts_local_pools_are_recorded_from_its_heartbeat(db: Database) -> None:
    host_heartbeat(db, "host-1", pool("local", 10))
    with db.read() as s:
        node = s.get(Node, ("host-1", "host"))
        assert node is not None
        assert [p.name for p in host_info(node).local_pools] == ["local"]
        [shown] = describe_hosts(s, 30.0)
        assert [(p.name, p.capacity_bytes) for p in shown.local_pools] == [("local", 10 << 30)]


def test_a_local_volume_goes_to_its_hosts_local_pool(db: Database) -> None:
    heartbeat(db, "storage-1", pool("default", 100))
    host_heartbeat(db, "host-1", pool("small", 4), pool("big", 40))
    out = create(db, size_gib=2, placement="local", host="host-1")
    assert (out.placement, out.host, out.storage_node, out.pool, out.persistent) == (
        "local", "host-1", "host-1", "big", False)
    kept = create(db, size_gib=1, placement="local", host="host-1", persistent=True)
    assert kept.persistent is True


def test_local_placement_is_refused_on_a_host_without_a_local_pool(db: Database) -> None:
    heartbeat(db, "storage-1", pool("default", 100))
    host_heartbeat(db, "host-1")
    with pytest.raises(InvalidParameter, match="no local pool") as err:
        create(db, size_gib=1, placement="local", host="host-1")
    assert err.value.status == 400


def test_local_placement_is_refused_on_a_host_without_room(db: Database) -> None:
    host_heartbeat(db, "host-1", pool("local", 3))
    create(db, size_gib=8, placement="local", host="host-1")  # overcommit 4: 12 GiB may be promised
    with pytest.raises(InsufficientCapacity, match="not enough room in the local pools of host 'host-1'") as err:
        create(db, size_gib=5, placement="local", host="host-1")
    assert err.value.status == 400
    with db.read() as s:
        assert [v.size_gib for v in s.scalars(select(Volume))] == [8]


def test_local_placement_is_refused_on_an_unknown_or_silent_host(db: Database) -> None:
    with pytest.raises(InvalidParameter, match="does not exist"):
        create(db, size_gib=1, placement="local", host="host-9")
    host_heartbeat(db, "host-1", pool("local", 10))
    with db.session() as s:
        s.execute(update(Node).where(Node.name == "host-1")
                  .values(last_heartbeat=utcnow().replace(year=2000)))
    with pytest.raises(IncorrectState, match="down"):
        create(db, size_gib=1, placement="local", host="host-1")


def test_a_local_create_needs_a_host_and_takes_no_shared_hints(db: Database) -> None:
    host_heartbeat(db, "host-1", pool("local", 10))
    with pytest.raises(MissingParameter, match="host"):
        create(db, size_gib=1, placement="local")
    with pytest.raises(InvalidParameter, match="by host"):
        create(db, size_gib=1, placement="local", host="host-1", storage_node="storage-1")
    with pytest.raises(InvalidParameter, match="encrypted"):
        create(db, size_gib=1, placement="local", host="host-1", encrypted=True)
    with pytest.raises(InvalidParameter, match="placement 'local'"):
        create(db, size_gib=1, host="host-1")


def test_local_volumes_do_not_count_against_shared_pools(db: Database) -> None:
    heartbeat(db, "storage-1", pool("default", 2))
    host_heartbeat(db, "host-1", pool("default", 10))
    create(db, size_gib=8, placement="local", host="host-1")
    shared = create(db, size_gib=8)  # 2 GiB x overcommit 4: all of it is still the shared pool's
    assert (shared.storage_node, shared.placement) == ("storage-1", "shared")



def test_a_local_volume_attaches_to_its_own_hosts_vms_only_and_its_detach_knows_it_is_not_persistent(
        db: Database) -> None:
    host_heartbeat(db, "host-1", pool("local", 10), vm="vm1")
    host_heartbeat(db, "host-2", pool("local", 10), vm="vm2")
    engine = RecordingEngine()
    svc = SimpleNamespace(cfg=ControllerConfig(heartbeat_timeout_s=30.0), db=db, engine=engine)
    vol = create_volume(svc, CreateVolumeRequest(size_gib=1, placement="local", host="host-1"),
                        DEFAULT_TENANT).volume_id
    with db.session() as s:
        s.execute(update(Volume).where(Volume.id == vol).values(status="available"))
    with pytest.raises(InvalidParameter, match="local to host 'host-1'") as err:
        attach_volume(svc, vol, AttachVolumeRequest(host="host-2", vm_id="vm2"), DEFAULT_TENANT)
    assert err.value.status == 400
    attach_volume(svc, vol, AttachVolumeRequest(host="host-1", vm_id="vm1"), DEFAULT_TENANT)
    with db.session() as s:
        s.execute(update(Attachment).where(Attachment.volume_id == vol).values(status="attached"))
    detach_volume(svc, vol, DetachVolumeRequest(), DEFAULT_TENANT)
    kinds = [kind for kind, _, _ in engine.begun]
    assert kinds == ["create-local-volume", "attach-local-volume", "detach-local-volume"]
    created, attached, detached = (params for _, _, params in engine.begun)
    assert (created.host, created.pool, created.snapshot_id) == ("host-1", "local", None)
    assert (attached.node, attached.pool, attached.host) == ("host-1", "local", "host-1")
    assert detached.persistent is False


def test_a_heartbeat_without_local_pools_is_what_older_controllers_read() -> None:
    hb = HostHeartbeat(name="host-1", url="http://127.0.0.1:2", address="127.0.0.1", hypervisor="qemu",
                       capabilities=HypervisorCapabilities(protocols=["nbd"]), started_at=utcnow())
    assert "local_pools" not in hb.model_dump(mode="json")
    with_pool = hb.model_copy(update={"local_pools": [pool("local", 1)]})
    assert HostHeartbeat.model_validate(with_pool.model_dump(mode="json")).local_pools == [pool("local", 1)]
